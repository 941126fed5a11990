"""The paths the benchmark measures side by side: for all-reduce the raw `dist.all_reduce` and the project's reducer
(`dtrain.collectives.reducer.Reducer`) used as training uses it; for reduce-scatter and all-gather the raw
`reduce_scatter_single` and `all_gather_single` (torch 2.13's names; `dtrain.collectives.dist` falls back to the
older `reduce_scatter_tensor` and `all_gather_into_tensor` before it). Also the data types and reduction ops, by nccl-tests'
names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from dtrain.collectives.bench.collectives import ALL_GATHER, ALL_REDUCE, NO_OP, REDUCE_SCATTER, Collective
from dtrain.collectives.dist import all_gather_single, reduce_scatter_single
from dtrain.collectives.plan import Bucket
from dtrain.collectives.reducer import Reducer
from dtrain.collectives.settings import ClassSettings

# nccl-tests' type names first; the others are accepted aliases.
DTYPES = {"int8": torch.int8, "uint8": torch.uint8, "int32": torch.int32, "int64": torch.int64,
          "half": torch.float16, "float": torch.float32, "double": torch.float64, "bfloat16": torch.bfloat16}
ALIASES = {"char": "int8", "int": "int32", "float16": "half", "fp16": "half", "float32": "float", "fp32": "float",
           "float64": "double", "bf16": "bfloat16"}
OPS = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT, "max": dist.ReduceOp.MAX,
       "min": dist.ReduceOp.MIN, "avg": dist.ReduceOp.AVG}
NCCL_ONLY_OPS = {"avg"}
# The reducer's wire dtypes, by the bench's type names.
WIRE = {"float": "fp32", "bfloat16": "bf16", "half": "fp16"}


def name_of(dtype: torch.dtype) -> str:
    """The bench's (nccl-tests') name of a torch dtype."""
    return next(n for n, d in DTYPES.items() if d == dtype)


@dataclass
class BenchPath:
    """A way of running one collective on flat tensors. `bind(t, op)` takes t's values as input (the collective's
    input buffer, `Collective.buffers`) and returns (the zero-argument operation to time, a function giving this
    rank's result as one flat tensor once it has run)."""

    name: str  # "raw" | "reducer": the `path` of a JSON row
    title: str  # what it is, for the table's comments
    bind: Callable[[torch.Tensor, str], tuple[Callable[[], None], Callable[[], torch.Tensor]]]
    place: str = "in-place"  # nccl-tests' column group: "out-of-place" (result in another buffer) or "in-place"
    ops: tuple[str, ...] = tuple(OPS)  # the reduction ops this path can do
    dtypes: tuple[str, ...] = tuple(DTYPES)  # and the data types
    result_op: Callable[[str], str] = lambda op: op  # what the result equals: the reducer averages its sum
    collective: Collective = ALL_REDUCE

    def can(self, op: str, dtype_name: str) -> bool:
        return op in self.ops and dtype_name in self.dtypes


def run_bound(bound) -> torch.Tensor:
    """Run a bound path once (`BenchPath.bind`'s pair) and return its result."""
    fn, result = bound
    fn()
    return result()


def raw_path(group, place: str = "in-place") -> BenchPath:
    """`dist.all_reduce` of the tensor. torch.distributed's all-reduce works in place only, so out-of-place (nccl-tests'
    first column group: the input kept, the result in another buffer) is the input copied into an output buffer and
    that buffer all-reduced in place, the copy timed with it, as torch's functional all_reduce does it."""
    if place == "in-place":
        def bind(t, op):
            return (lambda: dist.all_reduce(t, op=OPS[op], group=group)), (lambda: t)
    else:
        def bind(t, op):
            out = torch.empty_like(t)

            def fn():
                out.copy_(t)
                dist.all_reduce(out, op=OPS[op], group=group)

            return fn, (lambda: out)

    return BenchPath("raw", "dist.all_reduce", bind, place=place)


def raw_reduce_scatter(group, place: str = "in-place") -> BenchPath:
    """`dist.reduce_scatter_single` of the input (ranks x count elements) into this rank's share (count), as
    reduce_scatter_perf calls ncclReduceScatter: out-of-place into a buffer of its own, in-place into the share's
    own place in the input (nccl-tests' recvbuff + rank x count)."""
    rank, nranks = dist.get_rank(group), dist.get_world_size(group)

    def bind(t, op):
        out = torch.empty(t.numel() // nranks, dtype=t.dtype, device=t.device) if place == "out-of-place" \
            else t.view(nranks, -1)[rank]
        return (lambda: reduce_scatter_single(out, t, op=OPS[op], group=group)), (lambda: out)

    return BenchPath("raw", "dist.reduce_scatter_single", bind, place=place, collective=REDUCE_SCATTER)


def raw_all_gather(group, place: str = "in-place") -> BenchPath:
    """`dist.all_gather_single` of this rank's input (count elements) into the output (ranks x count), as
    all_gather_perf calls ncclAllGather: out-of-place from a buffer of its own, in-place from the rank's own place in
    the output (nccl-tests' sendbuff = recvbuff + rank x count; the input is copied there when bound, not timed)."""
    rank, nranks = dist.get_rank(group), dist.get_world_size(group)

    def bind(t, op):
        out = torch.empty(t.numel() * nranks, dtype=t.dtype, device=t.device)
        src = t
        if place == "in-place":
            src = out.view(nranks, -1)[rank]
            src.copy_(t)
        return (lambda: all_gather_single(out, src, group=group)), (lambda: out)

    return BenchPath("raw", "dist.all_gather_single", bind, place=place, ops=(NO_OP,), collective=ALL_GATHER)


def reducer_path(group, class_name: str | None, settings) -> BenchPath:
    """The project's bucketed all-reduce (`dtrain.collectives.reducer.Reducer`), used as training uses it: the size is cut
    into gradients of at most the bucket cap (25 MiB, or the class's `bucket_cap_mb`), one bucket each; every
    operation re-arms the reducer, launches the buckets asynchronously in order on the (class's) group, waits for
    them and averages. Its result is therefore checked against the mean, not the sum.

    A tensor class's own settings apply as they are (a bf16 wire dtype then compresses); without --class the wire
    dtype is the benchmarked dtype, so both paths move the same bytes."""
    nranks = dist.get_world_size(group)
    cls = class_name or "bench"

    def bind(t, op):
        s = settings if settings is not None else ClassSettings(wire_dtype=WIRE[name_of(t.dtype)])
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

    return BenchPath("reducer", "reducer (buckets, mean)", bind, ops=("sum",), dtypes=tuple(WIRE),
                     result_op=lambda op: "avg")


def bench_paths(which: str, group, class_name: str | None, settings, collective: Collective = ALL_REDUCE
                ) -> list[BenchPath]:
    """The paths of `collective` that `--path` names: raw (out-of-place, then in-place, as nccl-tests' two column
    groups), reducer (all-reduce only), or all."""
    raw = {ALL_REDUCE.name: raw_path, REDUCE_SCATTER.name: raw_reduce_scatter,
           ALL_GATHER.name: raw_all_gather}[collective.name]
    paths = []
    if which in ("raw", "all"):
        paths += [raw(group, "out-of-place"), raw(group, "in-place")]
    if which in ("reducer", "all") and collective == ALL_REDUCE:
        paths.append(reducer_path(group, class_name, settings))
    return paths
