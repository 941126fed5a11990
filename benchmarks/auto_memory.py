"""Peak memory of `auto` against a plain run of its pick, on 2 ranks, in one command.

    python benchmarks/auto_memory.py [--pairs 2] [--steps 200] [--glibc-tunables glibc.malloc.mmap_threshold=1048576]
    python benchmarks/auto_memory.py --engine [--pairs 2] [--steps 100] [--set data.max_tokens=1024]

By default runs `examples/gpt_lm.py` (made larger: d_model 256, 6 layers, 4.84M parameters) under torchrun on 2
local gloo ranks, alternately: `auto` through `attach` over its default space, then a plain run of the configuration
it picked (the candidate by name: the same sync keys, no search). Each run prints its largest rank's peak RSS
(getrusage ru_maxrss). With `--engine`: dtrain's trainer instead (`python -m dtrain.engine.train`, profile
`multi30k-cpu` in fp32, no evaluation), `sync.strategy: auto` against its pick from `tuned.json`, each run's peak
RSS from GNU time (`%M`: the largest process, a rank), and rank 0's heap after its last step (what the allocator
holds, and what of it is in use: steps.jsonl's `heap_mib`, `heap_used_mib`). Prints each pair's ratio, auto over the
plain run, and their median. The runs alternate so that the machine's drift falls on both alike. Give the runs more
steps than the search takes (its default budget is 72), so that the peak covers the winner's steps after it too.

glibc's malloc keeps freed heap memory and serves large blocks from it, so a process that frees and allocates
buffers of many sizes (the search, switching candidates) can peak higher than its live memory; `--glibc-tunables`
passes GLIBC_TUNABLES to the runs (e.g. a fixed mmap threshold, which hands large blocks back when freed), to
separate what the search holds from what the allocator keeps.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "gpt_lm.py"
PROFILE = str(Path(__file__).resolve().parents[1] / "dtrain" / "profiles" / "multi30k-cpu.yaml")


def environment(args) -> dict:
    """The runs' environment: one thread per rank, and GLIBC_TUNABLES if given."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if args.glibc_tunables:
        env["GLIBC_TUNABLES"] = args.glibc_tunables
    return env


def run(strategy: str, args) -> tuple[float, str]:
    """One 2-rank run: (its largest rank's peak RSS in MiB, what it printed)."""
    env = environment(args)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(EXAMPLE),
           "--strategy", strategy, "--steps", str(args.steps), "--d-model", "256", "--layers", "6"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"auto_memory: {' '.join(cmd[4:])} failed: {r.stderr.strip().splitlines()[-1:]}")
    peak = re.search(r"peak RSS (\d+) MiB", r.stdout)
    return float(peak.group(1)), r.stdout


def run_engine(sync: list[str], args, run_dir: Path) -> tuple[float, dict | None, str]:
    """One 2-rank run of dtrain's trainer with `sync` overrides: (its largest rank's peak RSS in MiB, the run's
    tuned.json or None, rank 0's heap after its last step: held and in use)."""
    env = environment(args)
    sets = ["train.amp=fp32", f"train.max_steps={args.steps}", "eval.at_end=false", "train.val_every=0",
            "train.average_last=1", *args.overrides, *sync]
    cmd = ["/usr/bin/time", "-f", "peak %M KB", sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node=2", "-m", "dtrain.engine.train", "--profile", PROFILE, "--run-dir", str(run_dir)]
    cmd += [a for s_ in sets for a in ("--set", s_)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    peak = re.findall(r"peak (\d+) KB", r.stderr)
    if r.returncode != 0 or not peak:
        sys.exit(f"auto_memory: {' '.join(cmd[4:])} failed: {r.stderr.strip().splitlines()[-1:]}")
    tuned = run_dir / "tuned.json"
    last = json.loads((run_dir / "steps.jsonl").read_text().splitlines()[-1])
    heap = (f"heap {last['heap_mib']:.0f} MiB, {last['heap_used_mib']:.0f} in use" if "heap_mib" in last
            else "heap not read (no glibc mallinfo2)")
    return int(peak[-1]) / 1024, (json.loads(tuned.read_text()) if tuned.exists() else None), heap


def engine_pairs(args) -> list[float]:
    ratios = []
    with tempfile.TemporaryDirectory(prefix="auto-memory-") as tmp:
        for i in range(args.pairs):
            searched, tuned, searched_heap = run_engine(["sync.strategy=auto"], args, Path(tmp) / f"auto{i}")
            if tuned is None:
                sys.exit("auto_memory: the auto run wrote no tuned.json")
            keys = [f"sync.{k}={json.dumps(v)}" for k, v in tuned["sync"].items()]
            plain, _, plain_heap = run_engine(keys, args, Path(tmp) / f"plain{i}")
            ratios.append(searched / plain)
            print(f"pair {i + 1}: auto {searched:.0f} MiB (picked {tuned['winner']} after {tuned['steps_spent']} "
                  f"steps; {searched_heap}), plain {tuned['winner']} {plain:.0f} MiB ({plain_heap}): "
                  f"{ratios[-1]:.3f}x", flush=True)
    return ratios


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default: 200; with --engine 100)")
    ap.add_argument("--glibc-tunables", help="GLIBC_TUNABLES for the runs")
    ap.add_argument("--engine", action="store_true", help="dtrain's trainer on multi30k-cpu, not the plain loop")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="with --engine: more overrides of the profile")
    args = ap.parse_args()
    if args.steps is None:
        args.steps = 100 if args.engine else 200
    if args.engine:
        ratios = engine_pairs(args)
        print(f"peak RSS of auto over its pick's plain run: median {statistics.median(ratios):.3f}x over "
              f"{args.pairs} pairs")
        return
    ratios = []
    for i in range(args.pairs):
        searched, out = run("auto", args)
        pick = re.search(r"auto picked (\S+) after (\d+)", out)
        if pick is None:
            sys.exit("auto_memory: the auto run printed no pick (no 'auto picked ...' line)")
        plain, _ = run(pick.group(1), args)
        ratios.append(searched / plain)
        print(f"pair {i + 1}: auto {searched:.0f} MiB (picked {pick.group(1)} after {pick.group(2)} steps), "
              f"plain {pick.group(1)} {plain:.0f} MiB: {ratios[-1]:.3f}x", flush=True)
    print(f"peak RSS of auto over its pick's plain run: median {statistics.median(ratios):.3f}x over {args.pairs} pairs")


if __name__ == "__main__":
    main()
