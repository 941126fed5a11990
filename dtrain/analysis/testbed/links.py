"""The emulated cluster's links (`dtrain.analysis.testbed`): tc's rate and byte units, one node's shaped `Link`, and the
`testbed:` section of a testbed profile (dtrain/profiles/testbed/*.yaml), read by the strict loader.

    testbed:
      nodes: 2
      link: 1gbit          # every node's rate in tc units, or 'none' (unshaped)
      link_per_node: ...   # instead: one rate per node, a list or "1gbit,100mbit"
      burst: 250kb         # tbf bucket size (default: 2 ms of the rate, at least 64 KiB)
      latency_ms: 50       # tbf queue depth: the longest a packet waits before it is dropped
      congestion_control: cubic  # the nodes' TCP congestion control (default: the host's, which they inherit)
      intra_link: none     # the link between the ranks inside a node (their loopback): 'none' (unshaped) or a rate
      ranks_per_node: 2    # `run`'s --nproc-per-node when the job names this profile

`up`'s command-line options override the profile's keys of the same name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from dtrain.common.errors import UserError
from dtrain.common.schema import Source, build, read_yaml

_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}  # tc's (decimal) bit rates
_BYTE_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1024, "m": 1024**2, "mb": 1024**2, "g": 1024**3, "gb": 1024**3}
DEFAULT_NODES = 2
DEFAULT_LINK = "1gbit"
DEFAULT_LATENCY_MS = 50.0
TCP_SYSCTLS = Path("/proc/sys/net/ipv4")


def parse_rate(text: str) -> int | None:
    """'1gbit' → 10**9 bits/s (tc's units); 'none' → None (an unshaped link)."""
    s = str(text).strip().lower()
    if s == "none":
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-z]+)", s)
    if not m or m.group(2) not in _RATE_UNITS or float(m.group(1)) <= 0:
        raise UserError(f"bad link rate '{text}': expected a number with a unit "
                        f"({', '.join(_RATE_UNITS)}), e.g. 1gbit or 100mbit, or 'none'")
    return int(float(m.group(1)) * _RATE_UNITS[m.group(2)])


def parse_bytes(text: str) -> int:
    """'256kb' → 262144 (tc's binary byte units: b, kb/k, mb/m, gb/g)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-z]*)", str(text).strip().lower())
    if not m or m.group(2) not in _BYTE_UNITS or float(m.group(1)) <= 0:
        raise UserError(f"bad byte size '{text}': expected a number with an optional unit (b, kb, mb, gb), e.g. 256kb")
    return int(float(m.group(1)) * _BYTE_UNITS[m.group(2)])


def format_rate(bits: int | None) -> str:
    if bits is None:
        return "unshaped"
    for unit in ("tbit", "gbit", "mbit", "kbit"):
        if bits >= _RATE_UNITS[unit]:
            return f"{bits / _RATE_UNITS[unit]:g}{unit}"
    return f"{bits}bit"


@dataclass(frozen=True)
class Link:
    """One node's link to the bridge, shaped the same way in both directions (a full-duplex port)."""

    rate: int | None  # bits/s; None = unshaped (veth speed, effectively memory bandwidth)
    burst: int | None = None  # bytes; None = default_burst(rate)
    latency_ms: float = DEFAULT_LATENCY_MS  # tbf queue depth: the longest a packet may wait before it is dropped
    congestion_control: str | None = None  # the node's TCP congestion control; None: the host's, inherited
    # The link between the ranks of this node: their traffic goes to the node's own address, which the kernel routes
    # over loopback, so shaping `lo` inside the namespace shapes it and nothing else. None: unshaped (shared memory
    # speed, as NVLink is to a network); a rate stands for a slower path, such as PCIe between GPUs without NVLink.
    intra_rate: int | None = None

    def intra_tbf_args(self) -> list[str]:
        # loopback's MTU is 64 KiB: tbf drops a packet larger than its bucket, so the bucket holds several
        burst = max(default_burst(self.intra_rate), 4 * 64 * 1024)
        return ["tbf", "rate", f"{self.intra_rate}bit", "burst", str(burst), "latency", f"{self.latency_ms:g}ms"]

    def tbf_args(self) -> list[str]:
        burst = self.burst or default_burst(self.rate)
        return ["tbf", "rate", f"{self.rate}bit", "burst", str(burst), "latency", f"{self.latency_ms:g}ms"]

    def describe(self) -> str:
        if self.rate is None:
            return "unshaped"
        return f"tbf {format_rate(self.rate)} burst {self.burst or default_burst(self.rate)}B lat {self.latency_ms:g}ms"


