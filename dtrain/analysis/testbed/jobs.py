"""Jobs on the testbed: one torchrun agent per node inside its namespace (c10d rendezvous on node 0), supervised
until the job ends, stopped with everything it started; `drop` takes a node away as a failing machine would.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dtrain.analysis.testbed.disks import prepare_disk, private_mounts
from dtrain.analysis.testbed.net import IFACE, PROG, Names, descendants, kill_all, require_tools, shielded
from dtrain.common.errors import UserError

DEFAULT_PORT = 29500


def node_cpus(i: int, nodes: int, available: list[int]) -> list[int]:
    """The CPUs node i is pinned to under `--pin-cpus`, of the `available` ones (this process's affinity):
    len(available) // nodes of them (at least one), consecutive, node after node; with more nodes than CPUs, the
    nodes take the CPUs in turn and share them."""
    n = len(available)
    k = max(1, n // nodes)
    return [available[(i * k + j) % n] for j in range(k)]


def agent_command(names: Names, i: int, nodes: int, nproc: int, port: int, run_id: str, args: list[str],
                  mounts: list[tuple[Path, Path]] = (), min_nodes: int | None = None,
                  last_call_s: int | None = None, cpus: list[int] | None = None) -> list[str]:
    """The torchrun agent of node i, inside its namespace. c10d ranks agents by their address, and node 0's is
    the lowest (10.77.0.1 sorts first, also as a string), so global rank 0 is always on node 0.

    With `mounts`, the agent first bind-mounts each (source, target) pair. `ip netns exec` runs its command in a mount
    namespace of its own whose mounts are slaves of the host's (iproute2, lib/namespace.c: netns_switch), so these
    mounts are seen by the agent and its workers only, never by the host or the other nodes, and vanish with them.

    With `min_nodes` the job is elastic (torchrun's `--nnodes=MIN:MAX`): after a node is lost, the others meet again
    at the rendezvous and go on with fewer once `min_nodes` are there, after waiting `last_call_s` for more (torch's
    c10d rendezvous `last_call_timeout`, 30 s by default).

    With `cpus`, the agent and everything it starts (its workers, their gloo threads) run on those CPUs only
    (`taskset`), as a separate machine's processes run on its own cores."""
    rdzv_conf = f"is_host={int(i == 0)}" + (f",last_call_timeout={last_call_s}" if last_call_s is not None else "")
    prefix = ["ip", "netns", "exec", names.node(i)]
    if cpus:
        prefix += ["taskset", "-c", ",".join(str(c) for c in cpus)]
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
        min_nodes: int | None = None, last_call_s: int | None = None, pin_cpus: bool = False) -> int:
    """Launch the job; stream node 0's rank 0, log the other nodes to files; return the job's exit code.
    `pin_cpus`: each node's processes on CPUs of its own (`node_cpus`); else the scheduler spreads every node's
    processes over all the machine's CPUs, so that the emulated nodes also share cores, which real ones do not.
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
        raise UserError("nothing to run: give the module and its arguments after '--', e.g. -- -m dtrain.collectives.bench")
    logs = Path(log_dir or tempfile.mkdtemp(prefix=f"{names.prefix}-run-"))
    logs.mkdir(parents=True, exist_ok=True)
    run_id = f"{names.prefix}-{os.getpid()}-{int(time.time())}"
    env = agent_env(nodes, nproc)
    cpus, pinned = {i: None for i in range(nodes)}, ""
    if pin_cpus:
        if shutil.which("taskset") is None:
            raise UserError("--pin-cpus needs taskset (util-linux), not found on PATH")
        available = sorted(os.sched_getaffinity(0))
        cpus = {i: node_cpus(i, nodes, available) for i in range(nodes)}
        pinned = "CPUs " + "; ".join(f"node {i}: {','.join(map(str, c))}" for i, c in cpus.items()) + ", "
    print(f"{PROG}: {nodes} node(s) x {nproc} rank(s), rendezvous {names.address(0)}:{port}, "
          f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']}, {pinned}logs of nodes 1.. in {logs}", file=sys.stderr,
          flush=True)
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
            command = agent_command(names, i, nodes, nproc, port, run_id, args, mounts[i], min_nodes, last_call_s,
                                    cpus[i])
            procs.append(subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
                                          start_new_session=True))
        if min_nodes is not None:
            return _supervise_elastic(procs, logs)
        return _supervise(procs, logs, grace_s)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted, stopping the job", file=sys.stderr, flush=True)
        return 130
    finally:
        with shielded():
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


def _stop(procs: list[subprocess.Popen]) -> None:
    """Stop every agent still running and everything it started (torchrun puts each worker in its own session, so
    the agent's process group alone would miss them)."""
    pids = []
    for p in procs:
        if p.poll() is None:
            pids += [p.pid] + descendants(p.pid)
    kill_all(pids)
    for p in procs:
        try:
            p.wait(timeout=1)
        except subprocess.TimeoutExpired:
            pass
