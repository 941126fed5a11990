"""The command line: nccl-tests' flags (`-b -e -f -i -w -n -c -d -o`), the collectives, the paths, the tensor class
and its group, and the sweep on every rank, rank 0 printing nccl-tests' table per collective and writing the rows."""

from __future__ import annotations

import math
import os
import platform
import socket
from dataclasses import asdict

import torch
import torch.distributed as dist

from dtrain.collectives import dist as ddist
from dtrain.collectives import nccl, tensor_classes
from dtrain.collectives.bench.collectives import ALL_REDUCE, NO_OP, Collective, parse_collectives
from dtrain.collectives.bench.groups import measure_groups
from dtrain.collectives.bench.host_work import measure_host_work
from dtrain.collectives.bench.measure import Row, measure
from dtrain.collectives.bench.output import extra_lines, footer, header, line, to_csv, to_json, write_out
from dtrain.collectives.bench.overlap import measure_overlap
from dtrain.collectives.bench.paths import ALIASES, DTYPES, NCCL_ONLY_OPS, OPS, bench_paths
from dtrain.collectives.config import load as load_comm_config
from dtrain.collectives.nccl import class_group
from dtrain.collectives.settings import CollectivesConfig, SyncConfig, bucket_cap_mb
from dtrain.common.errors import ArgumentParser, UserError, exit_on_user_error
from dtrain.common.files import check_writable
from dtrain.common.units import parse_size

PROG = "dtrain.collectives.bench"


def parse_dtypes(text: str) -> list[str]:
    names = list(DTYPES) if text == "all" else [ALIASES.get(text, text)]
    for n in names:
        if n not in DTYPES:
            raise UserError(f"unknown dtype '{text}' (known: {', '.join(DTYPES)}, all; "
                            f"aliases {', '.join(ALIASES)})")
    return names


def parse_ops(text: str, backend: str) -> list[str]:
    usable = [o for o in OPS if backend == "nccl" or o not in NCCL_ONLY_OPS]
    if text == "all":
        return usable
    if text not in OPS:
        raise UserError(f"unknown op '{text}' (known: {', '.join(OPS)}, all)")
    if text not in usable:
        raise UserError(f"op '{text}' needs the nccl backend (this run uses {backend})")
    return [text]


def sweep_sizes(min_bytes: int, max_bytes: int, factor: float, increment: int) -> list[int]:
    """nccl-tests' sweep: multiply by `factor`, or add `increment` when one is given."""
    if min_bytes > max_bytes:
        raise UserError(f"-b ({min_bytes}) is larger than -e ({max_bytes})")
    if not math.isfinite(factor):
        raise UserError(f"-f must be a finite number, not {factor}")
    if increment <= 0 and factor <= 1 and min_bytes != max_bytes:
        raise UserError(f"-f must be above 1 (or give -i) to sweep from {min_bytes} to {max_bytes}")
    sizes, s = [], min_bytes
    while s <= max_bytes:
        sizes.append(s)
        if min_bytes == max_bytes:
            break
        s = s + increment if increment > 0 else max(s + 1, int(s * factor))
    return sizes


def parse_args(argv=None):
    ap = ArgumentParser(prog=PROG, description="all_reduce_perf-like sweep on torch.distributed (also "
                                               "reduce_scatter_perf and all_gather_perf: --collective).",
                        epilog="Run under torchrun (or dtrain.analysis.testbed run); see the module docstring.")
    ap.add_argument("-b", "--minbytes", default="32M", help="smallest size in bytes, K/M/G suffix (default 32M)")
    ap.add_argument("-e", "--maxbytes", default="32M", help="largest size (default 32M)")
    ap.add_argument("-f", "--stepfactor", type=float, default=2.0, help="multiply the size by this (default 2)")
    ap.add_argument("-i", "--stepbytes", default="0", help="add this many bytes instead of multiplying")
    ap.add_argument("-w", "--warmup_iters", dest="warmup", type=int, default=1, help="warm-up iterations (1)")
    ap.add_argument("-n", "--iters", type=int, default=20, help="timed iterations (20)")
    ap.add_argument("-c", "--check", type=int, default=1, help="correctness pass: 1 on, 0 off (default 1)")
    ap.add_argument("-d", "--datatype", default="float", help=f"{', '.join(DTYPES)} or all (default float)")
    ap.add_argument("-o", "--op", default="sum", help=f"{', '.join(OPS)} or all (default sum)")
    ap.add_argument("--collective", default=ALL_REDUCE.name, metavar="NAME",
                    help="all_reduce, reduce_scatter, all_gather, a comma list of them or all: each measured in "
                         "turn, with its own nccl-tests table (default all_reduce)")
    ap.add_argument("--path", choices=["raw", "reducer", "all"], default="all",
                    help="which path(s) to measure: raw (the torch.distributed call), reducer (the project's "
                         "bucketed all-reduce; all-reduce only) or all (default all)")
    ap.add_argument("--class", dest="tensor_class", metavar="NAME",
                    help="run over this tensor class's process group (dtrain.collectives.nccl.class_group)")
    ap.add_argument("--profile", help="a run profile whose sync.classes give the class's settings (with --class)")
    ap.add_argument("--overlap", nargs="?", const="2M", metavar="MAX",
                    help="CPU only: also measure how much longer a computation takes per reducer all-reduce launched "
                         "during it, at the sweep's sizes up to MAX (default 2M); the simulator's host cost")
    ap.add_argument("--host-work", action="store_true",
                    help="also time the host work strategies add on the computing thread (flat-buffer copies, a "
                         "16-bit cast, an optimizer step over DTensors) at the sweep's sizes: what the step-time "
                         "predictor charges a schedule's host work")
    ap.add_argument("--groups", type=int, metavar="K",
                    help="also measure k = 1..K process groups all-reducing the sweep's largest size at once: the "
                         "share of one group's rate they reach together (what per_class's groups get of a link)")
    ap.add_argument("--csv", metavar="FILE", help="also write the rows as CSV ('-': stdout, instead of the table)")
    ap.add_argument("--json", metavar="FILE", help="also write the rows as a JSON list ('-': stdout, instead of the "
                                                     "table)")
    return ap.parse_args(argv)


