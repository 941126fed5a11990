"""The tuner's search alone: what `sync.strategy: auto` would pick on this machine, and its table, without training
on. Also the exhaustive sweep of the same space as an interleaved matrix, to check the pick against.

    torchrun --nproc_per_node=2 -m dtrain.analysis.tune --profile dtrain/profiles/tune-testbed.yaml --out runs/tune/a
    python -m dtrain.analysis.testbed run --nodes 2 --nproc-per-node 1 -- -m dtrain.analysis.tune \\
        --profile dtrain/profiles/tune-testbed.yaml --out runs/tune/seed1 --set seed=1
    python -m dtrain.analysis.tune --profile dtrain/profiles/tune-testbed.yaml --matrix-out runs/tune/space.yaml --steps 40
    python -m dtrain.analysis.testbed run --nodes 2 --nproc-per-node 1 -- -m dtrain.analysis.interleave \\
        --matrix runs/tune/space.yaml --out runs/tune/sweep1 --seed 1

The search writes <out>/tuning.csv and <out>/tuned.json, and its steps' records (steps.jsonl, buckets.jsonl).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
from pathlib import Path

import yaml

from dtrain.collectives import dist as ddist
from dtrain.collectives import nccl
from dtrain.collectives.settings import TuneConfig
from dtrain.common.errors import UserError, exit_on_user_error
from dtrain.common.files import output_dir, write_atomic
from dtrain.engine import autotune
from dtrain.engine import config as config_mod

PROG = "dtrain.analysis.tune"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog=PROG, description="Run the search of sync.strategy: auto alone and print its "
                                 "table, or write the exhaustive sweep of its space as an interleave matrix.")
    ap.add_argument("--profile", required=True, help="a profile with sync.strategy: auto")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", help="a new folder for the search's records (with torchrun or the testbed)")
    ap.add_argument("--matrix-out", metavar="FILE", help="write the candidate space as a sweep matrix and exit")
    ap.add_argument("--steps", type=int, default=40, help="with --matrix-out: train.max_steps of each cell")
    return ap.parse_args(argv)


def space_matrix(profile: str, overrides: list[str], steps: int) -> dict:
    """A sweep matrix (`dtrain.analysis.sweep`, `dtrain.analysis.interleave`) with one variant per candidate of the profile's
    search space, lossy ones only where the profile allows them, each variant its candidate's sync keys."""
    cfg = config_mod.load(profile, overrides)
    # The tune section is the auto strategy's alone: each of its keys set in the profile goes back to its default.
    reset = {f"sync.tune.{f.name}": getattr(TuneConfig(), f.name) for f in dataclasses.fields(TuneConfig)
             if getattr(cfg.sync.tune, f.name) != getattr(TuneConfig(), f.name)}
    variants = {c.name: {**{f"sync.{k}": v for k, v in c.keys.items()}, **copy.deepcopy(reset)}
                for c in autotune.candidates(cfg)}  # copies: no YAML anchors in the file
    # The overrides as --set reads them (YAML values); each variant names its own strategy
    extra = {k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in overrides) if k != "sync.strategy"}
    return {"name": f"{cfg.name}-space", "launcher": "testbed", "nodes": 2, "nproc": 1, "profiles": [profile],
            "variants": variants, "set": {**extra, "train.max_steps": steps, "train.max_minutes": None,
                                          "train.val_every": 0, "eval.at_end": False, "train.average_last": 1}}


def main(argv=None) -> int:
    args = parse_args(argv)
    with exit_on_user_error(PROG):
        if args.matrix_out:
            matrix = space_matrix(args.profile, args.overrides, args.steps)
            write_atomic(args.matrix_out, yaml.safe_dump(matrix, sort_keys=False), "--matrix-out")
            print(f"{len(matrix['variants'])} candidates -> {args.matrix_out}")
            return 0
        if not args.out:
            raise UserError("--out is required (or --matrix-out)")
        cfg = config_mod.load(args.profile, args.overrides)
        if cfg.sync.strategy != "auto":
            raise UserError(f"{args.profile}: sync.strategy is '{cfg.sync.strategy}'; the search needs auto")
        nccl.apply_global(cfg.sync, cfg.collectives)
        device, backend = ddist.init(cfg.collectives)
        try:
            out = Path(args.out)

            def prepare() -> None:
                if any(output_dir(out, "--out").iterdir()):
                    raise UserError(f"--out {out}: not empty; a search starts in a new folder")

            ddist.main_decides(prepare)
            autotune.search_only(cfg, out, device, backend)
        finally:
            ddist.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
