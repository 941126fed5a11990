"""`sync.strategy: auto`: the job picks its gradient-communication configuration by measuring candidates on its own
first training steps, then trains on with the winner.

1. **Candidates**: `sync.tune.candidates` (name -> `sync` keys), or DEFAULT_SPACE. Lossy ones (a bf16/fp16 wire,
   PowerSGD, a compressing hook) only with `sync.tune.lossy`.
2. **Pruning**: `dtrain.engine.tune_model` predicts each candidate's step (MODELED) from a short no-communication probe
   and a timing of the job's own process group; `top_k` go on, each family's best predicted first (a family: a
   strategy with or without the split, rows, bf16 exchanges; within FAMILY_SLACK of the best prediction, since a
   prediction can be 20-25% off), then the best predicted of the rest; the others are dropped unmeasured. bf16 exchanges are in the default space only
   where the profile trains under bf16 autocast, where they are exact; the hierarchical plan only where the job's
   nodes hold several ranks each, and it is measured without a prediction (the job times only the world's
   all-reduce).
3. **Measurement**: each remaining candidate is a replica of the job's trainer, built with the same seed, so all
   start from the same model and train on the same batches. Every round runs one training step of each, in an
   order shuffled per round and equal on every rank (the collectives must be issued in the same order), as
   `dtrain.analysis.interleave` does, so that the machine's drift hits all alike. After `warmup_rounds`, each
   candidate's step times are compared round by round with the leader's (the median of the paired differences and
   its order-statistics interval, `dtrain.common.stats.paired_median`); one slower than the leader at ~95% is dropped,
   and a lossy one whose loss is `loss_tolerance` above the best lossless one's. The search ends when one is left
   or the next round would pass `budget_steps`; the fastest by median then wins.
4. **The rest of the run**: the winner's replica moves into the run directory and trains on. Its steps so far are
   the run's first steps, so with lossless candidates the run is an untuned run of the winner. `<run>/tuning.csv`
   holds the search, `<run>/tuned.json` the choice: a resumed run takes it without searching again. A crash
   during the search leaves no checkpoint; the restarted job searches again from step 0.

Step times are averaged over the ranks before any decision, so every rank decides alike.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import random
import shutil
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from dtrain.collectives import dist as ddist
from dtrain.collectives import hooks, race, strategies
from dtrain.collectives.race import Entrant
from dtrain.collectives.strategies.auto import ONLINE_SPACE, multi_rank_nodes
from dtrain.common.errors import UserError
from dtrain.common.files import replace_atomically
from dtrain.common.rundir import TUNED, TUNING, TUNING_COLUMNS
from dtrain.engine import tune_model
from dtrain.engine.config import RunConfig, candidate_config
from dtrain.engine.log import prepare_run_dir
from dtrain.engine.model import sdpa_backend
from dtrain.engine.trainer import Trainer, rng_state, set_rng_state

TUNE_DIR = "tune"  # <run>/tune/<candidate>/: each replica's records during the search

# The search space when a profile names none: the strategies that send buckets, at caps around the sizes of the
# base model's tensors, a small first bucket, a per-class cap, the tied embedding's split, the sharded strategy's
# forward overlap and stock FSDP2 with each reshard setting.
DEFAULT_SPACE: dict[str, dict[str, Any]] = {
    **ONLINE_SPACE,  # ddp, bucketed, per_class, first and last buckets, the split, the hierarchical plan, sharded
    # bf16 exchanges: exact only under bf16 autocast, so in the space only where the profile trains so
    "sharded-2-split-bf16": {"strategy": "sharded", "bucket_cap_mb": 2, "classes.embedding.tied_split": True,
                             "gather_dtype": "bf16"},
    "sharded-8-split-bf16": {"strategy": "sharded", "bucket_cap_mb": 8, "classes.embedding.tied_split": True,
                             "gather_dtype": "bf16"},
    "fsdp2": {"strategy": "fsdp2"},  # stock FSDP2's defaults
    "fsdp2-keep": {"strategy": "fsdp2", "reshard_after_forward": False},
    "fsdp2-bf16": {"strategy": "fsdp2", "gather_dtype": "bf16"},  # FSDP2's mixed precision: lossy, with tune.lossy
}
# Of the `top_k` measured, each family's best predicted member goes first where its prediction is within this factor
# of the best one: a prediction can be 20-25% off (docs/results.md), and a family measurement would pick must not be
# lost to another family's near copies.
FAMILY_SLACK = 1.30


@dataclass
class Candidate(Entrant):
    keys: dict[str, Any] = field(default_factory=dict)  # its `sync` keys, dotted below `sync`
    cfg: RunConfig | None = None
    predicted_ms: float | None = None
    predicted_rank: int | None = None

    def row(self) -> dict:
        r = lambda v: "" if v is None else round(v, 2)  # noqa: E731
        d = self.diff or (None, None, None)
        return {"candidate": self.name, "sync": "; ".join(f"{k}={_text(v)}" for k, v in self.keys.items()),
                "lossless": str(self.lossless).lower(), "predicted_ms": r(self.predicted_ms),
                "predicted_rank": self.predicted_rank or "", "measured_ms": r(self.measured_ms),
                "diff_ms": r(d[0]), "diff_low": r(d[1]), "diff_high": r(d[2]), "rounds": len(self.times),
                "steps": self.steps, "status": self.status, "reason": self.reason}


def _text(v) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def is_lossless(sync) -> bool:
    """Whether every rank's averaged gradient is the exact mean: the strategy's own answer, fp32 on the wire, and
    for a DDP comm hook what `dtrain.collectives.hooks.resolve` says of it (the per-class hook: its classes' wire dtypes)."""
    fp32 = all(c.wire_dtype == "fp32" for c in sync.classes.values())
    hook = hooks.resolve(sync.hook) if "hook" in strategies.get(sync.strategy).sync_keys else None
    if hook is not None and not hook.per_class:
        return hook.lossless
    cls = strategies.get(sync.strategy)
    narrowed = "gather_dtype" in cls.sync_keys and sync.gather_dtype is not None and not cls.gather_dtype_exact
    return cls.lossless and fp32 and not narrowed


def candidates(cfg: RunConfig) -> list[Candidate]:
    t = cfg.sync.tune
    space = t.candidates or DEFAULT_SPACE
    out = []
    for name, keys in space.items():
        if space is DEFAULT_SPACE and keys.get("gather_dtype") and cfg.train.amp != "bf16":
            continue  # bf16 parameters or exchanges need the forward under bf16 autocast
        if space is DEFAULT_SPACE and keys.get("hierarchical") and not multi_rank_nodes(ddist.world_size()):
            continue
        c_cfg = candidate_config(cfg, name, keys)
        out.append(Candidate(name, is_lossless(c_cfg.sync), keys=dict(keys), cfg=c_cfg))
    if not t.lossy:
        out = [c for c in out if c.lossless]
    if not out:
        raise UserError("sync.tune.candidates: no lossless candidate (set sync.tune.lossy: true to search lossy ones)")
    return out


def family(sync) -> str:
    """A candidate's family: its strategy and the project's own ideas it uses (the split, rows, bf16 exchanges)."""
    split = any(c.tied_split for c in sync.classes.values()) and "classes.tied_split" in strategies.get(
        sync.strategy).sync_keys
    rows = split and sync.shard_tied_split
    return sync.strategy + ("+split" if split else "") + ("+rows" if rows else "") + (
        f"+{sync.gather_dtype}" if sync.gather_dtype else "") + ("+hierarchical" if sync.hierarchical else "")


def prune(cands: list[Candidate], top_k: int) -> list[Candidate]:
    """The `top_k` candidates to measure, and every one without a prediction (PowerSGD: no bucket plan to play).
    The `top_k` go first to the best predicted member of each family whose prediction is within FAMILY_SLACK of the
    best one, families in predicted order; the places left, to the best predicted of the rest. The others are
    marked dropped. Ranks are given in predicted order."""
    predicted = sorted((c for c in cands if c.predicted_ms is not None), key=lambda c: c.predicted_ms)
    for i, c in enumerate(predicted):
        c.predicted_rank = i + 1
    kept: list[Candidate] = []
    families: set[str] = set()
    for c in predicted:
        if (len(kept) < top_k and family(c.cfg.sync) not in families
                and c.predicted_ms <= FAMILY_SLACK * predicted[0].predicted_ms):
            kept.append(c)
            families.add(family(c.cfg.sync))
    kept += [c for c in predicted if c not in kept][:top_k - len(kept)]
    kept.sort(key=lambda c: c.predicted_ms)
    for c in predicted:
        if c not in kept:
            c.status = "dropped: predicted"
            c.reason = (f"predicted {c.predicted_ms:.0f} ms, rank {c.predicted_rank} of {len(predicted)}; "
                        f"{top_k} are measured, each family's best first")
    return kept + [c for c in cands if c.predicted_ms is None]


class Tuner:
    """The search of one job (see the module's docstring). `run()` returns the winner's trainer, in `run_dir`."""

    def __init__(self, cfg: RunConfig, run_dir: Path, device, backend: str, faults=(), stop=None,
                 train_after: bool = True, search: int = 0):
        """`search` > 0: a search again in the middle of the run (`sync.tune.retune_drift`); every candidate starts
        from the run's latest checkpoint, and the winner's steps are appended to the run's records."""
        self.cfg, self.run_dir, self.device, self.backend = cfg, Path(run_dir), device, backend
        self.faults, self.stop, self.train_after, self.search = list(faults), stop, train_after, search
        self.t = cfg.sync.tune
        self.cands = candidates(cfg)
        self.spent, self.rounds = 0, 0
        self.rng: dict[str, dict] = {}  # candidate -> its replica's RNG state between its steps
        self.main = ddist.is_main()

    # -- the search ---------------------------------------------------------------------------------------------

    def run(self) -> Trainer:
        with sdpa_backend(self.cfg.train.sdpa_backend, self.device):  # the attention kernel training uses
            return self._run()

    def _run(self) -> Trainer:
        tune_dir = self.run_dir / (TUNE_DIR if not self.search else f"{TUNE_DIR}-{self.search}")

        def prepare() -> None:  # rank 0; a restarted search begins afresh
            shutil.rmtree(tune_dir, ignore_errors=True)
            if self.search and (self.run_dir / TUNING).exists():  # the earlier search's table is kept
                os.replace(self.run_dir / TUNING, self.run_dir / f"tuning.{self.search - 1}.csv")
            for name in ["probe"] + [c.name for c in self.cands]:
                prepare_run_dir(tune_dir / name, resume=False)

        ddist.main_decides(prepare)
        self._predict(tune_dir / "probe")
        racing = prune(self.cands, self.t.top_k)
        trainers = {}
        for c in tqdm(racing, desc="tune: building", unit="candidate", disable=not self.main):
            trainers[c.name] = Trainer(c.cfg, tune_dir / c.name, self.device, self.backend, self.faults, self.stop)
            trainers[c.name].write_header()
            if self.search:
                trainers[c.name].resume(source=self.run_dir)
            self.rng[c.name] = rng_state()  # as an untuned run of it has before its first step
        winner = self._race(racing, trainers)
        set_rng_state(self.rng[winner.name])  # the rest of the run draws on as the winner alone would
        tr = trainers.pop(winner.name)
        for name in sorted(trainers):  # the others' replicas go: their memory, hooks, threads and process groups
            trainers.pop(name).close()
        self._finish(winner, tr)
        return tr

    def _predict(self, probe_dir: Path) -> None:
        """The probe (noop steps, compute only) and the network timing, averaged over ranks; then predictions."""
        probe_cfg = candidate_config(self.cfg, "probe", {"strategy": "noop"})
        tr = Trainer(probe_cfg, probe_dir, self.device, self.backend)
        tr.write_header()
        recs = [tr.recorded_step() for _ in range(self.t.probe_steps)]
        self.spent += self.t.probe_steps
        mine = tune_model.probe_of(recs, self.cfg.train.accum_steps) + tune_model.time_allreduce(self.device)
        world = ddist.world_size()
        avg = [v / world for v in ddist.all_reduce_sum(mine, self.device)]
        probe = tune_model.Probe(*avg[:4], accum_steps=self.cfg.train.accum_steps)
        net = tune_model.network_model(avg[5:], world)
        for c in self.cands:
            c.predicted_ms = tune_model.predict_ms(c.cfg.sync, tr.model, probe, net, world, self.backend)

    def _race(self, racing: list[Candidate], trainers: dict[str, Trainer]) -> Candidate:
        alive = list(racing)
        order = random.Random(self.cfg.seed)
        bar = tqdm(total=self.t.budget_steps, initial=self.spent, desc="tune", unit="step", disable=not self.main)
        def more() -> bool:  # another round fits the budget, and the run's steps (a search late in the run)
            return (len(alive) > 1 and self.spent + len(alive) <= self.t.budget_steps
                    and trainers[alive[0].name].step < self.cfg.train.max_steps)

        while more():
            mine = {}
            for c in order.sample(alive, len(alive)):  # the same order on every rank: the same seed
                # Each replica draws its dropout masks from its own RNG state, as it would alone.
                set_rng_state(self.rng[c.name])
                rec = trainers[c.name].turn_step()
                self.rng[c.name] = rng_state()
                mine[c.name] = (rec.step_ms, rec.loss)
                c.steps += 1
                bar.update(1)
            sums = ddist.all_reduce_sum([v for c in alive for v in mine[c.name]], self.device)
            world = ddist.world_size()
            self.spent += len(alive)
            if self.rounds >= self.t.warmup_rounds:
                for i, c in enumerate(alive):
                    c.times[self.rounds], c.losses[self.rounds] = sums[2 * i] / world, sums[2 * i + 1] / world
            self.rounds += 1
            alive = race.drop(alive, self.t.min_rounds, self.t.loss_tolerance)
            for name in sorted(set(trainers) - {c.name for c in alive}):
                trainers.pop(name).close()  # a dropped replica's memory goes now, not at the end of the search
            if alive[0].times:  # past the warm-up rounds
                leader = min(alive, key=lambda c: c.measured_ms)
                bar.set_postfix_str(f"{len(alive)} left, leader {leader.name}")
                self._write(leader)
        bar.close()
        # The fastest median; where nothing was measured (a search cut short by the run's last step), the prediction.
        if not any(c.times for c in alive):
            alive.sort(key=lambda c: c.predicted_ms if c.predicted_ms is not None else math.inf)
        winner = race.pick(alive, self.t.budget_steps)
        winner.reason = (f"fastest median over {len(winner.times)} rounds" if winner.times else
                         "best prediction: the run's last step came before any counted round")
        for c in racing:  # the dropped ones against the winner too
            if c.status.startswith("dropped: measured"):
                c.diff = race.paired(c, winner) or c.diff
        return winner

    # -- the record ---------------------------------------------------------------------------------------------

    def _finish(self, winner: Candidate, tr: Trainer) -> None:
        tuning = {"winner": winner.name, "sync": winner.keys, "steps_spent": self.spent, "rounds": self.rounds,
                  "budget_steps": self.t.budget_steps, "search": self.search, "from_step": tr.step - winner.steps}
        tr.facts["tuning"] = run_facts(tuning)
        if self.train_after:
            tr.relocate(self.run_dir)
        if self.main:
            self._write(winner)
            replace_atomically(self.run_dir / TUNED, json.dumps(tuning, indent=2) + "\n")
            print(table_text(self.cands, winner, self.spent), flush=True)

    def _write(self, leader: Candidate) -> None:
        """tuning.csv as it stands (after every round: a search cut short leaves what it had measured)."""
        if not self.main:
            return
        for c in self.cands:
            if not c.status and c.times:
                c.diff = race.paired(c, leader) if c is not leader else None
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=TUNING_COLUMNS, lineterminator="\n")
        w.writeheader()
        w.writerows(c.row() for c in sorted(self.cands, key=_order))
        replace_atomically(self.run_dir / TUNING, buf.getvalue())


