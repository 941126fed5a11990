"""What the benchmark prints and writes: nccl-tests' table (header, one line per size with a column group per
path, the footer with the wrong-element count and average bus bandwidth), and the rows as JSON or CSV."""

from __future__ import annotations

import csv
import io
import json
import sys
from dataclasses import asdict

from collectives.bench.measure import Row
from collectives.bench.paths import BenchPath
from common.files import write_atomic


def fmt_time(us: float) -> str:
    return f"{us:7.0f}" if us >= 10000 else f"{us:7.1f}" if us >= 100 else f"{us:7.2f}"


def fmt_cells(r: Row | None) -> str:
    if r is None:
        return f"{'N/A':>7}  {'N/A':>6}  {'N/A':>6}  {'N/A':>6}"
    wrong = "N/A" if r.wrong is None else str(r.wrong)
    return f"{fmt_time(r.time_us)}  {r.algbw:6.2f}  {r.busbw:6.2f}  {wrong:>6}"


def header(paths: list[BenchPath]) -> list[str]:
    pre = f"#  {'':>10}  {'':>12}  {'':>8}  {'':>6}"
    groups = "  ".join(f"{p.title:^32}" for p in paths)
    cols = "  ".join(f"{'time':>7}  {'algbw':>6}  {'busbw':>6}  {'#wrong':>6}" for _ in paths)
    units = "  ".join(f"{'(us)':>7}  {'(GB/s)':>6}  {'(GB/s)':>6}  {'':>6}" for _ in paths)
    return [f"{pre}  {groups}".rstrip(),
            f"#  {'size':>10}  {'count':>12}  {'type':>8}  {'redop':>6}  {cols}",
            f"#  {'(B)':>10}  {'(elements)':>12}  {'':>8}  {'':>6}  {units}".rstrip()]


def line(rows: list[Row | None]) -> str:
    r0 = next(r for r in rows if r is not None)
    return (f"   {r0.size:>10}  {r0.count:>12}  {r0.type:>8}  {r0.redop:>6}  "
            + "  ".join(fmt_cells(r) for r in rows))


def footer(rows: list[Row], paths: list[BenchPath]) -> list[str]:
    wrong = sum(r.wrong or 0 for r in rows)
    out = [f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}"]
    for p in paths:
        bw = [r.busbw for r in rows if r.path == p.name]
        avg = sum(bw) / len(bw) if bw else 0.0
        label = "  " if p.name == "raw" else f"({p.name})"
        out.append(f"# Avg bus bandwidth {label} : {avg:g}")
    if len(paths) > 1:
        out += ratio_lines(rows)
    return out + ["#"]


def ratio_lines(rows: list[Row], from_bytes: int = 4 << 20) -> list[str]:
    """busbw of the reducer path over the raw one, for the sizes where bandwidth (not latency) dominates."""
    raw = {(r.size, r.type, r.redop): r.busbw for r in rows if r.path == "raw"}
    ratios = [r.busbw / raw[k] for r in rows if r.path == "reducer" and r.size >= from_bytes
              and raw.get(k := (r.size, r.type, r.redop))]
    if not ratios:
        return []
    return [f"# reducer/raw busbw at >= {from_bytes >> 20} MiB : min {min(ratios):.3f} "
            f"mean {sum(ratios) / len(ratios):.3f} over {len(ratios)} size(s)"]


FIELDS = ["path", "size", "count", "type", "redop", "time_us", "algbw", "busbw", "wrong", "cpu_us", "median_us",
          "iqr_us", "host_us"]


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
