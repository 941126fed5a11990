"""Entry point: train the Transformer data-parallel under torchrun. `python -m dtrain.train` (`dtrain/train.py`) and
`dtrain train` run this same `main`.

    torchrun --nproc_per_node=2 -m dtrain.train --profile profiles/ll128.yaml
    torchrun --nproc_per_node=2 -m dtrain.train --profile smoke --run-dir runs/smoke
    torchrun --nproc_per_node=2 -m dtrain.train --profile multi30k-cpu --run-dir runs/m30k --resume
    python -m dtrain.train --profile base --set train.max_steps=10 --dry-run
    python -m dtrain.train --profile wmt14-en-de-base --dry-run --topology h100x8-ib:2      # + the plan
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        -m dtrain.train --profile base                   # a GPU cluster: NCCL, one process per GPU

A profile is a YAML file by its path, or one shipped in the package (dtrain/profiles/) by its name: `smoke`,
`profiles/ll128.yaml` (where the working directory has no such file), `dtrain/profiles/ll128.yaml`
(`dtrain.common.paths.resolve_profile`). The same command runs on GPUs and on CPUs: on gloo a profile's NCCL
settings (`collectives`, as in ll128.yaml) are recorded in run.json as requested, not applied, and the run says so.

Preemption: SIGTERM or SIGUSR1 reaching any rank (torchrun's agent forwards the SIGTERM it receives to every worker,
and the SIGUSR1 too when TORCHELASTIC_SIGNALS_TO_HANDLE names it, as scripts/slurm/train.sbatch sets) stops every
rank after the same step: the step in progress finishes, a checkpoint of it is written, and each rank exits with
status 75 (`dtrain.engine.trainer.PREEMPTED_EXIT`, EX_TEMPFAIL). `--resume` continues bit-identically, on the same number
of ranks or on another one (the data order is re-sharded; see `dtrain.engine.data.TokenBatcher`). A signal that comes after
the last step (during the final validation and evaluation) does not stop the job.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from dtrain.collectives import costmodel as cm
from dtrain.collectives import dist as ddist
from dtrain.collectives import nccl, strategies
from dtrain.common import host_memory
from dtrain.common.errors import UserError, exit_on_user_error
from dtrain.engine import autotune, runplan
from dtrain.engine import config as config_mod
from dtrain.engine.faults import parse as parse_fault
from dtrain.engine.log import prepare_run_dir
from dtrain.engine.trainer import PREEMPTED_EXIT, StopRequest, Trainer


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="dtrain.engine.train", description="Train the Transformer data-parallel.",
                                 epilog="Launch under torchrun for several ranks; see the module docstring.")
    ap.add_argument("--profile", required=True,
                    help="a YAML profile by its path, or a shipped one by its name: smoke, profiles/ll128.yaml")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a profile value by dotted key (repeatable), e.g. --set train.max_steps=100")
    ap.add_argument("--run-dir", help="where the run writes (default: runs/<name>-<time>)")
    ap.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint in --run-dir")
    ap.add_argument("--dry-run", action="store_true",
                    help="validate the profile, print the resolved config and the run's plan, exit")
    ap.add_argument("--topology", help="--dry-run: plan for this cluster shape, a dtrain.collectives.costmodel preset "
                                       "(h100x8 for 8 GPUs, h100x8-ib:2 for 2x8); MODELED")
    ap.add_argument("--fault", action="append", default=[], metavar="SPEC",
                    help="inject a fault (tests, demos): crash@step=S,rank=R | hang@step=S,rank=R | "
                         "nan@step=S,rank=R | slow@rank=R,ms=M")
    return ap.parse_args(argv)


def default_run_dir(name: str, restarted: bool) -> str:
    """runs/<name>-<time>; a restarted attempt (torchrun --max-restarts) takes the newest run of that name."""
    if restarted:
        previous = sorted(Path("runs").glob(f"{name}-*"), key=lambda p: p.stat().st_mtime)
        if previous:
            return str(previous[-1])
    return f"runs/{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def nccl_inactive(record: dict) -> str | None:
    """The line that says a profile's NCCL settings do nothing in this job (gloo), or None: none requested, or
    applied. `record`: what `nccl.apply_global` returns (run.json's `nccl`)."""
    if record["applied"]:
        return None
    requested = [record["requested"]["default"], *record["requested"]["classes"].values()]
    asked = sorted({f"{key} {value}" for spec in requested for key, value in spec.items() if value is not None})
    if not asked:
        return None
    return (f"dtrain.engine.train: NCCL settings inactive on backend {record['backend']}: {', '.join(asked)} "
            "recorded in run.json (nccl: requested, not applied)")


def main(argv=None) -> int:
    args = parse_args(argv)
    with exit_on_user_error("dtrain.engine.train"):
        cfg = config_mod.load(args.profile, args.overrides)
        faults = [parse_fault(spec) for spec in args.fault]
        if args.dry_run:
            topo = cm.topology(args.topology) if args.topology else None  # a bad preset: before any output
            # its error (auto picking fp32 under bf16 exchanges) before any output too; the choice is printed below
            _, amp = config_mod.resolve_amp(cfg, ddist.device_for(cfg.collectives), main=False)
            print(config_mod.dump(cfg), end="")
            print(nccl.groups_text(cfg.sync, cfg.collectives), end="")  # what each process group would get from NCCL
            print("\n".join(["# " + line for line in runplan.plan_lines(cfg, topo)]))
            print(f"# precision here: {amp['amp']} (train.amp {amp['amp_setting']}: {amp['amp_reason']})")
            if args.topology:
                print("# the MODELED step time (FLOP-estimated compute + this communication) and the whole run: "
                      + runplan.simulator_command(args.profile, args.overrides, args.topology))
            return 0
        if args.topology:
            raise UserError("--topology is read by --dry-run only (the plan); a training run uses the machine it is on")
        if args.resume and not args.run_dir:
            raise UserError("--resume needs --run-dir (the run to continue)")
        # From here on SIGTERM/SIGUSR1 end the job at the end of a step, with a checkpoint (a dry run changes nothing
        # of the process: it may run inside another program)
        stop = StopRequest().install()
        # Under `torchrun --max-restarts`, a restarted attempt continues from the latest complete checkpoint.
        restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
        resume = args.resume or restarted
        # Looked at before anything below can create it (NCCL's log directory lives inside the run directory).
        run_dir_existed = bool(args.run_dir) and Path(args.run_dir).is_dir()
        # The job's NCCL variables must exist before the first communicator does (no-op on gloo: recorded only).
        record = nccl.apply_global(cfg.sync, cfg.collectives,
                                   log_dir=Path(args.run_dir) / "nccl-logs" if args.run_dir else None)
        inactive = nccl_inactive(record)
        if inactive and ddist.env_rank()[0] == 0:
            print(inactive, file=sys.stderr, flush=True)
        device, backend = ddist.init(cfg.collectives)
        memory = ExitStack()  # freed host memory kept for the run where train.keep_host_memory asks (a CPU only)
        try:
            memory.enter_context(host_memory.kept_freed_memory(cfg.train.keep_host_memory, device.type))

            def name_and_check() -> str:  # rank 0 names the run directory and checks it; the others take its word
                run_dir = args.run_dir or default_run_dir(cfg.name, restarted)
                # Only a directory that does not exist is refused: an existing one without a checkpoint is what a
                # torchrun --max-restarts attempt finds after a crash before the first checkpoint, with the same
                # command line, and Trainer.resume starts it from step 0 on purpose.
                if args.resume and not run_dir_existed:
                    raise UserError(f"{run_dir}: nothing to resume there (no such directory); "
                                    "leave out --resume to start a new run")
                prepare_run_dir(Path(run_dir), resume)
                return run_dir

            run_dir = ddist.main_decides(name_and_check)
            if strategies.get(cfg.sync.strategy).searches:  # trained by the search's winner (on resume: the one recorded)
                summary = autotune.fit(cfg, Path(run_dir), device, backend, faults, stop, resume)
            else:
                trainer = Trainer(cfg, Path(run_dir), device, backend, faults, stop)
                if resume:
                    trainer.resume()
                summary = trainer.fit()
            if summary.get("preempted"):
                return PREEMPTED_EXIT
            if ddist.is_main():
                print("done: " + ", ".join(f"{k}={v}" for k, v in summary.items()) + f"; run directory {run_dir}",
                      flush=True)
        finally:
            trainer = None  # it holds the model and the strategy's handle, and through them the process groups
            ddist.cleanup()
            memory.close()  # glibc's defaults back, however the run ended
    return 0


if __name__ == "__main__":
    sys.exit(main())
