"""What every cost model shares: the algorithms, protocols and collectives it models, one (algorithm, protocol)
choice's time and bandwidths, and the cost of one all-reduce as the step simulator charges a bucket.

A model (`NcclModel`, `NcclTableModel`, `FittedModel`) has `name`, `ranks`, `choices(nbytes, coll)`,
`pick(nbytes, coll)`, `time_us(nbytes, coll, algo, proto)`, `header()`, and from `CollectiveCost` the two methods
of one all-reduce in milliseconds, `allreduce_ms` and `allreduce_latency_ms`.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtrain.collectives.settings import NCCL_ALGORITHMS, NCCL_PROTOCOLS
from dtrain.common.errors import UserError
from dtrain.common.units import bus_factor

# Tree, Ring, CollNetDirect, CollNetChain, NVLS, NVLSTree, PAT: NCCL's tuner indices 0..6 (src/include/nccl_tuner.h)
ALGOS = NCCL_ALGORITHMS
PROTOS = NCCL_PROTOCOLS  # LL, LL128, Simple: indices 0..2 (src/include/nccl_tuner.h)
COLLECTIVES = ("allreduce", "allgather", "reducescatter", "broadcast")


@dataclass(frozen=True)
class Choice:
    """One (algorithm, protocol) for one size: modeled time and bandwidths (GB/s, nccl-tests conventions)."""

    algo: str
    proto: str
    time_us: float
    algbw: float  # size / time
    busbw: float  # algbw x the collective's bus factor (dtrain.common.units.bus_factor)
    lat_us: float = 0.0  # the model's latency term
    bw: float = 0.0  # the model's algorithm bandwidth term (after the size correction)


def timed_choice(algo: str, proto: str, nbytes: int, lat: float, bw: float, coll: str, ranks: int | None) -> Choice:
    """t = lat + bytes / (1000 · bw) (µs, GB/s), with nccl-tests' bandwidths (busbw = algbw without a rank count)."""
    time = lat + nbytes / (1000.0 * bw)
    algbw = nbytes / (1000.0 * time)
    return Choice(algo, proto, time, algbw, algbw * bus_factor(coll, ranks) if ranks and ranks > 1 else algbw, lat,
                  bw)


def check_coll(coll: str) -> None:
    if coll not in COLLECTIVES:
        raise UserError(f"unknown collective '{coll}' (modeled: {', '.join(COLLECTIVES)})")


class CollectiveCost:
    """The cost of one all-reduce of `nbytes`, in ms, the same two methods on every model: what the step simulator
    charges a bucket, and the part of it that does not share the link with other collectives in flight."""

    # The ranks of each node of the machine modeled, where a user of the model knows them (the step simulator: its
    # --ranks-per-node, or the profiled run's record). None: unknown, each rank taken as its own node.
    ranks_per_node: int | None = None
    # The cost model of the path inside a node, where a user gives one (the step simulator's --intra-topology: a
    # benchmark of one node's ranks). None: collectives inside a node cost their latency.
    inside_node: "CollectiveCost | None" = None

    # Whether a forced (algo, proto) changes `allreduce_ms`: a bucket of a class whose profile forces NCCL's
    # choice is costed with that choice only on NCCL's analytical model. A fit costs what was measured (gloo has
    # no choice to force), and NCCL's printed table is costed at NCCL's own pick, as the simulator always has.
    honours_forced = False

    def allreduce_ms(self, nbytes: float, algo: str | None = None, proto: str | None = None) -> float:
        """One all-reduce of `nbytes` (ms): NCCL's pick, or the forced algo/proto where the model honours it."""
        if not self.honours_forced:
            algo = proto = None
        return self.time_us(nbytes, "allreduce", algo=algo, proto=proto) / 1000.0

    def allreduce_latency_ms(self, nbytes: float) -> float:
        """The part of `allreduce_ms` that does not use the link, where the model separates it: with several
        collectives in flight only the rest shares the bandwidth. 0 here: all of it shared (NCCL's models run one
        stream, where nothing shares the link)."""
        return 0.0

    def link_efficiency(self, k: int) -> float:
        """The share of the link's rate that `k` process groups transferring at once reach together: 1 here (NCCL's
        models run one stream); a fit to the benchmark's --groups rows says what it measured."""
        return 1.0
