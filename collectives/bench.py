"""all_reduce_perf for torch.distributed: a sweep of all-reduce sizes in nccl-tests' flags and table format.

Measures the raw path (`dist.all_reduce`) and the project's reducer path side by side, over the default group or a
tensor class's group, under torchrun on loopback or across the emulated cluster of `analysis.testbed`.

    torchrun --nproc_per_node=2 -m collectives.bench -b 8 -e 64M -f 4
    torchrun --nproc_per_node=2 -m collectives.bench -b 1M -e 256M -d bfloat16 --class ffn --json bench.json
    python -m analysis.testbed run --nodes 2 --nproc-per-node 1 -- -m collectives.bench -b 8 -e 256M
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import re
import socket
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.distributed as dist

from common.errors import UserError, exit_on_user_error
from common.files import check_writable, write_atomic

PROG = "collectives.bench"

# nccl-tests' type names first; the others are accepted aliases.
DTYPES = {"int8": torch.int8, "uint8": torch.uint8, "int32": torch.int32, "int64": torch.int64,
          "half": torch.float16, "float": torch.float32, "double": torch.float64, "bfloat16": torch.bfloat16}
ALIASES = {"char": "int8", "int": "int32", "float16": "half", "fp16": "half", "float32": "float", "fp32": "float",
           "float64": "double", "bf16": "bfloat16"}
OPS = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT, "max": dist.ReduceOp.MAX,
       "min": dist.ReduceOp.MIN, "avg": dist.ReduceOp.AVG}
NCCL_ONLY_OPS = {"avg"}
PERIOD = 257  # correctness data repeats with a prime period, so a shifted or misplaced chunk shows as wrong


# ---- parsing -----------------------------------------------------------------------------------------------------

def parse_size(text: str) -> int:
    """'8' → 8, '64K' → 65536, '256M', '1G' (binary multiples, as nccl-tests)."""
    m = re.fullmatch(r"(\d+)\s*([kKmMgG]?)[bB]?", str(text).strip())
    if not m:
        raise UserError(f"bad size '{text}': expected bytes with an optional K, M or G suffix, e.g. 8, 64K, 256M")
    return int(m.group(1)) * 1024 ** " kmg".index(m.group(2).lower() or " ")


def parse_dtypes(text: str) -> list[str]:
    names = list(DTYPES) if text == "all" else [ALIASES.get(text, text)]
    for n in names:
        if n not in DTYPES:
            raise UserError(f"unknown dtype '{text}' (known: {', '.join(DTYPES)}, all; "
                            f"aliases {', '.join(ALIASES)})")
    return names


def parse_ops(text: str, backend: str) -> list[str]:
    usable = [o for o in OPS if backend == "nccl" or o not in NCCL_ONLY_OPS]
    if text == "all":
        return usable
    if text not in OPS:
        raise UserError(f"unknown op '{text}' (known: {', '.join(OPS)}, all)")
    if text not in usable:
        raise UserError(f"op '{text}' needs the nccl backend (this run uses {backend})")
    return [text]


def sweep_sizes(min_bytes: int, max_bytes: int, factor: float, increment: int) -> list[int]:
    """nccl-tests' sweep: multiply by `factor`, or add `increment` when one is given."""
    if min_bytes > max_bytes:
        raise UserError(f"-b ({min_bytes}) is larger than -e ({max_bytes})")
    if not math.isfinite(factor):
        raise UserError(f"-f must be a finite number, not {factor}")
    if increment <= 0 and factor <= 1 and min_bytes != max_bytes:
        raise UserError(f"-f must be above 1 (or give -i) to sweep from {min_bytes} to {max_bytes}")
    sizes, s = [], min_bytes
    while s <= max_bytes:
        sizes.append(s)
        if min_bytes == max_bytes:
            break
        s = s + increment if increment > 0 else max(s + 1, int(s * factor))
    return sizes


# ---- bandwidths --------------------------------------------------------------------------------------------------

def bus_factor(nranks: int) -> float:
    """All-reduce moves 2(n-1)/n of the buffer through each rank's link (reduce-scatter then all-gather)."""
    return 2 * (nranks - 1) / nranks


