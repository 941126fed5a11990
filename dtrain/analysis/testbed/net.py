"""The testbed's network: N network namespaces ("nodes") on a bridge in a hub namespace, each link shaped with
`tc tbf`, all named from one prefix so that `down` removes exactly what `up` made (`dtrain.analysis.testbed` is the command
line; the jobs run on it: `dtrain.analysis.testbed.jobs`; the links: `dtrain.analysis.testbed.links`). Needs root and iproute2.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from dtrain.analysis.testbed.links import Link, format_rate
from dtrain.common.errors import UserError

PROG = "dtrain.analysis.testbed"  # the command line, named in messages
SUBNET = "10.77.0"  # a private /24 used only inside the testbed's namespaces, so it can never clash with the host
IFACE = "dtb-eth"  # each node's interface name (inside its namespace); GLOO_SOCKET_IFNAME points at it
BRIDGE = "br0"  # lives in the hub namespace, so the host's own network namespace is never touched
MAX_NODES = 64
DISKS = Path("/tmp")  # each node's private filesystem lives in DISKS/<prefix>-node<i> (run --private-fs)


# ---- the testbed's names -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Names:
    """Every name the testbed creates derives from one prefix, so `down` can find exactly those."""

    prefix: str = "dtb"

    @property
    def hub(self) -> str:
        return f"{self.prefix}-hub"

    def node(self, i: int) -> str:
        return f"{self.prefix}-n{i}"

    @staticmethod
    def port(i: int) -> str:  # the bridge side of node i's veth pair, inside the hub namespace
        return f"n{i}"

    @staticmethod
    def address(i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def disk(self, i: int) -> Path:
        """Node i's private filesystem (`run --private-fs`): its view of path P is disk(i)/P."""
        return DISKS / f"{self.prefix}-node{i}"

    def existing_disks(self) -> list[Path]:
        pattern = re.escape(self.prefix) + r"-node\d+"
        return sorted(p for p in DISKS.glob(f"{self.prefix}-node*") if re.fullmatch(pattern, p.name) and p.is_dir())

    def existing(self) -> tuple[list[str], list[int]]:
        """(all of this testbed's namespaces, hub included; the node indices among them, sorted)."""
        ours, nodes = [], []
        for ns in list_namespaces():
            if ns == self.hub:
                ours.append(ns)
            elif m := re.fullmatch(re.escape(self.prefix) + r"-n(\d+)", ns):
                ours.append(ns)
                nodes.append(int(m.group(1)))
        return ours, sorted(nodes)


def check_prefix(prefix: str) -> str:
    if not re.fullmatch(r"[a-z][a-z0-9]{0,7}", prefix):
        raise UserError(f"bad testbed name '{prefix}': 1-8 lowercase letters and digits, starting with a letter")
    return prefix


# ---- running ip / tc ---------------------------------------------------------------------------------------------

def require_tools() -> None:
    """One-line errors for a machine that cannot host the testbed."""
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        raise UserError(f"needs iproute2 ({' and '.join(missing)} not found on PATH)")
    if os.geteuid() != 0:
        raise UserError("needs root to create network namespaces (run as root or under sudo)")


def sh(*args: str) -> str:
    """Run one ip/tc command; failure becomes a one-line error naming the command."""
    p = subprocess.run(args, capture_output=True, text=True)
    if p.returncode != 0:
        msg = (p.stderr or p.stdout).strip().splitlines()
        raise UserError(f"'{' '.join(args)}' failed: {msg[-1] if msg else f'exit status {p.returncode}'}")
    return p.stdout


def list_namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


# ---- up / down / status ------------------------------------------------------------------------------------------

