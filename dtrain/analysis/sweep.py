"""Configuration sweeps: a matrix of profiles × strategies × knobs (× named variants), one training run per cell.

Sits before the report: each run trains under torchrun on loopback, or across the emulated cluster of
`dtrain.analysis.testbed`, into its own directory named from its settings. Re-running the same command skips the runs whose
records say they finished, resumes interrupted ones from their last checkpoint, and retries failed ones; a failed run
is recorded (exit code, last error line) in its `launch.json` and in `sweep.jsonl`, and the sweep goes on.

    python -m dtrain.analysis.sweep --matrix dtrain/profiles/sweeps/lossless-buckets.yaml            # runs/sweep-lossless-buckets
    python -m dtrain.analysis.sweep --matrix dtrain/profiles/sweeps/bleu-cost.yaml --dry-run        # the runs and commands only
    python -m dtrain.analysis.sweep --matrix m.yaml --out runs/m/round2 --shuffle 2         # a repeat, in another order
    python -m dtrain.analysis.report runs/sweep-lossless-buckets --out reports/lossless-buckets

A matrix (YAML; only `profiles` is required):

    name: lossless-buckets          # default: the file's stem; the output folder is runs/sweep-<name>
    launcher: torchrun              # or testbed (`python -m dtrain.analysis.testbed up` first; then `nodes: N`)
    nproc: 2                        # ranks per node
    profiles: [dtrain/profiles/multi30k-cpu.yaml]
    strategies: [ddp, bucketed]     # default: each profile's own
    knobs:                          # profile keys (dotted) → values; every combination is a run
      sync.bucket_cap_mb: [1, 5, 25, 100]
    only:                           # a knob that matters to some strategies only: the others run once without it
                                    # (a knob its strategy does not read is refused when the run loads)
      sync.bucket_cap_mb: [ddp, bucketed, per_class]
    variants:                       # named override sets, crossed with the rest (a variant may set sync.strategy)
      accum2: {train.accum_steps: 2}
    set: {train.max_minutes: 10}    # overrides for every run
    bench: "-b 8 -e 64M -f 4"       # also run dtrain.collectives.bench once under the same launcher → <out>/bench.json
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path

from dtrain.analysis.runs import finished
from dtrain.analysis.testbed.net import Names, status
from dtrain.collectives.strategies import available
from dtrain.common import rundir
from dtrain.common.errors import UserError, exit_on_user_error, unknown
from dtrain.common.files import output_dir
from dtrain.common.paths import resolve_profile
from dtrain.common.progress import Bar
from dtrain.common.schema import Source, build, read_yaml
from dtrain.engine import checkpoint
from dtrain.engine import config as config_mod
from dtrain.engine.config import RunConfig

PROG = "dtrain.analysis.sweep"
LAUNCHERS = ("torchrun", "testbed")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")  # a matrix or variant name: it goes into directory names


# ---------------------------------------------------------------------------------------------------------------
# The matrix


@dataclass(frozen=True)
class MatrixFile:
    """What a matrix file may hold, as written (the module docstring shows one); `load_matrix` checks the values
    and resolves it into a `Matrix`. Knob and override values are whatever the profile key takes."""

    name: str | None = None  # default: the file's stem
    launcher: str = "torchrun"
    nodes: int | None = None  # default: 2 under the testbed, 1 under torchrun
    nproc: int = 2
    profiles: list[str] | str | None = None  # required (checked after loading, so that its absence is named)
    strategies: list[str] | str | None = None
    knobs: dict[str, typing.Any] | None = None  # each a non-empty list of values (checked with its key)
    only: dict[str, list[str]] | None = None
    variants: dict[str, dict[str, typing.Any]] | None = None
    set: dict[str, typing.Any] | None = None
    bench: str | None = None
    testbed: str = "dtb"


@dataclass
class Matrix:
    name: str
    profiles: list[str]
    strategies: list[str | None] = field(default_factory=lambda: [None])  # None: the profile's own
    knobs: dict[str, list] = field(default_factory=dict)
    only: dict[str, list[str]] = field(default_factory=dict)
    variants: dict[str, dict] = field(default_factory=dict)
    set: dict = field(default_factory=dict)
    launcher: str = "torchrun"
    nodes: int = 1
    nproc: int = 2
    bench: str | None = None
    testbed: str = "dtb"  # the testbed's name (namespace prefix)
    source: str = ""


def check_key(key: str) -> str | None:
    """Why a dotted profile key does not exist in `RunConfig` (None if it does). Below a mapping (`sync.classes`)
    any name is a key; the profile's own validation judges it when the run loads."""
    cls, parts, i = RunConfig, key.split("."), 0
    while i < len(parts):
        part, last = parts[i], i == len(parts) - 1
        names = {f.name for f in dataclasses.fields(cls)}
        if part not in names:
            return unknown("key", part, names, "".join(p + "." for p in parts[:i]))
        tp = typing.get_type_hints(cls)[part]
        maps = [a for a in (typing.get_args(tp) or (tp,)) if typing.get_origin(a) is dict or a is dict]
        if maps and not last and tp not in maps:  # a value or a free-form mapping (`sync.hook`): its keys are free
            return None
        if typing.get_origin(tp) is dict or tp is dict:
            value = (typing.get_args(tp) or (None, None))[1]
            if not dataclasses.is_dataclass(value) or len(parts) <= i + 2:
                return None  # a free-form mapping, or a whole entry of a typed one
            cls, i = value, i + 2  # dict[str, ClassSettings]: skip the entry's name, check the field below it
            continue
        nested = [a for a in (typing.get_args(tp) or (tp,)) if dataclasses.is_dataclass(a)]
        if nested and last:
            return f"'{key}' is a section; name one of its keys"
        if not nested and not last:
            return f"'{'.'.join(parts[: i + 1])}' is a value, not a section"
        cls, i = (nested[0] if nested else cls), i + 1
    return None


