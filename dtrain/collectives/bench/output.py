"""What the benchmark prints and writes: nccl-tests' table per collective, column for column (src/common.cu and
src/util.cu: the heading rows, one line per size with the raw path's out-of-place and in-place column groups and root
-1, the footer with the wrong-element count and the average bus bandwidth, the line naming the program that
concluded), the project's own columns and the reducer path's rows after it as `#` comments (which nccl-tests' parsers
skip), and the rows as JSON or CSV."""

from __future__ import annotations

import csv
import io
import json
import sys
from dataclasses import asdict

from dtrain.collectives.bench.measure import Row
from dtrain.common.files import write_atomic


# nccl-tests' stdout table (src/common.cu in NVIDIA/nccl-tests): the same widths, so that its parsers read ours.
_HEAD = "# %10s  %12s  %8s  %6s  %6s"
_GROUPS = "           out-of-place                       in-place          "


def fmt_time(us: float) -> str:
    """nccl-tests' time cell: 7 characters, fewer decimals as the time grows."""
    return f"{us:7.0f}" if us >= 10000 else f"{us:7.1f}" if us >= 100 else f"{us:7.2f}"


def fmt_cells(r: Row | None) -> str:
    """One column group (time, algbw, busbw, #wrong), or N/A where that group was not measured."""
    if r is None:
        return f"  {'N/A':>7}  {'N/A':>6}  {'N/A':>6}  {'N/A':>5}"
    wrong = "N/A" if r.wrong is None else str(r.wrong)
    return f"  {fmt_time(r.time_us)}  {r.algbw:6.2f}  {r.busbw:6.2f}  {wrong:>5}"


def header() -> list[str]:
    """The three heading rows of all_reduce_perf's table: the column groups, the columns, their units."""
    return [_HEAD % ("", "", "", "", "") + _GROUPS,
            (_HEAD + "  %7s  %6s  %6s %6s  %7s  %6s  %6s %6s") % (
                "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "time", "algbw",
                "busbw", "#wrong"),
            (_HEAD + "  %7s  %6s  %6s  %5s  %7s  %6s  %6s  %5s") % (
                "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", "")]


def line(out_of_place: Row | None, in_place: Row | None) -> str:
    """One size: size, count, type, redop, root (-1: all-reduce, reduce-scatter and all-gather have none), then the
    two column groups."""
    r0 = out_of_place or in_place
    return f"{r0.size:12d}  {r0.count:12d}  {r0.type:>8}  {r0.redop:>6}  {-1:6d}" + fmt_cells(out_of_place) \
        + fmt_cells(in_place)


def footer(rows: list[Row], program: str | None = None) -> list[str]:
    """nccl-tests' two footer lines over one table's rows: the wrong elements of every correctness pass, and the mean
    bus bandwidth over both column groups of every size (as nccl-tests averages it); then, given the program
    (`all_reduce_perf` ...), the line saying it concluded."""
    table = [r for r in rows if r.path == "raw"]
    wrong = sum(r.wrong or 0 for r in table)
    avg = sum(r.busbw for r in table) / len(table) if table else 0.0
    out = [f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}",
           f"# Avg bus bandwidth    : {avg:g} ", "#"]
    return out + [f"# Collective test concluded: {program}"] if program else out


def extra_header(title: str) -> list[str]:
    """The heading of a commented table of the project's own columns (nccl-tests' parsers skip `#` lines)."""
    return [f"# {title}",
            f"#  {'size':>10}  {'count':>12}  {'type':>8}  {'redop':>6}  {'path':>7}  {'place':>12}  {'time':>7}  "
            f"{'algbw':>6}  {'busbw':>6}  {'#wrong':>6}  {'median':>7}  {'iqr':>7}  {'cpu':>7}",
            f"#  {'(B)':>10}  {'(elements)':>12}  {'':>8}  {'':>6}  {'':>7}  {'':>12}  {'(us)':>7}  {'(GB/s)':>6}  "
            f"{'(GB/s)':>6}  {'':>6}  {'(us)':>7}  {'(us)':>7}  {'(us)':>7}"]


def extra_line(r: Row) -> str:
    """One row of the commented table: the measurement, its median and interquartile range (CPU), CPU time."""
    def us(v):
        return f"{'-':>7}" if v is None else fmt_time(v)

    wrong = "N/A" if r.wrong is None else str(r.wrong)
    return (f"#  {r.size:>10}  {r.count:>12}  {r.type:>8}  {r.redop:>6}  {r.path:>7}  {r.place:>12}  "
            f"{fmt_time(r.time_us)}  {r.algbw:6.2f}  {r.busbw:6.2f}  {wrong:>6}  {us(r.median_us)}  {us(r.iqr_us)}  "
            f"{us(r.cpu_us)}")


def extra_lines(rows: list[Row]) -> list[str]:
    """After the table, as comments: every row with the project's columns (the reducer path's rows only here), the
    reducer path's wrong elements and mean bus bandwidth, and its busbw against the raw in-place path's."""
    if not rows:
        return []
    out = extra_header("every row, with the project's columns (median and iqr: CPU only; --json has them all)")
    out += [extra_line(r) for r in rows]
    reducer = [r for r in rows if r.path == "reducer"]
    if reducer:
        wrong = sum(r.wrong or 0 for r in reducer)
        out.append(f"# reducer path: out of bounds values {wrong} {'OK' if wrong == 0 else 'FAILED'}, mean bus "
                   f"bandwidth {sum(r.busbw for r in reducer) / len(reducer):g} GB/s")
    return out + ratio_lines(rows) + ["#"]


def ratio_lines(rows: list[Row], from_bytes: int = 4 << 20) -> list[str]:
    """busbw of the reducer path over the raw in-place one (the same collective as training calls it), for the sizes
    where bandwidth (not latency) dominates."""
    raw = {(r.coll, r.size, r.type, r.redop): r.busbw for r in rows if r.path == "raw" and r.place == "in-place"}
    ratios = [r.busbw / raw[k] for r in rows if r.path == "reducer" and r.size >= from_bytes
              and raw.get(k := (r.coll, r.size, r.type, r.redop))]
    if not ratios:
        return []
    return [f"# reducer/raw busbw at >= {from_bytes >> 20} MiB : min {min(ratios):.3f} "
            f"mean {sum(ratios) / len(ratios):.3f} over {len(ratios)} size(s)"]


FIELDS = ["path", "size", "count", "type", "redop", "time_us", "algbw", "busbw", "wrong", "cpu_us", "median_us",
          "iqr_us", "host_us", "place", "groups", "coll", "work"]


def to_json(rows: list[Row]) -> str:
    """A JSON list, one row a line."""
    return "[\n" + ",\n".join(json.dumps(asdict(r)) for r in rows) + "\n]\n"


def to_csv(rows: list[Row]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=FIELDS, lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow(asdict(r))
    return buf.getvalue()


def write_out(dest: str, text: str, option: str) -> None:
    if dest == "-":
        sys.stdout.write(text)
    else:
        write_atomic(dest, text, option)