def _order(c: Candidate):
    return (c.measured_ms is None, c.measured_ms or 0.0, c.predicted_ms is None, c.predicted_ms or 0.0)


def table_text(cands: list[Candidate], winner: Candidate, spent: int) -> str:
    """The search as a text table (printed at its end, and by `dtrain.analysis.tune`)."""
    lines = [f"tuning: {winner.name} wins after {spent} steps; predicted = MODELED, measured = median of its "
             "counted rounds, diff = paired median against the winner [~95% interval]",
             f"{'candidate':<22} {'predicted':>10} {'measured':>9} {'diff vs winner':>26} {'rounds':>6}  status"]
    for c in sorted(cands, key=_order):
        pred = f"{c.predicted_ms:.1f}" if c.predicted_ms is not None else "-"
        meas = f"{c.measured_ms:.1f}" if c.measured_ms is not None else "-"
        diff = race.fmt_diff(c.diff) if c.diff else "-"
        lines.append(f"{c.name:<22} {pred:>10} {meas:>9} {diff:>26} {len(c.times):>6}  {c.status}")
    return "\n".join(lines)


def run_facts(tuning: dict) -> dict:
    """run.json's `tuning`: tuned.json's record without the winner's sync keys (config.yaml holds its profile)."""
    return {k: v for k, v in tuning.items() if k != "sync"}