def load_matrix(path: str | Path) -> Matrix:
    """Read and check a matrix; every problem is a one-line `UserError` naming the file, the line and the key."""
    path = Path(path)
    raw, lines = read_yaml(path, "matrix")
    src = Source(str(path), lines)
    f = build(MatrixFile, raw, "", src)

    def bad(key: str, msg: str):
        raise UserError(f"{src.where(key)}: '{key}' {msg}")

    def names(key: str, value: list[str] | str | None) -> list[str] | None:
        v = [value] if isinstance(value, str) else value
        if v is not None and (not v or not all(v)):
            bad(key, f"must be a non-empty list of names, got {value!r}")
        return v

    profiles = names("profiles", f.profiles)
    if profiles is None:
        bad("profiles", "is required: a list of profile files")
    for p in profiles:
        try:
            resolve_profile(p)
        except UserError:
            bad("profiles", f"names '{p}', which is neither a file nor a shipped profile")
    strategies = names("strategies", f.strategies)
    for s in strategies or []:
        if s not in available():
            bad("strategies", f"names unknown strategy '{s}' (available: {', '.join(available())})")
    _check_overrides(f, strategies, bad)
    if f.launcher not in LAUNCHERS:
        bad("launcher", f"must be one of {', '.join(LAUNCHERS)}, got {f.launcher!r}")
    nodes = f.nodes if f.nodes is not None else 2 if f.launcher == "testbed" else 1
    for key, v in (("nodes", nodes), ("nproc", f.nproc)):
        if v < 1:
            bad(key, f"must be a positive integer, got {v!r}")
    if f.launcher == "torchrun" and nodes != 1:
        bad("nodes", "needs 'launcher: testbed' (torchrun here runs one node)")
    name = f.name if f.name is not None else path.stem
    if not _NAME.fullmatch(name):
        bad("name", f"must be letters, digits and _ . + -, got {name!r}")
    return Matrix(name=name, profiles=profiles, strategies=strategies or [None], knobs=f.knobs or {},
                  only=f.only or {}, variants=f.variants or {}, set=f.set or {}, launcher=f.launcher, nodes=nodes,
                  nproc=f.nproc, bench=f.bench, testbed=f.testbed, source=str(path))


