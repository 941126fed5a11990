"""Measurements to fit: the rows of an nccl-tests log (`all_reduce_perf`, `reduce_scatter_perf`, `all_gather_perf`
...) or of the project's benchmark (`dtrain.collectives.bench` CSV / JSON / JSONL), each row a collective, a size,
its time, and a label saying what ran.

The benchmark's printed table is nccl-tests', column for column, so one reader takes both: the rows under the
`# size count type redop root time algbw busbw #wrong ...` heading, their out-of-place column group, and the
footer's average bus bandwidth; `#` lines are comments to it (the benchmark's own columns live there). The collective
is the one the `# Collective test starting: <name>_perf` line names (nccl-tests prints it since June 2025; several
tables in one log each name theirs); without it, the rows say it (nccl-tests' src/*.cu): a root other than -1 is a
broadcast's, redop `none` with root -1 an all-gather's, a reduction whose size is count x itemsize an all-reduce's
and one whose size is count x itemsize x ranks (the whole buffer, every rank's share of `count`) a reduce-scatter's.
A row's `size` is the cost model's size of that collective either way. Also read:
- older nccl-tests tables, without `root` and with an `error` column (the largest deviation from the expected result
  rather than a count of wrong ones): a row is wrong where it exceeds what those versions accepted for the type
  (nccl-tests' src/common.cu, `DeltaMaxValue`: 1e-5 for float, 1e-12 for double, 5e-2 for half and bfloat16, exact
  for integers);
- a log captured through a launcher that labels each line: Open MPI's `--tag-output` (`[1,0]<stdout>:`) or
  Slurm's `srun -l` (`0: `); and lines before the table that are not comments (the shell prompt and command).

A label is "measured" when nothing says what ran, the benchmark's code path ("raw", "reducer") when several were
measured, or "Algo/proto" when NCCL's TUNING lines or a forced NCCL_ALGO / NCCL_PROTO in the log say it. Rows that
failed the correctness check (#wrong > 0) are left out and counted.
"""

from __future__ import annotations

import csv
import io
import json
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

from dtrain.collectives.costmodel.base import COLLECTIVES, PROTOS
from dtrain.collectives.nccl.log import canonical, forced, parse_log
from dtrain.collectives.settings import NCCL_ALGORITHMS
from dtrain.common.errors import UserError

# A launcher's label in front of each line: Open MPI's --tag-output ("[1,0]<stdout>:"), srun -l ("0: ").
_LAUNCHER_LABEL = re.compile(r"^\s*(?:\[\d+,\d+\]<std(?:out|err)>:|\d+: )")
# The heading of an nccl-tests table, recent ("# size count type redop root time ...") or older (no root column).
_NCCL_TESTS_HEADER = re.compile(r"^#\s*size\s+count\s+type\s+redop\s+(?:root\s+)?time\s+algbw\s+busbw")
# The largest deviation older nccl-tests accepted per data type (src/common.cu, DeltaMaxValue); integers: exact.
_DELTA_MAX = {"float": 1e-5, "double": 1e-12, "half": 5e-2, "bfloat16": 5e-2}
# nccl-tests' binary names, without `_perf`, to the cost model's collective names.
_TEST_NAMES = {"all_reduce": "allreduce", "all_gather": "allgather", "reduce_scatter": "reducescatter",
               "broadcast": "broadcast"}
# Bytes per element of nccl-tests' type names (src/common.cu, test_typenames), to tell a reduce-scatter's row
# (size = count x itemsize x ranks) from an all-reduce's (size = count x itemsize) in a log that does not name it.
_ITEMSIZE = {"int8": 1, "uint8": 1, "int32": 4, "uint32": 4, "int64": 8, "uint64": 8, "half": 2, "float": 4,
             "double": 8, "bfloat16": 2, "f8e4m3": 1, "f8e5m2": 1}


