"""One measurement: a path of one collective timed at one size, dtype and op over the group, as nccl-tests times it
(warm-up, then `-n` timed iterations, the mean over ranks), with the bandwidths and the correctness pass's count of
wrong elements."""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dtrain.collectives.bench.collectives import ALL_REDUCE
from dtrain.collectives.bench.correctness import check
from dtrain.collectives.bench.paths import DTYPES, BenchPath, run_bound
from dtrain.common.units import bus_factor


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
    # nccl-tests' column group: "out-of-place" (the raw path's result in another buffer) or "in-place"
    place: str = "in-place"
    # --groups: this many process groups all-reduced `size` each at once (time_us: until all were done)
    groups: int | None = None
    # --host-work: the host work timed (`dtrain.collectives.bench.host_work`), not a collective
    work: str | None = None
    # the collective, by nccl-tests' name (all_reduce, reduce_scatter, all_gather): `size` and `count` are its
    # table's (`dtrain.collectives.bench.collectives`)
    coll: str = ALL_REDUCE.name


def bandwidths(nbytes: int, time_us: float, nranks: int, coll: str = ALL_REDUCE.coll) -> tuple[float, float]:
    """(algbw, busbw) in GB/s: algbw = size / time, busbw = algbw x the bus factor of the cost model's collective
    `coll` (2(n-1)/n for all-reduce, (n-1)/n for reduce-scatter and all-gather: `dtrain.common.units.bus_factor`)."""
    algbw = nbytes / time_us / 1e3 if time_us > 0 else 0.0
    return algbw, algbw * bus_factor(coll, nranks)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(path: BenchPath, count: int, dtype_name: str, op: str, args, group, nranks: int, rank: int,
            device) -> Row:
    """`path` at the table's `count` (elements per rank: `Collective.count`)."""
    dtype, coll = DTYPES[dtype_name], path.collective
    # Zeros for timing: the values stay zero under every op, so no overflow, infinities or denormals in the loop.
    t = torch.zeros(coll.buffers(count, nranks)[0], dtype=dtype, device=device)
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
        bad = check(lambda x: run_bound(path.bind(x, op)), count, dtype, op, rank, nranks, device,
                    path.result_op(op), coll.name)
        total = torch.tensor([bad], dtype=torch.int64, device=device)
        dist.all_reduce(total, group=group)
        wrong = int(total)
    nbytes = coll.size(count, dtype.itemsize, nranks)
    algbw, busbw = bandwidths(nbytes, time_us, nranks, coll.coll)
    return Row(path.name, nbytes, count, dtype_name, op, time_us, algbw, busbw, wrong, round(cpu_us, 3),
               median_us=None if math.isnan(median_us) else round(median_us, 3),
               iqr_us=None if math.isnan(iqr_us) else round(iqr_us, 3), place=path.place, coll=coll.name)
