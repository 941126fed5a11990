"""NCCL's analytical cost model (Ring/Tree × LL/LL128/Simple), topology presets, and fits to measurements.

Sits beside the reducer: given a collective's size it predicts its time and the (algorithm, protocol) NCCL would
pick, for `recommend` and `analysis.simulate`. Constants follow nccl-facts.md §4 (NCCL 2.30). Every number it
prints is modeled, not measured, unless a row says otherwise.

    python -m collectives.costmodel --topology h100x8 --sizes 8:1G            # table: every choice, NCCL's pick
    python -m collectives.costmodel --topology h100x8-ib:2 --sizes 8:1G --json
    python -m collectives.costmodel fit all_reduce_perf.log [--topology h100x8] [--out local.json]
    python -m collectives.costmodel --topology local:local.json --sizes 1K:64M  # gloo / fitted model
    python -m collectives.costmodel recommend --profile profiles/base.yaml --topology h100x8-ib:2 --out rec.yaml
"""

from __future__ import annotations

import csv
import functools
import io
import json
import math
import re
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

from common.errors import ArgumentParser, UserError, exit_on_user_error
from common.files import check_writable, write_atomic

ALGOS = ("Tree", "Ring")  # NCCL's tuner indices 0 and 1 (facts §1); NVLS, CollNet and PAT are not modeled
PROTOS = ("LL", "LL128", "Simple")  # indices 0..2
COLLECTIVES = ("allreduce", "allgather", "reducescatter", "broadcast")

# ---------------------------------------------------------------------------------------------------------------
# Constants of NCCL 2.30's model (facts §4). Tuples are indexed by protocol (LL, LL128, Simple).

BASE_LAT_US = {"Tree": (6.8, 14.0, 8.4), "Ring": (6.6, 14.0, 8.4)}
# Per-hop hardware latency (µs) by link type: intra-node NVLink or PCIe, inter-node network.
HW_LAT_US = {
    "nvlink": {"Tree": (0.6, 1.25, 4.0), "Ring": (0.6, 1.9, 3.4)},
    "pcie": {"Tree": (1.0, 1.9, 4.0), "Ring": (1.0, 2.5, 5.7)},
    "net": {"Tree": (5.0, 8.5, 14.0), "Ring": (2.7, 4.0, 14.0)},
}

# Bandwidth caps (GB/s) by architecture, each a triple for [1 node, 2 nodes, >= 4 nodes] (facts §4). NCCL maps
# every GPU older than Ampere (Pascal included) onto the Volta row.
LL_MAX_BW = {"volta": (39.0, 39.0, 20.4), "ampere": (87.7, 22.5, 19.0), "hopper": (141.0, 45.0, 35.0),
             "blackwell": (282.0, 90.0, 70.0)}
PER_CH_MAX_RING_LL128_BW = {"volta": 20.0, "ampere": 20.0, "hopper": 36.7, "blackwell": 40.0}
PER_CH_MAX_TREE_BW = {"volta": (26.5, 18.5, 10.0), "ampere": (24.0, 23.6, 17.8), "hopper": (38.7, 41.4, 36.0),
                      "blackwell": (70.0, 42.8, 24.0)}  # Blackwell's row: NCCL 2.30 tuning.cc (not in §4)
# Not in §4; from NCCL 2.30 tuning.cc: the multi-node Tree/LL128 per-channel cap.
PER_CH_MAX_TREE_LL128_BW = {"volta": (20.0, 20.0, 20.0), "ampere": (20.0, 20.0, 20.0),
                            "hopper": (36.7, 36.7, 29.0), "blackwell": (55.6, 31.67, 20.0)}

# Tree bandwidth correction for sizes 64 B·2^k, k = 0..22 (below 512 MiB); facts §4 gives the range (0.4–1.0),
# the per-size values are NCCL 2.30's table (tuning.cc), rows LL, LL128, Simple.
TREE_CORRECTION = (
    (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0),
    (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0),
    (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9),
)

# Multi-node Ring/Simple AllReduce latency factor ("plateau effect of ring"): ×1.4 from Ampere on (facts §4); NCCL
# 2.30 uses ×1.9 below Ampere and applies it only once bytes/(channels·ranks) >= 64.
RING_SIMPLE_PLATEAU = {"volta": 1.9, "ampere": 1.4, "hopper": 1.4, "blackwell": 1.4}

# Not in §4; NCCL 2.30 tuning.cc: a multi-node ring pays a network post overhead per step (1 µs on Intel hosts,
# 2 µs on AMD, ×3 for Simple) wherever it exceeds the intra-node hop latency.
NET_OVERHEAD_US = {"intel": 1.0, "amd": 2.0}


def _arch(cc: int) -> str:
    return "blackwell" if cc >= 100 else "hopper" if cc >= 90 else "ampere" if cc >= 80 else "volta"


def _node_index(nodes: int) -> int:
    """Column of the [1 node, 2 nodes, >= 4 nodes] cap triples (3 nodes share the >= 4 column, as in NCCL)."""
    return 0 if nodes == 1 else 1 if nodes == 2 else 2


# ---------------------------------------------------------------------------------------------------------------
# Topologies