def class_group_for(name: str, sync: SyncConfig | None):
    """The tensor class's group, created through the one place that creates them, with the class's settings (from
    the profile's `sync.classes`, else the defaults)."""
    if sync is not None:
        classes = tensor_classes.from_config(sync)
    else:
        classes = tensor_classes.TensorClasses()
    known = [r.name for r in classes.rules]
    if name not in known:
        raise UserError(f"unknown tensor class '{name}' (known: {', '.join(known)})")
    settings = classes.setting(name)
    return class_group(name, settings.nccl(), None), settings


def main(argv=None) -> int:
    with exit_on_user_error(PROG):
        args = parse_args(argv)
        sizes = sweep_sizes(parse_size(args.minbytes), parse_size(args.maxbytes), args.stepfactor,
                            parse_size(args.stepbytes))
        dtypes = parse_dtypes(args.datatype)
        colls = parse_collectives(args.collective)
        if args.path == "reducer" and colls != [ALL_REDUCE]:
            raise UserError("--path reducer: the reducer all-reduces; drop --path reducer or measure all_reduce only")
        if args.iters < 1 or args.warmup < 0:
            raise UserError("-n must be at least 1 and -w at least 0")
        if args.groups is not None and args.tensor_class:
            raise UserError("--groups makes world groups of its own: drop --class")
        if args.groups is not None and args.groups < 2:
            raise UserError(f"--groups must be at least 2 (one group is the baseline), not {args.groups}")
        if args.profile and not args.tensor_class:
            raise UserError("--profile gives a tensor class's settings: use it with --class")
        for option, dest in (("--json", args.json), ("--csv", args.csv)):
            if dest and dest != "-" and ddist.env_rank()[0] == 0:  # rank 0 writes them
                check_writable(dest, option)  # before minutes of measuring, not after
        if args.overlap is not None:
            args.overlap = parse_size(args.overlap)
            if args.path == "raw":
                raise UserError("--overlap measures the reducer path: drop --path raw")
            if ALL_REDUCE not in colls:
                raise UserError("--overlap measures the reducer's all-reduces: add all_reduce to --collective")
        sync, coll = load_comm_config(args.profile) if args.profile else (None, CollectivesConfig())
        if sync is not None:
            # Before the default group exists: sets the profile's job-wide NCCL variables and arms class_group, so
            # that the class's group gets its own protocol/algorithm (the #wrong check then validates them).
            nccl.apply_global(sync, coll)
        device, backend = ddist.init(coll)
        try:
            return _bench(args, sizes, dtypes, colls, device, backend, sync)
        finally:
            ddist.cleanup()


