"""`dtrain nccl VERB` (`python -m dtrain.collectives.tools.nccl`): the group settings of a profile, the tuner plugin and its config files, the
NCCL log check, and the one-GPU check. Reads only the library's sections of a profile (`dtrain.collectives.config.load`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dtrain.collectives.config import load
from dtrain.collectives.nccl.check import check_decisions, load_buckets, render_check
from dtrain.collectives.nccl.classes import class_names, resolved
from dtrain.collectives.nccl.groups import groups_text
from dtrain.collectives.nccl.log import read_logs
from dtrain.collectives.nccl.tuner import build_tuner, example_tuner_csv
from dtrain.collectives.tools.tuner_check import render_tuner_table, tuner_table
from dtrain.collectives.nccl.versions import parse_version
from dtrain.collectives.tools.gpu_check import gpu_check
from dtrain.common.errors import ArgumentParser, UserError, exit_on_user_error
from dtrain.common.schema import apply_overrides, read_overlay

PROG = "dtrain nccl"


def parse_args(argv=None) -> argparse.Namespace:
    ap = ArgumentParser(prog=PROG, description="Per-class NCCL settings: what each process group gets, the "
                                                        "tuner plugin, NCCL's logs.")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="VERB")
    p = sub.add_parser("groups", help="print which variables, options and files each process group gets")
    p.add_argument("--profile", required=True)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--nccl-version", help="render for this NCCL (default: the runtime's, else >= 2.24)")
    p.add_argument("--backend", choices=("nccl", "gloo"), help="default: the profile's collectives.backend choice")
    sub.add_parser("build-tuner", help="compile dtrain's NCCL tuner plugin; prints its path")
    t = sub.add_parser("tuner-config", help="the rules as CSV for NCCL's example tuner plugin, one per communicator")
    t.add_argument("--profile", required=True)
    t.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    t.add_argument("--nproc", type=int, required=True, help="ranks per node")
    t.add_argument("--nnodes", type=int, default=1)
    t.add_argument("--channels", type=int, default=16,
                   help="channels where the profile sets no max_ctas (the example plugin would use 1)")
    t.add_argument("--out", help="a directory for nccl_tuner.<class>.conf files (default: print them)")
    c = sub.add_parser("tuner-check", help="drive the built plugin through ctypes: the cell forced per version, "
                                           "class and size")
    c.add_argument("--profile", required=True)
    c.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    c.add_argument("--nproc", type=int, default=8)
    c.add_argument("--nnodes", type=int, default=1)
    c.add_argument("--example-config", metavar="FILE",
                   help="a config file of NCCL's example tuner plugin, read after the classes' rules")
    lg = sub.add_parser("parse-log", help="NCCL ENV,TUNING log -> (communicator, collective, bytes, algorithm, "
                                          "protocol, channels); exit 1 when a bucket is off its requested choice")
    lg.add_argument("logs", nargs="+")
    lg.add_argument("--profile", help="the run's profile: the requested choices")
    lg.add_argument("--buckets", help="the run's buckets.jsonl (or a JSON list of {index, class, nbytes})")
    g = sub.add_parser("gpu-check", help="two NCCL ranks on one GPU (distinct NCCL_HOSTID), per_group then tuner "
                                         "mode, each checked with parse-log; exit 1 when a bucket is off its choice")
    g.add_argument("--out", default="runs/nccl-gpu-check")
    return ap.parse_args(argv)


def profile_name(path: str, overrides: list[str]) -> str:
    """The profile's `name` (with its `--set`), for the example plugin's config header: `dtrain.collectives.config.load`
    reads the library's sections only."""
    raw, src = read_overlay(path)
    apply_overrides(raw, src, overrides)
    return str(raw.get("name", "run"))


def parse_log_cmd(args) -> int:
    decisions, envs = read_logs(args.logs)
    want = resolved(*load(args.profile)) if args.profile else {}
    buckets = load_buckets(args.buckets) if args.buckets else []
    table, mismatches = check_decisions(decisions, buckets, want)
    print(render_check(table, mismatches, envs), end="")
    return 1 if mismatches else 0


def tuner_config_cmd(args) -> None:
    sync, coll = load(args.profile, args.overrides)
    if args.nproc < 1 or args.nnodes < 1 or args.channels < 1:
        raise UserError("--nproc, --nnodes and --channels must be positive")
    label = profile_name(args.profile, args.overrides)
    for name in ["world"] + class_names(sync):
        text = example_tuner_csv(sync, coll, name, args.nproc, args.nnodes, args.channels, label)
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / f"nccl_tuner.{name}.conf").write_text(text)
            print(Path(args.out) / f"nccl_tuner.{name}.conf")
        else:
            print(text)


def main(argv=None) -> int:
    with exit_on_user_error(PROG):
        args = parse_args(argv)
        if args.cmd == "build-tuner":
            print(build_tuner(force=True))
        elif args.cmd == "gpu-check":
            return gpu_check(args.out)
        elif args.cmd == "parse-log":
            return parse_log_cmd(args)
        elif args.cmd == "groups":
            sync, coll = load(args.profile, args.overrides)
            print(groups_text(sync, coll, parse_version(args.nccl_version), args.backend), end="")
        elif args.cmd == "tuner-config":
            tuner_config_cmd(args)
        elif args.cmd == "tuner-check":
            if args.nproc < 1 or args.nnodes < 1:
                raise UserError("--nproc and --nnodes must be positive")
            rows = tuner_table(*load(args.profile, args.overrides), nranks=args.nproc * args.nnodes,
                               nnodes=args.nnodes, example_config=args.example_config)
            print(render_tuner_table(rows), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
