"""The command line: `python -m dtrain.collectives.costmodel [table] ...` and `python -m dtrain.collectives.costmodel fit ...`.

    python -m dtrain.collectives.costmodel --topology h100x8 --sizes 8:1G            # table: every choice, NCCL's pick
    python -m dtrain.collectives.costmodel --topology h100x8-ib:2 --sizes 8:1G --json
    python -m dtrain.collectives.costmodel fit all_reduce_perf.log [--topology h100x8] [--out fit.json]
    python -m dtrain.collectives.costmodel --topology fit:fit.json --sizes 1K:64M      # gloo / fitted model
    python -m dtrain.collectives.costmodel --topology fit:rsag.json --coll reducescatter  # a fit of that collective
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace

from dtrain.collectives.costmodel.base import COLLECTIVES
from dtrain.collectives.costmodel.fit import FittedModel
from dtrain.collectives.costmodel.loading import is_fit_spec, load_model
from dtrain.collectives.costmodel.measurements import read_measurements
from dtrain.collectives.costmodel.nccl_model import NcclModel
from dtrain.collectives.costmodel.presets import preset_names
from dtrain.collectives.costmodel.tables import fit_report, format_fit, format_table, table
from dtrain.common.errors import ArgumentParser, UserError, exit_on_user_error
from dtrain.common.files import check_writable, write_atomic
from dtrain.common.units import parse_sizes

PROG = "dtrain.collectives.costmodel"
USAGE = ("python -m dtrain.collectives.costmodel [table] --topology SPEC [--sizes SIZES] [--coll COLL] [--json] ...\n"
         "       python -m dtrain.collectives.costmodel fit FILE [--topology SPEC] [--out FILE] [--json] ...")
COMMANDS_HELP = """commands:
  table (the default)  modeled time of one collective per size, every (algo, proto), and NCCL's pick
  fit FILE             fit latency/bandwidth per size regime to an nccl-tests log or the benchmark's CSV/JSON,
                       with the error per size ('fit --help' for its options)"""


def _cmd_table(argv) -> None:
    ap = ArgumentParser(prog="python -m dtrain.collectives.costmodel", usage=USAGE, epilog=COMMANDS_HELP,
                        formatter_class=argparse.RawDescriptionHelpFormatter,
                        description="Modeled time of one collective per size, every (algo, proto), and NCCL's pick.")
    ap.add_argument("--topology", required=True,
                    help=f"one of: {', '.join(preset_names())} (local:<file> is an older spelling of fit:<file>)")
    ap.add_argument("--sizes", default="8:1G", help="min:max[:factor] or a comma list (default 8:1G)")
    ap.add_argument("--coll", default="allreduce", choices=COLLECTIVES)
    ap.add_argument("--channels", type=int, help="override the preset's channel count (from a GRAPH log)")
    ap.add_argument("--bw-per-channel", type=float, help="override the preset's per-channel GB/s")
    ap.add_argument("--nvls-enable", type=int, choices=(0, 1),
                    help="as NCCL_NVLS_ENABLE: 0 leaves NVLS/NVLSTree out (default: on where the preset has NVSwitch)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    model = load_model(args.topology)
    if args.nvls_enable is not None:
        if not isinstance(model, NcclModel):
            raise UserError("--nvls-enable applies to topology presets, not to a fitted model or NCCL's table")
        model = NcclModel(replace(model.topo, nvls_enable=bool(args.nvls_enable)))
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
    ap = ArgumentParser(prog="python -m dtrain.collectives.costmodel fit",
                        description="Fit latency/bandwidth per size regime (per collective, and per algo/proto "
                                    "when the log tells) to an nccl-tests log (all_reduce_perf, reduce_scatter_perf, "
                                    "all_gather_perf) or the project's benchmark CSV/JSON, with the error per size.")
    ap.add_argument("file")
    ap.add_argument("--topology", help="also show a model's time and error per size: a preset, or nccl-log:<file> "
                                       "(NCCL's own table)")
    ap.add_argument("--max-regimes", type=int, default=4)
    ap.add_argument("--out", help="save the fitted model as JSON (use it as --topology fit:<file>)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.max_regimes < 1:
        raise UserError("--max-regimes must be >= 1")
    if args.out:
        check_writable(args.out, "--out")
    ms = read_measurements(args.file)
    # Named with the older `local:` spelling, as saved fits always have been (the name is part of the output).
    fm = FittedModel.from_measurements(ms, name=f"local:{args.file}", max_regimes=args.max_regimes)
    if args.topology and is_fit_spec(args.topology):
        raise UserError("fit --topology: compare against a preset or nccl-log:<file>, not another fit")
    preset = load_model(args.topology) if args.topology else None
    if preset is not None and ms.ranks and preset.ranks and ms.ranks != preset.ranks:
        print(f"# note: the measurements have {ms.ranks} ranks, {preset.name} has {preset.ranks}", file=sys.stderr)
    rep = fit_report(ms, fm, preset)
    if args.out:
        write_atomic(args.out, json.dumps(fm.to_dict(), indent=1) + "\n", "--out")
    print(json.dumps(rep, indent=1) if args.json else format_fit(rep, preset.name if preset else None))


COMMANDS = {"table": _cmd_table, "fit": _cmd_fit}


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    with exit_on_user_error(PROG):
        if argv and not argv[0].startswith("-"):
            if argv[0] not in COMMANDS:
                raise UserError(f"unknown command '{argv[0]}' (commands: {', '.join(COMMANDS)}; see --help)")
            COMMANDS[argv[0]](argv[1:])
        else:
            _cmd_table(argv)