def coll_name(name: str, where) -> str:
    """The cost model's name of a collective named the cost model's way or nccl-tests' (`all_gather`,
    `all_gather_perf`, `all_gather_perf_mpi`); one it does not model is a one-line error naming `where`."""
    base = re.sub(r"_perf(_mpi)?$", "", str(name).strip())
    coll = _TEST_NAMES.get(base, base)
    if coll not in COLLECTIVES:
        raise UserError(f"{where}: measurements of '{name}', which the cost model does not model (it models "
                        f"{', '.join(COLLECTIVES)}: nccl-tests' {', '.join(n + '_perf' for n in _TEST_NAMES)})")
    return coll


@dataclass
class Measurement:
    size: int  # bytes, the nccl-tests 'size' column
    time_us: float
    algbw: float | None = None
    busbw: float | None = None
    label: str = "measured"  # "Ring/LL128" when the log says what NCCL ran, else "measured"
    cpu_us: float | None = None  # the project's benchmark: process CPU time per operation
    host_us: float | None = None  # its --overlap: extra computation per all-reduce launched during it
    median_us: float | None = None  # its median operation (CPU devices); time_us is the mean, as nccl-tests'
    iqr_us: float | None = None  # the interquartile range of its operations (CPU devices)
    coll: str | None = None  # the cost model's collective; None: the set's `coll`

    @property
    def typical_us(self) -> float:
        """What a fit follows: the median operation where the benchmark recorded one (on a shared CPU the mean
        carries every scheduler outlier), else the mean."""
        return self.median_us if self.median_us is not None else self.time_us

    @property
    def spread(self) -> float | None:
        """Relative spread of the operations (interquartile range over the median), where recorded."""
        return self.iqr_us / self.typical_us if self.iqr_us is not None and self.median_us else None


@dataclass
class MeasurementSet:
    rows: list[Measurement]
    # the collective of the rows that do not say theirs; with several, all-reduce if measured, else the first of
    # `COLLECTIVES` measured
    coll: str = "allreduce"
    ranks: int | None = None
    source: str = ""
    skipped: int = 0  # rows dropped because their correctness check failed (#wrong > 0)
    # The benchmark's --groups: k -> the share of one group's rate that k process groups all-reducing at once
    # reach together (k x one group's time / k groups' time, at one size)
    link_efficiency: dict[int, float] | None = None
    avg_busbw: float | None = None  # an nccl-tests table's footer: the mean busbw over both column groups
    # The benchmark's --host-work: kind of host work -> (bytes, µs) per operation, the rows timed
    host_work: dict[str, list[tuple[int, float]]] | None = None

    def coll_of(self, m: Measurement) -> str:
        return m.coll or self.coll

    @property
    def colls(self) -> list[str]:
        """The collectives measured, in `COLLECTIVES` order."""
        return [c for c in COLLECTIVES if any(self.coll_of(m) == c for m in self.rows)]


def _main_coll(colls) -> str:
    """Which of several collectives a set is named by: all-reduce if measured, else the first of `COLLECTIVES`."""
    return next((c for c in COLLECTIVES if c in colls), "allreduce")


