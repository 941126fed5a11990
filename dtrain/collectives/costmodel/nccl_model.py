"""NCCL's analytical cost model for a topology preset, and its per-size choice: Tree, Ring, CollNetDirect,
CollNetChain, NVLS, NVLSTree and PAT x LL/LL128/Simple, each where NCCL enables it.

Constants and formulas follow NCCL 2.30's src/graph/tuning.cc (`ncclTopoTuneModel`, the tuner constants at its top,
`ncclTopoGetAlgoTime`) and the enable rules of src/enqueue.cc (`updateCollCostTable`): t = lat + bytes / (1000 ·
algbw) (µs, GB/s), the latency from a base per (algorithm, protocol) plus per-hop hardware latencies, the bandwidth
from the algorithm's graph (channels x per-channel bandwidth), capped per protocol and architecture. NCCL picks the
enabled (algorithm, protocol) with the least modeled time. Every number here is modeled, not measured.
"""

from __future__ import annotations

import math

from dtrain.collectives.costmodel.base import ALGOS, PROTOS, Choice, CollectiveCost, check_coll, timed_choice
from dtrain.collectives.costmodel.presets import Topology
from dtrain.common.errors import UserError

# Constants of NCCL 2.30's model (src/graph/tuning.cc, ncclTunerConstantsDefaults). Tuples are indexed by protocol
# (LL, LL128, Simple); a 0 is a protocol NCCL never runs for that algorithm.
BASE_LAT_US = {"Tree": (6.8, 14.0, 8.4), "Ring": (6.6, 14.0, 8.4), "CollNetDirect": (0, 0, 0),
               "CollNetChain": (0, 0, 0), "NVLS": (0, 0, 0), "NVLSTree": (0, 0, 0), "PAT": (8.0, 8.0, 8.0)}
