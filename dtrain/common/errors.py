"""The one exception type for bad input (profiles, corpora, paths, checkpoints).

Every command-line entry point catches `UserError`, prints its message on one line and exits with status 2, so
bad input never shows a traceback. Anything else escaping is a bug in dtrain and keeps its traceback.
"""

import argparse
import difflib
import os
import sys
from contextlib import contextmanager


class UserError(Exception):
    """Bad input from the user; the message names the file, line or dotted key at fault."""


def unknown(kind: str, name: str, known, prefix: str = "") -> str:
    """`unknown key 'a.x'; did you mean 'a.y'? (known: y, z)`: the nearest known name first, for a typo, then them
    all. `prefix` is the dotted path above `name` and the known names (`a.`), shown in the name and the suggestion."""
    known = sorted(known)
    near = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f"; did you mean '{prefix}{near[0]}'?" if near else ""
    return f"unknown {kind} '{prefix}{name}'{hint} (known: {', '.join(known) or 'none'})"


class JobFailure(Exception):
    """The job cannot go on (a peer stopped answering, too many non-finite steps); the message says why."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are `UserError`s: one line and exit 2 under `exit_on_user_error`, like every other
    bad input (argparse's own prints the usage block)."""

    def error(self, message):
        raise UserError(message)


@contextmanager
def exit_on_user_error(prog: str):
    """Wrap a `main()` body: a `UserError` becomes `prog: error: <message>` on stderr and exit code 2, a
    `JobFailure` the same with exit code 3. A reader that stops early (`... | head`) ends the command quietly."""
    try:
        yield
        sys.stdout.flush()  # here, so that a closed pipe is caught below rather than at interpreter exit
    except BrokenPipeError:
        # Python's documented recipe: point stdout at /dev/null so the flush at exit cannot fail a second time.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    except (UserError, JobFailure) as e:
        msg = " ".join(str(e).split("\n"))
        print(f"{prog}: error: {msg}", file=sys.stderr, flush=True)
        sys.exit(2 if isinstance(e, UserError) else 3)