def bandwidths(nbytes: int, time_us: float, nranks: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s: algbw = size / time, busbw = algbw · 2(n-1)/n."""
    algbw = nbytes / time_us / 1e3 if time_us > 0 else 0.0
    return algbw, algbw * bus_factor(nranks)


# ---- correctness -------------------------------------------------------------------------------------------------

def pattern(rank: int, op: str, dtype: torch.dtype) -> torch.Tensor:
    """One period of rank `rank`'s input: small integers (1..3; 1..2 for prod), so every partial result is exact
    in every dtype and the expected result does not depend on the reduction order."""
    span = 2 if op == "prod" else 3
    return ((torch.arange(PERIOD) + rank) % span + 1).to(dtype)


def expected_period(nranks: int, op: str, dtype: torch.dtype) -> torch.Tensor:
    parts = torch.stack([pattern(r, op, dtype) for r in range(nranks)])
    if op in ("sum", "avg"):
        out = parts.sum(0, dtype=dtype)
        return out if op == "sum" else (out.double() / nranks).to(dtype)
    if op == "prod":
        return parts.prod(0, dtype=dtype)
    return parts.amax(0) if op == "max" else parts.amin(0)


def fill(t: torch.Tensor, period: torch.Tensor) -> None:
    """Write `period` repeated along the flat tensor `t`, without materialising an index tensor of t's size."""
    q, rem = divmod(t.numel(), PERIOD)
    period = period.to(t.device)
    t[:q * PERIOD].view(q, PERIOD).copy_(period.expand(q, PERIOD))
    t[q * PERIOD:].copy_(period[:rem])


def count_wrong(t: torch.Tensor, expected: torch.Tensor, op: str) -> int:
    q, rem = divmod(t.numel(), PERIOD)
    expected = expected.to(t.device)
    if op == "avg":  # the only op whose result is not exact
        def bad(a, b):
            return ~torch.isclose(a.double(), b.double(), rtol=1e-2, atol=1 if not a.is_floating_point() else 0)
    else:
        def bad(a, b):
            return a != b
    return int(bad(t[:q * PERIOD].view(q, PERIOD), expected).sum()) + int(bad(t[q * PERIOD:], expected[:rem]).sum())


def check(reduce: Callable[[torch.Tensor], torch.Tensor], count: int, dtype: torch.dtype, op: str, rank: int,
          nranks: int, device, expect_op: str | None = None) -> int:
    """The separate correctness pass: known inputs, one all-reduce, the number of wrong elements on this rank.
    `reduce(t)` returns the tensor holding the result; `expect_op` is the op that result should equal (a path
    that averages is checked against "avg" although it was asked to sum)."""
    t = torch.empty(count, dtype=dtype, device=device)
    fill(t, pattern(rank, op, dtype))
    out = reduce(t)
    return count_wrong(out, expected_period(nranks, expect_op or op, dtype), expect_op or op)


# ---- the paths under test ----------------------------------------------------------------------------------------

@dataclass
class BenchPath:
    """A way of all-reducing one flat tensor. `bind(t, op)` takes t's values as input and returns (the
    zero-argument operation to time, a function giving the result as one flat tensor once it has run)."""

    name: str  # "raw" | "reducer": the `path` of a JSON row
    title: str  # column-group heading of the table
    bind: Callable[[torch.Tensor, str], tuple[Callable[[], None], Callable[[], torch.Tensor]]]
    ops: tuple[str, ...] = tuple(OPS)  # the reduction ops this path can do
    dtypes: tuple[str, ...] = tuple(DTYPES)  # and the data types
    result_op: Callable[[str], str] = lambda op: op  # what the result equals: the reducer averages its sum

    def can(self, op: str, dtype_name: str) -> bool:
        return op in self.ops and dtype_name in self.dtypes


def raw_path(group) -> BenchPath:
    def bind(t, op):
        return (lambda: dist.all_reduce(t, op=OPS[op], group=group)), (lambda: t)

    return BenchPath("raw", "dist.all_reduce", bind)


# ---- one measurement ---------------------------------------------------------------------------------------------

@dataclass
class Row:
    path: str
    size: int
    count: int
    type: str
    redop: str
    time_us: float
    algbw: float
    busbw: float
    wrong: int | None  # None: not checked (-c 0)
    # CPU time the process spent per operation, all its threads (the backend's too), mean over ranks
    cpu_us: float | None = None
    # CPU devices: the median of the operations' own times (mean over ranks); the mean (time_us) carries every
    # scheduler outlier of a shared machine, the median the typical operation (what the cost model fits)
    median_us: float | None = None
    # CPU devices: the interquartile range of the operations' own times (mean over ranks): how noisy the median is,
    # which the cost model's fit weighs each size by
    iqr_us: float | None = None
    # --overlap (CPU only, reducer path): how much longer a computation takes per all-reduce of this size launched
    # during it, mean over ranks; what a bucket launched during backward costs the backward (the simulator's host cost)
    host_us: float | None = None


def _run_bound(bound) -> torch.Tensor:
    fn, result = bound
    fn()
    return result()


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(path: BenchPath, count: int, dtype_name: str, op: str, args, group, nranks: int, rank: int,
            device) -> Row:
    dtype = DTYPES[dtype_name]
    # Zeros for timing: the values stay zero under every op, so no overflow, infinities or denormals in the loop.
    t = torch.zeros(count, dtype=dtype, device=device)
    fn, _ = path.bind(t, op)
    for _ in range(args.warmup):
        fn()
    _sync(device)
    dist.barrier(group=group)
    start, cpu_start = time.perf_counter(), time.process_time()
    marks = []  # on CPU each operation returns when done: its own time, for the median
    for _ in range(args.iters):
        fn()
        marks.append(time.perf_counter())
    _sync(device)
    elapsed_us = (time.perf_counter() - start) / args.iters * 1e6
    cpu_us = (time.process_time() - cpu_start) / args.iters * 1e6
    each = [(b - a) * 1e6 for a, b in zip([start, *marks], marks)]
    on_cpu = device.type == "cpu"
    median_us = statistics.median(each) if on_cpu else math.nan
    quartiles = statistics.quantiles(each, n=4) if on_cpu and len(each) > 1 else [math.nan] * 3
    del t, fn
    # As nccl-tests (-a 1): the time reported is the mean over ranks.
    mean = torch.tensor([elapsed_us, cpu_us, median_us, quartiles[2] - quartiles[0]], dtype=torch.float64,
                        device=device)
    dist.all_reduce(mean, group=group)
    time_us, cpu_us, median_us, iqr_us = (float(v) / nranks for v in mean)
    wrong = None
    if args.check:
        bad = check(lambda x: _run_bound(path.bind(x, op)), count, dtype, op, rank, nranks, device,
                    path.result_op(op))
        total = torch.tensor([bad], dtype=torch.int64, device=device)
        dist.all_reduce(total, group=group)
        wrong = int(total)
    nbytes = count * dtype.itemsize
    algbw, busbw = bandwidths(nbytes, time_us, nranks)
    return Row(path.name, nbytes, count, dtype_name, op, time_us, algbw, busbw, wrong, round(cpu_us, 3),
               median_us=None if math.isnan(median_us) else round(median_us, 3),
               iqr_us=None if math.isnan(iqr_us) else round(iqr_us, 3))


# ---- what an all-reduce costs the computation it overlaps ------------------------------------------------------

OVERLAP_OPS = 16  # all-reduces launched during one compute block
OVERLAP_REPEATS = 7  # pairs of blocks, one without and one with them, alternated so a drift hits both alike
OVERLAP_MIN_MS = 100.0  # a block computes at least this long, and at least twice what its all-reduces take


def _block(a: torch.Tensor, chunks: int, at: dict[int, Callable[[], None]]) -> float:
    """`chunks` matmuls of `a` (256 x 256 fp32, ~1 ms each on one core), calling at[j] after the j-th; seconds."""
    out = torch.empty_like(a)
    t0 = time.perf_counter()
    for j in range(chunks):
        torch.mm(a, a, out=out)
        if j in at:
            at[j]()
    return time.perf_counter() - t0


def overlap_cost(count: int, dtype_name: str, group, nranks: int, comm_us: float) -> tuple[float, float]:
    """How much longer a computation takes per all-reduce of `count` elements launched during it through the
    reducer (overlap on, one bucket each, launched at evenly spaced points as gradients become ready in backward):
    the median over OVERLAP_REPEATS of (the block with OVERLAP_OPS launches - the same block alone) / OVERLAP_OPS,
    in µs, mean over ranks; and the block's median time alone (ms). The all-reduces are waited for after the block,
    outside its time. On a CPU machine the backend's threads (and the callback that averages) take the cores'
    time from the computation; a GPU computes elsewhere, so this is measured on CPU only."""
    from collectives.plan import Bucket
    from collectives.reducer import Reducer
    from collectives.tensor_classes import CollectiveSettings

    dtype = DTYPES[dtype_name]
    s = CollectiveSettings(wire_dtype=_WIRE[dtype_name])
    params = {f"g{i}": torch.nn.Parameter(torch.zeros(count, dtype=dtype)) for i in range(OVERLAP_OPS)}
    buckets = [Bucket(i, (f"g{i}",), count, count * s.torch_wire_dtype.itemsize, "bench", s, dtype)
               for i in range(OVERLAP_OPS)]
    reducer = Reducer(params, buckets, nranks, overlap=True, groups={"bench": group}, default_group=group)
    reducer.remove()  # no backward here: `ready` is called directly
    a = torch.randn(256, 256)
    chunk_s = min(_block(a, 20, {}) / 20 for _ in range(2))
    want_ms = max(OVERLAP_MIN_MS, 2.0 * OVERLAP_OPS * comm_us / 1000.0)
    # At least one chunk between launches, so that every launch point is its own; every rank computes alike.
    chunks = torch.tensor([max(OVERLAP_OPS + 1, math.ceil(want_ms / 1000.0 / chunk_s))], dtype=torch.int64)
    dist.all_reduce(chunks, op=dist.ReduceOp.MAX, group=group)
    chunks = int(chunks)
    every = chunks / (OVERLAP_OPS + 1)
    launches = {int(every * (i + 1)): (lambda i=i: reducer.ready(f"g{i}")) for i in range(OVERLAP_OPS)}
    extra, alone = [], []
    for _ in range(OVERLAP_REPEATS):
        dist.barrier(group=group)
        t_alone = _block(a, chunks, {})
        dist.barrier(group=group)
        reducer.prepare(True)
        t_with = _block(a, chunks, launches)
        reducer.finish()
        extra.append(t_with - t_alone)
        alone.append(t_alone)
    mean = torch.tensor([statistics.median(extra) / OVERLAP_OPS * 1e6, statistics.median(alone) * 1e3],
                        dtype=torch.float64)
    dist.all_reduce(mean, group=group)
    host_us, alone_ms = (float(v) / nranks for v in mean)
    return host_us, alone_ms


# ---- nccl-tests' table -------------------------------------------------------------------------------------------

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


# ---- outputs -----------------------------------------------------------------------------------------------------

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


# ---- command line ------------------------------------------------------------------------------------------------

def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog=PROG, description="all_reduce_perf-like sweep on torch.distributed.",
                                 epilog="Run under torchrun (or analysis.testbed run); see the module docstring.")
    ap.add_argument("-b", "--minbytes", default="32M", help="smallest size in bytes, K/M/G suffix (default 32M)")
    ap.add_argument("-e", "--maxbytes", default="32M", help="largest size (default 32M)")
    ap.add_argument("-f", "--stepfactor", type=float, default=2.0, help="multiply the size by this (default 2)")
    ap.add_argument("-i", "--stepbytes", default="0", help="add this many bytes instead of multiplying")
    ap.add_argument("-w", "--warmup_iters", dest="warmup", type=int, default=1, help="warm-up iterations (1)")
    ap.add_argument("-n", "--iters", type=int, default=20, help="timed iterations (20)")
    ap.add_argument("-c", "--check", type=int, default=1, help="correctness pass: 1 on, 0 off (default 1)")
    ap.add_argument("-d", "--datatype", default="float", help=f"{', '.join(DTYPES)} or all (default float)")
    ap.add_argument("-o", "--op", default="sum", help=f"{', '.join(OPS)} or all (default sum)")
    ap.add_argument("--path", choices=["raw", "reducer", "all"], default="all",
                    help="which all-reduce path(s) to measure (default all that exist)")
    ap.add_argument("--class", dest="tensor_class", metavar="NAME",
                    help="run over this tensor class's process group (collectives.nccl.class_group)")
    ap.add_argument("--profile", help="a run profile whose sync.classes give the class's settings (with --class)")
    ap.add_argument("--overlap", nargs="?", const="2M", metavar="MAX",
                    help="CPU only: also measure how much longer a computation takes per reducer all-reduce launched "
                         "during it, at the sweep's sizes up to MAX (default 2M); the simulator's host cost")
    ap.add_argument("--csv", metavar="FILE", help="also write the rows as CSV ('-': stdout, instead of the table)")
    ap.add_argument("--json", metavar="FILE", help="also write the rows as a JSON list ('-': stdout, instead of the "
                                                     "table)")
    return ap.parse_args(argv)


