"""NCCL's analytical cost model (Ring/Tree x LL/LL128/Simple) for a topology preset, and its per-size choice.

Constants and formulas follow NCCL 2.30's src/graph/tuning.cc (`ncclTopoTuneModel` and the bandwidth/latency tables
at its top): t = lat + bytes / (1000 · algbw) (µs, GB/s), the latency from a base per (algorithm, protocol) plus a
per-hop hardware latency, the bandwidth from the ring graph's channels, capped per protocol and architecture. NCCL
picks the (algorithm, protocol) with the least modeled time. Every number here is modeled, not measured.
"""

from __future__ import annotations

import math

from collectives.costmodel.base import ALGOS, PROTOS, Choice, CollectiveCost, check_coll, timed_choice
from collectives.costmodel.presets import Topology
from common.errors import UserError

# Constants of NCCL 2.30's model (src/graph/tuning.cc). Tuples are indexed by protocol (LL, LL128, Simple).

BASE_LAT_US = {"Tree": (6.8, 14.0, 8.4), "Ring": (6.6, 14.0, 8.4)}
# Per-hop hardware latency (µs) by link type: intra-node NVLink or PCIe, inter-node network.
HW_LAT_US = {
    "nvlink": {"Tree": (0.6, 1.25, 4.0), "Ring": (0.6, 1.9, 3.4)},
    "pcie": {"Tree": (1.0, 1.9, 4.0), "Ring": (1.0, 2.5, 5.7)},
    "net": {"Tree": (5.0, 8.5, 14.0), "Ring": (2.7, 4.0, 14.0)},
}

# Bandwidth caps (GB/s) by architecture, each a triple for [1 node, 2 nodes, >= 4 nodes] (llMaxBws,
# perChMaxRingLL128Bws, perChMaxTreeBws in tuning.cc). NCCL maps every GPU older than Ampere (Pascal included)
# onto the Volta row.
LL_MAX_BW = {"volta": (39.0, 39.0, 20.4), "ampere": (87.7, 22.5, 19.0), "hopper": (141.0, 45.0, 35.0),
             "blackwell": (282.0, 90.0, 70.0)}
PER_CH_MAX_RING_LL128_BW = {"volta": 20.0, "ampere": 20.0, "hopper": 36.7, "blackwell": 40.0}
PER_CH_MAX_TREE_BW = {"volta": (26.5, 18.5, 10.0), "ampere": (24.0, 23.6, 17.8), "hopper": (38.7, 41.4, 36.0),
                      "blackwell": (70.0, 42.8, 24.0)}
# The multi-node Tree/LL128 per-channel cap (perChMaxTreeLL128Bws in tuning.cc).
PER_CH_MAX_TREE_LL128_BW = {"volta": (20.0, 20.0, 20.0), "ampere": (20.0, 20.0, 20.0),
                            "hopper": (36.7, 36.7, 29.0), "blackwell": (55.6, 31.67, 20.0)}

# Tree bandwidth correction for sizes 64 B·2^k, k = 0..22 (below 512 MiB), between 0.4 and 1.0: NCCL 2.30's
# treeCorrectionFactor table (tuning.cc), rows LL, LL128, Simple.
TREE_CORRECTION = (
    (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0),
    (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0),
    (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9),
)

# Multi-node Ring/Simple AllReduce latency factor ("plateau effect of ring" in tuning.cc): ×1.4 from Ampere on,
# ×1.9 below, applied only once bytes/(channels·ranks) >= 64.
RING_SIMPLE_PLATEAU = {"volta": 1.9, "ampere": 1.4, "hopper": 1.4, "blackwell": 1.4}

# tuning.cc: a multi-node ring pays a network post overhead per step (1 µs on Intel hosts, 2 µs on AMD, ×3 for
# Simple) wherever it exceeds the intra-node hop latency.
NET_OVERHEAD_US = {"intel": 1.0, "amd": 2.0}


def _node_index(nodes: int) -> int:
    """Column of the [1 node, 2 nodes, >= 4 nodes] cap triples (3 nodes share the >= 4 column, as in NCCL)."""
    return 0 if nodes == 1 else 1 if nodes == 2 else 2


def tree_corrected(bw: float, nbytes: int, algo: str, proto: str) -> float:
    """Tree's algorithm bandwidth times NCCL's per-size correction for 64 B·2^k sizes (TREE_CORRECTION)."""
    if algo == "Tree" and nbytes >= 64:
        k = int(math.log2(nbytes >> 6))
        if k < len(TREE_CORRECTION[PROTOS.index(proto)]):
            return bw * TREE_CORRECTION[PROTOS.index(proto)][k]
    return bw


class NcclPick(CollectiveCost):
    """NCCL's choice over a model's `choices(nbytes, coll)`: the least modeled time, or the least of a forced
    algorithm and/or protocol."""

    unavailable = "is not available"  # how a forced choice the model does not have is named

    def pick(self, nbytes: int, coll: str = "allreduce") -> Choice:
        options = self.choices(nbytes, coll)
        if not options:
            raise UserError(f"{self.name}: no Ring/Tree choice is enabled for {coll}")
        return min(options, key=lambda c: c.time_us)

    def time_us(self, nbytes: int, coll: str = "allreduce", algo: str | None = None, proto: str | None = None
                ) -> float:
        """Time of one collective; NCCL's pick unless (algo, proto) is forced (either may be None = free)."""
        cands = [c for c in self.choices(nbytes, coll)
                 if (algo is None or c.algo == algo) and (proto is None or c.proto == proto)]
        if not cands:
            raise UserError(f"{self.name}: {algo or 'any'}/{proto or 'any'} {self.unavailable} for {coll}")
        return min(c.time_us for c in cands)


