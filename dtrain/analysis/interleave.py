"""Interleaved measurement: the configurations of a sweep matrix trained in one job, step by step in turn.

Sequential runs on a machine whose speed drifts over minutes (a shared VM) compare the machine's moments as much as
the configurations. Here each configuration gets its own `Trainer` (model replica, optimizer,
gradient synchronization and process groups), all built with the same seed, so they train on the same batches in the
same order; every step runs each configuration once, in an order shuffled per step (the same on every rank: the
collectives must be issued in the same order), so a drift in the machine's speed hits all of them alike. Each
configuration leaves an ordinary run directory (config.yaml, run.json, steps.jsonl, buckets.jsonl) for
`dtrain.analysis.simulate --measured` and `dtrain.analysis.report`, and the job ends with its comparison against its stock DDP
configuration (`dtrain.analysis.paired`, which also pools several jobs).

What it does not measure: a configuration alone on the machine. Replicas share the caches, and each step of one
comes after steps of the others; the comparison between configurations is what it is for.

    torchrun --nproc_per_node=2 -m dtrain.analysis.interleave --matrix dtrain/profiles/sweeps/simulator-check-testbed.yaml \\
        --out runs/il --set data.max_tokens=512
    python -m dtrain.analysis.testbed run --nodes 2 --nproc-per-node 1 -- -m dtrain.analysis.interleave \\
        --matrix dtrain/profiles/sweeps/simulator-check-testbed.yaml --out runs/simcheck-il/job1 --seed 1
"""

from __future__ import annotations

import argparse
import random
import sys
from contextlib import ExitStack
from pathlib import Path

from dtrain.analysis import paired
from dtrain.analysis.sweep import expand, load_matrix
from dtrain.collectives import dist as ddist
from dtrain.collectives import nccl
from dtrain.common import host_memory
from dtrain.common.errors import UserError, exit_on_user_error
from dtrain.common.files import output_dir
from dtrain.common.progress import Bar
from dtrain.engine import config as config_mod
from dtrain.engine.log import prepare_run_dir
from dtrain.engine.model import sdpa_backend
from dtrain.engine.trainer import Trainer

PROG = "dtrain.analysis.interleave"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog=PROG, description="Train every configuration of a sweep matrix in one job, "
                                 "step by step in turn on the same batches, so that machine drift hits all alike.")
    ap.add_argument("--matrix", required=True, help="a sweep matrix (dtrain.analysis.sweep); its launcher and bench are "
                                                    "ignored: start this module under torchrun or the testbed")
    ap.add_argument("--out", required=True, help="a new folder: one run directory per configuration inside")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="one more override for every configuration")
    ap.add_argument("--seed", type=int, default=0, help="seed of the per-step order (the same on every rank)")
    ap.add_argument("--only", metavar="NAME[,NAME...]", help="just these cells: variant names of the matrix, or run "
                    "names (one alone, e.g. to watch its threads or profile it)")
    return ap.parse_args(argv)


def load_configs(matrix_path: str, overrides: list[str], only: str | None = None) -> list[tuple[str, object]]:
    """(run name, resolved config) per cell of the matrix (`only`: the cells of these comma-separated variant or run
    names); they must agree on what the job shares."""
    m = load_matrix(matrix_path)
    jobs = expand(m)
    if only is not None:
        wanted = [w.strip() for w in only.split(",") if w.strip()]
        known = [j.variant for j in jobs if j.variant] + [j.name for j in jobs]
        unknown = [w for w in wanted if w not in known]
        if unknown or not wanted:
            raise UserError(f"--only {only}: no cell named '{(unknown or [only])[0]}' in {matrix_path} (variants: "
                            f"{', '.join(dict.fromkeys(j.variant for j in jobs if j.variant)) or 'none'})")
        jobs = [j for j in jobs if j.variant in wanted or j.name in wanted]
    cells = [(job.name, config_mod.load(job.profile, job.overrides + list(overrides))) for job in jobs]
    if not cells:
        raise UserError(f"{matrix_path}: the matrix has no cells")
    first_name, first = cells[0]
    for name, cfg in cells[1:]:
        for what, a, b in (("train.max_steps", first.train.max_steps, cfg.train.max_steps),
                           ("train.sdpa_backend", first.train.sdpa_backend, cfg.train.sdpa_backend),
                           ("train.keep_host_memory", first.train.keep_host_memory, cfg.train.keep_host_memory),
                           ("collectives", first.collectives, cfg.collectives),
                           ("data", first.data, cfg.data), ("seed", first.seed, cfg.seed)):
            if a != b:
                raise UserError(f"{matrix_path}: '{name}' and '{first_name}' differ in {what}; an interleaved job "
                                "shares it (steps, batches, NCCL settings, the process's allocator): make it the "
                                "same or sweep separately")
    if first.collectives.parse_log:
        raise UserError("collectives.parse_log: not in an interleaved job (one NCCL log would hold every "
                        "configuration's collectives)")
    return cells