def class_group_for(name: str, profile: str | None):
    """The tensor class's group, created through the one place that creates them, with the class's settings."""
    from collectives import tensor_classes
    from collectives.nccl import class_group

    if profile:
        from dtrain import config as config_mod

        classes = tensor_classes.from_config(config_mod.load(profile).sync)
    else:
        classes = tensor_classes.TensorClasses()
    known = [r.name for r in classes.rules]
    if name not in known:
        raise UserError(f"unknown tensor class '{name}' (known: {', '.join(known)})")
    settings = classes.setting(name)
    return class_group(name, settings.nccl(), None), settings


def bench_paths(which: str, group, class_name: str | None, settings) -> list[BenchPath]:
    paths = []
    if which in ("raw", "all"):
        paths.append(raw_path(group))
    if which in ("reducer", "all"):
        p = reducer_path(group, class_name, settings)
        if p is not None:
            paths.append(p)
        elif which == "reducer":
            raise UserError("the reducer path needs collectives/reducer.py, which this checkout does not have")
    return paths


# The reducer's wire dtypes, by the bench's type names.
_WIRE = {"float": "fp32", "bfloat16": "bf16", "half": "fp16"}


def reducer_path(group, class_name: str | None, settings) -> BenchPath | None:
    """The project's bucketed all-reduce (`collectives.reducer.Reducer`), used as training uses it: the size is cut
    into gradients of at most the bucket cap (25 MiB, or the class's `bucket_cap_mb`), one bucket each; every
    operation re-arms the reducer, launches the buckets asynchronously in order on the (class's) group, waits for
    them and averages. Its result is therefore checked against the mean, not the sum.

    A tensor class's own settings apply as they are (a bf16 wire dtype then compresses); without --class the wire
    dtype is the benchmarked dtype, so both paths move the same bytes."""
    try:
        from collectives.plan import Bucket
        from collectives.reducer import Reducer
        from collectives.tensor_classes import CollectiveSettings
    except ImportError:
        return None
    nranks = dist.get_world_size(group)
    cls = class_name or "bench"

    def bind(t, op):
        s = settings if settings is not None else CollectiveSettings(wire_dtype=_WIRE[_name_of(t.dtype)])
        cap = max(1, s.bucket_cap_bytes // s.torch_wire_dtype.itemsize)  # elements per bucket
        params, buckets = {}, []
        for i, chunk in enumerate(t.split(cap)):
            p = torch.nn.Parameter(torch.empty_like(chunk))  # never read: only its gradient is
            p.grad = chunk  # the reducer copies it into the bucket's flat buffer and keeps a view of that
            params[f"g{i}"] = p
            buckets.append(Bucket(i, (f"g{i}",), chunk.numel(), chunk.numel() * s.torch_wire_dtype.itemsize, cls,
                                  s, t.dtype))
        reducer = Reducer(params, buckets, nranks, overlap=False, groups={cls: group}, default_group=group)
        reducer.remove()  # no backward runs here: its gradient hooks are not needed

        def step():
            reducer.prepare(True)
            reducer.finish()

        def result():
            grads = [p.grad.view(-1) for p in params.values()]
            return grads[0] if len(grads) == 1 else torch.cat(grads)

        return step, result

    return BenchPath("reducer", "reducer (buckets, mean)", bind, ops=("sum",), dtypes=tuple(_WIRE),
                     result_op=lambda op: "avg")


def measure_overlap(rows: list[Row], max_bytes: int, group, nranks: int, device, emit) -> None:
    """--overlap: `overlap_cost` for each reducer row up to `max_bytes`, stored in its `host_us`."""
    if device.type != "cpu":
        raise UserError("--overlap measures what collectives take from computation on the CPU: this run computes "
                        f"on {device}")
    todo = [r for r in rows if r.path == "reducer" and r.size <= max_bytes]
    if not todo:
        raise UserError(f"--overlap: no reducer row up to {max_bytes} bytes to measure")
    emit(f"# overlap: {OVERLAP_OPS} reducer all-reduces launched during a matmul block, {OVERLAP_REPEATS} repeats; "
         "extra compute per all-reduce (the simulator's host cost)")
    emit(f"#  {'size':>10}  {'type':>8}  {'block alone':>11}  {'extra per op':>12}")
    emit(f"#  {'(B)':>10}  {'':>8}  {'(ms)':>11}  {'(us)':>12}")
    for r in todo:
        host, alone = overlap_cost(r.count, r.type, group, nranks, r.time_us)
        r.host_us = round(host, 3)
        emit(f"   {r.size:>10}  {r.type:>8}  {alone:11.1f}  {host:12.1f}", flush=True)
    emit("#")


def _name_of(dtype: torch.dtype) -> str:
    return next(n for n, d in DTYPES.items() if d == dtype)


def main(argv=None) -> int:
    args = parse_args(argv)
    with exit_on_user_error(PROG):
        sizes = sweep_sizes(parse_size(args.minbytes), parse_size(args.maxbytes), args.stepfactor,
                            parse_size(args.stepbytes))
        dtypes = parse_dtypes(args.datatype)
        if args.iters < 1 or args.warmup < 0:
            raise UserError("-n must be at least 1 and -w at least 0")
        if args.profile and not args.tensor_class:
            raise UserError("--profile gives a tensor class's settings: use it with --class")
        from collectives import dist as ddist

        for option, dest in (("--json", args.json), ("--csv", args.csv)):
            if dest and dest != "-" and ddist.env_rank()[0] == 0:  # rank 0 writes them
                check_writable(dest, option)  # before minutes of measuring, not after
        if args.overlap is not None:
            args.overlap = parse_size(args.overlap)
            if args.path == "raw":
                raise UserError("--overlap measures the reducer path: drop --path raw")
        from collectives.settings import DistConfig

        device, backend = ddist.init(DistConfig())
        try:
            return _bench(args, sizes, dtypes, device, backend)
        finally:
            ddist.cleanup()


def _bench(args, sizes: list[int], dtypes: list[str], device, backend: str) -> int:
    """The sweep on every rank; rank 0 prints and writes."""
    ops = parse_ops(args.op, backend)
    group, settings, what = None, None, "world"  # settings None: the reducer's defaults
    if args.tensor_class:
        group, settings = class_group_for(args.tensor_class, args.profile)
        what = f"class {args.tensor_class} (" + ", ".join(f"{k} {v}" for k, v in asdict(settings).items()) + ")"
    rank, nranks = dist.get_rank(group), dist.get_world_size(group)
    main_rank = dist.get_rank() == 0
    table = args.csv != "-" and args.json != "-"
    emit = print if (main_rank and table) else (lambda *a, **k: None)

    hosts = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, (dist.get_rank(), os.getpid(), socket.gethostname(), str(device)))
    step = f"{parse_size(args.stepbytes)}(bytes)" if parse_size(args.stepbytes) > 0 else f"{args.stepfactor:g}(factor)"
    emit(f"# {PROG}: nRanks {nranks} backend {backend} minBytes {parse_size(args.minbytes)} maxBytes {parse_size(args.maxbytes)} step: {step} "
         f"warmup iters: {args.warmup} iters: {args.iters} validation: {args.check} group: {what}")
    emit("#\n# Using devices")
    for r, pid, host, dev in hosts:
        emit(f"#  Rank {r:2d} Group  0 Pid {pid:6d} on {host:>10} device {dev}")
    emit("#")

    paths = bench_paths(args.path, group, args.tensor_class, settings)
    if any(p.name == "reducer" for p in paths):
        from collectives.tensor_classes import CollectiveSettings

        cap = (settings or CollectiveSettings()).bucket_cap_mb
        emit(f"# reducer path: collectives.reducer.Reducer, the size cut into buckets of <= {cap:g} MiB, launched "
             f"async in order, waited, averaged (checked against the mean); float types, op sum only")
    elif args.path == "all":
        emit("# reducer path: not measured (this checkout has no collectives/reducer.py)")
    emit("#")
    for h in header(paths):
        emit(h)
    rows: list[Row] = []
    for dtype_name in dtypes:
        for op in ops:
            for size in sizes:
                count = size // DTYPES[dtype_name].itemsize
                if count == 0:  # nccl-tests too skips sizes below one element
                    continue
                # A path that cannot do this op (the reducer only sums) shows N/A in its columns.
                cells = [measure(p, count, dtype_name, op, args, group, nranks, rank, device)
                         if p.can(op, dtype_name)
                         else None for p in paths]
                rows += [c for c in cells if c is not None]
                if any(c is not None for c in cells):
                    emit(line(cells), flush=True)
    for f in footer(rows, paths):
        emit(f)
    if args.overlap is not None:
        measure_overlap(rows, args.overlap, group, nranks, device, emit)
    if main_rank:
        if args.json:
            write_out(args.json, to_json(rows), "--json")
        if args.csv:
            write_out(args.csv, to_csv(rows), "--csv")
    return 0 if all(not r.wrong for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
