"""Progress of a long command (an interleaved job, a sweep): tqdm's bar where stderr is a terminal; elsewhere (a batch
job's log file, a pipe) a plain line now and then, since a bar redrawn into a file only piles up carriage-return
copies of itself on one line:

    interleaved x4 step 120/400 sharded 512 ms elapsed 01:02 eta 02:25

The training loop's own progress (`dtrain.engine.progress`) prints its lines at its log interval instead, with the
loss; both ask `plain_output` whether stderr is a terminal.
"""

from __future__ import annotations

import sys
import time

from tqdm import tqdm


def plain_output() -> bool:
    """Whether progress goes to stderr as plain lines: stderr is not a terminal. Read when a bar is made, so that a
    redirected stderr (a test's, a job's log) counts."""
    return not sys.stderr.isatty()


def format_interval(seconds: float) -> str:
    """00:42, 12:05, 1:02:03: tqdm's form, in the plain lines as in the bar."""
    return tqdm.format_interval(seconds)


class Bar:
    """A subset of tqdm's interface (update, set_postfix, set_postfix_str, write, close). `enabled`: this process
    shows progress (rank 0). Where stderr is not a terminal, a line every `every_s` seconds of updates, and one at
    `close` for the count reached."""

    def __init__(self, total: int | None, desc: str, unit: str, enabled: bool = True, every_s: float = 30.0,
                 **tqdm_kwargs):
        self.total, self.desc, self.unit, self.every_s = total, desc, unit, every_s
        self.plain = enabled and plain_output()
        self.bar = None if self.plain or not enabled else tqdm(total=total, desc=desc, unit=unit, **tqdm_kwargs)
        self.n, self.postfix = 0, ""
        self.t0 = self.shown_at = time.monotonic()
        self.shown_n = 0  # the count the last plain line showed

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.plain and time.monotonic() - self.shown_at >= self.every_s:
            self._line()

    def set_postfix_str(self, text: str) -> None:
        self.postfix = text
        if self.bar is not None:
            self.bar.set_postfix_str(text)

    def set_postfix(self, **values) -> None:
        self.postfix = " ".join(f"{k}={v}" for k, v in values.items())
        if self.bar is not None:
            self.bar.set_postfix(**values)

    def write(self, message: str) -> None:
        """A message of its own on stdout, between the bar's redraws in a terminal (from any process, as tqdm's)."""
        if self.bar is not None:
            self.bar.write(message)
        else:
            print(message, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.plain and self.n != self.shown_n:
            self._line()

    def _line(self) -> None:
        elapsed = time.monotonic() - self.t0
        line = f"{self.desc} {self.unit} {self.n}" + (f"/{self.total}" if self.total else "")
        line += (f" {self.postfix}" if self.postfix else "") + f" elapsed {format_interval(elapsed)}"
        if self.total and self.n:
            line += f" eta {format_interval(elapsed / self.n * max(self.total - self.n, 0))}"
        print(line, file=sys.stderr, flush=True)
        self.shown_at, self.shown_n = time.monotonic(), self.n