def tuned(run_dir: Path) -> dict | None:
    """The choice a finished search recorded in `run_dir` (rank 0 reads it; every rank gets it), or None."""
    def read():
        path = Path(run_dir) / TUNED
        if not path.exists():
            return None
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise UserError(f"{path}: unreadable ({e}); remove it to search again") from None

    return ddist.main_decides(read)


class DriftWatch:
    """`Trainer.watch` after a search (`sync.tune.retune_drift`): the median step of the first `retune_window` steps
    is the baseline; at the end of each later window, the median of that window (averaged over the ranks, so all
    decide alike: one small all-reduce per window) drifting more than `retune_drift` from it asks for a new search."""

    def __init__(self, drift: float, window: int, device):
        self.drift, self.window, self.device = drift, window, device
        self.times: list[float] = []  # the current window's
        self.base: float | None = None
        self.last: float | None = None

    def __call__(self, rec) -> bool:
        self.times.append(rec.step_ms)
        if len(self.times) < self.window:
            return False
        world = ddist.world_size()
        self.last = ddist.all_reduce_sum([statistics.median(self.times)], self.device)[0] / world
        self.times = []
        if self.base is None:
            self.base = self.last
            return False
        return abs(self.last / self.base - 1) > self.drift


def trainer_for(cfg: RunConfig, run_dir: Path, device, backend: str, faults=(), stop=None,
                resume: bool = False) -> Trainer:
    """The trainer of an `auto` run: on resume, the recorded winner's (no search again); else the search's winner."""
    choice = tuned(run_dir) if resume else None
    if choice is not None:
        tr = Trainer(candidate_config(cfg, choice["winner"], choice["sync"]), run_dir, device, backend, faults, stop)
        tr.facts["tuning"] = run_facts(choice)
        tr.resume()
        return tr
    return Tuner(cfg, run_dir, device, backend, faults, stop).run()


def fit(cfg: RunConfig, run_dir: Path, device, backend: str, faults=(), stop=None, resume: bool = False) -> dict:
    """An `auto` run from start to end: the search, the winner's training, and with `sync.tune.retune_drift` a new
    search from a checkpoint whenever the step time drifts; returns the last trainer's `fit()` summary."""
    tr = trainer_for(cfg, run_dir, device, backend, faults, stop, resume)
    search = tr.facts["tuning"].get("search", 0)  # the search that chose it (recorded in tuned.json)
    while True:
        watch = None
        if cfg.sync.tune.retune_drift is not None:
            watch = tr.watch = DriftWatch(cfg.sync.tune.retune_drift, cfg.sync.tune.retune_window, device)
        summary = tr.fit()
        if not summary.get("retune"):
            return summary
        search += 1
        if ddist.is_main():
            print(f"step {tr.step}: the median step moved from {watch.base:.1f} to {watch.last:.1f} ms (more than "
                  f"sync.tune.retune_drift = {cfg.sync.tune.retune_drift:g}); searching again from this checkpoint",
                  flush=True)
        tr.close()  # its replica's memory, before the new search builds its own
        del tr
        tr = Tuner(cfg, run_dir, device, backend, faults, stop, search=search).run()
