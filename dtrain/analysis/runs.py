"""The one run loader: a run directory (`dtrain.common.rundir`) read back once, for the report, the comparison, the
simulator and the network replay, with the one warm-up rule and the one typical-step rule they all use.

Warm-up (`warmup_steps`): the first max(3, 10 %) steps are not steady (allocation, the first re-plan of the bucket
layout, caches warming), and steps with non-finite gradients (update skipped) are left out too; every tool's
`--warmup` overrides the count. The typical step (`typical_step`): the steady step nearest the run's medians in every
phase, not the step of median time alone, which can be an outlier in its parts (another rank late to launch, so
that nothing overlapped backward).
Also here: finding the runs of a sweep, whether a run finished (the sweep's resume test), and the ranks' bucket
records of one step put on one clock.
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import pandas as pd

from dtrain.collectives import strategies
from dtrain.collectives.settings import bucket_cap_mb
from dtrain.common import rundir
from dtrain.common.errors import UserError
from dtrain.common.jsonl import read_jsonl
from dtrain.engine import config as config_mod

# Phase columns of steps.jsonl in the order a step runs them (ms); what is left of step_ms is "other".
PHASES = ("data_ms", "forward_ms", "backward_ms", "comm_exposed_ms", "optimizer_ms")
TYPICAL_PHASES = ("forward_ms", "backward_ms", "comm_exposed_ms", "step_ms")


@dataclass
class Run:
    """Everything one run directory holds, loaded once. Records are the JSON objects as written (`dtrain.common.rundir`)."""

    path: Path
    header: dict  # run.json
    config: dict  # config.yaml as written (the resolved profile); `cfg` is it loaded and checked
    launch: dict  # launch.json, when the sweep launched it
    steps: list[dict]  # step records, in order
    buckets: dict[int, list[dict]]  # rank 0's bucket records by step, in bucket order
    evals: list[dict] = field(default_factory=list)
    # the other ranks' bucket records by rank and step (`train.record_ranks`), each on its own rank's clock
    rank_buckets: dict[int, dict[int, list[dict]]] = field(default_factory=dict)
    label: str = ""

    def __post_init__(self):
        self.label = self.label or self.path.name

    # -- what it was ----------------------------------------------------------------------------------------------

    @cached_property
    def cfg(self):
        """The resolved profile as a `RunConfig` (a one-line error if config.yaml is missing or invalid)."""
        if not (self.path / rundir.CONFIG).is_file():
            raise UserError(f"{self.path}: not a run directory (no {rundir.CONFIG})")
        return config_mod.load_recorded(self.path / rundir.CONFIG)

    @property
    def sync(self) -> dict:
        """The sync strategy's facts from run.json (strategy, lossless, communicates, bucket sizes ...)."""
        return self.header.get("sync") or {}

    @property
    def strategy(self) -> str:
        return self.sync.get("strategy") or self.config.get("sync", {}).get("strategy") or "?"

    @property
    def world(self) -> int:
        return int(self.header.get("world_size") or 1)

    @property
    def ranks_per_node(self) -> int | None:
        """The ranks of each node the job ran on: run.json's (torchrun's LOCAL_WORLD_SIZE), else its hierarchical
        plan's; None where neither was recorded (runs before run.json had it, without the plan)."""
        layout = self.sync.get("hierarchical")
        recorded = self.header.get("ranks_per_node") or (layout.get("ranks_per_node") if isinstance(layout, dict)
                                                          else None)
        return int(recorded) if recorded else None

    @property
    def vocab(self) -> int:
        return int(self.header.get("vocab") or self.cfg.data.vocab_size)

    @property
    def communicates(self) -> bool:
        """False only for the no-communication baseline: headroom in timing figures, never a quality result."""
        return self.sync.get("communicates", True) is not False

    @property
    def bucket_cap_mb(self) -> float | None:
        """The cap that shaped the buckets, or None for strategies that have no cap."""
        if self.strategy not in strategies.available() or not strategies.get(self.strategy).uses_cap:
            return None
        cap = self.config.get("sync", {}).get("bucket_cap_mb")
        return float(bucket_cap_mb(cap))  # null: DDP's default, planned ones too

    @property
    def series(self) -> str:
        """What a figure's legend calls this configuration: the strategy, and the sweep's variant if any."""
        variant = self.launch.get("variant")
        return f"{self.strategy} {variant}" if variant else self.strategy

    @property
    def on_cpu(self) -> bool:
        """It computed on the CPU (run.json's device; a run without one is taken as a CPU run)."""
        return str(self.header.get("device", "cpu")).startswith("cpu")

    @property
    def machine(self) -> str:
        """Where it ran, from run.json (and the sweep's launch record for the emulated testbed)."""
        h = self.header
        if not h:
            return "unknown machine (no run.json)"
        v = h.get("versions", {})
        where = f"{h.get('host', '?')} ({h.get('cpu', '?')}, {h.get('cpus', '?')} CPUs"
        where += f", {v['gpu']})" if v.get("gpu") else ")"
        ranks = f"{h.get('world_size', '?')} ranks, {h.get('backend', '?')}"
        if self.launch.get("launcher") == "testbed":
            ranks += f" over {self.launch.get('nodes', '?')} emulated nodes"
            if self.launch.get("link"):
                ranks += f" ({self.launch['link']} links)"
        else:
            ranks += " on one host"
        soft = f"torch {v.get('torch', '?')}" + (f", NCCL {v['nccl']}" if v.get("nccl") else "")
        return f"{where}, {ranks}, {soft}"

    # -- what it measured -----------------------------------------------------------------------------------------

    def steady(self, warmup: int | None = None) -> list[dict]:
        """The step records after warm-up (`steady_records`); [] for a run too short."""
        return steady_records(self.steps, warmup)

    def steady_steps(self, warmup: int | None = None) -> list[dict]:
        """`steady`, or a one-line error when no step is left."""
        kept = self.steady(warmup)
        if not kept:
            raise UserError(f"{self.path}: no steps left after skipping {warmup_steps(len(self.steps), warmup)} "
                            f"warm-up steps (it has {len(self.steps)})")
        return kept

    def steady_frame(self, warmup: int | None = None) -> pd.DataFrame:
        """`steady` as a frame, one row a step (no rows, but the columns, for a run too short)."""
        steady = self.steady(warmup)
        return pd.DataFrame(steady) if steady else self.step_frame.iloc[0:0]

    @cached_property
    def step_frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.steps)

    @cached_property
    def bucket_frame(self) -> pd.DataFrame:
        """Rank 0's bucket records of every step."""
        return pd.DataFrame([r for step in sorted(self.buckets) for r in self.buckets[step]])

    @property
    def bleu(self) -> dict | None:
        """The last BLEU record (the score of the final, possibly averaged, model)."""
        scores = [e for e in self.evals if e.get("kind") == "bleu"]
        return {k: v for k, v in scores[-1].items() if v is not None} if scores else None

    @property
    def val(self) -> pd.DataFrame:
        """Validation records: step, val_nll."""
        rows = [{"step": e.get("step"), "val_nll": e.get("val_nll")} for e in self.evals if e.get("kind") == "val"]
        return pd.DataFrame(rows, columns=["step", "val_nll"])