# Per-hop hardware latency (µs) by link type: intra-node NVLink or PCIe, inter-node network.
HW_LAT_US = {
    "nvlink": {"Tree": (0.6, 1.25, 4.0), "Ring": (0.6, 1.9, 3.4), "CollNetDirect": (0, 0, 3.7),
               "CollNetChain": (0, 0, 2.8), "NVLS": (0, 0, 25.0), "NVLSTree": (0, 0, 25.0), "PAT": (0, 0, 4.0)},
    "pcie": {"Tree": (1.0, 1.9, 4.0), "Ring": (1.0, 2.5, 5.7), "CollNetDirect": (0, 0, 3.7),
             "CollNetChain": (0, 0, 2.8), "NVLS": (0, 0, 0), "NVLSTree": (0, 0, 0), "PAT": (0, 0, 4.0)},
    "net": {"Tree": (5.0, 8.5, 14.0), "Ring": (2.7, 4.0, 14.0), "CollNetDirect": (0, 0, 31.0),
            "CollNetChain": (0, 0, 30.0), "NVLS": (0, 0, 18.0), "NVLSTree": (0, 0, 20.9), "PAT": (0, 0, 14.0)},
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
# NVLSTree's per-channel cap (perChMaxNVLSTreeBws; NVLSTree only runs across nodes).
PER_CH_MAX_NVLS_TREE_BW = {"hopper": (0.0, 57.7, 45.5), "blackwell": (0.0, 96.0, 80.0)}
# NVLS efficiency: the fraction of the NVLS graph's intra bandwidth NVLink SHARP delivers (nvlsEfficiency).
NVLS_EFFICIENCY = {"hopper": 0.85, "blackwell": 0.74}

# Tree bandwidth correction for sizes 64 B·2^k, k = 0..22 (below 512 MiB), between 0.4 and 1.0: NCCL 2.30's
# treeCorrectionFactor table (tuning.cc), rows LL, LL128, Simple. NVLSTree uses it too on Blackwell x86 hosts.
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

MAX_DIRECT_ARITY = 7  # NCCL_MAX_DIRECT_ARITY (src/include/device.h): CollNet runs with up to 8 GPUs per node
# Which collectives each algorithm serves in NCCL's model (tuning.cc's loop): Broadcast only Ring; AllGather and
# ReduceScatter Ring, PAT, NVLS and CollNetDirect; AllReduce every algorithm but PAT.
SERVES = {"Tree": {"allreduce"}, "Ring": {"allreduce", "allgather", "reducescatter", "broadcast"},
          "CollNetDirect": {"allreduce", "allgather", "reducescatter"}, "CollNetChain": {"allreduce"},
          "NVLS": {"allreduce", "allgather", "reducescatter"}, "NVLSTree": {"allreduce"},
          "PAT": {"allgather", "reducescatter"}}


def _node_index(nodes: int) -> int:
    """Column of the [1 node, 2 nodes, >= 4 nodes] cap triples (3 nodes share the >= 4 column, as in NCCL)."""
    return 0 if nodes == 1 else 1 if nodes == 2 else 2


def tree_corrected(bw: float, nbytes: int, algo: str, proto: str, cc: int = 0) -> float:
    """Tree's algorithm bandwidth times NCCL's per-size correction for 64 B·2^k sizes (TREE_CORRECTION); NVLSTree's
    too on Blackwell (our presets' hosts are x86)."""
    if (algo == "Tree" or (algo == "NVLSTree" and cc >= 100)) and nbytes >= 64:
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
            raise UserError(f"{self.name}: no algorithm/protocol is enabled for {coll}")
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

    # ---- which (algorithm, protocol) NCCL enables ------------------------------------------------------------

    def enabled(self, algo: str, proto: str, coll: str = "allreduce") -> bool:
        """Whether NCCL would consider (algo, proto) for `coll` on this machine (tuning.cc's loop and enable rules,
        enqueue.cc's updateCollCostTable): LL128 from sm70 on; NVLS/NVLSTree/CollNet/PAT with Simple only; NVLS
        where the node has it, across nodes only with CollNet (SHARP), NVLSTree only across nodes; CollNet only
        with SHARP, CollNetDirect only on NVSwitch; PAT only with one GPU per node."""
        t, ppn = self.topo, self.topo.gpus_per_node
        if coll not in SERVES[algo] or (proto == "LL128" and t.cc < 70):
            return False
        if algo in ("Tree", "Ring"):
            return True
        if proto != "Simple":
            return False
        if algo == "NVLS":
            # AllGather/ReduceScatter across nodes need the CollNet plugin's own AG/RS (not modeled): one node only.
            return t.nvls and (t.nodes == 1 or (t.collnet and coll == "allreduce"))
        if algo == "NVLSTree":
            return t.nvls and t.nodes > 1
        if algo in ("CollNetDirect", "CollNetChain"):
            if not (t.collnet and t.nodes > 1 and ppn <= MAX_DIRECT_ARITY + 1) or coll != "allreduce":
                return False  # AllGather/ReduceScatter over CollNet need the plugin's AG/RS: not modeled
            return algo == "CollNetChain" or t.nvswitch
        return t.pat_enable and ppn == 1 and t.cc >= 60  # PAT (tuning.cc ncclPatEnable)

    # ---- latency ---------------------------------------------------------------------------------------------

    def latency_us(self, algo: str, proto: str, coll: str = "allreduce") -> float:
        """The size-independent latency term, before the multi-node Ring/Simple factor: Ring pays one hop per step
        (2(n-1) for AllReduce, 2(nodes-1) of them over the network), Tree AllReduce climbs the intra-node chain and
        log2(nodes) network levels up and down; NVLS one NVLink SHARP operation (plus one network step across
        nodes), NVLSTree that and 2 log2(nodes) network levels, CollNet one network step, PAT a log-latency
        schedule plus 2.8 µs per rank (tuning.cc)."""
        t, p = self.topo, PROTOS.index(proto)
        n, nodes, ppn = t.ranks, t.nodes, t.gpus_per_node
        intra = HW_LAT_US[t.intra][algo][p]
        # With one GPU per node every hop is a network hop, and NCCL charges Tree's network latency (tuning.cc).
        inter = HW_LAT_US["net"]["Tree" if ppn == 1 else algo][p]
        lat = BASE_LAT_US[algo][p]
        levels = int(math.log2(nodes))
        if algo == "Tree":  # AllReduce only: up and down the intra-node chain and log2(nodes) network levels
            return lat + 2 * ((ppn - 1) * intra + levels * inter)
        if algo == "NVLS":  # NCCL sets (not adds) the NVLink latency
            return intra + (inter if nodes > 1 else 0.0)
        if algo == "NVLSTree":
            return lat + intra + 2 * levels * inter
        if algo == "CollNetDirect":  # 0.4 µs arity serialization per local GPU
            return lat + 2 * (min(1, ppn - 1) * intra + (ppn - 1) * 0.4) + inter
        if algo == "CollNetChain":
            return lat + 2 * (ppn - 1) * intra + inter
        if algo == "PAT":
            return lat + levels * (inter / 3.5) + n * 2.8
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

    # ---- bandwidth -------------------------------------------------------------------------------------------

    def _nvls_per_channel(self, algo: str, coll: str) -> float:
        """NVLS/NVLSTree bandwidth per channel (tuning.cc): the NVLS graph's intra bandwidth x NVLS efficiency x
        (channels-1)/channels, x2 for AllReduce (two operations pipelined) or x(ppn-1)/ppn otherwise, under the
        graph's inter bandwidth (doubled for NVLSTree on <= 2 nodes) and NVLSTree's per-channel cap."""
        t = self.topo
        ch, ppn = t.nvls_channels, t.gpus_per_node
        intra = t.nvls_bw_intra * NVLS_EFFICIENCY[t.arch] * (ch - 1) / ch
        intra *= 2.0 if coll == "allreduce" else (ppn - 1) / ppn
        inter = t.nvls_bw_inter * (2 if algo == "NVLSTree" and t.nodes <= 2 else 1)
        bw = min(intra, inter)
        if algo == "NVLSTree":
            bw = min(bw, PER_CH_MAX_NVLS_TREE_BW[t.arch][_node_index(t.nodes)])
        return bw

    def bus_bw(self, algo: str, proto: str, coll: str = "allreduce") -> float:
        """Modeled bus bandwidth (GB/s) before the conversion to algorithm bandwidth: channels x per-channel
        bandwidth, then per protocol LL x0.5, LL128 x0.92, each under its cap; Tree x0.92 under its own cap; NVLS
        and NVLSTree from the NVLS graph; CollNet from its graph (Direct x0.85 from Hopper on); PAT x0.75."""
        t, arch, col = self.topo, self.topo.arch, _node_index(self.topo.nodes)
        if algo in ("NVLS", "NVLSTree"):
            return t.nvls_channels * self._nvls_per_channel(algo, coll)
        if algo in ("CollNetDirect", "CollNetChain"):
            bus = t.collnet_channels * t.collnet_bw  # collnet graphs use bwIntra
            if algo == "CollNetDirect":
                # GPU/NIC ratio (tuning.cc): ppn/channels, halfway back to 1; 1 with one NIC per GPU.
                factor = t.gpus_per_node / t.collnet_channels
                bus /= factor - (factor - 1) / 2
                if t.cc >= 90:
                    bus *= 0.85
            return bus
        ch = t.channels
        bus = ch * t.bw_per_channel
        if algo == "PAT":  # on the Tree graph, which the presets take to be the ring graph's channels
            return bus * 0.75
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
        """Bus bandwidth converted to the model's algorithm bandwidth (tuning.cc): Ring, NVLS and NVLSTree x
        N/steps, the others x0.5; AllGather/ReduceScatter on anything but Ring are not converted."""
        n = self.topo.ranks
        bus = self.bus_bw(algo, proto, coll)
        if algo != "Ring" and coll in ("allgather", "reducescatter"):
            return bus
        if algo in ("Ring", "NVLS", "NVLSTree"):
            steps = {"allreduce": 2 * (n - 1), "allgather": n - 1, "reducescatter": n - 1, "broadcast": n}[coll]
            return bus * n / steps
        return bus * 0.5

    # ---- time and choice -------------------------------------------------------------------------------------

    def choice(self, nbytes: int, algo: str, proto: str, coll: str = "allreduce") -> Choice:
        """Modeled time of one collective of `nbytes` (the nccl-tests 'size', which is NCCL's own nBytes: the
        larger of the send and receive buffers) forced to (algo, proto)."""
        t = self.topo
        bw = tree_corrected(self.alg_bw(algo, proto, coll), nbytes, algo, proto, t.cc)
        lat = self.latency_us(algo, proto, coll)
        if (algo == "Ring" and proto == "Simple" and coll == "allreduce" and t.nodes > 1
                and nbytes / (t.channels * t.ranks) >= 64):
            lat *= RING_SIMPLE_PLATEAU[t.arch]
        return timed_choice(algo, proto, nbytes, lat, bw, coll, t.ranks)

    def choices(self, nbytes: int, coll: str = "allreduce") -> list[Choice]:
        check_coll(coll)
        return [self.choice(nbytes, a, p, coll) for a in ALGOS for p in PROTOS if self.enabled(a, p, coll)]

    def header(self) -> list[str]:
        algos = [a for a in ALGOS if any(self.enabled(a, p, c) for p in PROTOS for c in SERVES[a])]
        return [f"MODELED (not measured): NCCL 2.30 analytical cost model (src/graph/tuning.cc): {', '.join(algos)}, "
                "each with the protocols NCCL enables for it",
                self.topo.describe()]
