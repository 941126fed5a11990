"""JSON Lines records: one JSON object per line, appended as a run goes; read back tolerating a crash's torn tail."""

from __future__ import annotations

import json
from pathlib import Path

from common.errors import UserError


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