def up(names: Names, links: list[Link]) -> None:
    """Create len(links) nodes. On any failure or interrupt, everything created so far is removed again."""
    require_tools()
    n = len(links)
    if not 1 <= n <= MAX_NODES:
        raise UserError(f"--nodes must be between 1 and {MAX_NODES}, got {n}")
    ours, nodes = names.existing()
    if ours:
        raise UserError(f"testbed '{names.prefix}' is already up ({len(nodes)} nodes); "
                        f"run 'python -m {PROG} down' first")
    created: list[str] = []
    try:
        # Recorded before it is made, so an interrupt between the two cannot leak it (deleting a name that was never
        # made is harmless; none of these names existed before, checked above).
        created.append(names.hub)
        sh("ip", "netns", "add", names.hub)
        hub = ["ip", "-n", names.hub]
        sh(*hub, "link", "add", BRIDGE, "type", "bridge")
        sh(*hub, "link", "set", BRIDGE, "addrgenmode", "none")
        sh(*hub, "link", "set", BRIDGE, "up")
        for i, link in enumerate(links):
            ns, port = names.node(i), names.port(i)
            created.append(ns)
            sh("ip", "netns", "add", ns)
            node = ["ip", "-n", ns]
            # The pair is born with one end in each namespace: nothing ever appears in the host's namespace.
            sh(*hub, "link", "add", port, "type", "veth", "peer", "name", IFACE, "netns", ns)
            # No IPv6 link-local addresses: gloo and c10d then see exactly one address per node, the IPv4 one.
            sh(*hub, "link", "set", port, "addrgenmode", "none")
            sh(*node, "link", "set", IFACE, "addrgenmode", "none")
            sh(*hub, "link", "set", port, "master", BRIDGE)
            sh(*hub, "link", "set", port, "up")
            sh(*node, "addr", "add", f"{names.address(i)}/24", "dev", IFACE)
            sh(*node, "link", "set", IFACE, "up")
            sh(*node, "link", "set", "lo", "up")
            if link.congestion_control is not None:  # a new namespace starts with the host's
                sh("ip", "netns", "exec", ns, "sysctl", "-q", "-w",
                   f"net.ipv4.tcp_congestion_control={link.congestion_control}")
            if link.rate is not None:
                # Egress on both ends: the node's sending side and the bridge port's side towards the node.
                sh("tc", "-n", ns, "qdisc", "add", "dev", IFACE, "root", *link.tbf_args())
                sh("tc", "-n", names.hub, "qdisc", "add", "dev", port, "root", *link.tbf_args())
            if link.intra_rate is not None:  # the ranks inside the node reach each other over loopback
                sh("tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", *link.intra_tbf_args())
    except BaseException:
        with shielded():
            _delete_namespaces(reversed(created))
        raise


def _delete_namespaces(namespaces) -> None:
    """Deleting a namespace removes every interface and qdisc inside it; the veth pairs die with either end."""
    for ns in namespaces:
        _stop_processes_in(ns)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _stop_processes_in(ns: str) -> None:
    # A process left inside a namespace (a crashed run) would keep it alive, unnamed, after `ip netns del`.
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    pids = [int(p) for p in out.split()]
    if not pids:
        return
    print(f"{PROG}: stopping {len(pids)} leftover process(es) in {ns}", file=sys.stderr)
    kill_all(pids)


def down(names: Names) -> list[str]:
    """Remove every namespace of this testbed (and with them its bridge, veths and qdiscs); idempotent."""
    require_tools()
    ours, nodes = names.existing()
    # Nodes first, hub last: each node's veth pair is removed with its node, the bridge with the hub.
    with shielded():
        _delete_namespaces([names.node(i) for i in nodes] + ([names.hub] if names.hub in ours else []))
    left = names.existing()[0]
    if left:
        raise UserError(f"could not remove {', '.join(left)}")
    disks = names.existing_disks()
    for disk in disks:  # no process is left to hold a mount over it: the namespaces' processes were stopped above
        shutil.rmtree(disk, ignore_errors=True)
    return sorted(ours) + [str(d) for d in disks]


def _json(*args: str) -> list:
    """The JSON answer of `ip -j`/`tc -j`, or [] when the device is gone (status then reports a broken testbed)."""
    p = subprocess.run(args, capture_output=True, text=True)
    return json.loads(p.stdout or "[]") if p.returncode == 0 else []


def _qdisc(ns: str, dev: str) -> str:
    q = _json("tc", "-n", ns, "-j", "qdisc", "show", "dev", dev)
    root = next((x for x in q if x.get("root")), None)
    if root is None or root.get("kind") != "tbf":
        return "unshaped"
    o = root.get("options", {})
    return f"tbf {format_rate(o.get('rate', 0) * 8)} burst {o.get('burst')}B lat {o.get('lat', 0) / 1000:g}ms"


def _congestion_control(ns: str) -> str:
    p = subprocess.run(["ip", "netns", "exec", ns, "cat", "/proc/sys/net/ipv4/tcp_congestion_control"],
                       capture_output=True, text=True)
    return p.stdout.strip() if p.returncode == 0 else "?"


