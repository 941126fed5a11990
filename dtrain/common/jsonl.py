"""JSON Lines records: one JSON object per line, appended as a run goes; read back tolerating a crash's torn tail."""

from __future__ import annotations

import json
from pathlib import Path

from dtrain.common.errors import UserError
from dtrain.common.files import replace_atomically


def _lines(records: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def append_jsonl(path: Path, records: list[dict]) -> None:
    """One open and one write per call, however many records (a step can carry a hundred bucket records)."""
    if records:
        with open(path, "a") as f:
            f.write(_lines(records))


def rewrite_jsonl(path: Path, records: list[dict]) -> None:
    """Replace a JSONL file's records at once (`dtrain.common.files.replace_atomically`)."""
    replace_atomically(path, _lines(records))


def read_jsonl(path: Path) -> list[dict]:
    """The records of a .jsonl file ([] if there is none). A last line cut short (a crash in the middle of a write
    leaves one, without its newline) is dropped: the record was never complete. Any other line that is not a JSON
    object is an error naming the file and the line."""
    path = Path(path)
    if not path.exists():
        return []
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot read it as text ({e.__class__.__name__})") from e
    lines = text.split("\n")
    records = []
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if no == len(lines):  # the last line, without a newline: torn by a crash
                break
            raise UserError(f"{path}:{no}: not a JSON record ({e.msg})") from e
        if not isinstance(record, dict):
            raise UserError(f"{path}:{no}: not a JSON object")
        records.append(record)
    return records