def read_measurements(path: str | Path) -> MeasurementSet:
    """Rows of an nccl-tests log (`all_reduce_perf` ...), or of the project's benchmark CSV / JSON / JSONL."""
    p = Path(path)
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read measurements '{path}': {e}") from e
    lines = [_LAUNCHER_LABEL.sub("", ln, count=1) for ln in text.splitlines()]
    text = "\n".join(lines)
    body = [ln for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    if not body:
        raise UserError(f"{path}: no measurement rows")
    first = body[0].lstrip()
    if any(_NCCL_TESTS_HEADER.match(ln.strip()) for ln in lines):
        ms = _read_nccl_tests(text, path)
    elif first.startswith(("{", "[")):
        ms = _read_bench_json(text, path)
    elif "size" in first.split(",")[0:3] or ("," in first and "time_us" in first):
        ms = _read_bench_csv(body, path)
    else:
        ms = _read_nccl_tests(text, path)
    for coll in ms.colls or [ms.coll]:
        rows = [m for m in ms.rows if ms.coll_of(m) == coll]
        if len({m.size for m in rows}) < 2:
            of = f" of {coll}" if len(ms.colls) > 1 else ""
            raise UserError(f"{path}: need measurements at two sizes at least, found {len(rows)} row(s){of}")
    ms.source = str(path)
    if ms.ranks is None:
        ms.ranks = _ranks_from_bus_factor(ms)
    return ms


def _ranks_from_bus_factor(ms: MeasurementSet) -> int | None:
    """Recover the rank count from busbw/algbw (`dtrain.common.units.bus_factor` inverted: 2(n-1)/n for all-reduce,
    (n-1)/n for all-gather and reduce-scatter), using the third of a collective's rows with the largest algbw:
    printed bandwidths are rounded, so small ones say little. The first collective measured that tells."""
    for coll in ms.colls:
        rows = sorted((m for m in ms.rows if ms.coll_of(m) == coll and m.algbw and m.busbw), key=lambda m: m.algbw)
        ratios = [m.busbw / m.algbw for m in rows[-max(1, len(rows) // 3):]]
        if not ratios or coll == "broadcast":
            continue
        r = statistics.median(ratios)
        # nccl-tests before 2020 printed an all-gather's and a reduce-scatter's busbw as its algbw (r = 1): no count
        n = 2 / (2 - r) if coll == "allreduce" else 1 / (1 - r) if r < 1 else None
        if n and n < 1e6:
            return round(n)
    return None


# ---- the project's benchmark: CSV, JSON, JSONL --------------------------------------------------------------------

def _num(v) -> float | None:
    """A number from a CSV/JSON cell; None for empty, null or N/A (a path that could not run that row)."""
    if v is None or str(v).strip() in ("", "N/A", "nan", "None"):
        return None
    return float(v)


def bench_row(d: dict, where: str) -> Measurement:
    """One benchmark row (a CSV or JSON row as a dict) as a measurement; `where` names the file in errors."""
    try:
        label = d.get("label") or "measured"
        algo, proto = d.get("algo"), d.get("proto")
        if algo or proto:
            label = f"{canonical(algo, NCCL_ALGORITHMS) if algo else '*'}/{canonical(proto, PROTOS) if proto else '*'}"
        return Measurement(int(float(d["size"])), _num(d["time_us"]), _num(d.get("algbw")), _num(d.get("busbw")),
                           label, _num(d.get("cpu_us")), _num(d.get("host_us")), _num(d.get("median_us")),
                           _num(d.get("iqr_us")), _row_coll(d, where))
    except (KeyError, ValueError, TypeError) as e:
        raise UserError(f"{where}: bad benchmark row {d!r} ({e.__class__.__name__}: {e})") from e


def _row_coll(d: dict, where) -> str | None:
    """The cost model's collective a benchmark row names in `coll` (nccl-tests' name); None where it names none."""
    return coll_name(d["coll"], where) if d.get("coll") not in (None, "") else None


def _by_path(dicts: list[dict], where) -> list[dict]:
    """nccl-tests and the bench report out-of-place and in-place: keep out-of-place when both exist. Any other
    'path' values (code paths) become labels, so each is fitted on its own. The benchmark's rows say their column
    group in 'place': of an all-reduce, a code path measured in place keeps those rows (dist.all_reduce as training
    calls it; its out-of-place rows add a copy), one measured out of place only keeps these; of a reduce-scatter or an
    all-gather, the out-of-place rows where measured (their own call, into a separate output, as training calls them
    and as the out-of-place group of an nccl-tests log is read)."""
    if any(d.get("place") for d in dicts):
        def place(d):
            return d.get("place") or "in-place"

        def preferred(d):
            return "in-place" if (_row_coll(d, where) or "allreduce") == "allreduce" else "out-of-place"

        def key(d):
            return _row_coll(d, where), str(d.get("path", ""))

        measured = {key(d) for d in dicts if place(d) == preferred(d)}
        dicts = [d for d in dicts if place(d) == preferred(d) or key(d) not in measured]
    paths = {str(d.get("path", "")).lower() for d in dicts}
    if any("place" in p for p in paths):
        if any("out" in p for p in paths):
            return [d for d in dicts if "out" in str(d.get("path", "")).lower()]
        return dicts
    if len(paths) > 1:
        return [{**d, "label": str(d.get("path"))} for d in dicts]
    return dicts


def _collect(dicts: list[dict], where: str) -> MeasurementSet:
    """Rows to fit: out-of-place (or per code path), the sum reduction when several were run, none that failed
    the correctness check (#wrong > 0, counted) or that a path could not run (N/A, dropped)."""
    rows, skipped = [], 0
    together = [d for d in dicts if d.get("groups") not in (None, "")]  # --groups: not sizes to fit
    work = [d for d in dicts if d.get("work") not in (None, "")]  # --host-work: not collectives
    dicts = [d for d in dicts if d.get("groups") in (None, "") and d.get("work") in (None, "")]
    ops: dict[str | None, set[str]] = {}  # collective -> the reduction ops measured
    for d in dicts:
        ops.setdefault(_row_coll(d, where), set()).add(str(d.get("redop", "")).lower())
    for d in _by_path(dicts, where):
        if len(ops[_row_coll(d, where)]) > 1 and str(d.get("redop", "")).lower() != "sum":
            continue
        try:
            wrong, t = _num(d.get("wrong")) or 0, _num(d.get("time_us"))
        except ValueError as e:
            raise UserError(f"{where}: bad benchmark row {d!r} ({e})") from e
        if wrong > 0:
            skipped += 1
        elif t is not None:
            rows.append(bench_row(d, where))
    colls = {m.coll for m in rows if m.coll}
    ranks = {int(d["world_size"]) for d in dicts if d.get("world_size") not in (None, "")}
    return MeasurementSet(rows, _main_coll(colls), ranks.pop() if len(ranks) == 1 else None, skipped=skipped,
                          link_efficiency=_link_efficiency(together, where), host_work=_host_work(work, where))


def _host_work(dicts: list[dict], where) -> dict[str, list[tuple[int, float]]] | None:
    """The benchmark's --host-work rows as kind -> [(bytes, µs)]; None without them."""
    out: dict[str, list[tuple[int, float]]] = {}
    try:
        for d in dicts:
            out.setdefault(str(d["work"]), []).append((int(float(d["size"])), _num(d.get("median_us")) or
                                                       _num(d["time_us"])))
    except (KeyError, ValueError, TypeError) as e:
        raise UserError(f"{where}: bad --host-work row ({e.__class__.__name__}: {e})") from e
    return out or None


def _link_efficiency(dicts: list[dict], where) -> dict[int, float] | None:
    """The benchmark's --groups rows (k groups, each all-reducing `size` at once, in `median_us` or `time_us`) as
    k -> k x one group's time / k groups' time; None without them, or without the one-group row to compare with."""
    try:
        times = {int(float(d["groups"])): _num(d.get("median_us")) or _num(d["time_us"]) for d in dicts}
    except (KeyError, ValueError, TypeError) as e:
        raise UserError(f"{where}: bad --groups row ({e.__class__.__name__}: {e})") from e
    if 1 not in times or any(not t or t <= 0 for t in times.values()) or min(times) < 1:
        return None
    return {k: round(k * times[1] / t, 4) for k, t in sorted(times.items())}


def _read_bench_csv(body: list[str], where) -> MeasurementSet:
    reader = csv.DictReader(io.StringIO("\n".join(body)))
    if not reader.fieldnames or "size" not in reader.fieldnames or "time_us" not in reader.fieldnames:
        raise UserError(f"{where}: a benchmark CSV needs 'size' and 'time_us' columns, got {reader.fieldnames}")
    return _collect(list(reader), where)


def _read_bench_json(text: str, where) -> MeasurementSet:
    """A JSON list of rows, a JSON object with 'rows' (and header fields), or JSONL (a header line allowed)."""
    try:
        try:
            doc = json.loads(text)
        except json.JSONDecodeError:
            doc = [json.loads(ln) for ln in text.splitlines() if ln.strip()]
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: not valid benchmark JSON/JSONL ({e})") from e
    items = doc.get("rows", []) if isinstance(doc, dict) else doc if isinstance(doc, list) else []
    header = doc if isinstance(doc, dict) else next(
        (d for d in items if isinstance(d, dict) and "size" not in d), {})
    rows = [d for d in items if isinstance(d, dict) and "size" in d and "time_us" in d]
    if not rows:
        raise UserError(f"{where}: no rows with 'size' and 'time_us'")
    ms = _collect(rows, where)
    ms.ranks = ms.ranks or header.get("world_size")
    if header.get("coll"):  # the collective of the rows that do not name theirs
        ms.coll = coll_name(header["coll"], where)
    return ms


# ---- nccl-tests' output ---------------------------------------------------------------------------------------------

class _NcclTestsLog:
    """What an nccl-tests output says, line by line (nccl-tests' doc/PERFORMANCE.md): the '# size count type redop
    root time algbw busbw #wrong ...' header, data rows (out-of-place columns first), each test's name (a table per
    `# Collective test starting` line) and the ranks, and any NCCL INFO TUNING/ENV lines to label the sizes."""

    def __init__(self, where):
        self.where = where
        self.cols: list[str] | None = None
        # one per table: the collective its starting line names (None: not named) and its rows with their cells
        self.tables: list[tuple[str | None, list[tuple[Measurement, dict[str, str]]]]] = []
        self.skipped = 0
        self.ranks: set[int] = set()  # the rank lines' ranks (each table of a log with several lists them again)
        self.env = {"PROTO": None, "ALGO": None}
        # (collective, size) -> label -> how often NCCL logged it; collective None where the line does not say
        self.tuned: dict[tuple[str | None, int], dict[str, int]] = {}
        self.avg_busbw: float | None = None

    def nccl_line(self, s: str) -> None:
        decisions, envs = parse_log([s])  # the one reader of NCCL's log lines (dtrain.collectives.nccl.log)
        for e in envs:
            if e.var in ("NCCL_PROTO", "NCCL_ALGO"):
                self.env[e.var[len("NCCL_"):]] = e.value
        for d in decisions:
            if d.known:
                lab = f"{d.algo}/{d.proto}"
                self.tuned.setdefault((d.collective, d.nbytes), {}).setdefault(lab, 0)
                self.tuned[d.collective, d.nbytes][lab] += 1

    def comment(self, s: str) -> None:
        words = s.lstrip("#").split()
        # The first heading is the table's; the benchmark prints its own columns after it as a commented table.
        if self.cols is None and "size" in words and "time" in words and "busbw" in words:
            self.cols = words
        m = re.match(r"#\s*Avg bus bandwidth\s*:\s*(\S+)", s)
        if m and self.avg_busbw is None:  # the first table's, where a log holds several
            try:
                self.avg_busbw = float(m.group(1))
            except ValueError as e:
                raise UserError(f"{self.where}: cannot parse nccl-tests footer '{s}' ({e})") from e
        m = re.search(r"Collective test starting:\s*(\S+)", s)
        if m:
            coll = coll_name(m.group(1), self.where)
            if self.tables and self.tables[-1][0] is None and not self.tables[-1][1]:
                self.tables[-1] = (coll, [])
            else:
                self.tables.append((coll, []))
        m = re.match(r"#\s+Rank\s+(\d+)\s", s)
        if m:
            self.ranks.add(int(m.group(1)))

    def data(self, s: str) -> None:
        cols = self.cols
        if cols is None or not s or not s.split()[0].isdigit():
            return
        f = s.split()
        if len(f) < len(cols) - 4:  # a truncated line
            return
        try:
            d = {k: f[i] for i, k in enumerate(cols[: cols.index("busbw") + 2]) if i < len(f)}
            check = d.get("#wrong", d.get("error", "N/A"))  # N/A: run without validation (-c 0)
            limit = 0.0 if "#wrong" in d else _DELTA_MAX.get(d.get("type", ""), 0.0)  # a count, or a deviation
            if check != "N/A" and float(check) > limit:
                self.skipped += 1
                return
            m = Measurement(int(d["size"]), float(d["time"]), float(d["algbw"]), float(d["busbw"]))
        except (KeyError, ValueError) as e:
            raise UserError(f"{self.where}: cannot parse nccl-tests row '{s}' ({e})") from e
        if not self.tables:
            self.tables.append((None, []))
        self.tables[-1][1].append((m, d))

    def inferred_coll(self, cells: list[dict[str, str]]) -> str:
        """A table's collective from its rows, where no starting line names it (see the module docstring); the
        first row with elements decides (a size-0 row says nothing)."""
        d = next((d for d in cells if d.get("count", "0") != "0"), cells[0] if cells else {})
        if d.get("root", "-1") != "-1":
            return coll_name("broadcast" if d.get("redop") == "none" else "reduce", self.where)
        if d.get("redop") == "none":
            return "allgather"
        itemsize = _ITEMSIZE.get(d.get("type", ""))
        try:
            whole = itemsize and int(d["size"]) > int(d["count"]) * itemsize
        except (KeyError, ValueError):
            whole = False
        return "reducescatter" if whole else "allreduce"

    def label(self, m: Measurement, coll: str) -> str:
        """What NCCL logged most often for this collective and size, else a forced choice, else `m`'s label."""
        counts: dict[str, int] = {}
        for key in ((coll, m.size), (None, m.size)):
            for lab, k in self.tuned.get(key, {}).items():
                counts[lab] = counts.get(lab, 0) + k
        if counts:
            return max(counts.items(), key=lambda kv: kv[1])[0]
        forced_algo = forced(self.env["ALGO"], coll, NCCL_ALGORITHMS) if self.env["ALGO"] else None
        forced_proto = forced(self.env["PROTO"], coll, PROTOS) if self.env["PROTO"] else None
        if forced_algo or forced_proto:
            return f"{forced_algo or '*'}/{forced_proto or '*'}"
        return m.label

    def measurements(self) -> MeasurementSet:
        """The rows, each with its table's collective and labelled by what NCCL logged most often for its size,
        else by a forced choice."""
        if self.cols is None:
            raise UserError(f"{self.where}: neither a benchmark CSV/JSON nor an nccl-tests log "
                            "(no '# size count type redop ... time algbw busbw' header)")
        rows = []
        for named, table in self.tables:
            coll = named or self.inferred_coll([d for _, d in table])
            for m, _ in table:
                m.coll, m.label = coll, self.label(m, coll)
                rows.append(m)
        colls = {m.coll for m in rows} or {named for named, _ in self.tables if named}
        return MeasurementSet(rows, _main_coll(colls), len(self.ranks) or None, skipped=self.skipped,
                              avg_busbw=self.avg_busbw)


def _read_nccl_tests(text: str, where) -> MeasurementSet:
    log = _NcclTestsLog(where)
    for line in text.splitlines():
        s = line.strip()
        if "NCCL INFO" in s or "NCCL WARN" in s:
            log.nccl_line(s)
        elif s.startswith("#"):
            log.comment(s)
        else:
            log.data(s)
    return log.measurements()
