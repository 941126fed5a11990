"""The search of a run that tuned its own communication (`sync.strategy: auto`), read from its tuning.csv and shown as
a report section: a figure of each candidate's predicted and measured step time, and the rows as a table.

Rank 0 writes tuning.csv, one row per candidate configuration, comma-separated with a header:

    candidate       a short name (ddp-25, bucketed-0.5-split)
    sync            its sync overrides: key=value pairs joined by "; "
    lossless        true | false
    predicted_ms    the tuner's predicted step time (ms): MODELED, not measured; empty where it made none
    predicted_rank  1 = predicted fastest; empty where predicted_ms is
    measured_ms     median measured step time over its measured rounds after warm-up (ms); empty if never measured
    diff_ms         median paired step difference against the winner (ms, positive = slower); empty for the winner
                    and for candidates never measured
    diff_low        the 95% interval of diff_ms (ms); empty where diff_ms is
    diff_high
    rounds          measured rounds it took part in (0: pruned by the prediction)
    steps           training steps it ran
    status          winner | dropped: predicted | dropped: measured | kept: budget (still racing when the budget
                    ran out) | empty: still racing when the file was written
    reason          free text

The file is rewritten after every round, so a search cut short (the job stopped while searching) leaves one with no
winner, its candidates still racing, and their differences against the leader of its last round: the report shows
it as such. run.json's `tuning` holds a finished search's summary: winner, steps_spent, rounds, budget_steps. A
tuned run without tuning.csv gets a note in place of its sections; a tuning.csv that cannot be read is a one-line
error naming the file, the line and the column.
"""

from __future__ import annotations

import csv
import math
import re
from pathlib import Path

import numpy as np
import pandas as pd

from dtrain.analysis import plots
from dtrain.analysis.report.sections import Section, fmt, missing
from dtrain.analysis.runs import Run
from dtrain.common.errors import UserError
from dtrain.common.rundir import TUNING, TUNING_COLUMNS, TUNING_FINAL

FINAL = TUNING_FINAL  # a candidate's status at the end
RACING = ""  # the status of a candidate still racing when a search that was cut short last wrote the file
PRUNED = "dropped: predicted"


def _name(text: str) -> str:
    if not text:
        raise ValueError("empty: every candidate needs a name")
    return text


def _sync(text: str) -> str:
    """The overrides as written, once each part is checked to be key=value."""
    for part in filter(None, (p.strip() for p in text.split(";"))):
        key, eq, _ = part.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"{part!r} is not key=value")
    return text


def _bool(text: str) -> bool:
    if text.lower() not in ("true", "false"):
        raise ValueError(f"{text!r} is not true or false")
    return text.lower() == "true"