def summary(out: Path, cells: list[tuple[str, str]]) -> str:
    """The job's comparison (`dtrain.analysis.paired`): against its first stock DDP cell, and its noop cell if any; or why
    there is none."""
    short = paired.short_names([name for name, _ in cells])
    ddp = next((short[n] for n, strategy in cells if strategy == "ddp"), None)
    noop = next((short[n] for n, strategy in cells if strategy == "noop"), None)
    if ddp is None:
        return "(no stock DDP configuration to compare against: python -m dtrain.analysis.paired --baseline NAME)"
    try:
        rows = paired.compare(paired.load_jobs([str(out)]), ddp, noop)
    except UserError as e:
        return f"(no comparison: {e})"
    return paired.render(rows, ddp, noop, cpu=False) + f"\n(python -m {paired.PROG} {out} --baseline {ddp} --cpu: more)"


def main(argv=None) -> int:
    args = parse_args(argv)
    with exit_on_user_error(PROG):
        cells = load_configs(args.matrix, args.overrides, args.only)
        out = Path(args.out)
        first = cells[0][1]  # the job's NCCL variables and backend are the same for every cell (load_configs)
        nccl.apply_global(first.sync, first.collectives)  # recorded on gloo
        device, backend = ddist.init(first.collectives)
        memory = ExitStack()  # freed host memory kept for the job where train.keep_host_memory asks (a CPU only)
        try:
            memory.enter_context(host_memory.kept_freed_memory(cells[0][1].train.keep_host_memory, device.type))
            def prepare() -> None:  # on rank 0; its error reaches every rank
                if any(output_dir(out, "--out").iterdir()):
                    raise UserError(f"--out {out}: not empty; an interleaved job starts in a new folder")
                for name, _ in cells:
                    prepare_run_dir(out / name, resume=False)

            ddist.main_decides(prepare)
            trainers = []
            building = Bar(len(cells), "building", "config", enabled=ddist.is_main())
            for name, cfg in cells:
                trainers.append(Trainer(cfg, out / name, device, backend))
                trainers[-1].write_header()
                building.update()
            building.close()
            order = random.Random(args.seed)
            steps = cells[0][1].train.max_steps
            bar = Bar(steps * len(trainers), f"interleaved x{len(trainers)}", "step", enabled=ddist.is_main())
            with sdpa_backend(cells[0][1].train.sdpa_backend, device):  # the attention kernel training would use
                for _ in range(steps):
                    for tr in order.sample(trainers, len(trainers)):  # a fresh order each step, equal on every rank
                        rec = tr.turn_step()
                        bar.update(1)
                        bar.set_postfix_str(f"{tr.cfg.sync.strategy} {rec.step_ms:.0f} ms")
            bar.close()
            if ddist.is_main():
                print(f"{len(trainers)} configurations x {steps} steps, interleaved, in {out}", flush=True)
                print(summary(out, [(name, cfg.sync.strategy) for name, cfg in cells]), flush=True)
        finally:
            trainers = tr = None  # their models and strategies hold the process groups (`ddist.cleanup`)
            ddist.cleanup()
            memory.close()  # glibc's defaults back, however the job ended
    return 0


if __name__ == "__main__":
    sys.exit(main())
