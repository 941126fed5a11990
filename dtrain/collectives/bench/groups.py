"""`--groups K`: what several process groups all-reducing at once get of the link together.

`per_class` gives each tensor class its own process group, so its classes' buckets cross the network on connections
of their own, at the same time, while backward computes. The simulator shares the link between the groups
transferring; this measures how much of one group's rate they reach together: k groups (1..K), each all-reducing the
same size at the same moment, against one group alone. On a CPU device the rank multiplies matrices until all k are
done, as backward computes beside them: there the groups' threads compete with the computation for the cores, which
an idle rank would not show. The counts are alternated within each repeat, so that a drift of the machine's speed
hits them alike. Rows: path "groups", `size` each group's bytes, `groups` k, the time until all k are done.
"""

from __future__ import annotations

import math
import statistics
import time

import torch
import torch.distributed as dist

from dtrain.collectives.bench.measure import Row, bandwidths
from dtrain.collectives.bench.paths import DTYPES
from dtrain.common.errors import UserError

GROUPS_REPEATS = 7  # rounds, each timing every count once


def all_reduce_together(tensors: list[torch.Tensor], groups: list, compute: torch.Tensor | None = None,
                        offsets: list[float] | None = None) -> float:
    """Seconds from launching the first all-reduce (one on each group) until every one is done; with `compute` (a
    256 x 256 matrix), multiplying it meanwhile. `offsets`: each launch's seconds after the first (default all 0),
    as backward launches its buckets one after another."""
    out = torch.empty_like(compute) if compute is not None else None
    t0 = time.perf_counter()
    works = []
    for t, g, at in zip(tensors, groups, offsets or [0.0] * len(tensors)):
        while time.perf_counter() - t0 < at:
            if out is not None:
                torch.mm(compute, compute, out=out)
        works.append(dist.all_reduce(t, group=g, async_op=True))
    if out is not None:
        while not all(w.is_completed() for w in works):
            torch.mm(compute, compute, out=out)
    for w in works:
        w.wait()
    if tensors[0].is_cuda:  # on NCCL wait() only orders the stream: the collectives are done when it is
        torch.cuda.synchronize(tensors[0].device)
    return time.perf_counter() - t0


def measure_groups(max_groups: int, nbytes: int, dtype_name: str, warmup: int, nranks: int, device,
                   emit) -> list[Row]:
    """One row per count k = 1..max_groups: the median over GROUPS_REPEATS rounds of the time k groups (of every
    rank) take to all-reduce `nbytes` each at once, mean over ranks."""
    dtype = DTYPES[dtype_name]
    count = nbytes // dtype.itemsize
    if count == 0:
        raise UserError(f"--groups: {nbytes} bytes is less than one {dtype_name} element")
    ranks = list(range(dist.get_world_size()))
    groups = [dist.new_group(ranks) for _ in range(max_groups)]  # collective: every rank, the same order
    tensors = [torch.zeros(count, dtype=dtype, device=device) for _ in range(max_groups)]
    compute = torch.randn(256, 256) if device.type == "cpu" else None  # a GPU computes elsewhere
    for _ in range(max(1, warmup)):  # every group's connections set up before anything is timed
        all_reduce_together(tensors, groups, compute)
    times: dict[int, list[float]] = {k: [] for k in range(1, max_groups + 1)}
    for _ in range(GROUPS_REPEATS):
        for k in times:
            dist.barrier()
            times[k].append(all_reduce_together(tensors[:k], groups[:k], compute))
    medians = torch.tensor([statistics.median(times[k]) * 1e6 for k in times], dtype=torch.float64)
    dist.all_reduce(medians)
    medians /= nranks
    beside = ", the rank computing meanwhile" if compute is not None else ""
    emit(f"# groups: k process groups, each all-reducing {nbytes} B of {dtype_name} at once{beside}, "
         f"{GROUPS_REPEATS} repeats (median); their rate together as a share of one group's")
    emit(f"#  {'k':>3}  {'time (us)':>12}  {'share':>6}")
    rows = []
    one = float(medians[0])
    for k, t in zip(times, medians.tolist()):
        algbw, busbw = bandwidths(k * nbytes, t, nranks)
        rows.append(Row("groups", nbytes, count, dtype_name, "sum", round(t, 3), algbw, busbw, None,
                        median_us=round(t, 3), groups=k))
        share = k * one / t if t > 0 else math.nan
        emit(f"#  {k:>3}  {t:12.1f}  {share:6.3f}", flush=True)
    emit("#")
    return rows
