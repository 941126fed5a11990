"""The one reader of NCCL_DEBUG=INFO logs: the ENV lines (variables NCCL honoured), the TUNING lines (the algorithm and
protocol NCCL chose per collective, in both formats), and the latency/bandwidth table a communicator prints at init.

Formats (NCCL's src/enqueue.cc and src/graph/tuning.cc; NCCL_DEBUG / NCCL_DEBUG_SUBSYS in NCCL's documentation):
  NCCL >= 2.24: `AllReduce: 1048576 Bytes -> Algo RING proto LL128 channel{Lo..Hi}={0..7}`
  NCCL 2.21-2.23: `1048576 Bytes -> Algo 1 proto 2 time 12.345` (tuner indices; rank 0 only)
  ENV: `NCCL_PROTO set by environment to allreduce:LL128`
  init table: `Algorithm | Tree | Ring ...`, `Protocol | LL | LL128 | Simple ...`, then one row per collective of
  `latency/bandwidth` cells (µs / GB/s of algorithm bandwidth; 0.0 bandwidth: disabled), algorithms in blocks.
Each line may carry NCCL's prefix `host:pid:tid [dev] NCCL INFO `.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from dtrain.collectives.nccl.settings import COLLECTIVES
from dtrain.collectives.settings import NCCL_ALGORITHMS, NCCL_PROTOCOLS
from dtrain.common.errors import UserError

_PREFIX = re.compile(r"^(?P<host>[^\s:]+):(?P<pid>\d+):(?P<tid>\d+) \[(?P<dev>\d+)\] NCCL INFO ")
_NAMED = re.compile(r"(?P<coll>[A-Za-z]+): (?P<bytes>\d+) Bytes -> Algo (?P<algo>[A-Za-z_]+) proto "
                    r"(?P<proto>[A-Za-z0-9_]+)(?: channel\{Lo\.\.Hi\}=\{(?P<lo>\d+)\.\.(?P<hi>\d+)\})?")
_NUMERIC = re.compile(r"(?:^|\s)(?P<bytes>\d+) Bytes -> Algo (?P<algo>\d+) proto (?P<proto>\d+) time ")
_ENV = re.compile(r"(?P<var>NCCL_[A-Z0-9_]+) set by environment to (?P<value>\S+)")
_INIT = re.compile(r"NCCL INFO comm \S+ rank \d+ nRanks (?P<ranks>\d+)")
_TABLE_LINE = re.compile(r"(?P<who>\S+)(?: \[\d+\])? NCCL INFO\s+(?P<text>.*\|.*)$")  # a table row, any prefix
_ALGO_BY_KEY = {a.upper(): a for a in NCCL_ALGORITHMS}
_PROTO_BY_KEY = {p.upper(): p for p in NCCL_PROTOCOLS}


@dataclass(frozen=True)
class Decision:
    """One TUNING line: a collective NCCL planned, and the (algorithm, protocol, channels) it chose."""

    line: int
    source: str  # host:pid of the logging rank, "-" when the line has no NCCL prefix
    collective: str | None  # None in the 2.21-2.23 format, which does not say
    nbytes: int
    algo: str
    proto: str
    channels: int | None  # None in the 2.21-2.23 format

    @property
    def known(self) -> bool:
        """Both names are NCCL's (a numeric index out of range stays a number)."""
        return self.algo in NCCL_ALGORITHMS and self.proto in NCCL_PROTOCOLS


@dataclass(frozen=True)
class EnvSetting:
    line: int
    source: str
    var: str
    value: str


@dataclass(frozen=True)
class InitTable:
    """NCCL's own latency/bandwidth table, as the first communicator of the first process in the log printed it."""

    cells: dict[tuple[str, str, str], tuple[float, float]]  # (collective, algorithm, protocol) -> (µs, GB/s)
    ranks: int | None  # from the first `comm ... nRanks N` line, when the log has one
    source: str  # host:pid:tid of the process that printed it