def _check_overrides(f: MatrixFile, strategies: list[str] | None, bad) -> None:
    """The profile keys of `knobs`, `variants` and `set` exist, and the strategy is set in one place only."""
    knobs, only, variants, sets = f.knobs or {}, f.only or {}, f.variants or {}, f.set or {}

    def profile_key(where: str, key: str) -> None:
        problem = check_key(key)
        if problem:
            bad(where, problem)

    for k, values in knobs.items():
        profile_key(f"knobs.{k}", k)
        if k == "sync.strategy":
            bad(f"knobs.{k}", "belongs in 'strategies'")
        if not isinstance(values, list) or not values:
            bad(f"knobs.{k}", f"must be a non-empty list of values, got {values!r}")
    for k in only:
        if k not in knobs:
            bad(f"only.{k}", "names a knob that 'knobs' does not have")
    for name, overrides in variants.items():
        if not _NAME.fullmatch(name):
            bad(f"variants.{name}", "must be named with letters, digits and _ . + - (it goes into directory names)")
        for k in overrides:
            profile_key(f"variants.{name}.{k}", k)
        if "sync.strategy" in overrides and strategies:
            bad(f"variants.{name}.sync.strategy", "conflicts with 'strategies': set the strategy in one place")
    for k in sets:
        profile_key(f"set.{k}", k)
    if "sync.strategy" in sets and (strategies or any("sync.strategy" in v for v in variants.values())):
        bad("set.sync.strategy", "conflicts with 'strategies' or a variant's: set the strategy in one place")


# ---------------------------------------------------------------------------------------------------------------
# Runs of a matrix


def yaml_value(v) -> str:
    """A value as `--set` parses it back (YAML): JSON for everything but plain strings."""
    return v if isinstance(v, str) else json.dumps(v)


def _slug(v) -> str:
    text = f"{v:g}" if isinstance(v, float) else "null" if v is None else str(v).lower() if isinstance(v, bool) \
        else str(v)
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", text)


def short_keys(keys: list[str]) -> dict[str, str]:
    """The shortest dotted suffix of each knob key that tells it apart from the others, for directory names."""
    out = {}
    for k in keys:
        parts = k.split(".")
        for n in range(1, len(parts) + 1):
            tail = ".".join(parts[-n:])
            if sum(1 for o in keys if o == tail or o.endswith("." + tail)) == 1:
                out[k] = tail
                break
    return out


@dataclass
class Job:
    """One run: where it goes and the overrides that make it."""

    name: str
    profile: str
    strategy: str | None
    variant: str | None
    knobs: dict
    overrides: list[str]

    def describe(self) -> dict:
        return {"name": self.name, "profile": self.profile, "strategy": self.strategy, "variant": self.variant,
                "knobs": self.knobs, "overrides": self.overrides}


def profile_strategy(profile: str) -> str | None:
    """The strategy a profile picks by itself (for `only`); None if it does not load (its run will say why)."""
    try:
        return config_mod.load(profile).sync.strategy
    except UserError:
        return None


def expand(m: Matrix) -> list[Job]:
    """Every cell of the matrix, in a stable order (profile, strategy, variant, knobs)."""
    short = short_keys(list(m.knobs))
    variants = list(m.variants.items()) or [(None, {})]
    jobs, seen = [], {}
    for profile, strategy, (variant, vsets) in itertools.product(m.profiles, m.strategies, variants):
        strat = strategy or vsets.get("sync.strategy") or m.set.get("sync.strategy") or profile_strategy(profile)
        applies = [k for k in m.knobs if k not in m.only or (strat in m.only[k])]
        for values in itertools.product(*(m.knobs[k] for k in applies)):
            knobs = dict(zip(applies, values))
            parts = [Path(profile).stem] + ([strategy] if strategy else []) + ([variant] if variant else [])
            parts += [f"{short[k]}={_slug(v)}" for k, v in knobs.items()]
            name = "-".join(parts)
            overrides = [f"{k}={yaml_value(v)}" for k, v in m.set.items()]
            overrides += [f"{k}={yaml_value(v)}" for k, v in vsets.items()]
            overrides += [f"sync.strategy={strategy}"] if strategy else []
            overrides += [f"{k}={yaml_value(v)}" for k, v in knobs.items()]
            if name in seen:
                raise UserError(f"{m.source}: two runs would share the directory '{name}' (a profile stem repeated?)")
            seen[name] = True
            jobs.append(Job(name, profile, strat, variant, knobs, overrides))
    return jobs


def launcher_prefix(m: Matrix) -> list[str]:
    """The command that starts a module on every rank: torchrun on this host, or one agent per testbed node."""
    if m.launcher == "testbed":
        return [sys.executable, "-m", "dtrain.analysis.testbed", "--name", m.testbed, "run", "--nodes", str(m.nodes),
                "--nproc-per-node", str(m.nproc), "--"]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={m.nproc}"]