def _ms(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a number (ms)") from None
    if not math.isfinite(v):
        raise ValueError(f"{text!r} is not a finite number (ms)")
    return v


def _optional_ms(text: str) -> float:
    return _ms(text) if text else np.nan


def _count(text: str, least: int = 0) -> int:
    try:
        v = float(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a whole number") from None
    if not v.is_integer() or v < least:
        raise ValueError(f"{text!r} is not a whole number of at least {least}")
    return int(v)


def _optional_rank(text: str) -> float:
    return float(_count(text, least=1)) if text else np.nan


def _status(text: str) -> str:
    if text not in (*FINAL, RACING):
        raise ValueError(f"{text!r} is not one of: {', '.join(FINAL)}, or empty (still racing)")
    return text


# Each column of tuning.csv and how one of its cells is read (a ValueError says what is wrong with it).
_READERS = {"candidate": _name, "sync": _sync, "lossless": _bool, "predicted_ms": _optional_ms,
            "predicted_rank": _optional_rank, "measured_ms": _optional_ms, "diff_ms": _optional_ms,
            "diff_low": _optional_ms, "diff_high": _optional_ms, "rounds": _count, "steps": _count,
            "status": _status, "reason": str}
COLUMNS = {c: _READERS[c] for c in TUNING_COLUMNS}  # the writer's columns (dtrain.common.rundir), in its order


def read_tuning(path: Path) -> pd.DataFrame:
    """tuning.csv's rows, typed (empty cells of the times and of predicted_rank as NaN), in the file's order; columns
    beyond COLUMNS are left out. A one-line `UserError` names the file, the line and the column of the first bad
    cell."""
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            if reader.fieldnames is None:
                raise UserError(f"{path}: empty, no header row")
            lacking = [c for c in COLUMNS if c not in reader.fieldnames]
            if lacking:
                raise UserError(f"{path}: no column {', '.join(lacking)} (header: {','.join(reader.fieldnames)})")
            rows = [_row(path, reader.line_num, raw) for raw in reader]
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise UserError(f"{path}: cannot be read as CSV ({e})") from None
    t = pd.DataFrame(rows, columns=list(COLUMNS))
    _check(path, t)
    return t


def _row(path: Path, line: int, raw: dict) -> dict:
    # csv.DictReader keeps cells beyond the header under the key None, and gives None for cells a row lacks.
    if None in raw:
        raise UserError(f"{path} line {line}: {len(raw[None])} cell(s) beyond the header's {len(raw) - 1} columns")
    short = [k for k, v in raw.items() if v is None]
    if short:
        raise UserError(f"{path} line {line}, column {short[0]}: no cell (the row is shorter than the header)")
    row = {}
    for column, read in COLUMNS.items():
        try:
            row[column] = read(raw[column].strip())
        except ValueError as e:
            raise UserError(f"{path} line {line}, column {column}: {e}") from None
    # The interval comes with the difference it bounds, and bounds it from below and above.
    given = [not np.isnan(row[c]) for c in ("diff_ms", "diff_low", "diff_high")]
    if any(given) and not all(given):
        column = ("diff_low", "diff_high")[given[1]] if given[0] else "diff_ms"
        raise UserError(f"{path} line {line}, column {column}: diff_ms, diff_low and diff_high are given together "
                        "or not at all")
    if all(given) and row["diff_low"] > row["diff_high"]:
        raise UserError(f"{path} line {line}, column diff_low: {row['diff_low']:g} is above diff_high "
                        f"{row['diff_high']:g}")
    return row


def _check(path: Path, t: pd.DataFrame) -> None:
    """What holds across rows: names are unique, and a search has one winner at most (none: cut short)."""
    twice = sorted(set(t.loc[t["candidate"].duplicated(), "candidate"]))
    if twice:
        raise UserError(f"{path}, column candidate: {', '.join(twice)} listed more than once")
    winners = list(t.loc[t["status"] == "winner", "candidate"])
    if len(winners) > 1:
        raise UserError(f"{path}, column status: {len(winners)} rows are the winner ({', '.join(winners)}); a "
                        "search has one")


def reference(rows: pd.DataFrame) -> tuple[str | None, bool]:
    """The candidate the paired differences are against, and whether the search finished: the winner; in a search
    cut short, the leader of its last round (the racing candidate of least measured median, as the tuner picks it);
    None where there is neither."""
    won = rows.loc[rows["status"] == "winner", "candidate"]
    if len(won):
        return won.iloc[0], True
    racing = rows[(rows["status"] == RACING) & rows["measured_ms"].notna()]
    return (racing.loc[racing["measured_ms"].idxmin(), "candidate"] if len(racing) else None), False


def search_table(rows: pd.DataFrame) -> pd.DataFrame:
    """The figure's rows: the candidates ordered by measured median, then (those never measured) by predicted step
    time; each paired difference put on the time axis around the reference's median (`reference`): paired_ms =
    reference + diff_ms, over [reference + diff_low, reference + diff_high]. In a search cut short, only the racing
    candidates' differences are against that reference (a dropped one's is against the leader of its round), so
    only theirs are put on the axis."""
    t = rows.sort_values(["measured_ms", "predicted_ms"], na_position="last", kind="stable").reset_index(drop=True)
    ref, finished = reference(t)
    t["reference"] = t["candidate"] == ref
    t["pruned"] = t["status"] == PRUNED
    base = t.loc[t["reference"], "measured_ms"].iloc[0] if ref is not None else np.nan
    against = ~t["reference"] & (finished or t["status"] == RACING)
    for col, diff in (("paired_ms", "diff_ms"), ("paired_low", "diff_low"), ("paired_high", "diff_high")):
        t[col] = base + t[diff].where(against)
    return t[["candidate", "status", "reference", "pruned", "predicted_ms", "predicted_rank", "measured_ms",
              "diff_ms", "diff_low", "diff_high", "paired_ms", "paired_low", "paired_high", "rounds", "steps"]]


def display(rows: pd.DataFrame, against: str) -> pd.DataFrame:
    """`search_table`'s rows with their sync, lossless and reason columns, as text for the report's table: the
    predicted figures labelled MODELED, the paired difference against `against` (winner or leader) with its interval
    (+ = slower)."""
    def signed(v):
        return ("+" if v > 0 else "") + fmt(float(v))

    def diff(r):
        if r["reference"]:
            return f"({against})"
        return "" if np.isnan(r["diff_ms"]) else \
            f"{signed(r['diff_ms'])} [{signed(r['diff_low'])}, {signed(r['diff_high'])}]"

    return pd.DataFrame({
        "candidate": rows["candidate"], "sync": rows["sync"],
        "lossless": rows["lossless"].map({True: "yes", False: "no"}),
        "predicted ms (MODELED)": rows["predicted_ms"].map(fmt),
        "predicted rank (MODELED)": rows["predicted_rank"].map(lambda v: "" if np.isnan(v) else str(int(v))),
        "measured ms": rows["measured_ms"].map(fmt),
        f"Δ vs {against} ms [95%]": [diff(r) for _, r in rows.iterrows()],
        "rounds": rows["rounds"].astype(str), "steps": rows["steps"].astype(str),
        "status": rows["status"].replace(RACING, "racing (search cut short)"), "reason": rows["reason"]})


def tuned(run: Run) -> bool:
    """Whether the run tuned its own communication: it left a tuning.csv, a summary in run.json, or asked to."""
    sync = run.config.get("sync") if isinstance(run.config.get("sync"), dict) else {}
    return (run.path / TUNING).is_file() or "tuning" in run.header or sync.get("strategy") == "auto"


def sections_tuning(runs: list[Run]) -> list[Section]:
    """A figure and a table for each run that tuned itself, in the order of the runs; none for the others."""
    return [s for r in runs if tuned(r) for s in sections_of(r)]


def sections_of(run: Run) -> list[Section]:
    key = "tuning_" + re.sub(r"[^\w.=-]+", "_", run.label)  # a file stem: a label may hold its sweep's folder/
    title = f"Auto-tuning search of run {run.label}: predicted and measured step time per candidate"
    path = run.path / TUNING
    if not path.is_file():
        return [missing(key, title, f"no {path}: the run tuned its communication (sync.strategy auto) but left no "
                                    "record of its search")]
    rows = read_tuning(path)
    if rows.empty:
        return [missing(key, title, f"{path} lists no candidate")]
    t = search_table(rows)
    ref, finished = reference(rows)
    summary = run.header.get("tuning") if isinstance(run.header.get("tuning"), dict) else {}
    if finished and summary.get("winner") not in (None, ref):
        raise UserError(f"{run.path / 'run.json'}: tuning.winner is {summary['winner']!r}, but {path} marks "
                        f"{ref!r} the winner")
    against = "winner" if finished else "leader"
    if finished:
        outcome = f"winner {ref}; " + (
            f"the search ran {summary.get('steps_spent', '?')} steps of its budget of "
            f"{summary.get('budget_steps', '?')} in {summary.get('rounds', '?')} measured rounds (run.json)"
            if summary else "run.json holds no summary of the search")
    else:
        outcome = ("search cut short: no winner, differences against the leader of its last round"
                   + (f", {ref}" if ref else ", none measured yet") + "; a dropped candidate's against the leader "
                   "of the round it was dropped in (in the table only)")
    caption = (f"Run {run.label}: {len(t)} candidate sync configurations, {outcome}. y: candidate, ordered by "
               "measured median step time, then (never measured) by predicted step time; x: step time (ms). Open "
               "diamonds: predicted step time, MODELED by the tuner, not measured. Dots: measured median step time "
               f"over the candidate's measured rounds after warm-up. Red bar and tick: the {against}'s measured "
               f"median plus the candidate's median paired step difference against the {against}, over its 95% "
               f"interval (measured). Gold row and dotted line: the {against} and its measured median. Grey names: "
               f"{int(t['pruned'].sum())} candidate(s) pruned by the prediction, never measured, shown by their "
               f"prediction only. Measured on: {run.machine}.")
    figure = Section(key, title, caption, t, plots.tuning(t, f"{run.label}: auto-tuning search", against))
    note = (f"{path}, one row per candidate, in the figure's order; {outcome}. predicted ms and rank are MODELED: "
            "the tuner's prediction, not a measurement (rank 1 = predicted fastest). measured ms: median step time "
            f"over its measured rounds after warm-up; Δ vs {against}: median paired step difference against the "
            f"{against} (ms, + = slower) and its 95% interval; rounds: measured rounds it took part in (0: pruned "
            f"by the prediction); steps: training steps it ran. Measured on: {run.machine}.")
    shown = display(t.merge(rows[["candidate", "sync", "lossless", "reason"]], on="candidate"), against)
    table = Section(f"{key}_candidates", f"Auto-tuning search of run {run.label}: every candidate", note, rows,
                    display=shown)
    return [figure, table]