def default_burst(rate_bits: int) -> int:
    # Two milliseconds of traffic, at least 64 KiB: a 64 KiB GSO packet off the veth then passes the bucket whole
    # (smaller buckets make tbf segment it, costing CPU that the emulated node does not have to spare).
    return max(64 * 1024, rate_bits // 8 // 500)


@dataclass(frozen=True)
class TestbedSection:
    """The `testbed:` section of a testbed profile; a key left out takes `up`'s default."""

    __test__ = False  # not a pytest test class, despite its name

    nodes: int | None = None  # default: as many as link_per_node names, else DEFAULT_NODES
    link: str | None = None  # every node's rate in tc units (parse_rate); default DEFAULT_LINK
    link_per_node: list[str] | str | None = None  # one rate per node: a list, or comma-separated
    burst: str | int | None = None  # tbf bucket size (parse_bytes); default: default_burst(rate)
    latency_ms: float | None = None  # default DEFAULT_LATENCY_MS
    congestion_control: str | None = None  # default: the host's (check_congestion_control)
    intra_link: str | None = None  # the link inside a node (parse_rate); default 'none', unshaped loopback
    ranks_per_node: int | None = None  # `run`'s default --nproc-per-node with this profile; default 1


def load_profile(path: str | Path) -> TestbedSection:
    """The `testbed:` section of a YAML file (other sections are not read); file:line errors for unknown keys and
    wrong types."""
    raw, lines = read_yaml(Path(path), "testbed profile")
    section = raw.get("testbed")
    if not isinstance(section, dict):
        raise UserError(f"{path}: no 'testbed:' section")
    return build(TestbedSection, section, "testbed", Source(str(path), lines))


def links_from(args, profile: TestbedSection | None = None) -> list[Link]:
    """Resolve the links: command line (`up`'s options, None where not given) over profile over defaults."""
    profile = profile or TestbedSection()

    def pick(name: str, default):
        v = getattr(args, name)
        if v is None:
            v = getattr(profile, name)
        return v if v is not None else default

    per_node = pick("link_per_node", None)
    if isinstance(per_node, str):
        per_node = [x for x in per_node.split(",") if x.strip()]
    nodes = pick("nodes", len(per_node) if per_node else DEFAULT_NODES)
    if per_node and len(per_node) != nodes:
        raise UserError(f"link_per_node gives {len(per_node)} rate(s) for {nodes} node(s)")
    burst = pick("burst", None)
    burst = parse_bytes(burst) if burst is not None else None
    latency = float(pick("latency_ms", DEFAULT_LATENCY_MS))
    rates = [parse_rate(r) for r in per_node] if per_node else [parse_rate(pick("link", DEFAULT_LINK))] * nodes
    cc = pick("congestion_control", None)
    if cc is not None:
        check_congestion_control(cc)
    intra = parse_rate(pick("intra_link", "none"))
    return [Link(rate, burst, latency, cc, intra) for rate in rates]


def check_congestion_control(name: str, sysctls: Path | None = None) -> None:
    """A TCP congestion control that a node's namespace may use: the kernel must have it, and the host must allow
    it (`tcp_allowed_congestion_control` is the host's, and a namespace other than the host's may only pick from
    it; the kernel's ip-sysctl documentation)."""
    sysctls = sysctls or TCP_SYSCTLS
    available = (sysctls / "tcp_available_congestion_control").read_text().split()
    allowed = (sysctls / "tcp_allowed_congestion_control").read_text().split()
    if name not in available:
        raise UserError(f"congestion control '{name}' is not available in this kernel (available: "
                        f"{' '.join(available)}; a module may add it: modprobe tcp_{name})")
    if name not in allowed:
        raise UserError(f"congestion control '{name}' is not allowed in network namespaces (allowed: "
                        f"{' '.join(allowed)}); as root: sysctl -w "
                        f"net.ipv4.tcp_allowed_congestion_control='{' '.join(allowed + [name])}'")
