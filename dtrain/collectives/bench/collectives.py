"""The collectives the benchmark measures, each as nccl-tests measures it with a program of its own (all_reduce_perf,
reduce_scatter_perf, all_gather_perf: src/all_reduce.cu, src/reduce_scatter.cu and src/all_gather.cu in
NVIDIA/nccl-tests): their names, the size and count columns of their table, and their bus bandwidth factor.

A requested size of S bytes is S / itemsize elements (src/common.cu, setupArgs). An all-reduce reduces them all: count
and size are those. A reduce-scatter or an all-gather gives each rank a share of them, rounded down to a multiple of
16 bytes (`GetCollByteCount`: `(count/nranks) & ~(16/eltSize - 1)`); its table prints the whole buffer as `size` (the
reduce-scatter's input, the all-gather's output: every rank's share, `max(sendBytes, expectedBytes)`) and one rank's
share as `count`, so that size = count x itemsize x ranks. Bandwidths follow nccl-tests' doc/PERFORMANCE.md: algbw =
size / time, busbw = algbw x 2(n-1)/n for all-reduce and x (n-1)/n for the other two (`dtrain.common.units.bus_factor`).
"""

from __future__ import annotations

from dataclasses import dataclass

from dtrain.common.errors import UserError, unknown

NO_OP = "none"  # the redop column of a collective without a reduction (all_gather_perf prints "none")


@dataclass(frozen=True)
class Collective:
    name: str  # nccl-tests' name (its program without `_perf`), the bench's --collective and a JSON row's `coll`
    coll: str  # the cost model's name, which `dtrain.common.units.bus_factor` takes
    title: str  # in words, for the table's comments
    reduces: bool  # takes a reduction op (-o); all-gather's redop column is NO_OP

    @property
    def program(self) -> str:
        """nccl-tests' program of this collective, as its output names it."""
        return f"{self.name}_perf"

    def count(self, nbytes: int, itemsize: int, nranks: int) -> int:
        """The table's count for a requested size of `nbytes`: elements per rank (0: nothing to measure)."""
        count = nbytes // itemsize
        if self.name == ALL_REDUCE.name:
            return count
        return (count // nranks) & ~(16 // itemsize - 1)

    def size(self, count: int, itemsize: int, nranks: int) -> int:
        """The table's size (bytes) for `count`: one rank's buffer for all-reduce, every rank's share otherwise."""
        return count * itemsize * (1 if self.name == ALL_REDUCE.name else nranks)

    def buffers(self, count: int, nranks: int) -> tuple[int, int]:
        """Elements of one rank's (input, output) buffers."""
        if self.name == REDUCE_SCATTER.name:
            return count * nranks, count
        if self.name == ALL_GATHER.name:
            return count, count * nranks
        return count, count


ALL_REDUCE = Collective("all_reduce", "allreduce", "all-reduce", True)
REDUCE_SCATTER = Collective("reduce_scatter", "reducescatter", "reduce-scatter", True)
ALL_GATHER = Collective("all_gather", "allgather", "all-gather", False)
COLLECTIVES = {c.name: c for c in (ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER)}


def parse_collectives(text: str) -> list[Collective]:
    """`--collective`: one of nccl-tests' names, a comma list of them, or all (each measured in turn, in the order
    given)."""
    names = list(COLLECTIVES) if text == "all" else [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise UserError(f"--collective: no collective in '{text}' (known: {', '.join(COLLECTIVES)}, all)")
    for n in names:
        if n not in COLLECTIVES:
            raise UserError(unknown("collective", n, [*COLLECTIVES, "all"]))
    if len(set(names)) != len(names):
        raise UserError(f"--collective names a collective twice: '{text}'")
    return [COLLECTIVES[n] for n in names]