def train_command(m: Matrix, job: Job, run_dir: Path, resume: bool) -> list[str]:
    cmd = launcher_prefix(m) + ["-m", "dtrain.engine.train", "--profile", job.profile, "--run-dir", str(run_dir)]
    cmd += ["--resume"] if resume else []
    for o in job.overrides:
        cmd += ["--set", o]
    return cmd


# ---------------------------------------------------------------------------------------------------------------
# Running


def last_error_line(text: str) -> str:
    """The line that says why a run failed: dtrain's one-line `prog: error: ...` if there is one, else the last
    line with words in it (torchrun's and tqdm's decorations and progress redraws left out)."""
    lines = [ln.strip() for ln in re.split(r"[\r\n]+", text) if ln.strip()]
    for ln in reversed(lines):
        if re.search(r"(^|\s)[\w.]+: error: ", ln):
            return ln[:300]
    for ln in reversed(lines):
        if re.search(r"[A-Za-z]{3}", ln) and not re.fullmatch(r"[-=*#\s]+.*[-=*#]+", ln):
            return ln[:300]
    return ""


def _checkpointed(run_dir: Path) -> bool:
    return checkpoint.latest(run_dir) is not None


def testbed_link(m: Matrix) -> str | None:
    """The shaping of node 0's link as the testbed reports it (recorded with each run, for the report)."""
    try:
        rows = status(Names(m.testbed))
        return rows[0]["egress"] if rows else None
    except Exception:  # not root, testbed down: the run itself will say so
        return None


@dataclass
class Outcome:
    job: str
    status: str  # "skipped" (finished before), "finished", "failed"
    exit_code: int | None = None
    error: str = ""
    seconds: float = 0.0


def next_attempt(run_dir: Path) -> str:
    """"skip" a run whose records say it finished, "resume" an interrupted one from its last complete checkpoint,
    start a "fresh" one otherwise (a run that failed before its first checkpoint starts again)."""
    if finished(run_dir):
        return "skip"
    if (run_dir / rundir.STEPS).exists() and _checkpointed(run_dir):
        return "resume"
    return "fresh"


