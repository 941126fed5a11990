"""An emulated cluster on one machine, its command line: N network namespaces ("nodes") on a bridge, each link
shaped with `tc tbf`.

The multi-node regime of the study (communication visible next to compute) without a second machine. `up` builds
it, `run` launches one torchrun agent per node over it, `status` shows it, `down` removes exactly what `up` made.
Needs root and iproute2 (`ip`, `tc`). The network: `dtrain.analysis.testbed.net`; the jobs on it: `dtrain.analysis.testbed.jobs`;
the links and the testbed profile (`--profile`): `dtrain.analysis.testbed.links`.

    python -m dtrain.analysis.testbed up --nodes 2 --link 1gbit          # or: up --profile dtrain/profiles/testbed/1gbit.yaml
    python -m dtrain.analysis.testbed status
    python -m dtrain.analysis.testbed probe                              # measured node 0 → node 1 throughput
    python -m dtrain.analysis.testbed run --nodes 2 --nproc-per-node 1 -- -m dtrain.collectives.bench -b 8 -e 256M
    python -m dtrain.analysis.testbed run --nodes 2 --nproc-per-node 1 -- -m dtrain.engine.train --profile dtrain/profiles/smoke.yaml
    python -m dtrain.analysis.testbed run --private-fs -- -m dtrain.engine.train --profile dtrain/profiles/smoke.yaml
    python -m dtrain.analysis.testbed up --profile dtrain/profiles/testbed/2x2.yaml  # 2 nodes x 2 ranks
    python -m dtrain.analysis.testbed run --profile dtrain/profiles/testbed/2x2.yaml -- -m dtrain.engine.train ...
    python -m dtrain.analysis.testbed down

The nodes share the host's filesystem unless `run --private-fs`: then every node but node 0 (the machine the job is
launched from) sees its own run directories, caches and /tmp, as a separate machine would
(`dtrain.analysis.testbed.disks`).
"""

from __future__ import annotations

import argparse
import sys

from dtrain.analysis.testbed.disks import private_paths
from dtrain.analysis.testbed.jobs import DEFAULT_PORT, drop, run
from dtrain.analysis.testbed.links import links_from, load_profile
from dtrain.analysis.testbed.net import (DISKS, PROG, Names, check_prefix, down, print_status, probe, signals_as_interrupt,
                                  up)
from dtrain.common.errors import UserError, exit_on_user_error


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
    p_up.add_argument("--congestion-control", help="the nodes' TCP congestion control, e.g. cubic or bbr (default: "
                                                   "the host's, which each node's namespace inherits)")
    p_up.add_argument("--intra-link", help="the link between the ranks inside each node (their loopback) in tc "
                                           "units, or 'none' (default: unshaped)")
    p_up.add_argument("--profile", help="a YAML file with a 'testbed:' section; the options above override it")
    sub.add_parser("down", help="remove everything 'up' created (idempotent)")
    sub.add_parser("status", help="show nodes, addresses and shaping")
    p_probe = sub.add_parser("probe", help="measure one TCP stream's throughput between two nodes")
    p_probe.add_argument("--src", type=int, default=0)
    p_probe.add_argument("--dst", type=int, default=1)
    p_probe.add_argument("--seconds", type=float, default=2.0)
    p_run = sub.add_parser("run", help="run a torchrun job across the nodes: run [options] -- <module and args>")
    p_run.add_argument("--nodes", type=int, help="nodes to use (default: all that are up)")
    p_run.add_argument("--nproc-per-node", type=int, help="ranks per node (default: the profile's "
                                                         "ranks_per_node, else 1)")
    p_run.add_argument("--profile", help="a testbed profile: its ranks_per_node is the default --nproc-per-node")
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
    p_run.add_argument("--pin-cpus", action="store_true",
                       help="each node's ranks on CPUs of their own (the machine's CPUs divided between the nodes), "
                            "as separate machines have; default: every node's ranks may run on every CPU")
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
        with signals_as_interrupt():
            up(names, links)
        print_status(names)
    elif args.cmd == "down":
        with signals_as_interrupt():
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
        nproc = args.nproc_per_node or (load_profile(args.profile).ranks_per_node if args.profile else None) or 1
        with signals_as_interrupt():
            return run(names, args.nodes, nproc, job, args.port, args.log_dir, private=private,
                       min_nodes=args.min_nodes, last_call_s=args.last_call, pin_cpus=args.pin_cpus)
    return 0