def warmup_steps(n: int, warmup: int | None = None) -> int:
    """How many of a run's `n` steps are warm-up: `warmup` when given, else max(3, n // 10)."""
    return warmup if warmup is not None else max(3, n // 10)


def steady_records(steps: list[dict], warmup: int | None = None) -> list[dict]:
    """Step records after warm-up (`warmup_steps`), skipped updates left out."""
    return [s for s in steps[warmup_steps(len(steps), warmup):] if not s.get("skipped")]


def steady_text(warmup: int | None = None) -> str:
    """What `Run.steady` leaves out, in words, for captions."""
    first = f"the first {warmup}" if warmup is not None else "the first max(3, 10%)"
    return f"{first} and any with non-finite gradients left out"


# ---------------------------------------------------------------------------------------------------------------
# Loading


def load_run(path: str | Path, strict: bool = True) -> Run:
    """The run at `path`. `strict` (a run to model or replay): config.yaml and step records must be there, run.json
    a JSON object, and the fields computed with numbers (`dtrain.common.rundir`), else a one-line error naming the file
    and record. Otherwise (a report over a sweep, some of whose runs failed early): what is there, {} or [] for the
    rest."""
    p = Path(path)
    if strict:
        for f in (rundir.CONFIG, rundir.STEPS):
            if not (p / f).is_file():
                raise UserError(f"{p}: not a run directory (no {f})")
    header = rundir.read_json(p / rundir.HEADER, strict)
    steps = rundir.read_steps(p)
    if strict:
        if not steps:
            raise UserError(f"{p}/{rundir.STEPS}: no step records")
        rundir.check_numbers(steps, p / rundir.STEPS, rundir.STEP_NUMBERS, rundir.STEP_OPTIONAL_NUMBERS)
    world = header.get("world_size") or 1
    if not isinstance(world, int) or world < 1:
        if strict:
            raise UserError(f"{p}/{rundir.HEADER}: world_size must be a positive integer, not {world!r}")
        world = 1
    others = {rank: _by_step(p, rank, strict) for rank in range(1, world)
              if (p / rundir.rank_buckets_file(rank)).is_file()}
    run = Run(p, header, rundir.read_config(p), rundir.read_json(p / rundir.LAUNCH), steps, _by_step(p, 0, strict),
              rundir.read_evals(p), others)
    if strict:
        _ = run.cfg  # loaded now, so that a bad config.yaml is an error here, not halfway through
    return run


def _by_step(run_dir: Path, rank: int, strict: bool) -> dict[int, list[dict]]:
    """A rank's bucket records by step, each step's in bucket order."""
    rows = rundir.read_buckets(run_dir, rank)
    path = run_dir / (rundir.BUCKETS if rank == 0 else rundir.rank_buckets_file(rank))
    rundir.check_numbers(rows, path, rundir.BUCKET_NUMBERS, rundir.BUCKET_TIMES if strict else ())
    out: dict[int, list[dict]] = {}
    for r in rows:
        out.setdefault(int(r["step"]), []).append(r)
    return {k: sorted(v, key=lambda r: r["bucket"]) for k, v in out.items()}


def is_run_dir(path: Path) -> bool:
    """A run's folder: records, or at least the sweep's note of a launch (a run that failed before its first step)."""
    return any((path / f).is_file() for f in (rundir.STEPS, rundir.HEADER, rundir.LAUNCH))


def find_runs(paths: list[str | Path]) -> list[Path]:
    """Run directories among `paths`: each is a run, or a folder (a sweep's) whose sub-folders are runs."""
    found = []
    for p in map(Path, paths):
        if is_run_dir(p):
            found.append(p)
        elif p.is_dir():
            found += sorted((c for c in p.iterdir() if c.is_dir() and is_run_dir(c)), key=natural_key)
    return list(dict.fromkeys(found))


def natural_key(path: Path) -> list:
    """Numbers in a name compare as numbers: bucket_cap_mb=2 before bucket_cap_mb=32 before ...=128."""
    return [float(part) if i % 2 else part for i, part in enumerate(re.split(r"(\d+(?:\.\d+)?)", path.name))]


def load_runs(paths: list[str | Path]) -> list[Run]:
    """Every run among `paths` (`find_runs`), loaded as they are (not strict)."""
    return [load_run(p, strict=False) for p in find_runs(paths)]


def finished(path: str | Path) -> bool:
    """Whether a run's records say it ended normally (the sweep skips those).

    The trainer validates once more after its last step and, when `eval.at_end` holds and the strategy
    communicates, writes a BLEU record after that: so a finished run has a val record at its last step, that step is
    `train.max_steps` unless a wall-clock budget stopped it, and the BLEU record is there when one was due.
    """
    p = Path(path)
    steps, evals, cfg = read_jsonl(p / rundir.STEPS), rundir.read_evals(p), rundir.read_config(p)
    if not steps or not isinstance(cfg, dict) or not isinstance(steps[-1].get("step"), int):
        return False  # a damaged run directory is not finished: the sweep runs it again
    last = steps[-1]["step"]
    train = cfg.get("train") if isinstance(cfg.get("train"), dict) else {}
    if train.get("max_minutes") is None and last < train.get("max_steps", 0):
        return False
    if not any(e.get("kind") == "val" and e.get("step") == last for e in evals):
        return False
    communicates = (rundir.read_json(p / rundir.HEADER).get("sync") or {}).get("communicates", True) is not False
    if cfg.get("eval", {}).get("at_end", True) and communicates:
        return any(e.get("kind") == "bleu" for e in evals)
    return True


# ---------------------------------------------------------------------------------------------------------------
# One step across ranks, and the typical step


def slowest_rank_records(run: Run, step: int) -> tuple[list[dict], float | None]:
    """Rank 0's bucket records of `step` (those of its backward), with each bucket's ready and launch times the latest over the ranks whose
    records the run has (`train.record_ranks`): a collective cannot start before every rank has launched it; and
    when the last rank's backward started and ended (`last_backward_start_ms`, `last_wait_start_ms`). Each
    rank's clock starts at its own backward; it is put on rank 0's by the median, over buckets, of the difference
    in completion times (an all-reduce completes on every rank at about the same moment). Also returns the largest
    delay another rank added to a bucket's launch (ms), None where no other rank's records cover the step."""
    def in_backward(recs):  # a sharded run's all-gathers ran in the forward, before the backward's clock starts
        return [r for r in recs if r.get("part") != "all_gather"]

    own = in_backward(run.buckets.get(step, []))
    others = [in_backward(recs[step]) for recs in run.rank_buckets.values()
              if own and len(in_backward(recs.get(step, []))) == len(own)]
    if not own or not others or any(r.get("complete_ms") is None or r.get("launch_ms") is None
                                    for recs in (own, *others) for r in recs):
        return own, None
    out = [dict(r) for r in own]
    delay = 0.0
    for recs in others:
        offset = statistics.median(a["complete_ms"] - b["complete_ms"] for a, b in zip(own, recs))
        for rec, theirs in zip(out, recs):
            # when the last rank's backward started: its clock's 0 on rank 0's
            rec["last_backward_start_ms"] = max(rec.get("last_backward_start_ms", 0.0), offset)
            if theirs.get("wait_start_ms") is not None and rec.get("wait_start_ms") is not None:
                # when the last rank's backward ended (ranks sharing cores drift apart by whole phases)
                rec["last_wait_start_ms"] = max(rec.get("last_wait_start_ms", rec["wait_start_ms"]),
                                                theirs["wait_start_ms"] + offset)
            for key in ("ready_ms", "launch_ms"):
                if theirs.get(key) is not None and rec.get(key) is not None:
                    later = theirs[key] + offset
                    if key == "launch_ms":
                        delay = max(delay, later - rec[key])
                    rec[key] = max(rec[key], later)
    return out, delay


def typical_step(run: Run, pool: list[dict]) -> dict:
    """The step of `pool` nearest the run's medians in every part: the least sum of |ln(x / median)| over
    TYPICAL_PHASES, plus ln(1 + d / median backward) for d, how late another rank launched a bucket (where the
    ranks' records say). The step of median step time alone can be an outlier in its parts: another rank launching
    late leaves nothing overlapping backward, which says little about the run's usual step."""
    med = {k: statistics.median(s.get(k) or 0.0 for s in pool) for k in TYPICAL_PHASES}

    def distance(s):
        d = sum(abs(math.log(max(s.get(k) or 0.0, 1e-3) / max(med[k], 1e-3))) for k in TYPICAL_PHASES)
        _, delay = slowest_rank_records(run, s["step"])
        return d + (math.log1p(max(0.0, delay) / max(med["backward_ms"], 1e-3)) if delay is not None else 0.0)

    return min(pool, key=distance)
