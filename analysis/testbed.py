"""An emulated cluster on one machine: N network namespaces ("nodes") on a bridge, each link shaped with `tc tbf`.

The multi-node regime of the study (communication visible next to compute) without a second machine. `up` builds
it, `run` launches one torchrun agent per node over it, `status` shows it, `down` removes exactly what `up` made.
Needs root and iproute2 (`ip`, `tc`). The links and the testbed profile (`--profile`): `analysis.testbed_links`.

    python -m analysis.testbed up --nodes 2 --link 1gbit          # or: up --profile profiles/testbed/1gbit.yaml
    python -m analysis.testbed status
    python -m analysis.testbed probe                              # measured node 0 → node 1 throughput
    python -m analysis.testbed run --nodes 2 --nproc-per-node 1 -- -m collectives.bench -b 8 -e 256M
    python -m analysis.testbed run --nodes 2 --nproc-per-node 1 -- -m dtrain.train --profile profiles/smoke.yaml
    python -m analysis.testbed run --private-fs -- -m dtrain.train --profile profiles/smoke.yaml
    python -m analysis.testbed down

The nodes share the host's filesystem unless `run --private-fs`: then every node but node 0 (the machine the job is
launched from) sees its own run directories, caches and /tmp, as a separate machine would (see `analysis.testbed_disks`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from analysis.testbed_disks import prepare_disk, private_mounts, private_paths
from analysis.testbed_links import Link, format_rate, links_from, load_profile
from common.errors import UserError, exit_on_user_error

PROG = "analysis.testbed"
SUBNET = "10.77.0"  # a private /24 used only inside the testbed's namespaces, so it can never clash with the host
IFACE = "dtb-eth"  # each node's interface name (inside its namespace); GLOO_SOCKET_IFNAME points at it
BRIDGE = "br0"  # lives in the hub namespace, so the host's own network namespace is never touched
MAX_NODES = 64
DEFAULT_PORT = 29500
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
            if link.rate is not None:
                # Egress on both ends: the node's sending side and the bridge port's side towards the node.
                sh("tc", "-n", ns, "qdisc", "add", "dev", IFACE, "root", *link.tbf_args())
                sh("tc", "-n", names.hub, "qdisc", "add", "dev", port, "root", *link.tbf_args())
    except BaseException:
        with _shielded():
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
    _kill_all(pids)


def down(names: Names) -> list[str]:
    """Remove every namespace of this testbed (and with them its bridge, veths and qdiscs); idempotent."""
    require_tools()
    ours, nodes = names.existing()
    # Nodes first, hub last: each node's veth pair is removed with its node, the bridge with the hub.
    with _shielded():
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
                     "egress": _qdisc(ns, IFACE),
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
    cols = ["node", "netns", "iface", "address", "state", "egress", "ingress"]
    heads = {"egress": "node→bridge", "ingress": "bridge→node"}
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


# ---- run: one torchrun agent per node ----------------------------------------------------------------------------

def agent_command(names: Names, i: int, nodes: int, nproc: int, port: int, run_id: str, args: list[str],
                  mounts: list[tuple[Path, Path]] = (), min_nodes: int | None = None,
                  last_call_s: int | None = None) -> list[str]:
    """The torchrun agent of node i, inside its namespace. c10d ranks agents by their address, and node 0's is
    the lowest (10.77.0.1 sorts first, also as a string), so global rank 0 is always on node 0.

    With `mounts`, the agent first bind-mounts each (source, target) pair. `ip netns exec` runs its command in a mount
    namespace of its own whose mounts are slaves of the host's (iproute2, lib/namespace.c: netns_switch), so these
    mounts are seen by the agent and its workers only, never by the host or the other nodes, and vanish with them.

    With `min_nodes` the job is elastic (torchrun's `--nnodes=MIN:MAX`): after a node is lost, the others meet again
    at the rendezvous and go on with fewer once `min_nodes` are there, after waiting `last_call_s` for more (torch's
    c10d rendezvous `last_call_timeout`, 30 s by default)."""
    rdzv_conf = f"is_host={int(i == 0)}" + (f",last_call_timeout={last_call_s}" if last_call_s is not None else "")
    prefix = ["ip", "netns", "exec", names.node(i)]
    if mounts:
        binds = [f"mount --bind {shlex.quote(str(s))} {shlex.quote(str(t))}" for s, t in mounts]
        prefix += ["sh", "-c", " && ".join([*binds, 'exec "$@"']), "sh"]
    return [*prefix, sys.executable, "-m", "torch.distributed.run",
            f"--nnodes={nodes}" if min_nodes is None else f"--nnodes={min_nodes}:{nodes}",
            f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={names.address(0)}:{port}", f"--rdzv-id={run_id}",
            f"--rdzv-conf={rdzv_conf}", f"--local-addr={names.address(i)}",
            *(["--local-ranks-filter=0"] if i == 0 else []), *args]


def agent_env(nodes: int, nproc: int) -> dict[str, str]:
    env = dict(os.environ)
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME"):
        env[var] = IFACE
    env["PYTHONUNBUFFERED"] = "1"  # rank 0's lines reach the terminal as they are printed
    # The emulated nodes share this machine's cores: give each rank its share instead of letting every rank's
    # intra-op pool claim all of them (torchrun itself only sets 1 when a node runs several ranks).
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // (nodes * nproc))))
    return env


def run(names: Names, nodes: int | None, nproc: int, args: list[str], port: int = DEFAULT_PORT,
        log_dir: str | None = None, grace_s: float = 5.0, private: list[Path] | None = None,
        min_nodes: int | None = None, last_call_s: int | None = None) -> int:
    """Launch the job; stream node 0's rank 0, log the other nodes to files; return the job's exit code.
    `private`: paths that nodes 1.. see on their own disks (`private_paths`); None: every node sees the host's.
    `min_nodes`: an elastic job (`agent_command`), whose exit code is node 0's: losing another node is the job's
    business (`drop`), not a failure; `last_call_s`: how long its rendezvous waits for more than `min_nodes`."""
    require_tools()
    _, up_nodes = names.existing()
    if not up_nodes:
        raise UserError(f"testbed '{names.prefix}' is not up; run 'python -m {PROG} up --nodes 2 --link 1gbit'")
    nodes = nodes or len(up_nodes)
    if up_nodes[:nodes] != list(range(nodes)):
        raise UserError(f"--nodes {nodes} but testbed '{names.prefix}' has {len(up_nodes)} node(s)")
    if nproc < 1:
        raise UserError(f"--nproc-per-node must be at least 1, got {nproc}")
    if min_nodes is not None and not 1 <= min_nodes <= nodes:
        raise UserError(f"--min-nodes must be between 1 and the job's {nodes} node(s), got {min_nodes}")
    if last_call_s is not None and (min_nodes is None or last_call_s < 1):
        raise UserError(f"--last-call is for an elastic job (--min-nodes) and must be at least 1 s, got {last_call_s}")
    if not args:
        raise UserError("nothing to run: give the module and its arguments after '--', e.g. -- -m collectives.bench")
    logs = Path(log_dir or tempfile.mkdtemp(prefix=f"{names.prefix}-run-"))
    logs.mkdir(parents=True, exist_ok=True)
    run_id = f"{names.prefix}-{os.getpid()}-{int(time.time())}"
    env = agent_env(nodes, nproc)
    print(f"{PROG}: {nodes} node(s) x {nproc} rank(s), rendezvous {names.address(0)}:{port}, "
          f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']}, logs of nodes 1.. in {logs}", file=sys.stderr, flush=True)
    mounts = {i: private_mounts(names.disk(i), private) if private is not None and i > 0 else [] for i in range(nodes)}
    for i in range(1, nodes):
        if mounts[i]:
            prepare_disk(mounts[i])
    if private is not None and nodes > 1:
        print(f"{PROG}: private filesystems: node i (i >= 1) sees {names.disk(1).parent}/{names.prefix}-node<i>/P "
              f"at P for P in {', '.join(str(t) for _, t in mounts[1])}", file=sys.stderr, flush=True)
    procs: list[subprocess.Popen] = []
    files = []
    try:
        for i in range(nodes):
            out = None
            if i > 0:
                out = open(logs / f"node{i}.log", "w")
                files.append(out)
            # Its own session per agent: Ctrl-C reaches only us, and we stop each agent's tree deliberately.
            command = agent_command(names, i, nodes, nproc, port, run_id, args, mounts[i], min_nodes, last_call_s)
            procs.append(subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
                                          start_new_session=True))
        if min_nodes is not None:
            return _supervise_elastic(procs, logs)
        return _supervise(procs, logs, grace_s)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted, stopping the job", file=sys.stderr, flush=True)
        return 130
    finally:
        with _shielded():
            _stop(procs)
        for f in files:
            f.close()


def _supervise(procs: list[subprocess.Popen], logs: Path, grace_s: float) -> int:
    """Wait for all agents. The first failure gives the others `grace_s` to fail too (they usually do, at their
    next collective), then they are stopped: a rank blocked on a dead peer would otherwise wait out its timeout."""
    failed_at = None
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            break
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > grace_s:
            break
        time.sleep(0.1)
    codes = [p.poll() for p in procs]
    bad = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
    for i, c in bad:
        if i > 0:
            tail = (logs / f"node{i}.log").read_text(errors="replace").splitlines()[-15:]
            print(f"{PROG}: node {i} exited with {c}; last lines of {logs / f'node{i}.log'}:", file=sys.stderr)
            print("\n".join("    " + line for line in tail), file=sys.stderr, flush=True)
    if not bad:
        return 0
    code = bad[0][1] if codes[0] in (None, 0) else codes[0]
    return 128 - code if code < 0 else code  # killed by signal N: the shell's 128 + N


def _supervise_elastic(procs: list[subprocess.Popen], logs: Path) -> int:
    """An elastic job ends when node 0's agent does (it hosts the rendezvous); the other nodes may come and go."""
    code = procs[0].wait()
    for i, p in enumerate(procs[1:], start=1):
        c = p.poll()
        if c not in (None, 0):
            print(f"{PROG}: node {i} exited with {c} during the job (log: {logs / f'node{i}.log'})",
                  file=sys.stderr, flush=True)
    return 128 - code if code < 0 else code


def drop(names: Names, node: int) -> int:
    """Take node `node` away from whatever runs on it, as a machine that fails would: every process in its
    namespace is killed at once (no SIGTERM: nothing gets to say goodbye). Returns how many were killed."""
    _, up_nodes = names.existing()
    if node not in up_nodes:
        raise UserError(f"testbed '{names.prefix}' has no node {node} (nodes: {', '.join(map(str, up_nodes))})")
    if node == 0:
        raise UserError("node 0 hosts the rendezvous; drop another node")
    out = subprocess.run(["ip", "netns", "pids", names.node(node)], capture_output=True, text=True, check=True)
    pids = [int(p) for p in out.stdout.split()]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return len(pids)


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _stop(procs: list[subprocess.Popen]) -> None:
    """Stop every agent still running and everything it started (torchrun puts each worker in its own session, so
    the agent's process group alone would miss them)."""
    pids = []
    for p in procs:
        if p.poll() is None:
            pids += [p.pid] + _descendants(p.pid)
    _kill_all(pids)
    for p in procs:
        try:
            p.wait(timeout=1)
        except subprocess.TimeoutExpired:
            pass


def _kill_all(pids: list[int], grace_s: float = 5.0) -> None:
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


def _alive(pid: int) -> bool:
    try:
        # A zombie (exited, not yet reaped by its parent) counts as gone.
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# ---- command line -------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after the first '--' belongs to the job, untouched by our parser.
    job = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv

    ap = argparse.ArgumentParser(prog=PROG, description="An emulated multi-node cluster on one machine.",
                                 epilog="See the module docstring for examples.")
    ap.add_argument("--name", default="dtb", help="testbed name: prefix of every namespace it creates (default dtb)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p_up = sub.add_parser("up", help="create the nodes, bridge and shaped links")
    p_up.add_argument("--nodes", type=int, help="number of nodes (default 2, or the profile's)")
    p_up.add_argument("--link", help="every node's link rate in tc units, e.g. 1gbit, 100mbit, or 'none' "
                                     "(default 1gbit)")
    p_up.add_argument("--link-per-node", help="comma-separated rates, one per node (overrides --link)")
    p_up.add_argument("--burst", help="tbf bucket size, e.g. 256kb (default: 2 ms of the rate, at least 64kb)")
    p_up.add_argument("--latency-ms", type=float, help="tbf queue: longest wait before a packet drops (default 50)")
    p_up.add_argument("--profile", help="a YAML file with a 'testbed:' section; the options above override it")
    sub.add_parser("down", help="remove everything 'up' created (idempotent)")
    sub.add_parser("status", help="show nodes, addresses and shaping")
    p_probe = sub.add_parser("probe", help="measure one TCP stream's throughput between two nodes")
    p_probe.add_argument("--src", type=int, default=0)
    p_probe.add_argument("--dst", type=int, default=1)
    p_probe.add_argument("--seconds", type=float, default=2.0)
    p_run = sub.add_parser("run", help="run a torchrun job across the nodes: run [options] -- <module and args>")
    p_run.add_argument("--nodes", type=int, help="nodes to use (default: all that are up)")
    p_run.add_argument("--nproc-per-node", type=int, default=1)
    p_run.add_argument("--port", type=int, default=DEFAULT_PORT, help="rendezvous port on node 0")
    p_run.add_argument("--log-dir", help="where nodes 1.. write their output (default: a new /tmp/<name>-run-*)")
    p_run.add_argument("--private-fs", action="store_true",
                       help="nodes 1.. get their own runs/, dtrain cache and /tmp, as separate machines would "
                            f"(kept in {DISKS}/<name>-node<i>/ until 'down')")
    p_run.add_argument("--private-path", action="append", default=[], metavar="PATH",
                       help="with --private-fs: one more path that nodes 1.. see on their own disks (repeatable)")
    p_run.add_argument("--min-nodes", type=int, metavar="N",
                       help="an elastic job (torchrun --nnodes=N:nodes) that goes on with at least N nodes; give "
                            "torchrun's --max-restarts after '--', before the module")
    p_run.add_argument("--last-call", type=int, metavar="S",
                       help="with --min-nodes: seconds the rendezvous waits for more nodes once N are there "
                            "(torch's last_call_timeout; default 30)")
    p_drop = sub.add_parser("drop", help="take a node away: kill every process on it at once (elastic jobs)")
    p_drop.add_argument("node", type=int)
    args = ap.parse_args(argv)
    if job and args.cmd != "run":
        ap.error("arguments after '--' are only for 'run'")

    try:
        with exit_on_user_error(PROG):
            return _command(args, job)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


def _command(args, job: list[str]) -> int:
    names = Names(check_prefix(args.name))
    if args.cmd == "up":
        links = links_from(args, load_profile(args.profile) if args.profile else None)
        with _signals_as_interrupt():
            up(names, links)
        print_status(names)
    elif args.cmd == "down":
        with _signals_as_interrupt():
            removed = down(names)
        print(f"testbed '{names.prefix}': removed {', '.join(removed)}" if removed
              else f"testbed '{names.prefix}': nothing to remove")
    elif args.cmd == "status":
        print_status(names)
    elif args.cmd == "drop":
        print(f"testbed '{names.prefix}': node {args.node}: {drop(names, args.node)} process(es) killed")
    elif args.cmd == "probe":
        bps = probe(names, args.src, args.dst, args.seconds)
        print(f"node {args.src} -> node {args.dst}: {bps / 1e6:.1f} MB/s ({bps * 8 / 1e9:.3f} Gbit/s), "
              f"one TCP stream, {args.seconds:g} s")
    elif args.cmd == "run":
        if args.private_path and not args.private_fs:
            raise UserError("--private-path needs --private-fs")
        private = private_paths(args.private_path) if args.private_fs else None
        with _signals_as_interrupt():
            return run(names, args.nodes, args.nproc_per_node, job, args.port, args.log_dir, private=private,
                       min_nodes=args.min_nodes, last_call_s=args.last_call)
    return 0


class _shielded:
    """Cleanup in progress: a second Ctrl-C (or SIGTERM) must not cut it short and leave things behind."""

    def __enter__(self):
        self._old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)


class _signals_as_interrupt:
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


if __name__ == "__main__":
    sys.exit(main())