def _device_text(device) -> str:
    """A rank's device as nccl-tests names it (index [PCI bus] name); a CPU rank has no index or bus."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        bus = getattr(props, "pci_bus_id", None)
        return f"{device.index or 0:2d} [{f'0x{bus:02x}' if bus is not None else '?'}] {props.name}"
    return f"{-1:2d} [cpu] {platform.processor() or platform.machine() or 'CPU'}"


# What each column group times, per collective (nccl-tests' size and count: `dtrain.collectives.bench.collectives`).
_PLACES = {
    "all_reduce": "# out-of-place: dist.all_reduce into an output buffer (the input copied there first, timed with it: "
                  "torch.distributed reduces in place only); in-place: dist.all_reduce of the tensor itself",
    "reduce_scatter": "# out-of-place: dist.reduce_scatter_single of the input (size bytes) into an output buffer "
                      "(count elements); in-place: into this rank's share of the input itself; size = count x ranks",
    "all_gather": "# out-of-place: dist.all_gather_single of an input buffer (count elements) into the output (size "
                  "bytes); in-place: from this rank's share of the output itself; size = count x ranks",
}


def _preamble(args, coll: Collective, paths, hosts, nranks: int, backend: str, what: str, settings, emit) -> None:
    """The table's head, as nccl-tests prints it for `coll` (the program starting; one process a rank: nThread 1
    nGpus 1; a rank line each), then, as comments of its own, what this benchmark adds: backend, group, what the
    column groups time and the reducer path."""
    step = f"{parse_size(args.stepbytes)}(bytes)" if parse_size(args.stepbytes) > 0 else f"{args.stepfactor:g}(factor)"
    emit(f"# Collective test starting: {coll.program}")
    emit(f"# nThread 1 nGpus 1 minBytes {parse_size(args.minbytes)} maxBytes {parse_size(args.maxbytes)} "
         f"step: {step} warmup iters: {args.warmup} iters: {args.iters} agg iters: 1 validation: {args.check} "
         f"graph: 0")
    emit("#\n# Using devices")
    for r, pid, host, dev in hosts:
        emit(f"#  Rank {r:2d} Group  0 Pid {pid:6d} on {host:>10} device {dev}")
    emit("#")
    emit(f"# {PROG}: nRanks {nranks} backend {backend} group: {what}")
    emit(_PLACES[coll.name])
    if any(p.name == "reducer" for p in paths):
        cap = bucket_cap_mb(settings.bucket_cap_mb if settings else None)
        emit(f"# reducer path: dtrain.collectives.reducer.Reducer, the size cut into buckets of <= {cap:g} MiB, launched "
             f"async in order, waited, averaged (checked against the mean); float types, op sum only; its rows are "
             f"the commented table after the footer")
    if not any(p.name == "raw" for p in paths):
        emit("# --path reducer: the raw path is not measured, so the table below has no rows")
    emit("#")
    for h in header():
        emit(h)


def _bench(args, sizes: list[int], dtypes: list[str], colls: list[Collective], device, backend: str,
           sync: SyncConfig | None) -> int:
    """The sweep on every rank, one collective after the other; rank 0 prints and writes."""
    ops = parse_ops(args.op, backend)
    group, settings, what = None, None, "world"  # settings None: the reducer's defaults
    if args.tensor_class:
        group, settings = class_group_for(args.tensor_class, sync)
        what = f"class {args.tensor_class} (" + ", ".join(f"{k} {v}" for k, v in asdict(settings).items()) + ")"
    rank, nranks = dist.get_rank(group), dist.get_world_size(group)
    main_rank = dist.get_rank() == 0
    table = args.csv != "-" and args.json != "-"
    emit = print if (main_rank and table) else (lambda *a, **k: None)

    hosts = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, (dist.get_rank(), os.getpid(), socket.gethostname(), _device_text(device)))
    rows: list[Row] = []
    for coll in colls:
        paths = bench_paths(args.path, group, args.tensor_class, settings, coll)
        _preamble(args, coll, paths, hosts, nranks, backend, what, settings, emit)
        measured: list[Row] = []
        for dtype_name in dtypes:
            itemsize = DTYPES[dtype_name].itemsize
            for op in ops if coll.reduces else [NO_OP]:
                for size in sizes:
                    count = coll.count(size, itemsize, nranks)
                    if count == 0:  # below one element (a share of 16 bytes a rank): nothing to measure
                        continue
                    # A path that cannot do this op (the reducer only sums) is skipped at that size.
                    cells = [measure(p, count, dtype_name, op, args, group, nranks, rank, device) for p in paths
                             if p.can(op, dtype_name)]
                    measured += cells
                    raw = {c.place: c for c in cells if c.path == "raw"}
                    if raw:
                        emit(line(raw.get("out-of-place"), raw.get("in-place")), flush=True)
        for f in footer(measured, coll.program) + extra_lines(measured):
            emit(f)
        rows += measured
    if args.overlap is not None:
        measure_overlap(rows, args.overlap, group, nranks, device, emit)
    if args.groups is not None:
        rows += measure_groups(args.groups, max(sizes), dtypes[0], args.warmup, nranks, device, emit)
    if args.host_work:
        if device.type != "cpu":
            raise UserError(f"--host-work times work on the CPU's computing thread: this run computes on {device}")
        rows += measure_host_work([s for s in sizes if s >= 1 << 10], group, nranks, device, emit)
    if main_rank:
        if args.json:
            write_out(args.json, to_json(rows), "--json")
        if args.csv:
            write_out(args.csv, to_csv(rows), "--csv")
    return 0 if all(not r.wrong for r in rows) else 1