@dataclass(frozen=True)
class Topology:
    """What NCCL's model needs to know about a machine: GPUs, links, and the ring graph its search would find."""

    name: str
    gpu: str
    cc: int  # compute capability ×10 (60 Pascal, 70 Volta, 80 Ampere, 90 Hopper)
    nodes: int
    gpus_per_node: int
    intra: str  # "nvlink" or "pcie": the intra-node link type of the graph
    channels: int  # channels of the Ring/Tree graph (NCCL_DEBUG_SUBSYS=GRAPH prints them)
    bw_per_channel: float  # GB/s per channel found by the topology search (bwIntra; bwInter equal for a ring)
    cpu: str = "intel"  # host CPU vendor: selects the multi-node LL cap row and the network overhead
    source: str = ""  # where the channel count and per-channel bandwidth come from

    @property
    def ranks(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def arch(self) -> str:
        return _arch(self.cc)

    def describe(self) -> str:
        return (f"{self.name}: {self.nodes} node(s) x {self.gpus_per_node} {self.gpu} (sm{self.cc}), "
                f"{self.intra} intra-node{', InfiniBand between nodes' if self.nodes > 1 else ''}; assumed graph "
                f"{self.channels} channels x {self.bw_per_channel:g} GB/s = {self.channels * self.bw_per_channel:g}"
                f" GB/s bus bandwidth ({self.source})")


# Single-node presets. NVLink per-link bandwidth is NCCL's (facts §4: Ampere 20.0, Hopper 20.6; NCCL's topo.h:
# sm60 18.0, sm70 20.0). Channel counts are our reading of NCCL 2.30's ring search (search.cc): the highest speed
# from its speed list whose channels fit the GPU's NVLink bandwidth, then channel duplication (bw >= 25 GB/s halves
# the per-channel bandwidth and doubles the channels). Not measured here: check with NCCL_DEBUG_SUBSYS=GRAPH.
_SINGLE_NODE = {
    "h100x8": dict(gpu="H100", cc=90, intra="nvlink", channels=12, bw_per_channel=30.0, cpu="intel",
                   source="DGX H100: 18 NVLink4 x 20.6 GB/s = 370.8 GB/s to NVSwitch; sm90 search: 6 channels x 60 "
                          "GB/s, duplicated to 12 x 30"),
    "a100x8": dict(gpu="A100", cc=80, intra="nvlink", channels=12, bw_per_channel=20.0, cpu="amd",
                   source="DGX A100: 12 NVLink3 x 20.0 GB/s = 240 GB/s to NVSwitch; search: 6 channels x 40 GB/s, "
                          "duplicated to 12 x 20"),
    "v100x8": dict(gpu="V100", cc=70, intra="nvlink", channels=6, bw_per_channel=20.0, cpu="intel",
                   source="DGX-1V hybrid cube-mesh: 6 NVLink2 per GPU at NCCL's 20.0 GB/s, one ring direction per "
                          "link: 6 channels x 20, no duplication below 25 GB/s"),
    "p100x8": dict(gpu="P100", cc=60, intra="nvlink", channels=4, bw_per_channel=18.0, cpu="intel",
                   source="DGX-1 (P100) hybrid cube-mesh: 4 NVLink1 per GPU at NCCL's 18.0 GB/s: 4 channels x 18; "
                          "LL128 disabled below sm70"),
}
# Multi-node over InfiniBand: one NIC per GPU (DGX designs). A ring channel enters and leaves a node through one
# NIC, so channels x per-channel bandwidth is bounded by the node's NICs and the per-channel speed comes from
# NCCL's inter-node speed list. Again our reading of the search, to be checked with NCCL_DEBUG_SUBSYS=GRAPH.
_MULTI_NODE = {
    "h100x8-ib": dict(channels=8, bw_per_channel=45.0,
                      source="8 x ConnectX-7 400 Gb/s (50 GB/s) per node; sm90 inter speed 45 GB/s per channel, one "
                             "channel per NIC: 8 x 45"),
    "a100x8-ib": dict(channels=8, bw_per_channel=24.0,
                      source="8 x HDR 200 Gb/s (25 GB/s) per node; inter speed 24 GB/s, one channel per NIC: 8 x 24"),
    "v100x8-ib": dict(channels=4, bw_per_channel=12.0,
                      source="DGX-1V: 4 x EDR 100 Gb/s (NCCL's 12 GB/s) per node: 4 channels x 12"),
    "p100x8-ib": dict(channels=4, bw_per_channel=12.0,
                      source="DGX-1: 4 x EDR 100 Gb/s (NCCL's 12 GB/s) per node: 4 channels x 12"),
}


def preset_names() -> list[str]:
    return (list(_SINGLE_NODE) + [f"{n}:<nodes>" for n in _MULTI_NODE] + ["local:<fit.json | bench.csv | log>",
                                                                          "nccl-log:<NCCL_DEBUG log>"])


def topology(spec: str) -> Topology:
    """`h100x8`, `a100x8`, `v100x8`, `p100x8`, or `<one of those>-ib:<nodes>` (nodes >= 2)."""
    base, _, arg = spec.partition(":")
    if base in _SINGLE_NODE and not arg:
        return Topology(name=spec, nodes=1, gpus_per_node=8, **_SINGLE_NODE[base])
    if base in _MULTI_NODE:
        if not arg.isdigit() or int(arg) < 2:
            raise UserError(f"topology '{spec}': give the node count (>= 2) after the colon, e.g. '{base}:2'")
        node = dict(_SINGLE_NODE[base.removesuffix("-ib")])
        node.update(_MULTI_NODE[base])
        return Topology(name=spec, nodes=int(arg), gpus_per_node=8, **node)
    raise UserError(f"unknown topology '{spec}' (available: {', '.join(preset_names())})")


# ---------------------------------------------------------------------------------------------------------------
# The analytical model


@dataclass(frozen=True)
class Choice:
    """One (algorithm, protocol) for one size: modeled time and bandwidths (GB/s, nccl-tests conventions)."""

    algo: str
    proto: str
    time_us: float
    algbw: float  # size / time
    busbw: float  # algbw x the collective's bus factor (facts §5)
    lat_us: float = 0.0  # the model's latency term
    bw: float = 0.0  # the model's algorithm bandwidth term (after the size correction)


def bus_factor(coll: str, ranks: int) -> float:
    """nccl-tests' busbw / algbw (facts §5)."""
    n = ranks
    return {"allreduce": 2 * (n - 1) / n, "allgather": (n - 1) / n, "reducescatter": (n - 1) / n,
            "broadcast": 1.0}[coll]


def _tree_corrected(bw: float, nbytes: int, algo: str, proto: str) -> float:
    """Tree's algorithm bandwidth times NCCL's per-size correction for 64 B·2^k sizes (facts §4)."""
    if algo == "Tree" and nbytes >= 64:
        k = int(math.log2(nbytes >> 6))
        if k < len(TREE_CORRECTION[PROTOS.index(proto)]):
            return bw * TREE_CORRECTION[PROTOS.index(proto)][k]
    return bw


def _choice(algo: str, proto: str, nbytes: int, lat: float, bw: float, coll: str, ranks: int | None) -> Choice:
    """t = lat + bytes / (1000 · bw) (µs, GB/s), with nccl-tests' bandwidths (busbw = algbw without a rank count)."""
    time = lat + nbytes / (1000.0 * bw)
    algbw = nbytes / (1000.0 * time)
    return Choice(algo, proto, time, algbw, algbw * bus_factor(coll, ranks) if ranks and ranks > 1 else algbw, lat,
                  bw)


def _check_coll(coll: str) -> None:
    if coll not in COLLECTIVES:
        raise UserError(f"unknown collective '{coll}' (modeled: {', '.join(COLLECTIVES)})")


class _NcclPick:
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


class NcclModel(_NcclPick):
    """NCCL's per-communicator latency/bandwidth tables for a topology, and its per-size choice."""

    kind = "nccl"

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
        """The size-independent latency term (facts §4), before the multi-node Ring/Simple factor."""
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
        if nodes > 1:  # network post overhead, not in §4 (see NET_OVERHEAD_US)
            intra = max(intra, NET_OVERHEAD_US[t.cpu] * (3 if proto == "Simple" else 1))
        return lat + (steps - inter_steps) * intra + inter_steps * inter

    def bus_bw(self, algo: str, proto: str, coll: str = "allreduce") -> float:
        """Modeled bus bandwidth (GB/s) before the conversion to algorithm bandwidth (facts §4)."""
        t, arch, col = self.topo, self.topo.arch, _node_index(self.topo.nodes)
        ch = t.channels
        bus = ch * t.bw_per_channel
        # Multi-node LL cap: NCCL indexes it by host CPU vendor, not GPU (Intel -> Volta row, AMD -> Ampere row);
        # facts §4 lists it by architecture, which is what NCCL does on one node.
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
        """Bus bandwidth converted to the model's algorithm bandwidth: Ring N/steps, Tree x0.5 (facts §4)."""
        n = self.topo.ranks
        if algo == "Tree":
            return self.bus_bw(algo, proto, coll) * 0.5
        steps = {"allreduce": 2 * (n - 1), "allgather": n - 1, "reducescatter": n - 1, "broadcast": n}[coll]
        return self.bus_bw(algo, proto, coll) * n / steps

    def choice(self, nbytes: int, algo: str, proto: str, coll: str = "allreduce") -> Choice:
        """Modeled time of one collective of `nbytes` (the nccl-tests 'size') forced to (algo, proto)."""
        t = self.topo
        bw = _tree_corrected(self.alg_bw(algo, proto, coll), nbytes, algo, proto)
        lat = self.latency_us(algo, proto, coll)
        if (algo == "Ring" and proto == "Simple" and coll == "allreduce" and t.nodes > 1
                and nbytes / (t.channels * t.ranks) >= 64):
            lat *= RING_SIMPLE_PLATEAU[t.arch]
        return _choice(algo, proto, nbytes, lat, bw, coll, t.ranks)

    def choices(self, nbytes: int, coll: str = "allreduce") -> list[Choice]:
        _check_coll(coll)
        return [self.choice(nbytes, a, p, coll) for a in ALGOS for p in PROTOS if self.enabled(a, p, coll)]

    def header(self) -> list[str]:
        return ["MODELED (not measured): NCCL 2.30 analytical cost model, Ring/Tree x LL/LL128/Simple only "
                "(NVLS, CollNet, PAT not modeled)",
                self.topo.describe()]


class NcclTableModel(_NcclPick):
    """NCCL's own model of the machine it ran on: the latency/bandwidth table a communicator prints at init with
    `NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=TUNING` (one row per collective, `lat/bw` per algorithm and protocol: µs and
    GB/s of algorithm bandwidth; 0.0 bandwidth = disabled). Time = lat + bytes / (1000 · bw), with Tree's per-size
    correction (facts §4). No preset's assumptions: channels and links are what NCCL's search found there. Not
    applied: the multi-node Ring/Simple latency factor, which needs the channel count the table does not print."""

    kind = "nccl-table"
    unavailable = "is disabled in NCCL's table"

    def __init__(self, cells: dict[tuple[str, str, str], tuple[float, float]], ranks: int | None, name: str,
                 source: str):
        self.cells, self.ranks, self.name, self.source = cells, ranks, name, source

    @classmethod
    def from_log(cls, path: str | Path) -> "NcclTableModel":
        """The first complete table in the log (the first communicator's; later ones may be restricted by a
        per-communicator NCCL_PROTO/NCCL_ALGO) and the rank count from an INIT line, when there is one."""
        try:
            text = Path(path).read_text(errors="replace")
        except OSError as e:
            raise UserError(f"{path}: cannot read NCCL log ({e.strerror})") from None
        cells: dict[tuple[str, str, str], tuple[float, float]] = {}
        algos: list[str] = []
        source, ranks, done = None, None, False
        for line in text.splitlines():
            m = re.search(r"NCCL INFO comm \S+ rank \d+ nRanks (\d+)", line)
            if m and ranks is None:
                ranks = int(m.group(1))
            m = re.match(r"(\S+)(?: \[\d+\])? NCCL INFO\s+(.*)$", line.strip())  # "host:pid:tid [dev] NCCL INFO"
            if not m or "|" not in m.group(2) or done:
                continue
            who, (head, *rest) = m.group(1), [c.strip() for c in m.group(2).split("|")]
            if source not in (None, who):
                continue  # another process's table
            if head == "Algorithm":
                if cells and any(a in algos for a in ("Tree", "Ring")) and "Tree" in rest:
                    done = True  # a second communicator's table begins
                    continue
                source, algos = who, [a for a in rest if a]
            elif algos and head.lower() in COLLECTIVES:  # NCCL's row names: AllReduce, AllGather ...
                values = [c for c in rest if c]
                for i, cell in enumerate(values):
                    lat, _, bw = cell.partition("/")
                    if i // 3 < len(algos) and algos[i // 3] in ALGOS:
                        try:
                            cells[(head.lower(), algos[i // 3], PROTOS[i % 3])] = (float(lat), float(bw))
                        except ValueError:
                            raise UserError(f"{path}: NCCL tuning table cell '{cell}' in row {head} is not "
                                            "latency/bandwidth (a truncated log?)") from None
        if not cells:
            raise UserError(f"{path}: no NCCL tuning table found (rank 0 prints it, with NCCL_DEBUG=INFO "
                            "NCCL_DEBUG_SUBSYS=TUNING or INIT,TUNING)")
        return cls(cells, ranks, f"nccl-log:{path}", str(path))

    def choice(self, nbytes: int, algo: str, proto: str, coll: str = "allreduce") -> Choice:
        lat, bw = self.cells[(coll, algo, proto)]
        return _choice(algo, proto, nbytes, lat, _tree_corrected(bw, nbytes, algo, proto), coll, self.ranks)

    def choices(self, nbytes: int, coll: str = "allreduce") -> list[Choice]:
        _check_coll(coll)
        return [self.choice(nbytes, a, p, coll) for a in ALGOS for p in PROTOS
                if self.cells.get((coll, a, p), (0.0, 0.0))[1] > 0]

    def header(self) -> list[str]:
        return [f"MODELED (not measured): NCCL's own latency/bandwidth table as printed at init ({self.source}), "
                f"{self.ranks or '?'} ranks; Ring/Tree x LL/LL128/Simple"]


# ---------------------------------------------------------------------------------------------------------------
# Measurements: nccl-tests logs and the project's benchmark rows


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

    @property
    def typical_us(self) -> float:
        """What a fit follows: the median operation where the benchmark recorded one (on a shared CPU the mean
        carries every scheduler outlier: 0.9-2.6 ms at 8 B-32 KiB on the 2-vCPU testbed), else the mean."""
        return self.median_us if self.median_us is not None else self.time_us

    @property
    def spread(self) -> float | None:
        """Relative spread of the operations (interquartile range over the median), where recorded."""
        return self.iqr_us / self.typical_us if self.iqr_us is not None and self.median_us else None


@dataclass
class MeasurementSet:
    rows: list[Measurement]
    coll: str = "allreduce"
    ranks: int | None = None
    source: str = ""
    skipped: int = 0  # rows dropped because their correctness check failed (#wrong > 0)


_TUNING_NEW = re.compile(r"(\w+): (\d+) Bytes -> Algo (\w+) proto (\w+)")  # NCCL >= 2.24 (facts §2)
_TUNING_OLD = re.compile(r"(\d+) Bytes -> Algo (\d+) proto (\d+) time")  # NCCL 2.21-2.23, numeric indices
_ENV_SET = re.compile(r"NCCL_(PROTO|ALGO) set by environment to (\S+)")
_ALGO_NAMES = ("Tree", "Ring", "CollNetDirect", "CollNetChain", "NVLS", "NVLSTree", "PAT")
_TEST_NAMES = {"all_reduce": "allreduce", "all_gather": "allgather", "reduce_scatter": "reducescatter",
               "broadcast": "broadcast"}


def _canon(name: str, names: tuple[str, ...]) -> str:
    for n in names:
        if n.lower() == name.lower().replace("_", ""):
            return n
    return name


def _forced(value: str, coll: str, names: tuple[str, ...]) -> str | None:
    """The single algorithm/protocol an NCCL_ALGO/NCCL_PROTO value forces for `coll`, if it forces exactly one."""
    items = [v for v in value.split(";") if v]
    for item in items:  # per-collective form since 2.24: "allreduce:LL128" (facts §1)
        c, _, v = item.rpartition(":")
        if c and c.lower() == coll and "," not in v and not v.startswith("^"):
            return _canon(v, names)
    plain = [i for i in items if ":" not in i]
    if len(plain) == 1 and "," not in plain[0] and not plain[0].startswith("^"):
        return _canon(plain[0], names)
    return None


def read_measurements(path: str | Path) -> MeasurementSet:
    """Rows of an nccl-tests log (`all_reduce_perf` ...), or of the project's benchmark CSV / JSON / JSONL."""
    p = Path(path)
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read measurements '{path}': {e}") from e
    body = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    if not body:
        raise UserError(f"{path}: no measurement rows")
    first = body[0].lstrip()
    if first.startswith(("{", "[")):
        ms = _read_bench_json(text, path)
    elif "size" in first.split(",")[0:3] or ("," in first and "time_us" in first):
        ms = _read_bench_csv(body, path)
    else:
        ms = _read_nccl_tests(text, path)
    if len({m.size for m in ms.rows}) < 2:
        raise UserError(f"{path}: need measurements at two sizes at least, found {len(ms.rows)} row(s)")
    ms.source = str(path)
    if ms.ranks is None:
        ms.ranks = _ranks_from_bus_factor(ms)
    return ms


def _ranks_from_bus_factor(ms: MeasurementSet) -> int | None:
    """Recover the rank count from busbw/algbw (facts §5), using the third of the rows with the largest algbw:
    printed bandwidths are rounded, so small ones say little."""
    rows = sorted((m for m in ms.rows if m.algbw and m.busbw), key=lambda m: m.algbw)
    ratios = [m.busbw / m.algbw for m in rows[-max(1, len(rows) // 3):]]
    if not ratios or ms.coll == "broadcast":
        return None
    r = statistics.median(ratios)
    n = 2 / (2 - r) if ms.coll == "allreduce" else 1 / (1 - r) if r < 1 else None
    return round(n) if n and n < 1e6 else None


def _num(v) -> float | None:
    """A number from a CSV/JSON cell; None for empty, null or N/A (a path that could not run that row)."""
    if v is None or str(v).strip() in ("", "N/A", "nan", "None"):
        return None
    return float(v)


def _bench_row(d: dict, where: str) -> Measurement:
    try:
        label = d.get("label") or "measured"
        algo, proto = d.get("algo"), d.get("proto")
        if algo or proto:
            label = f"{_canon(algo, _ALGO_NAMES) if algo else '*'}/{_canon(proto, PROTOS) if proto else '*'}"
        return Measurement(int(float(d["size"])), _num(d["time_us"]), _num(d.get("algbw")), _num(d.get("busbw")),
                           label, _num(d.get("cpu_us")), _num(d.get("host_us")), _num(d.get("median_us")),
                           _num(d.get("iqr_us")))
    except (KeyError, ValueError, TypeError) as e:
        raise UserError(f"{where}: bad benchmark row {d!r} ({e.__class__.__name__}: {e})") from e


def _by_path(dicts: list[dict]) -> list[dict]:
    """nccl-tests and the bench report out-of-place and in-place: keep out-of-place when both exist. Any other
    'path' values (code paths) become labels, so each is fitted on its own."""
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
    ops = {str(d.get("redop", "")).lower() for d in dicts}
    for d in _by_path(dicts):
        if len(ops) > 1 and str(d.get("redop", "")).lower() != "sum":
            continue
        try:
            wrong, t = _num(d.get("wrong")) or 0, _num(d.get("time_us"))
        except ValueError as e:
            raise UserError(f"{where}: bad benchmark row {d!r} ({e})") from e
        if wrong > 0:
            skipped += 1
        elif t is not None:
            rows.append(_bench_row(d, where))
    coll = {_TEST_NAMES.get(str(d.get("coll", "")).replace("_perf", ""), str(d.get("coll", ""))) for d in dicts}
    coll.discard("")
    ranks = {int(d["world_size"]) for d in dicts if d.get("world_size") not in (None, "")}
    return MeasurementSet(rows, coll.pop() if len(coll) == 1 else "allreduce",
                          ranks.pop() if len(ranks) == 1 else None, skipped=skipped)


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
    if header.get("coll"):
        ms.coll = _TEST_NAMES.get(str(header["coll"]).replace("_perf", ""), ms.coll)
    return ms


def _read_nccl_tests(text: str, where) -> MeasurementSet:
    """Parse an nccl-tests output (facts §5): the '# size count type redop root time algbw busbw #wrong ...'
    header, data rows (out-of-place columns first), and any NCCL INFO TUNING/ENV lines to label the sizes."""
    cols, rows, skipped, coll, ranks = None, [], 0, None, 0
    env = {"PROTO": None, "ALGO": None}
    tuned: dict[int, dict[str, int]] = {}  # size -> label -> how often NCCL logged it
    for line in text.splitlines():
        s = line.strip()
        if "NCCL INFO" in s or "NCCL WARN" in s:
            m = _ENV_SET.search(s)
            if m:
                env[m.group(1)] = m.group(2)
            m = _TUNING_NEW.search(s)
            if m and not m.group(3).isdigit() and (coll is None or m.group(1).lower() == coll):
                lab = f"{_canon(m.group(3), _ALGO_NAMES)}/{_canon(m.group(4), PROTOS)}"
                tuned.setdefault(int(m.group(2)), {}).setdefault(lab, 0)
                tuned[int(m.group(2))][lab] += 1
            m = _TUNING_OLD.search(s)
            if m and int(m.group(2)) < len(_ALGO_NAMES) and int(m.group(3)) < len(PROTOS):
                lab = f"{_ALGO_NAMES[int(m.group(2))]}/{PROTOS[int(m.group(3))]}"
                tuned.setdefault(int(m.group(1)), {}).setdefault(lab, 0)
                tuned[int(m.group(1))][lab] += 1
            continue
        if s.startswith("#"):
            words = s.lstrip("#").split()
            if "size" in words and "time" in words and "busbw" in words:
                cols = words
            m = re.search(r"Collective test starting:\s*(\w+?)_perf", s)
            if m:
                coll = _TEST_NAMES.get(m.group(1), m.group(1))
            if re.match(r"#\s+Rank\s+\d+\s", s):
                ranks += 1
            continue
        if cols is None or not s or not s.split()[0].isdigit():
            continue
        f = s.split()
        if len(f) < len(cols) - 4:  # a truncated line
            continue
        try:
            d = {k: f[i] for i, k in enumerate(cols[: cols.index("busbw") + 2]) if i < len(f)}
            wrong = d.get("#wrong", d.get("error", "0"))
            if wrong not in ("N/A",) and float(wrong) > 0:
                skipped += 1
                continue
            rows.append(Measurement(int(d["size"]), float(d["time"]), float(d["algbw"]), float(d["busbw"])))
            if coll is None and d.get("redop") == "none" and d.get("root") == "-1":
                coll = "allgather"
        except (KeyError, ValueError) as e:
            raise UserError(f"{where}: cannot parse nccl-tests row '{s}' ({e})") from e
    if cols is None:
        raise UserError(f"{where}: neither a benchmark CSV/JSON nor an nccl-tests log "
                        "(no '# size count type redop ... time algbw busbw' header)")
    coll = coll or "allreduce"
    forced_algo = _forced(env["ALGO"], coll, _ALGO_NAMES) if env["ALGO"] else None
    forced_proto = _forced(env["PROTO"], coll, PROTOS) if env["PROTO"] else None
    for m in rows:
        if m.size in tuned:
            m.label = max(tuned[m.size].items(), key=lambda kv: kv[1])[0]
        elif forced_algo or forced_proto:
            m.label = f"{forced_algo or '*'}/{forced_proto or '*'}"
    return MeasurementSet(rows, coll, ranks or None, skipped=skipped)


# ---------------------------------------------------------------------------------------------------------------
# Fitting: latency + bytes/bandwidth per size regime, least squares on relative error


@dataclass(frozen=True)
class Regime:
    """t = lat_us + bytes / (1000 · bw) for sizes up to `max_bytes` (inclusive); bw in GB/s (inf: flat)."""

    max_bytes: float
    lat_us: float
    bw: float

    def time_us(self, nbytes: float) -> float:
        return self.lat_us + (0.0 if math.isinf(self.bw) else nbytes / (1000.0 * self.bw))


def _fit_line(pts) -> tuple[float, float, float]:
    """Least squares of t ≈ a + b·x on relative error (weights v/t² for points (x, t, v)), a >= 0, b >= 0; x in
    MB. Returns (a, b, weighted SSE). Closed form from the weighted sums, so the regime search stays cheap."""
    sw = swx = swxx = swt = swxt = swtt = 0.0
    for x, t, v in pts:
        w = v / (t * t)
        sw += w; swx += w * x; swxx += w * x * x; swt += w * t; swxt += w * x * t; swtt += w * t * t  # noqa: E702
    det = sw * swxx - swx * swx
    a = b = None
    if det > 1e-12 * sw * swxx:
        a, b = (swxx * swt - swx * swxt) / det, (sw * swxt - swx * swt) / det
    if a is None or a < 0 or b < 0:  # constrained: the better of latency-only and bandwidth-only
        cands = [(swt / sw, 0.0)]
        if swxx > 0:
            cands.append((0.0, swxt / swxx))
        a, b = min(cands, key=lambda ab: _sse(ab, sw, swx, swxx, swt, swxt, swtt))
    return a, b, _sse((a, b), sw, swx, swxx, swt, swxt, swtt)


def _sse(ab, sw, swx, swxx, swt, swxt, swtt) -> float:
    a, b = ab
    return max(0.0, swtt + a * a * sw + b * b * swxx + 2 * a * b * swx - 2 * a * swt - 2 * b * swxt)


MONOTONE = 0.9  # a regime may start at most 10 % below where the previous one ends (a bigger message is not faster)
# Fit weights: a size's relative spread (interquartile range / median) is taken as at least MIN_SPREAD (no median
# is known better than to 1 %) and at most MAX_SPREAD. On the shared CPU the operations of a small all-reduce are
# bimodal (most near the median, a quarter or more at 3-4 ms), so their interquartile range is 2-10x the median and
# says more about that second mode than about how well the median is known; uncapped, the small sizes weighed
# nothing and a one-regime fit put 1 KiB at 26 us where every median was 240 us or more.
MIN_SPREAD, MAX_SPREAD = 0.01, 0.5


def fit_regimes(sizes: list[float], times: list[float], max_regimes: int = 4, tol: float = 0.02,
                spreads: list[float | None] | None = None) -> list[Regime]:
    """Split the size axis into at most `max_regimes` contiguous regimes, each fitted with latency + bandwidth.
    Each split minimizes the summed squared relative error; the count is the fewest regimes whose RMS relative
    error is within `tol` (or within 1.5x of the best count's, if no count reaches `tol`), so that a regime is
    added to explain a change of slope, not noise.

    `spreads`: each size's measured relative spread (interquartile range / median; None where unknown). Where
    every size has one, each point weighs 1/spread² (the spread held within MIN_SPREAD..MAX_SPREAD): on a shared
    CPU a small all-reduce scatters by 50 % or more and an 8 MiB one by 1 %, and unweighted the noisy small sizes
    drag the large sizes' bandwidth (10 % off at 8 MiB on the testbed)."""
    if len(sizes) != len(times) or not sizes:
        raise UserError("fit: need as many times as sizes, and at least one")
    if any(t <= 0 for t in times) or any(s < 0 for s in sizes):
        raise UserError("fit: times must be positive and sizes non-negative")
    weights = [1.0] * len(sizes)
    if spreads is not None and len(spreads) == len(sizes) and all(s is not None for s in spreads):
        raw = [1.0 / min(max(s, MIN_SPREAD), MAX_SPREAD) ** 2 for s in spreads]
        weights = [w * len(raw) / sum(raw) for w in raw]  # mean 1: the RMS below stays a relative error
    order = sorted(range(len(sizes)), key=lambda i: sizes[i])
    pts = [(sizes[i] / 1e6, times[i], weights[i]) for i in order]
    n = len(pts)
    # Boundaries only between distinct sizes, so repeated measurements of one size stay in one regime.
    cuts = [0] + [i for i in range(1, n) if pts[i][0] != pts[i - 1][0]] + [n]
    min_pts = 3 if n >= 6 else 2
    cost = {}
    for ia, i in enumerate(cuts):
        for j in cuts[ia + 1:]:
            if j - i >= min_pts and len({x for x, _, _ in pts[i:j]}) >= 2:
                cost[i, j] = _fit_line(pts[i:j])
    if not cost:
        a, b, _ = _fit_line(pts)
        return [Regime(math.inf, a, 1000.0 / b if b > 0 else math.inf)]
    # Dynamic programme over (regime count, last regime): the last regime is kept so that the next one can be
    # refused where it would model a bigger message as markedly faster than a smaller one (at their boundary).
    def boundary(i: int) -> float:  # MB: where a regime ending before point i hands over to the next
        return math.sqrt(max(pts[i - 1][0], 1e-9) * pts[i][0])

    def at(seg: tuple[int, int], x: float) -> float:
        a, b, _ = cost[seg]
        return a + b * x

    ending: dict[tuple[int, int], list[tuple[float, list[tuple[int, int]]]]] = {}  # (count, end) -> solutions
    for (i, j), (_, _, sse) in cost.items():
        if i == 0:
            ending.setdefault((1, j), []).append((sse, [(0, j)]))
    for k in range(2, max_regimes + 1):
        for (i, j), (_, _, sse) in sorted(cost.items()):
            x = boundary(i) if i > 0 else 0.0
            options = [(c + sse, segs + [(i, j)]) for c, segs in ending.get((k - 1, i), [])
                       if at((i, j), x) >= MONOTONE * at(segs[-1], x)]
            if options:
                ending.setdefault((k, j), []).append(min(options, key=lambda o: o[0]))
    best = {k: min(ending[k, n], key=lambda o: o[0]) for k in range(1, max_regimes + 1) if (k, n) in ending}
    rms = {k: math.sqrt(cost_k / n) for k, (cost_k, _) in best.items()}
    good_enough = max(tol, 1.5 * min(rms.values()))
    k = min(k for k, e in rms.items() if e <= good_enough)
    regimes = []
    segs = best[k][1]
    for idx, (i, j) in enumerate(segs):
        a, b, _ = cost[i, j]
        # A regime reaches up to the geometric middle of the gap to the next measured size.
        upper = math.inf if idx == len(segs) - 1 else math.sqrt(max(pts[j - 1][0], 1e-9) * pts[j][0]) * 1e6
        regimes.append(Regime(upper, a, 1000.0 / b if b > 0 else math.inf))
    return regimes


class FittedModel:
    """Measured costs: regimes per label ("measured", or "Ring/LL128" ... when the log says what NCCL ran).
    This is the `local` model for gloo, and a calibrated model wherever a benchmark exists."""

    kind = "fitted"

    def __init__(self, fits: dict[str, list[Regime]], coll: str = "allreduce", ranks: int | None = None,
                 name: str = "local", source: str = "", cpu: dict[str, tuple[float, float]] | None = None,
                 host: dict[str, tuple[float, float]] | None = None):
        self.fits, self.coll, self.ranks, self.name, self.source = fits, coll, ranks, name, source
        self.cpu = cpu or {}  # label -> (µs per operation, µs per byte): the process's CPU time, where measured
        self.host = host or {}  # label -> (µs per operation, µs per byte): computation lost per overlapped one

    @classmethod
    def from_measurements(cls, ms: MeasurementSet, name: str = "local", max_regimes: int = 4) -> "FittedModel":
        groups: dict[str, list[Measurement]] = {}
        for m in ms.rows:
            groups.setdefault(m.label, []).append(m)
        fits = {lab: fit_regimes([m.size for m in rows], [m.typical_us for m in rows], max_regimes,
                                 spreads=[m.spread for m in rows])
                for lab, rows in sorted(groups.items())}
        cpu = {lab: fit_per_op([(m.size, m.cpu_us) for m in rows]) for lab, rows in sorted(groups.items())
               if all(m.cpu_us is not None for m in rows)}
        host = {lab: fit_per_op(pts) for lab, rows in sorted(groups.items())
                if (pts := [(m.size, m.host_us) for m in rows if m.host_us is not None])}
        return cls(fits, ms.coll, ms.ranks, name, ms.source, cpu, host)

    @staticmethod
    def _per_op(table: dict[str, tuple[float, float]], nbytes: float) -> float | None:
        # The reducer's path when there is one: what the planned strategies run.
        label = "reducer" if "reducer" in table else next(iter(table), None)
        if label is None:
            return None
        per_op, per_byte = table[label]
        return per_op + per_byte * nbytes

    def cpu_us(self, nbytes: float) -> float | None:
        """CPU time one all-reduce of `nbytes` costs the process (all threads), from the benchmark; None where it
        was not measured."""
        return self._per_op(self.cpu, nbytes)

    def host_us(self, nbytes: float) -> float | None:
        """How much longer a computation takes per all-reduce of `nbytes` launched during it (the benchmark's
        --overlap, CPU); None where it was not measured."""
        return self._per_op(self.host, nbytes)

    def _regime(self, label: str, nbytes: float) -> Regime:
        return next(r for r in self.fits[label] if nbytes <= r.max_bytes)

    def label_time_us(self, label: str, nbytes: float) -> float:
        return self._regime(label, nbytes).time_us(nbytes)

    def _check_coll(self, coll: str) -> None:
        _check_coll(coll)
        if coll != self.coll:
            raise UserError(f"model '{self.name}' was fitted on {self.coll}, not {coll}")

    def _label(self, nbytes: float, coll: str, algo: str | None, proto: str | None) -> str:
        """The fit that costs this call: with labelled fits, (algo, proto) selects one, else the fastest of them
        (NCCL-like); the bench's reducer path when there is one, which is what the planned strategies run."""
        self._check_coll(coll)
        labels = [lab for lab in self.fits if _label_matches(lab, algo, proto)]
        if "reducer" in labels:
            return "reducer"
        if not labels:
            raise UserError(f"model '{self.name}' has no fit for {algo or 'any'}/{proto or 'any'} "
                            f"(fitted: {', '.join(self.fits)})")
        return min(labels, key=lambda lab: self.label_time_us(lab, nbytes))

    def time_us(self, nbytes: float, coll: str = "allreduce", algo: str | None = None, proto: str | None = None
                ) -> float:
        return self.label_time_us(self._label(nbytes, coll, algo, proto), nbytes)

    def latency_us(self, nbytes: float, coll: str = "allreduce", algo: str | None = None, proto: str | None = None
                   ) -> float:
        """The part of `time_us` that does not grow with the bytes: the latency of the size's regime."""
        return self._regime(self._label(nbytes, coll, algo, proto), nbytes).lat_us

    def choices(self, nbytes: int, coll: str = "allreduce") -> list[Choice]:
        self._check_coll(coll)
        out = []
        for lab in self.fits:
            algo, _, proto = lab.partition("/")
            r = self._regime(lab, nbytes)
            out.append(_choice(algo, proto, nbytes, r.lat_us, r.bw, coll, self.ranks))
        return out

    def pick(self, nbytes: int, coll: str = "allreduce") -> Choice:
        return min(self.choices(nbytes, coll), key=lambda c: c.time_us)

    def header(self) -> list[str]:
        lines = [f"MODELED from a fit to measurements ({self.source or 'fit'}): latency + bytes/bandwidth per size "
                 f"regime; {self.coll}, {self.ranks or '?'} ranks"]
        if self.cpu_us(0) is not None:
            lines.append(f"CPU time per all-reduce (benchmark, all threads): {self.cpu_us(0):.0f} us + "
                         f"{(self.cpu_us(1 << 20) - self.cpu_us(0)):.0f} us per MiB")
        if self.host_us(0) is not None:
            lines.append(f"computation lost per all-reduce launched during it (benchmark --overlap): "
                         f"{self.host_us(0):.0f} us + {(self.host_us(1 << 20) - self.host_us(0)):.0f} us per MiB")
        return lines

    def to_dict(self) -> dict:
        return {"kind": "fitted", "name": self.name, "coll": self.coll, "ranks": self.ranks, "source": self.source,
                "fits": {lab: [_regime_dict(r) for r in regs] for lab, regs in self.fits.items()},
                "cpu": {lab: {"per_op_us": round(a, 4), "per_byte_us": b} for lab, (a, b) in self.cpu.items()},
                "host": {lab: {"per_op_us": round(a, 4), "per_byte_us": b} for lab, (a, b) in self.host.items()}}

    @classmethod
    def from_dict(cls, d: dict, where: str = "") -> "FittedModel":
        try:
            fits = {lab: [Regime(math.inf if r["max_bytes"] is None else float(r["max_bytes"]), float(r["lat_us"]),
                                 math.inf if r["bw_GBps"] is None else float(r["bw_GBps"])) for r in regs]
                    for lab, regs in d["fits"].items()}
            cpu, host = ({lab: (float(c["per_op_us"]), float(c["per_byte_us"])) for lab, c in (d.get(k) or {}).items()}
                         for k in ("cpu", "host"))
        except (KeyError, TypeError, ValueError) as e:
            raise UserError(f"{where}: not a fitted cost model ({e})") from e
        return cls(fits, d.get("coll", "allreduce"), d.get("ranks"), d.get("name", "local"), d.get("source", where),
                   cpu, host)


def fit_per_op(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(µs per operation, µs per byte) from (size, µs) per all-reduce (CPU time, or computation lost): the
    per-operation cost is the median over sizes up to 64 KiB (where the data costs nothing), the per-byte cost the
    median of the excess per byte from 1 MiB up (the reduction and copies); robust to the odd slow size."""
    small = [v for n, v in points if n <= 64 << 10]
    per_op = max(0.0, statistics.median(small) if small else min(v for _, v in points))
    large = [(v - per_op) / n for n, v in points if n >= 1 << 20]
    return per_op, max(0.0, statistics.median(large)) if large else 0.0


def _label_matches(label: str, algo: str | None, proto: str | None) -> bool:
    a, _, p = label.partition("/")
    if not p:  # an unlabelled fit ("measured", or a bench path): whatever NCCL or gloo ran
        return True
    return (algo is None or a in ("*", algo)) and (proto is None or p in ("*", proto))


def _regime_dict(r: Regime) -> dict:
    return {"max_bytes": None if math.isinf(r.max_bytes) else round(r.max_bytes),
            "lat_us": round(r.lat_us, 4), "bw_GBps": None if math.isinf(r.bw) else round(r.bw, 6)}


def load_model(spec: str):
    """A topology preset's `NcclModel`; `local:<file>`: a saved fit (JSON) or measurements fitted on the spot;
    `nccl-log:<file>`: NCCL's own table from a log (`NcclTableModel`)."""
    if spec.startswith("nccl-log:") or spec == "nccl-log":
        path = spec.partition(":")[2]
        if not path:
            raise UserError("topology 'nccl-log' needs a file: 'nccl-log:<rank 0's NCCL_DEBUG log>'")
        return NcclTableModel.from_log(path)
    if spec.startswith("local:") or spec == "local":
        path = spec.partition(":")[2]
        if not path:
            raise UserError("topology 'local' needs measurements or a saved fit: 'local:<bench.csv | log | fit.json>'")
        p = Path(path)
        if p.suffix == ".json" and p.is_file():
            try:
                d = json.loads(p.read_text())
            except json.JSONDecodeError as e:
                raise UserError(f"{path}: invalid JSON ({e})") from e
            if isinstance(d, dict) and d.get("kind") == "fitted":
                return FittedModel.from_dict(d, path)
        return FittedModel.from_measurements(read_measurements(path), name=spec)
    return NcclModel(topology(spec))


# ---------------------------------------------------------------------------------------------------------------
# Bucket plans of a profile, and per-class recommendations

CAP_CANDIDATES_MB = (0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256)


@functools.lru_cache(maxsize=8)
def _ready_params(model_cfg, vocab: int) -> tuple:
    """The model's parameters as meta tensors, in the expected gradient-ready order (collectives.plan)."""
    import torch

    from collectives.plan import ready_order
    from dtrain.model import Transformer

    with torch.device("meta"):
        model = Transformer.from_config(model_cfg, vocab)
    return tuple(ready_order(model))


def ready_params(cfg, vocab: int | None = None) -> tuple:
    return _ready_params(cfg.model, vocab or cfg.data.vocab_size)


def bucket_plan(cfg, strategy: str | None = None, bucket_cap_mb: float | None = None,
                classes: dict[str, dict] | None = None, vocab: int | None = None):
    """The plan of `cfg`'s model under `strategy` (default: the profile's), built on meta tensors in the expected
    ready order; `classes` overrides `sync.classes.<class>` settings (bucket_cap_mb ...)."""
    import dataclasses as dc

    from collectives import strategies

    name = strategy or cfg.sync.strategy
    classes_raw = {k: dict(v) for k, v in (cfg.sync.classes or {}).items()}
    for c, over in (classes or {}).items():
        classes_raw.setdefault(c, {}).update(over)
    sync = dc.replace(cfg.sync, strategy=name, classes=classes_raw,
                      bucket_cap_mb=bucket_cap_mb if bucket_cap_mb is not None else cfg.sync.bucket_cap_mb)
    return strategies.plan_for(sync, list(ready_params(cfg, vocab)))


def recommend(cfg, model, fitted: FittedModel | None = None, timeline=None, vocab: int | None = None) -> dict:
    """Per tensor class of the `per_class` plan: bucket caps that minimize the modeled exposed communication of
    the step, then the (algo, proto) with the least modeled time for the class's buckets (None: NCCL's own pick).

    `model` is a topology preset (NCCL's per-size choice comes from it) or a fit; `fitted`, when given, costs every
    choice with measured per-algo/proto fits, so a forced choice can beat NCCL's modeled pick. `timeline` is
    (StepProfile, ReadyCurve, Calibration) from `analysis.simulate`; by default a FLOP estimate for the preset."""
    from analysis import simulate as sim

    cost_model = fitted or model
    nccl = model if isinstance(model, NcclModel) else None

    def one_us(nbytes, algo=None, proto=None):
        if algo is None and proto is None and nccl is not None:
            pick = nccl.pick(nbytes)  # what NCCL runs by default, costed by the fit when there is one
            try:
                return cost_model.time_us(nbytes, "allreduce", algo=pick.algo, proto=pick.proto)
            except UserError:  # the fit lacks NCCL's pick: the best measured choice stands in
                return cost_model.time_us(nbytes, "allreduce")
        try:
            return cost_model.time_us(nbytes, "allreduce", algo=algo, proto=proto)
        except UserError:  # a forced choice nobody measured cannot be recommended
            return math.inf

    def cost(nbytes, algo=None, proto=None):  # ms, for the replay
        return one_us(nbytes, algo, proto) / 1000.0

    if timeline is None:
        if nccl is None:
            raise UserError("recommend with a fitted model needs --run (a profiled step) for the backward timeline")
        timeline = sim.flop_timeline(cfg, nccl.topo, vocab=vocab)
    prof, curve, calib = timeline[:3]

    def run(strategy, classes=None, forced=None):
        nccl_of = (lambda b: tuple((forced or {}).get(b.tensor_class, (None, None)))) if forced is not None else None
        return sim.predict(cfg, prof, curve, cost_model, calib, strategy, classes=classes, vocab=vocab, cost=cost,
                           nccl_of=nccl_of)

    actual = run(cfg.sync.strategy)
    base_plan = bucket_plan(cfg, "per_class", vocab=vocab).buckets
    classes = list(dict.fromkeys(b.tensor_class for b in base_plan))
    totals = {c: sum(b.nbytes for b in base_plan if b.tensor_class == c) for c in classes}
    caps = {c: b.settings.bucket_cap_mb for c in classes for b in base_plan if b.tensor_class == c}
    at_profile_caps = run("per_class")

    def key(pred):
        return (round(pred.exposed_ms, 3), round(pred.comm_ms, 3))

    best = at_profile_caps
    for _ in range(2):  # coordinate descent over the classes' caps; two rounds settle it
        for c in classes:
            for cap in CAP_CANDIDATES_MB:
                trial = {**caps, c: cap}
                pred = run("per_class", {k: {"bucket_cap_mb": v} for k, v in trial.items()})
                if key(pred) < key(best):
                    best, caps = pred, trial
                if cap * 2**20 >= totals[c]:
                    break
    overrides = {c: {"bucket_cap_mb": caps[c]} for c in classes}
    plan = bucket_plan(cfg, "per_class", classes=overrides, vocab=vocab).buckets
    options = [(a, p) for a in ALGOS for p in PROTOS if nccl is None or nccl.enabled(a, p)]
    rows, forced = [], {}
    for c in classes:
        sizes = [b.nbytes for b in plan if b.tensor_class == c]
        default = sum(one_us(n) for n in sizes)
        t, a, p = min((sum(one_us(n, a, p) for n in sizes), a, p) for a, p in options)
        pin = t < default * 0.995  # force only what beats NCCL's own choice by a margin
        if pin:
            forced[c] = (a, p)
        rows.append({"class": c, "bytes": totals[c],
                     "profile_buckets": [b.nbytes for b in base_plan if b.tensor_class == c],
                     "cap_mb": caps[c], "buckets": sizes,
                     "picks": sorted({_pick_label(nccl, n) for n in sizes}) if nccl else [],
                     "comm_us_default": round(default, 2), "comm_us_best_forced": round(t, 2),
                     "recommended": {"algo": a, "proto": p} if pin else None})
    final = run("per_class", overrides, forced) if forced else best

    def summary(pred):
        return {"buckets": pred.buckets, "comm_ms": round(pred.comm_ms, 3), "exposed_ms": round(pred.exposed_ms, 3),
                "step_ms": round(pred.step_ms, 3)}

    overlay = {"sync": {"strategy": "per_class", "classes": {c: {"bucket_cap_mb": caps[c]} for c in classes}}}
    if forced:
        overlay["collectives"] = {"mode": "per_group", "classes": {
            c: {"algo": a, "proto": p} for c, (a, p) in forced.items()}}
    return {"topology": model.name, "modeled": True, "profile_strategy": cfg.sync.strategy,
            "timeline": list(timeline[3]) if len(timeline) > 3 else [], "classes": rows,
            "profile_plan_default": summary(actual), "per_class_profile_caps_default": summary(at_profile_caps),
            "recommended_caps_default": summary(best), "recommended": summary(final), "overlay": overlay}


def _pick_label(model, nbytes: int) -> str:
    c = model.pick(nbytes)
    return f"{c.algo}/{c.proto}" if c.proto else c.algo


def format_recommend(rec: dict) -> str:
    lines = [f"# MODELED recommendation for {rec['topology']}: per-class bucket caps minimizing the exposed "
             f"all-reduce time of a replayed step, then per-class NCCL choices",
             "# (under NCCL's own analytic model its per-size pick is never beaten; a forced choice can only win "
             "with --fit from measurements per algo/proto)"] + [f"# {n}" for n in rec["timeline"]]
    lines.append(f"{'class':>11} {'bytes':>7} {'profile bkts':>12} | {'cap MiB':>7} {'buckets':>7} "
                 f"{'NCCL picks':>22} {'default ms':>10} {'best forced':>11} {'choice':>13}")
    for r in rec["classes"]:
        choice = f"{r['recommended']['algo']}/{r['recommended']['proto']}" if r["recommended"] else "NCCL's"
        lines.append(f"{r['class']:>11} {human(r['bytes']):>7} {len(r['profile_buckets']):>12} | "
                     f"{r['cap_mb']:>7g} {len(r['buckets']):>7} {'+'.join(r['picks']):>22} "
                     f"{r['comm_us_default'] / 1000:10.3f} {r['comm_us_best_forced'] / 1000:11.3f} {choice:>13}")
    lines.append(f"{'per step (modeled)':>30} {'buckets':>7} {'comm ms':>9} {'exposed ms':>10} {'step ms':>9}")
    for label, k in ((f"profile's plan ({rec['profile_strategy']}), NCCL default", "profile_plan_default"),
                     ("per_class at profile caps, default", "per_class_profile_caps_default"),
                     ("per_class at recommended caps", "recommended_caps_default"),
                     ("recommendation", "recommended")):
        v = rec[k]
        lines.append(f"{label:>30.30} {v['buckets']:>7} {v['comm_ms']:9.3f} {v['exposed_ms']:10.3f} "
                     f"{v['step_ms']:9.2f}")
    return "\n".join(lines)


def overlay_yaml(profile_path: str, rec: dict, argv: list[str]) -> str:
    """The profile with the recommendation merged in: a complete profile, ready for `--profile`."""
    import yaml

    raw = yaml.safe_load(Path(profile_path).read_text()) or {}

    def merge(dst, src):
        for k, v in src.items():
            if isinstance(v, dict) and isinstance(dst.get(k), dict):
                merge(dst[k], v)
            else:
                dst[k] = v

    merge(raw, rec["overlay"])
    raw["name"] = f"{raw.get('name', Path(profile_path).stem)}-rec-{rec['topology'].replace(':', 'x')}"
    head = (f"# Generated by: python -m collectives.costmodel recommend {' '.join(argv)}\n"
            f"# From {profile_path}, with per-class bucket caps{' and NCCL choices' if 'collectives' in rec['overlay'] else ''}"
            f" MODELED for {rec['topology']}: {rec['recommended']['exposed_ms']:.3f} ms of exposed all-reduce per step "
            f"vs {rec['profile_plan_default']['exposed_ms']:.3f} ms for the profile's plan.\n"
            "# A forced NCCL protocol/algorithm must pass the benchmark's #wrong check before it is trusted "
            "(nccl-facts.md §1).\n")
    return head + yaml.safe_dump(raw, sort_keys=False)


def _cmd_recommend(argv) -> None:
    ap = ArgumentParser(prog="python -m collectives.costmodel recommend",
                        description="Per-class bucket sizes and NCCL protocol/algorithm for a profile's model "
                                    "(modeled).")
    ap.add_argument("--profile", required=True)
    ap.add_argument("--topology", required=True, help="a preset (NCCL's choice) or local:<fit>")
    ap.add_argument("--fit", help="cost every choice with this fit (per algo/proto) instead of the analytic model")
    ap.add_argument("--run", help="replay this run's profiled step (default: a FLOP estimate for the preset's GPU)")
    ap.add_argument("--mfu", type=float, default=0.3, help="without --run: assumed fraction of the GPU's peak")
    ap.add_argument("--out", help="write the profile with the recommendation merged in (YAML)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.out:
        check_writable(args.out, "--out")  # before the work, not after it
    from analysis import simulate as sim
    from dtrain import config as config_mod

    cfg = config_mod.load(args.profile)
    model = load_model(args.topology)
    fitted = load_model(f"local:{args.fit}") if args.fit else None
    timeline, vocab = None, None
    if args.run:
        run = sim.load_run(args.run)
        prof = sim.profiled_step(run)
        calib = sim.calibrate(prof, fitted or model)
        timeline = (prof, sim.ready_curve(run, prof), calib, [f"timeline: step {prof.step} of {args.run}",
                                                               f"calibration: {calib.note}"])
        vocab = run.vocab
    elif isinstance(model, NcclModel):
        timeline = sim.flop_timeline(cfg, model.topo, mfu=args.mfu)
    rec = recommend(cfg, model, fitted, timeline, vocab)
    argv_used = ["--profile", args.profile, "--topology", args.topology] + (["--fit", args.fit] if args.fit else []) \
        + (["--run", args.run] if args.run else [])
    text = overlay_yaml(args.profile, rec, argv_used)
    if args.out:
        import yaml

        config_mod.from_dict(yaml.safe_load(text), args.out)  # the overlay must be a valid profile
        write_atomic(args.out, text, "--out")
    print(json.dumps(rec, indent=1) if args.json else format_recommend(rec)
          + (f"\n# profile written to {args.out}" if args.out else "\n# profile with the recommendation "
             "(--out to save it):\n" + text))


# ---------------------------------------------------------------------------------------------------------------
# Command line

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """'8', '64K', '1M', '1G', '1GiB', '512B' -> bytes (binary units, as nccl-tests' -b/-e)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise UserError(f"bad size '{text}' (e.g. 8, 64K, 1M, 1G)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def parse_sizes(spec: str) -> list[int]:
    """'8:1G' (powers of 2), '1K:1M:4' (factor 4), or a list '1M,4M,16M'."""
    if ":" in spec:
        parts = spec.split(":")
        if len(parts) not in (2, 3):
            raise UserError(f"bad size range '{spec}' (min:max[:factor])")
        lo, hi = parse_size(parts[0]), parse_size(parts[1])
        factor = int(parts[2]) if len(parts) == 3 and parts[2].isdigit() else 2 if len(parts) == 2 else 0
        if lo < 1 or hi < lo or factor < 2:
            raise UserError(f"bad size range '{spec}': need 1 <= min <= max and an integer factor >= 2")
        out, s = [], lo
        while s <= hi:
            out.append(s)
            s *= factor
        return out
    sizes = [parse_size(s) for s in spec.split(",") if s.strip()]
    if not sizes:
        raise UserError(f"bad sizes '{spec}': give min:max[:factor] or a list of sizes")
    return sizes


def human(nbytes: float) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale:
            v = nbytes / scale
            return f"{v:.0f}{unit}" if v == int(v) else f"{v:.3g}{unit}"
    return f"{nbytes:.0f}B"


def table(model, sizes: list[int], coll: str = "allreduce") -> dict:
    """The `--json` document: per size every choice and the pick."""
    rows = []
    for s in sizes:
        cs = model.choices(s, coll)
        pick = min(cs, key=lambda c: c.time_us)
        rows.append({"size": s, "pick": {"algo": pick.algo, "proto": pick.proto or None},
                     "choices": [{"algo": c.algo, "proto": c.proto or None, "time_us": round(c.time_us, 3),
                                  "algbw": round(c.algbw, 4), "busbw": round(c.busbw, 4)} for c in cs]})
    return {"topology": model.name, "modeled": True, "coll": coll, "ranks": model.ranks, "notes": model.header(),
            "rows": rows}


def _label(c: dict) -> str:
    return f"{c['algo']}/{c['proto']}" if c.get("proto") else c["algo"]


def pick_changes(doc: dict) -> list[tuple[int, str, str]]:
    """(size, from, to) wherever the pick differs from the previous size's."""
    out, prev = [], None
    for r in doc["rows"]:
        cur = _label(r["pick"])
        if prev is not None and cur != prev:
            out.append((r["size"], prev, cur))
        prev = cur
    return out


def format_table(doc: dict) -> str:
    labels = [_label(c) for c in doc["rows"][0]["choices"]]
    lines = [f"# {n}" for n in doc["notes"]]
    lines.append(f"# {doc['coll']}, {doc['ranks'] or '?'} ranks; each cell: time(us) busbw(GB/s); pick = least modeled time")
    lines.append(f"{'size(B)':>12} {'':>5} " + " ".join(f"{lab:>16}" for lab in labels) + f"  {'pick':<12}")
    for r in doc["rows"]:
        cells = [f"{c['time_us']:9.1f} {c['busbw']:6.1f}" for c in r["choices"]]
        pick = _label(r["pick"])
        lines.append(f"{r['size']:>12} {human(r['size']):>5} " + " ".join(cells) + f"  {pick:<12}")
    changes = pick_changes(doc)
    lines.append("# pick changes: " + ("; ".join(f"{a} -> {b} at {human(s)}" for s, a, b in changes) or "none"))
    return "\n".join(lines)


def fit_report(ms: MeasurementSet, fm: FittedModel, preset=None) -> dict:
    """Per size: measured, fitted and (optionally) the preset's modeled time, with relative errors."""
    rows = []
    for m in sorted(ms.rows, key=lambda m: (m.label, m.size)):
        fit = fm.label_time_us(m.label, m.size)
        row = {"size": m.size, "label": m.label, "measured_us": m.typical_us, "fitted_us": round(fit, 3),
               "fit_err_pct": round(100 * (fit - m.typical_us) / m.typical_us, 2)}
        if preset is not None:
            a, _, p = m.label.partition("/")
            forced = dict(algo=a if a in ALGOS else None, proto=p if p in PROTOS else None)
            try:
                mod = preset.time_us(m.size, ms.coll, **forced)
            except UserError:
                mod = preset.time_us(m.size, ms.coll)
            row["preset_us"] = round(mod, 3)
            row["preset_err_pct"] = round(100 * (mod - m.typical_us) / m.typical_us, 2)
        rows.append(row)
    errs = [abs(r["fit_err_pct"]) for r in rows]
    return {"source": ms.source, "coll": ms.coll, "ranks": ms.ranks, "skipped_wrong": ms.skipped,
            "fits": {lab: [_regime_dict(r) for r in regs] for lab, regs in fm.fits.items()},
            "fit_error_pct": {"median_abs": round(statistics.median(errs), 2), "max_abs": round(max(errs), 2)},
            "rows": rows, "model": fm.to_dict()}


def format_fit(rep: dict, preset_name: str | None) -> str:
    lines = [f"# fit of {rep['source']}: {rep['coll']}, {rep['ranks'] or '?'} ranks"
             + (f", {rep['skipped_wrong']} row(s) with #wrong > 0 left out" if rep["skipped_wrong"] else ""),
             "# model per label: t = lat + bytes / (1000 * bw), one line per size regime (fitted to measurements: "
             "the median operation where the benchmark recorded it, else the mean)"]
    for lab, regs in rep["fits"].items():
        lo = 0
        for r in regs:
            hi = "inf" if r["max_bytes"] is None else human(r["max_bytes"])
            bw = "inf" if r["bw_GBps"] is None else f"{r['bw_GBps']:.3f}"
            lines.append(f"{lab:>14}  sizes {human(lo):>5} .. {hi:<6} lat {r['lat_us']:9.2f} us   bw {bw:>9} GB/s")
            lo = r["max_bytes"] or 0
    head = f"{'size(B)':>12} {'':>5} {'label':>14} {'measured':>10} {'fitted':>10} {'err%':>7}"
    if preset_name:
        head += f" {preset_name + ' (modeled)':>22} {'err%':>7}"
    lines.append(head)
    for r in rep["rows"]:
        ln = (f"{r['size']:>12} {human(r['size']):>5} {r['label']:>14} {r['measured_us']:10.2f} "
              f"{r['fitted_us']:10.2f} {r['fit_err_pct']:7.1f}")
        if "preset_us" in r:
            ln += f" {r['preset_us']:22.2f} {r['preset_err_pct']:7.1f}"
        lines.append(ln)
    e = rep["fit_error_pct"]
    lines.append(f"# fit error: median |err| {e['median_abs']}%, max |err| {e['max_abs']}%")
    return "\n".join(lines)



def _cmd_table(argv) -> None:
    ap = ArgumentParser(prog="python -m collectives.costmodel",
                        description="Modeled time of one collective per size, every (algo, proto), and NCCL's pick.")
    ap.add_argument("--topology", required=True, help=f"one of: {', '.join(preset_names())}")
    ap.add_argument("--sizes", default="8:1G", help="min:max[:factor] or a comma list (default 8:1G)")
    ap.add_argument("--coll", default="allreduce", choices=COLLECTIVES)
    ap.add_argument("--channels", type=int, help="override the preset's channel count (from a GRAPH log)")
    ap.add_argument("--bw-per-channel", type=float, help="override the preset's per-channel GB/s")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    model = load_model(args.topology)
    if args.channels is not None or args.bw_per_channel is not None:
        if not isinstance(model, NcclModel):
            raise UserError("--channels/--bw-per-channel apply to topology presets, not to a fitted model")
        if (args.channels is not None and args.channels < 1) or (
                args.bw_per_channel is not None and not (math.isfinite(args.bw_per_channel)
                                                         and args.bw_per_channel > 0)):
            raise UserError("--channels must be >= 1 and --bw-per-channel a finite number > 0")
        t = model.topo
        model = NcclModel(replace(t, channels=args.channels or t.channels,
                                  bw_per_channel=args.bw_per_channel or t.bw_per_channel,
                                  source="overridden on the command line"))
    doc = table(model, parse_sizes(args.sizes), args.coll)
    print(json.dumps(doc, indent=1) if args.json else format_table(doc))


def _cmd_fit(argv) -> None:
    ap = ArgumentParser(prog="python -m collectives.costmodel fit",
                        description="Fit latency/bandwidth per size regime (and per algo/proto when the log tells) "
                                    "to an nccl-tests log or the project's benchmark CSV/JSON, with the error per size.")
    ap.add_argument("file")
    ap.add_argument("--topology", help="also show a model's time and error per size: a preset, or nccl-log:<file> "
                                       "(NCCL's own table)")
    ap.add_argument("--max-regimes", type=int, default=4)
    ap.add_argument("--out", help="save the fitted model as JSON (use it as --topology local:<file>)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.max_regimes < 1:
        raise UserError("--max-regimes must be >= 1")
    if args.out:
        check_writable(args.out, "--out")
    ms = read_measurements(args.file)
    fm = FittedModel.from_measurements(ms, name=f"local:{args.file}", max_regimes=args.max_regimes)
    if args.topology and args.topology.partition(":")[0] == "local":
        raise UserError("fit --topology: compare against a preset or nccl-log:<file>, not another fit")
    preset = load_model(args.topology) if args.topology else None
    if preset is not None and ms.ranks and preset.ranks and ms.ranks != preset.ranks:
        print(f"# note: the measurements have {ms.ranks} ranks, {preset.name} has {preset.ranks}", file=sys.stderr)
    rep = fit_report(ms, fm, preset)
    if args.out:
        write_atomic(args.out, json.dumps(fm.to_dict(), indent=1) + "\n", "--out")
    print(json.dumps(rep, indent=1) if args.json else format_fit(rep, preset.name if preset else None))


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    with exit_on_user_error("collectives.costmodel"):
        if argv and argv[0] == "fit":
            _cmd_fit(argv[1:])
        elif argv and argv[0] == "recommend":
            _cmd_recommend(argv[1:])
        else:
            _cmd_table(argv)


if __name__ == "__main__":
    main()