class NcclModel(NcclPick):
    """NCCL's per-communicator latency/bandwidth tables for a topology, and its per-size choice."""

    kind = "nccl"
    honours_forced = True  # a class's forced NCCL choice is what NCCL would run: costed as such

    def __init__(self, topo: Topology):
        self.topo = topo
        self.name = topo.name
        self.ranks = topo.ranks

    def enabled(self, algo: str, proto: str, coll: str = "allreduce") -> bool:
        """NCCL only models Tree for AllReduce here, and enables LL128 by default from sm70 on (tuning.cc)."""
        if algo == "Tree" and coll != "allreduce":
            return False
        if proto == "LL128" and self.topo.cc < 70:
            return False
        return True

    def latency_us(self, algo: str, proto: str, coll: str = "allreduce") -> float:
        """The size-independent latency term, before the multi-node Ring/Simple factor: Ring pays one hop per step
        (2(n-1) for AllReduce, 2(nodes-1) of them over the network), Tree AllReduce climbs the intra-node chain and
        log2(nodes) network levels up and down."""
        t, p = self.topo, PROTOS.index(proto)
        n, nodes, ppn = t.ranks, t.nodes, t.gpus_per_node
        intra = HW_LAT_US[t.intra][algo][p]
        # With one GPU per node every hop is a network hop, and NCCL charges Tree's network latency (tuning.cc).
        inter = HW_LAT_US["net"]["Tree" if ppn == 1 else algo][p]
        lat = BASE_LAT_US[algo][p]
        if algo == "Tree":  # AllReduce only: up and down the intra-node chain and log2(nodes) network levels
            return lat + 2 * ((ppn - 1) * intra + int(math.log2(nodes)) * inter)
        if coll == "broadcast":
            # Ring broadcast: one hop per rank; Simple charges Tree's hop latency for its chunk (tuning.cc,
            # assuming channels are not all the same ring).
            hop = HW_LAT_US[t.intra if nodes == 1 else "net"]["Tree" if p == 2 else "Ring"][p]
            return lat + n * hop
        steps = 2 * (n - 1) if coll == "allreduce" else n - 1
        inter_steps = 0 if nodes == 1 else (2 * (nodes - 1) if coll == "allreduce" else nodes - 1)
        if nodes > 1:  # network post overhead (see NET_OVERHEAD_US)
            intra = max(intra, NET_OVERHEAD_US[t.cpu] * (3 if proto == "Simple" else 1))
        return lat + (steps - inter_steps) * intra + inter_steps * inter

    def bus_bw(self, algo: str, proto: str, coll: str = "allreduce") -> float:
        """Modeled bus bandwidth (GB/s) before the conversion to algorithm bandwidth: channels x per-channel
        bandwidth, then per protocol LL x0.5, LL128 x0.92, each under its cap; Tree x0.92 under its own cap."""
        t, arch, col = self.topo, self.topo.arch, _node_index(self.topo.nodes)
        ch = t.channels
        bus = ch * t.bw_per_channel
        # Multi-node LL cap: NCCL indexes it by host CPU vendor, not GPU (Intel -> Volta row, AMD -> Ampere row);
        # on one node by architecture.
        ll_row = arch if t.nodes == 1 else ("ampere" if t.cpu == "amd" else "volta")
        ll_max = LL_MAX_BW[ll_row][col]
        if algo == "Ring":
            if proto == "LL":
                bus = min(ll_max, bus * 0.5)  # 4 B data + 4 B flag per 8 B line
            elif proto == "LL128":
                bus = min(bus * 0.92, ch * PER_CH_MAX_RING_LL128_BW[arch])  # 120 B of 128 B lines
            return bus
        bus = min(bus * 0.92, ch * PER_CH_MAX_TREE_BW[arch][col])
        if proto == "LL":
            bus = min(bus / 3.8, ll_max)
        elif proto == "LL128":
            bus = min(bus * (7.0 / 9.0 if t.nodes == 1 else 120.0 / 128.0), ch * PER_CH_MAX_TREE_LL128_BW[arch][col])
        return bus

    def alg_bw(self, algo: str, proto: str, coll: str = "allreduce") -> float:
        """Bus bandwidth converted to the model's algorithm bandwidth: Ring x N/steps, Tree x0.5 (tuning.cc)."""
        n = self.topo.ranks
        if algo == "Tree":
            return self.bus_bw(algo, proto, coll) * 0.5
        steps = {"allreduce": 2 * (n - 1), "allgather": n - 1, "reducescatter": n - 1, "broadcast": n}[coll]
        return self.bus_bw(algo, proto, coll) * n / steps

    def choice(self, nbytes: int, algo: str, proto: str, coll: str = "allreduce") -> Choice:
        """Modeled time of one collective of `nbytes` (the nccl-tests 'size') forced to (algo, proto)."""
        t = self.topo
        bw = tree_corrected(self.alg_bw(algo, proto, coll), nbytes, algo, proto)
        lat = self.latency_us(algo, proto, coll)
        if (algo == "Ring" and proto == "Simple" and coll == "allreduce" and t.nodes > 1
                and nbytes / (t.channels * t.ranks) >= 64):
            lat *= RING_SIMPLE_PLATEAU[t.arch]
        return timed_choice(algo, proto, nbytes, lat, bw, coll, t.ranks)

    def choices(self, nbytes: int, coll: str = "allreduce") -> list[Choice]:
        check_coll(coll)
        return [self.choice(nbytes, a, p, coll) for a in ALGOS for p in PROTOS if self.enabled(a, p, coll)]

    def header(self) -> list[str]:
        return ["MODELED (not measured): NCCL 2.30 analytical cost model, Ring/Tree x LL/LL128/Simple only "
                "(NVLS, CollNet, PAT not modeled)",
                self.topo.describe()]
