"""Topology presets: what NCCL's model needs to know about a machine (GPUs, links, and the ring graph its topology
search would find), for DGX-like machines of four GPU generations, on one node or several over InfiniBand.

The channel counts and per-channel bandwidths are our reading of NCCL 2.30's ring search (src/graph/search.cc), not
measurements: check them on a machine with `NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=GRAPH`, and override them with the
CLI's `--channels` / `--bw-per-channel`.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.errors import UserError


def arch_of(cc: int) -> str:
    """NCCL's architecture row for a compute capability x10; every GPU older than Ampere maps onto Volta's."""
    return "blackwell" if cc >= 100 else "hopper" if cc >= 90 else "ampere" if cc >= 80 else "volta"


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
        return arch_of(self.cc)

    def describe(self) -> str:
        return (f"{self.name}: {self.nodes} node(s) x {self.gpus_per_node} {self.gpu} (sm{self.cc}), "
                f"{self.intra} intra-node{', InfiniBand between nodes' if self.nodes > 1 else ''}; assumed graph "
                f"{self.channels} channels x {self.bw_per_channel:g} GB/s = {self.channels * self.bw_per_channel:g}"
                f" GB/s bus bandwidth ({self.source})")


# Single-node presets. NVLink per-link bandwidth is NCCL's (src/graph/topo.h: sm60 18.0, sm70 20.0, sm80 20.0,
# sm90 20.6 GB/s). Channel counts are our reading of NCCL 2.30's ring search (search.cc): the highest speed from its
# speed list whose channels fit the GPU's NVLink bandwidth, then channel duplication (bw >= 25 GB/s halves the
# per-channel bandwidth and doubles the channels). Not measured here: check with NCCL_DEBUG_SUBSYS=GRAPH.
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
    """Every `--topology` spelling: the presets, and the models read from a file (`collectives.costmodel.loading`)."""
    return (list(_SINGLE_NODE) + [f"{n}:<nodes>" for n in _MULTI_NODE] + ["fit:<fit.json | bench.csv | log>",
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
