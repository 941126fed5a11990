"""Output files the command-line tools write: checked before the work that fills them, written whole or not at all.

A benchmark that runs for minutes must not lose its rows to a mistyped `--json` path at the end, and a reader must
never find half a file: `check_writable` runs up front, `write_atomic` writes a temporary file beside the target and
renames it over (atomic on POSIX).
"""

from __future__ import annotations

import os
from pathlib import Path

from dtrain.common.errors import UserError


def check_writable(path: str | Path, option: str) -> Path:
    """The output file of `option`, or a one-line error saying why it cannot be written there."""
    p = Path(path)
    if p.is_dir():
        raise UserError(f"{option} {p}: is a directory; give a file name")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise UserError(f"{option} {p}: the folder {parent} does not exist")
    if not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise UserError(f"{option} {p}: not writable")
    return p


def replace_atomically(path: str | Path, text: str) -> None:
    """`path` holds `text`, or what it held before: a temporary file beside it (named per process, so that ranks
    writing the same file do not share one) renamed over it. An OSError leaves no temporary file behind."""
    p = Path(path)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, p)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def write_atomic(path: str | Path, text: str, option: str) -> None:
    """The output file of `option`, written whole or not at all; a one-line error naming it when it cannot be."""
    p = check_writable(path, option)
    try:
        replace_atomically(p, text)
    except OSError as e:
        raise UserError(f"{option} {p}: cannot write it ({e.strerror})") from None


def output_dir(path: str | Path, option: str) -> Path:
    """The output folder of `option`, made if missing, or a one-line error saying why it cannot be."""
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise UserError(f"{option} {p}: a file is in the way; give a folder") from None
    except OSError as e:
        raise UserError(f"{option} {p}: cannot make this folder ({e.strerror})") from None
    return p
