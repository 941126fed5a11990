"""`--overlap`: what an all-reduce costs the computation it overlaps. On a CPU machine the backend's threads (and
the callback that averages) take the cores' time from a backward that launches collectives; the simulator charges
a step that much (its host cost). A GPU computes elsewhere, so this is measured on CPU only."""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist

from dtrain.collectives.bench.measure import Row
from dtrain.collectives.bench.paths import DTYPES, WIRE
from dtrain.collectives.plan import Bucket
from dtrain.collectives.reducer import Reducer
from dtrain.collectives.settings import ClassSettings
from dtrain.common.errors import UserError

OVERLAP_OPS = 16  # all-reduces launched during one compute block
OVERLAP_REPEATS = 7  # pairs of blocks, one without and one with them, alternated so a drift hits both alike
OVERLAP_MIN_MS = 100.0  # a block computes at least this long, and at least twice what its all-reduces take


def _block(a: torch.Tensor, chunks: int, at: dict[int, Callable[[], None]]) -> float:
    """`chunks` matmuls of `a` (256 x 256 fp32), calling at[j] after the j-th; the seconds they took."""
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
    dtype = DTYPES[dtype_name]
    s = ClassSettings(wire_dtype=WIRE[dtype_name])
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
        emit(f"#  {r.size:>10}  {r.type:>8}  {alone:11.1f}  {host:12.1f}", flush=True)  # "#": not a table row
    emit("#")