def status(names: Names) -> list[dict]:
    """What the kernel says exists now (not what `up` was asked for)."""
    require_tools()
    ours, nodes = names.existing()
    rows = []
    for i in nodes:
        ns = names.node(i)
        addrs = _json("ip", "-n", ns, "-j", "addr", "show", "dev", IFACE)
        inet = [f"{a['local']}/{a['prefixlen']}" for x in addrs for a in x.get("addr_info", [])
                if a["family"] == "inet"]
        state = addrs[0].get("operstate", "?") if addrs else "missing"
        rows.append({"node": i, "netns": ns, "iface": IFACE, "address": ",".join(inet) or "-", "state": state,
                     "tcp": _congestion_control(ns), "egress": _qdisc(ns, IFACE), "intra": _qdisc(ns, "lo"),
                     "ingress": _qdisc(names.hub, names.port(i)) if names.hub in ours else "no hub"})
    return rows


def print_status(names: Names) -> None:
    ours, _ = names.existing()
    rows = status(names)
    if not ours:
        print(f"testbed '{names.prefix}': down")
        return
    hub = f"bridge {BRIDGE} in netns {names.hub}" if names.hub in ours else "NO HUB NAMESPACE (broken: run down)"
    print(f"testbed '{names.prefix}': {len(rows)} node(s), {hub}, {SUBNET}.0/24")
    cols = ["node", "netns", "iface", "address", "state", "tcp", "egress", "ingress", "intra"]
    heads = {"egress": "node→bridge", "ingress": "bridge→node", "intra": "inside the node"}
    width = {c: max([len(heads.get(c, c))] + [len(str(r[c])) for r in rows]) for c in cols}
    print("  ".join(heads.get(c, c).ljust(width[c]) for c in cols).rstrip())
    for r in rows:
        print("  ".join(str(r[c]).ljust(width[c]) for c in cols).rstrip())


# ---- probe: measured throughput between two nodes ----------------------------------------------------------------

_SINK = ("import socket,sys;s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);"
         "s.bind((sys.argv[1],int(sys.argv[2])));s.listen(1);print('ready',flush=True);c,_=s.accept()\n"
         "while c.recv(1<<20): pass")
_SOURCE = ("import socket,sys,time;c=socket.create_connection((sys.argv[1],int(sys.argv[2])));b=bytes(1<<20);"
           "n=0;t=time.perf_counter();d=float(sys.argv[3])\n"
           "while time.perf_counter()-t<d: c.sendall(b);n+=len(b)\n"
           "c.shutdown(socket.SHUT_WR);c.recv(1);print(n/(time.perf_counter()-t))")


def probe(names: Names, src: int = 0, dst: int = 1, seconds: float = 2.0, port: int = 29499) -> float:
    """Bytes per second that one TCP stream moves from node `src` to node `dst`."""
    require_tools()
    _, nodes = names.existing()
    for i in (src, dst):
        if i not in nodes:
            raise UserError(f"testbed '{names.prefix}' has no node {i} (nodes up: {nodes or 'none'})")
    sink = subprocess.Popen(["ip", "netns", "exec", names.node(dst), sys.executable, "-c", _SINK,
                             names.address(dst), str(port)], stdout=subprocess.PIPE, text=True)
    try:
        sink.stdout.readline()  # 'ready': listening
        out = sh("ip", "netns", "exec", names.node(src), sys.executable, "-c", _SOURCE, names.address(dst),
                 str(port), str(seconds))
        return float(out.strip())
    finally:
        sink.kill()
        sink.wait()


# ---- processes: stopping what runs in a namespace, signals during clean-up ---------------------------------------

def kill_all(pids: list[int], grace_s: float = 5.0) -> None:
    """SIGTERM (torchrun then shuts its workers down cleanly), SIGKILL whatever is still there after `grace_s`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.05)
        if not any(_alive(p) for p in pids):
            return


def _stat(pid: int | str) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state, ppid, ...); None once the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _alive(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"  # a zombie (exited, not yet reaped by its parent) counts as gone


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, children first."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit() and (fields := _stat(d)) is not None:
            children.setdefault(int(fields[1]), []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


class shielded:
    """Cleanup in progress: a second Ctrl-C (or SIGTERM) must not cut it short and leave things behind."""

    def __enter__(self):
        self._old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)


class signals_as_interrupt:
    """Ctrl-C, SIGTERM and SIGHUP all raise KeyboardInterrupt, so the same cleanup paths run whichever way we are
    stopped. SIGINT is set explicitly: a process started with SIGINT ignored (a shell's background job, or a parent
    that ignored it) would otherwise never see Ctrl-C."""

    def __enter__(self):
        def raise_interrupt(signum, frame):
            raise KeyboardInterrupt

        self._old = {s: signal.signal(s, raise_interrupt) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)
