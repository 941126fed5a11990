"""Topology presets: what NCCL's model needs to know about a machine (GPUs, links, the graphs its topology search
would find, and which of NCCL's algorithms the machine and its network allow), for DGX-like machines of five GPU
generations on one node or several over InfiniBand (optionally with SHARP), and one Ethernet (RoCE) cluster of
one GPU per node.

The channel counts and per-channel bandwidths are our reading of NCCL 2.30's topology search (src/graph/search.cc:
the speed lists, `ncclTopoDupChannels`, `ncclTopoSearchTryNvls`), not measurements: check them on a machine with
`NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=GRAPH` (one "Pattern ..., nChannels ..., bw intra/inter" line per graph), and
override the ring graph with the CLI's `--channels` / `--bw-per-channel`. Each preset's `notes` say where every
number comes from; docs/costmodel.md tabulates them.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtrain.common.errors import UserError


def arch_of(cc: int) -> str:
    """NCCL's architecture row for a compute capability x10; every GPU older than Ampere maps onto Volta's."""
    return "blackwell" if cc >= 100 else "hopper" if cc >= 90 else "ampere" if cc >= 80 else "volta"


@dataclass(frozen=True)
class Topology:
    """What NCCL's model needs to know about a machine: GPUs, links, the graphs its search would find, and the
    algorithms the machine allows (NVLS needs NVSwitch and sm90+, CollNet a SHARP-capable network)."""

    name: str
    gpu: str
    cc: int  # compute capability x10 (60 Pascal, 70 Volta, 80 Ampere, 90 Hopper, 100 Blackwell)
    nodes: int
    gpus_per_node: int
    intra: str  # "nvlink" or "pcie": the intra-node link type of the graph
    channels: int  # channels of the Ring/Tree graph (NCCL_DEBUG_SUBSYS=GRAPH prints them)
    bw_per_channel: float  # GB/s per channel found by the topology search (bwIntra; bwInter equal for a ring)
    cpu: str = "intel"  # host CPU vendor: selects the multi-node LL cap row and the network overhead
    source: str = ""  # where the ring graph's channel count and per-channel bandwidth come from
    net: str = "InfiniBand"  # the network between nodes, as NCCL reaches it (for the description only)
    nvswitch: bool = False  # an NVSwitch in the node: needed by NVLS and CollNetDirect (tuning.cc nvsCount)
    # The NVLS graph (search.cc, pattern NVLS): channels (one head GPU each) and its intra/inter bandwidth.
    nvls_channels: int = 0
    nvls_bw_intra: float = 0.0
    nvls_bw_inter: float = 0.0
    nvls_enable: bool = True  # NCCL_NVLS_ENABLE (default 2: on wherever the node supports it)
    collnet: bool = False  # SHARP in the network and NCCL_COLLNET_ENABLE=1 with NCCL's SHARP plugin
    # The CollNet graphs (assumed one channel per NIC at the NIC's speed from the inter-node speed list).
    collnet_channels: int = 0
    collnet_bw: float = 0.0
    pat_enable: bool = True  # NCCL_PAT_ENABLE (default 2: on with one GPU per node, NCCL 2.23+)
    notes: tuple[str, ...] = ()  # where each constant comes from: NCCL source file or hardware spec sheet

    @property
    def ranks(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def arch(self) -> str:
        return arch_of(self.cc)

    @property
    def nvls(self) -> bool:
        """Whether NCCL would set up NVLS: NVSwitch, sm90+, NCCL_NVLS_ENABLE, and an NVLS graph of >= 2 channels
        (src/transport/nvls.cc, src/graph/search.cc, tuning.cc)."""
        return self.nvswitch and self.cc >= 90 and self.nvls_enable and self.nvls_channels >= 2

    def describe(self) -> str:
        return (f"{self.name}: {self.nodes} node(s) x {self.gpus_per_node} {self.gpu} (sm{self.cc}), "
                f"{self.intra} intra-node{f', {self.net} between nodes' if self.nodes > 1 else ''}; assumed graph "
                f"{self.channels} channels x {self.bw_per_channel:g} GB/s = {self.channels * self.bw_per_channel:g}"
                f" GB/s bus bandwidth ({self.source})"
                + (f"; NVLS graph {self.nvls_channels} channels x {self.nvls_bw_intra:g}/{self.nvls_bw_inter:g} GB/s "
                   "intra/inter" if self.nvls else "")
                + (f"; SHARP (CollNet) graph {self.collnet_channels} x {self.collnet_bw:g} GB/s" if self.collnet
                   else ""))


# Where the shared constants come from (the per-preset notes repeat the ones each preset uses).
_NCCL = "NCCL 2.30 src/graph/tuning.cc: base/hardware latencies, protocol caps, NVLS efficiency"
_SM90 = "NVLink bandwidth per link 20.6 GB/s: NCCL src/graph/topo.h SM90_NVLINK_BW"
_SM100 = "NVLink bandwidth per link 40.1 GB/s: NCCL src/graph/topo.h SM100_NVLINK_BW"
_NVLS1 = ("NVLS graph on one node: 8 channels (one head per GPU, search.cc); each GPU's NVSwitch link carries 9 "
          "channel loads (x2 as head), so the speed is the first of the intra list under link/9; bwInter then raised "
          "to the top of the list (search.cc pass 2)")
_NVLSN = ("NVLS graph across nodes: 8 channels; bwIntra the first inter-list speed whose 9 channel loads fit the "
          "NVSwitch link, bwInter raised up to the NIC's speed (search.cc)")

# DGX H100 and H200 share the NVLink4 fabric, hence NCCL's sm90 graph: only the GPU and the sources differ.
_DGX_SM90 = dict(cc=90, intra="nvlink", channels=12, bw_per_channel=30.0, cpu="intel", nvswitch=True, nvls_channels=8,
                 nvls_bw_intra=40.0, nvls_bw_inter=60.0)

# Single-node presets. NVLink per-link bandwidth is NCCL's (src/graph/topo.h: sm60 18.0, sm70 20.0, sm80 20.0,
# sm90 20.6, sm100 40.1 GB/s). Ring channel counts are our reading of NCCL 2.30's ring search (search.cc): the
# highest speed from its speed list whose channels fit the GPU's NVLink bandwidth, then channel duplication
# (ncclTopoDupChannels: bw >= 25 GB/s halves the per-channel bandwidth and doubles the channels).
_SINGLE_NODE = {
    "h100x8": dict(_DGX_SM90, gpu="H100",
                   source="DGX H100: 18 NVLink4 x 20.6 GB/s = 370.8 GB/s to NVSwitch; sm90 search: 6 channels x 60 "
                          "GB/s, duplicated to 12 x 30",
                   notes=(_NCCL, _SM90, "18 NVLink4 links per GPU to NVSwitch: NVIDIA DGX H100 user guide",
                          f"{_NVLS1}: 370.8/9 -> 40 GB/s (sm90 intra list), bwInter 60")),
    "h200x8": dict(_DGX_SM90, gpu="H200",
                   source="DGX H200: the same 18 NVLink4 x 20.6 GB/s as DGX H100; sm90 search: 6 x 60, duplicated "
                          "to 12 x 30",
                   notes=(_NCCL, _SM90, "18 NVLink4 links per GPU to NVSwitch: NVIDIA DGX H200 datasheet",
                          f"{_NVLS1}: 370.8/9 -> 40 GB/s (sm90 intra list), bwInter 60")),
    "b200x8": dict(gpu="B200", cc=100, intra="nvlink", channels=16, bw_per_channel=45.0, cpu="intel", nvswitch=True,
                   nvls_channels=8, nvls_bw_intra=80.0, nvls_bw_inter=90.0,
                   source="DGX B200: 18 NVLink5 x 40.1 GB/s = 721.8 GB/s to NVSwitch; sm100 search: 8 channels x 90 "
                          "GB/s, duplicated to 16 x 45",
                   notes=(_NCCL, _SM100, "18 NVLink5 links per GPU to NVSwitch: NVIDIA DGX B200 datasheet",
                          f"{_NVLS1}: 721.8/9 -> 80 GB/s (sm100 intra list), bwInter 90")),
    "a100x8": dict(gpu="A100", cc=80, intra="nvlink", channels=12, bw_per_channel=20.0, cpu="amd", nvswitch=True,
                   source="DGX A100: 12 NVLink3 x 20.0 GB/s = 240 GB/s to NVSwitch; search: 6 channels x 40 GB/s, "
                          "duplicated to 12 x 20",
                   notes=(_NCCL, "NVLink bandwidth per link 20.0 GB/s: NCCL src/graph/topo.h SM80_NVLINK_BW",
                          "12 NVLink3 links per GPU to NVSwitch, AMD EPYC hosts: NVIDIA DGX A100 user guide",
                          "no NVLS: NCCL's NVLS search needs sm90 (search.cc)")),
    "v100x8": dict(gpu="V100", cc=70, intra="nvlink", channels=6, bw_per_channel=20.0, cpu="intel",
                   source="DGX-1V hybrid cube-mesh: 6 NVLink2 per GPU at NCCL's 20.0 GB/s, one ring direction per "
                          "link: 6 channels x 20, no duplication below 25 GB/s",
                   notes=(_NCCL, "NVLink bandwidth per link 20.0 GB/s: NCCL src/graph/topo.h SM70_NVLINK_BW",
                          "6 NVLink2 links per GPU, hybrid cube-mesh, no NVSwitch: NVIDIA DGX-1 with V100 whitepaper")),
    "p100x8": dict(gpu="P100", cc=60, intra="nvlink", channels=4, bw_per_channel=18.0, cpu="intel",
                   source="DGX-1 (P100) hybrid cube-mesh: 4 NVLink1 per GPU at NCCL's 18.0 GB/s: 4 channels x 18; "
                          "LL128 disabled below sm70",
                   notes=(_NCCL, "NVLink bandwidth per link 18.0 GB/s: NCCL src/graph/topo.h SM60_NVLINK_BW",
                          "4 NVLink1 links per GPU, hybrid cube-mesh: NVIDIA DGX-1 (P100) whitepaper")),
}

# Multi-node presets: a node preset and what the network changes. Over InfiniBand, one NIC per GPU (DGX designs):
# a ring channel enters and leaves a node through one NIC, so channels x per-channel bandwidth is bounded by the
# node's NICs and the per-channel speed comes from NCCL's inter-node speed list (search.cc).
_IB = {
    "h100x8-ib": dict(node="h100x8", channels=8, bw_per_channel=45.0, nvls_bw_inter=48.0,
                      source="8 x ConnectX-7 400 Gb/s (50 GB/s) per node; sm90 inter speed 45 GB/s per channel, one "
                             "channel per NIC: 8 x 45",
                      notes=("8 ConnectX-7 400 Gb/s NICs per node: NVIDIA DGX H100 user guide",
                             f"{_NVLSN}: 40 GB/s intra, 48 inter (sm90 inter list, NIC 50 GB/s)")),
    "h200x8-ib": dict(node="h200x8", channels=8, bw_per_channel=45.0, nvls_bw_inter=48.0,
                      source="8 x ConnectX-7 400 Gb/s (50 GB/s) per node; sm90 inter speed 45 GB/s per channel, one "
                             "channel per NIC: 8 x 45",
                      notes=("8 ConnectX-7 400 Gb/s NICs per node: NVIDIA DGX H200 datasheet",
                             f"{_NVLSN}: 40 GB/s intra, 48 inter (sm90 inter list, NIC 50 GB/s)")),
    "b200x8-ib": dict(node="b200x8", channels=8, bw_per_channel=48.0, nvls_bw_intra=48.0, nvls_bw_inter=48.0,
                      source="8 x ConnectX-7 400 Gb/s (50 GB/s) per node; sm100 inter speed 48 GB/s per channel "
                             "(first of the list under the NIC), one channel per NIC: 8 x 48",
                      notes=("8 ConnectX-7 400 Gb/s NICs per node: NVIDIA DGX B200 datasheet",
                             f"{_NVLSN}: the search starts at the NIC-bound 48 GB/s (sm100 inter list: 96, 86, 80 "
                             "exceed the NIC), 48 intra and inter")),
    "a100x8-ib": dict(node="a100x8", channels=8, bw_per_channel=24.0,
                      source="8 x HDR 200 Gb/s (25 GB/s) per node; inter speed 24 GB/s, one channel per NIC: 8 x 24",
                      notes=("8 ConnectX-6 HDR 200 Gb/s NICs per node: NVIDIA DGX A100 user guide",)),
    "v100x8-ib": dict(node="v100x8", channels=4, bw_per_channel=12.0,
                      source="DGX-1V: 4 x EDR 100 Gb/s (NCCL's 12 GB/s) per node: 4 channels x 12",
                      notes=("4 EDR 100 Gb/s NICs per node: NVIDIA DGX-1 with V100 whitepaper",
                             "100 Gb/s as 12 GB/s: NCCL src/graph/topo.h NET_BW")),
    "p100x8-ib": dict(node="p100x8", channels=4, bw_per_channel=12.0,
                      source="DGX-1: 4 x EDR 100 Gb/s (NCCL's 12 GB/s) per node: 4 channels x 12",
                      notes=("4 EDR 100 Gb/s NICs per node: NVIDIA DGX-1 (P100) whitepaper",
                             "100 Gb/s as 12 GB/s: NCCL src/graph/topo.h NET_BW")),
}
# InfiniBand with SHARP (Quantum switches) and NCCL's SHARP plugin, NCCL_COLLNET_ENABLE=1: CollNetDirect and
# CollNetChain become available, and on Hopper NVLS across nodes (NVLS + SHARP). The CollNet graphs are assumed to
# have one channel per NIC at the ring's inter-node speed: check with NCCL_DEBUG_SUBSYS=GRAPH.
_SHARP = {
    "h100x8-ib-sharp": dict(base="h100x8-ib", collnet=True, collnet_channels=8, collnet_bw=48.0,
                            notes=("SHARP: NVIDIA Quantum-2 switches with the SHARP plugin (nccl-rdma-sharp-plugins), "
                                   "NCCL_COLLNET_ENABLE=1",
                                   "CollNet graphs assumed 8 channels x 48 GB/s (one per NIC; sm90 inter list)")),
    "a100x8-ib-sharp": dict(base="a100x8-ib", collnet=True, collnet_channels=8, collnet_bw=24.0,
                            notes=("SHARP: NVIDIA Quantum switches with the SHARP plugin (nccl-rdma-sharp-plugins), "
                                   "NCCL_COLLNET_ENABLE=1",
                                   "CollNet graphs assumed 8 channels x 24 GB/s (one per NIC; inter list)")),
}
# Ethernet: one GPU per node (a PCIe A100 server) and one 25 Gb/s NIC, RoCE v2 through NCCL's IB verbs transport
# (src/transport/net_ib.cc; not the TCP socket transport). NCCL sees the NIC at 3.125 GB/s; the first speed of the
# pre-sm90 inter list under it is 3.0 GB/s, and the one NIC carries one ring channel; below 25 GB/s nothing is
# duplicated (search.cc). One GPU per node: every hop is a network hop, and PAT serves AllGather/ReduceScatter.
_ETHERNET = {
    "a100x1-roce25": dict(gpu="A100 PCIe", cc=80, gpus_per_node=1, intra="pcie", channels=1, bw_per_channel=3.0,
                          cpu="intel", net="RoCE v2 25 Gb/s (NCCL's IB verbs transport)",
                          source="one 25 Gb/s RoCE NIC per node (3.125 GB/s); pre-sm90 inter speed 3.0 GB/s, one "
                                 "channel, no duplication below 25 GB/s",
                          notes=(_NCCL, "25 Gb/s as 3.125 GB/s: the NIC's link speed as NCCL reads it (net_ib.cc)",
                                 "inter-node speed list and channel duplication: NCCL src/graph/search.cc",
                                 "PAT for AllGather/ReduceScatter with one GPU per node: tuning.cc ncclPatEnable")),
}


def _node_preset(base: str) -> dict:
    return dict(_SINGLE_NODE[base])


def _multi_node(base: str) -> dict:
    """A multi-node preset's fields: its node preset overridden by what the network changes; notes add up."""
    if base in _ETHERNET:
        return dict(_ETHERNET[base])
    over = dict(_SHARP[base]) if base in _SHARP else {}
    ib = dict(_IB[over.pop("base", base)])
    fields = _node_preset(ib.pop("node"))
    notes = fields.get("notes", ()) + ib.pop("notes", ()) + over.pop("notes", ())
    fields.update(ib)
    fields.update(over)
    fields["notes"] = notes
    return fields