def parse_log(lines) -> tuple[list[Decision], list[EnvSetting]]:
    """The TUNING decisions (both formats) and the ENV lines of an NCCL log, in order."""
    decisions, envs = [], []
    for i, raw in enumerate(lines, 1):
        m = _PREFIX.match(raw)
        source = f"{m['host']}:{m['pid']}" if m else "-"
        text = raw[m.end():] if m else raw
        if d := _NAMED.search(text):
            algo = _ALGO_BY_KEY.get(d["algo"].upper().replace("_", ""), d["algo"])
            proto = _PROTO_BY_KEY.get(d["proto"].upper(), d["proto"])
            channels = int(d["hi"]) - int(d["lo"]) + 1 if d["lo"] is not None else None
            decisions.append(Decision(i, source, d["coll"].lower(), int(d["bytes"]), algo, proto, channels))
        elif d := _NUMERIC.search(text):
            a, p = int(d["algo"]), int(d["proto"])
            decisions.append(Decision(i, source, None, int(d["bytes"]),
                                      NCCL_ALGORITHMS[a] if a < len(NCCL_ALGORITHMS) else str(a),
                                      NCCL_PROTOCOLS[p] if p < len(NCCL_PROTOCOLS) else str(p), None))
        elif e := _ENV.search(text):
            envs.append(EnvSetting(i, source, e["var"], e["value"].rstrip(".")))  # NCCL ends numbers with "."
    return decisions, envs


def parse_init_table(lines, where: str) -> InitTable | None:
    """The first complete init table in the log (the first communicator's: later ones may be restricted by a
    per-communicator NCCL_PROTO/NCCL_ALGO), or None when the log has none. `where` names the log in errors."""
    cells: dict[tuple[str, str, str], tuple[float, float]] = {}
    algos: list[str] = []
    source, ranks = None, None
    for raw in lines:
        m = _INIT.search(raw)
        if m and ranks is None:
            ranks = int(m["ranks"])
        m = _TABLE_LINE.match(raw.strip())
        if not m or (source is not None and m["who"] != source):
            continue  # not a table row, or another process's table
        head, *rest = [c.strip() for c in m["text"].split("|")]
        if head == "Algorithm":
            names = [a for a in rest if a]
            if any(key[1] in names for key in cells):
                break  # a second communicator's table begins
            source, algos = m["who"], names
        elif algos and head.lower() in COLLECTIVES:  # NCCL's row names: AllReduce, AllGather ...
            for i, cell in enumerate(c for c in rest if c):
                if i // 3 < len(algos):
                    cells[(head.lower(), algos[i // 3], NCCL_PROTOCOLS[i % 3])] = _cell(cell, head, where)
    return InitTable(cells, ranks, source) if cells else None


def _cell(cell: str, row: str, where: str) -> tuple[float, float]:
    lat, _, bw = cell.partition("/")
    try:
        return float(lat), float(bw)
    except ValueError:
        raise UserError(f"{where}: NCCL tuning table cell '{cell}' in row {row} is not latency/bandwidth (a "
                        "truncated log?)") from None


def read_log(path: str | Path) -> list[str]:
    """A log's lines; an unreadable file is a one-line error naming it."""
    try:
        return Path(path).read_text(errors="replace").splitlines()
    except OSError as e:
        raise UserError(f"{path}: cannot read log ({e.strerror})") from None


def read_logs(paths) -> tuple[list[Decision], list[EnvSetting]]:
    """`parse_log` over several files, in the order given."""
    decisions, envs = [], []
    for path in paths:
        d, e = parse_log(read_log(path))
        decisions += d
        envs += e
    return decisions, envs


def canonical(name: str, names: tuple[str, ...]) -> str:
    """NCCL's spelling of an algorithm or protocol name written in another case ('ring' -> 'Ring')."""
    for n in names:
        if n.lower() == name.lower().replace("_", ""):
            return n
    return name


def forced(value: str, coll: str, names: tuple[str, ...]) -> str | None:
    """The single algorithm/protocol an NCCL_ALGO/NCCL_PROTO value forces for `coll`, if it forces exactly one.
    Since NCCL 2.24 a value may be a per-collective list ("^LL128;allreduce:LL128"); a leading '^' excludes."""
    items = [v for v in value.split(";") if v]
    for item in items:
        c, _, v = item.rpartition(":")
        if c and c.lower() == coll and "," not in v and not v.startswith("^"):
            return canonical(v, names)
    plain = [i for i in items if ":" not in i]
    if len(plain) == 1 and "," not in plain[0] and not plain[0].startswith("^"):
        return canonical(plain[0], names)
    return None