def run_job(m: Matrix, job: Job, out: Path, env: dict) -> Outcome:
    run_dir = out / job.name
    attempt = next_attempt(run_dir)
    if attempt == "skip":
        return Outcome(job.name, "skipped", 0)
    resume = attempt == "resume"
    if run_dir.exists() and not resume:
        shutil.rmtree(run_dir)  # its failure is in sweep.jsonl and logs/; the trainer wants a clean directory
    run_dir.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    cmd = train_command(m, job, run_dir, resume)
    record = {**job.describe(), "launcher": m.launcher, "nodes": m.nodes, "nproc": m.nproc, "resumed": resume,
              "command": cmd, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if m.launcher == "testbed":
        record["link"] = testbed_link(m)
    (run_dir / rundir.LAUNCH).write_text(json.dumps(record, indent=2) + "\n")
    t0 = time.perf_counter()
    with open(logs / f"{job.name}.out", "a") as fo, open(logs / f"{job.name}.err", "a") as fe:
        mark = fe.tell()  # a retried run appends; its error is in what this attempt wrote
        code = subprocess.run(cmd, stdout=fo, stderr=fe, env=env).returncode
    seconds = round(time.perf_counter() - t0, 1)
    with open(logs / f"{job.name}.err", errors="replace") as fe:
        fe.seek(mark)
        err_text = fe.read()
    done = code == 0 and finished(run_dir)
    error = "" if done else (last_error_line(err_text) if code != 0 else
                             "exited 0 but its records do not show a finished run")
    record.update(exit_code=code, error=error, seconds=seconds, finished=done)
    (run_dir / rundir.LAUNCH).write_text(json.dumps(record, indent=2) + "\n")
    with open(out / "sweep.jsonl", "a") as f:
        f.write(json.dumps({k: record[k] for k in ("name", "exit_code", "error", "seconds", "finished", "resumed",
                                                   "started")}) + "\n")
    return Outcome(job.name, "finished" if done else "failed", code, error, seconds)


def run_bench(m: Matrix, out: Path, env: dict) -> Outcome:
    """The all-reduce benchmark under the sweep's launcher, once: <out>/bench.json for the report."""
    target = out / "bench.json"
    if target.is_file():
        return Outcome("bench", "skipped", 0)
    tmp = out / ".bench.json.tmp"
    cmd = launcher_prefix(m) + ["-m", "dtrain.collectives.bench", *m.bench.split(), "--json", str(tmp)]
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    t0 = time.perf_counter()
    with open(logs / "bench.out", "w") as fo, open(logs / "bench.err", "w") as fe:
        code = subprocess.run(cmd, stdout=fo, stderr=fe, env=env).returncode
    seconds = round(time.perf_counter() - t0, 1)
    if code == 0 and tmp.is_file():
        tmp.replace(target)
        return Outcome("bench", "finished", 0, seconds=seconds)
    return Outcome("bench", "failed", code, last_error_line((logs / "bench.err").read_text(errors="replace")), seconds)


def sweep(m: Matrix, out: Path, jobs: list[Job]) -> list[Outcome]:
    output_dir(out, "--out")
    # torchrun gives each rank one thread when several share a node; a sweep's single-rank runs get the same, so
    # runs of different shapes are measured alike.
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1"}
    outcomes = []
    total = len(jobs) + (1 if m.bench else 0)
    bar = Bar(total, f"sweep {m.name}", "run", dynamic_ncols=True)
    counts = {"skipped": 0, "finished": 0, "failed": 0}
    steps = ([("bench", None)] if m.bench else []) + [("train", j) for j in jobs]
    for kind, job in steps:
        bar.set_postfix_str(job.name if job else "bench")
        o = run_bench(m, out, env) if kind == "bench" else run_job(m, job, out, env)
        outcomes.append(o)
        counts[o.status] += 1
        if o.status == "failed":
            bar.write(f"{o.job}: FAILED (exit {o.exit_code}) after {o.seconds:g} s: {o.error}")
        elif o.status == "finished":
            bar.write(f"{o.job}: finished in {o.seconds:g} s")
        bar.set_postfix(done=counts["finished"], skipped=counts["skipped"], failed=counts["failed"])
        bar.update(1)  # after the counts: a plain line shows them
    bar.close()
    return outcomes


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog=PROG, description="Run a matrix of profiles x strategies x knobs, resumably.")
    ap.add_argument("--matrix", required=True, help="the matrix YAML (see the module docstring)")
    ap.add_argument("--out", help="folder of the runs (default runs/sweep-<matrix name>); re-running resumes it")
    ap.add_argument("--dry-run", action="store_true", help="list the runs and their commands, run nothing")
    ap.add_argument("--shuffle", type=int, metavar="SEED",
                    help="run in an order shuffled with this seed, so that a drift in the machine's speed does not "
                         "follow the matrix order (use a different seed for each round of a repeated sweep)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    with exit_on_user_error(PROG):
        m = load_matrix(args.matrix)
        jobs = expand(m)
        if args.shuffle is not None:
            random.Random(args.shuffle).shuffle(jobs)
        out = Path(args.out or f"runs/sweep-{m.name}")
        if args.dry_run:
            for job in jobs:
                state = {"skip": "finished", "resume": "to resume", "fresh": "to run"}[next_attempt(out / job.name)]
                try:
                    config_mod.load(job.profile, job.overrides)
                except UserError as e:  # the run would stop at start-up with this message
                    state += f"; its profile will be refused: {e}"
                print(f"{job.name}  [{state}]\n    {' '.join(train_command(m, job, out / job.name, False))}")
            print(f"{len(jobs)} run(s) into {out}" + (" and the benchmark" if m.bench else ""))
            return 0
        outcomes = sweep(m, out, jobs)
    failed = [o for o in outcomes if o.status == "failed"]
    done = sum(o.status != "failed" for o in outcomes)
    print(f"{PROG}: {done} of {len(outcomes)} finished ({sum(o.status == 'skipped' for o in outcomes)} "
          f"skipped as already finished), {len(failed)} failed; runs in {out}, log {out / 'sweep.jsonl'}")
    for o in failed:
        print(f"  {o.job}: exit {o.exit_code}: {o.error}")
    if not failed:
        print(f"next: python -m dtrain.analysis.report {out} --out {out}/report")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