_MULTI_NODE = list(_IB) + list(_SHARP) + list(_ETHERNET)


def preset_names() -> list[str]:
    """Every `--topology` spelling: the presets, and the models read from a file (`dtrain.collectives.costmodel.loading`)."""
    return (list(_SINGLE_NODE) + [f"{n}:<nodes>" for n in _MULTI_NODE] + ["fit:<fit.json | bench.csv | log>",
                                                                          "nccl-log:<NCCL_DEBUG log>"])


def topology(spec: str) -> Topology:
    """A single-node preset (`h100x8`, ...), or a multi-node one with its node count: `<gpu>x8-ib:<nodes>`,
    `<gpu>x8-ib-sharp:<nodes>`, `a100x1-roce25:<nodes>` (nodes >= 2)."""
    base, _, arg = spec.partition(":")
    if base in _SINGLE_NODE and not arg:
        fields = _node_preset(base)
        return Topology(name=spec, nodes=1, gpus_per_node=fields.pop("gpus_per_node", 8), **fields)
    if base in _MULTI_NODE:
        if not arg.isdigit() or int(arg) < 2:
            raise UserError(f"topology '{spec}': give the node count (>= 2) after the colon, e.g. '{base}:2'")
        fields = _multi_node(base)
        return Topology(name=spec, nodes=int(arg), gpus_per_node=fields.pop("gpus_per_node", 8), **fields)
    raise UserError(f"unknown topology '{spec}' (available: {', '.join(preset_names())})")


def preset_notes() -> dict[str, tuple[str, ...]]:
    """Every preset's notes (for docs/costmodel.md), multi-node ones at 2 nodes."""
    names = list(_SINGLE_NODE) + [f"{n}:2" for n in _MULTI_NODE]
    return {n: topology(n).notes for n in names}
