"""`sync.strategy: auto` in dtrain's trainer: the job picks its gradient-communication configuration by measuring
candidates on its own first training steps, then trains on with the winner.

The search is `attach`'s (`dtrain.collectives.auto.search.OnlineSearch`): one model, no replica. The trainer
attaches it like any strategy, over this module's space, and every search step is a training step of the run, in its
records:
1. **Candidates**: `sync.tune.candidates` (name -> `sync` keys), or the default space (`dtrain.collectives.auto.space`,
   the one `attach`'s search draws from too). Lossy ones (a bf16/fp16 wire, PowerSGD, a compressing hook) only with
   `sync.tune.lossy`, judged by the loss the trainer passes to `stepped`.
   bf16 exchanges are in the default space only where the profile trains under bf16 autocast, where they are exact;
   the hierarchical plan only where the job's nodes hold several ranks each; per-class NCCL protocol, algorithm and
   CTA bounds only on NCCL with `collectives.mode` per_group or tuner (global mode sets one choice for the job).
2. **Probe and pruning**: the run's first `probe_steps` steps under stock DDP's defaults, and a timing of the
   job's own process group, predict each candidate's step (`dtrain.collectives.auto.predict`, MODELED); `top_k` go
   on, each family's best predicted first. FSDP2 (`fully_shard` replaces the model's parameters for good, so it
   cannot be switched in and out) is predicted and listed, never measured.
3. **The race**: rounds of one training step per candidate, in an order shuffled per round and equal on every rank;
   switching to or from `sharded` moves the optimizer's state; paired differences drop the slower ones.
4. **The rest of the run**: the winner's handle takes the trainer's place. `<run>/tuning.csv` holds the search (after
   each round of it: a search cut short leaves what it had measured), `<run>/tuned.json` the choice: a resumed run
   takes it without searching again. A job that stops during the search resumes from its last checkpoint, if any,
   and searches again from there. With `sync.tune.retune_drift`, a drifting step time searches again from a
   checkpoint, on the same model.

Step times are averaged over the ranks before any decision, so every rank decides alike.
"""

from __future__ import annotations

import csv
import io
import json
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dtrain.collectives import dist as ddist
from dtrain.collectives import strategies
from dtrain.collectives.auto import predict, race
from dtrain.collectives.auto.race import Entrant
from dtrain.collectives.auto.search import OnlineSearch
from dtrain.collectives.auto.space import default_space, is_lossless
from dtrain.collectives.dist import local_world_size
from dtrain.common.errors import UserError
from dtrain.common.files import replace_atomically
from dtrain.common.rundir import TUNED, TUNING, TUNING_COLUMNS
from dtrain.engine.config import RunConfig, candidate_config, from_dict
from dtrain.engine.model import Transformer, sdpa_backend
from dtrain.engine.trainer import Trainer

@dataclass
class Candidate:
    """One configuration of the space: its name, `sync` keys (dotted below `sync`) and profile."""

    name: str
    lossless: bool
    keys: dict[str, Any] = field(default_factory=dict)
    cfg: RunConfig | None = None

    @property
    def searchable(self) -> bool:
        """Whether the search can switch it in and out on the one model (not fsdp2)."""
        return strategies.get(self.cfg.sync.strategy).switchable


def _text(v) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def candidates(cfg: RunConfig) -> list[Candidate]:
    """The space of the profile's search (the sweep of `dtrain.analysis.tune --matrix-out` too): lossless ones,
    and lossy ones with `sync.tune.lossy`."""
    t = cfg.sync.tune
    # per-class NCCL choices: on NCCL, where each class's communicator gets its own (collectives.mode per_group or
    # tuner; global mode sets one choice for the job); bf16 parameters or exchanges where the forward runs under
    # bf16 autocast; stock FSDP2 predicted and listed, not measured
    class_nccl = ddist.choose_backend(cfg.collectives) == "nccl" and cfg.collectives.mode != "global"
    world = ddist.world_size()
    space = t.candidates or default_space(world, class_nccl, cfg.train.amp == "bf16", predicted_only=True)
    with torch.device("meta"):
        shape = Transformer.from_config(cfg.model, cfg.data.vocab_size)
    out = []
    for name, keys in space.items():
        c_cfg = candidate_config(cfg, name, keys)
        out.append(Candidate(name, is_lossless(c_cfg.sync, shape, max(2, world), local_world_size()),
                             keys=dict(keys), cfg=c_cfg))
    if not t.lossy:
        out = [c for c in out if c.lossless]
    if not out:
        raise UserError("sync.tune.candidates: no lossless candidate (set sync.tune.lossy: true to search lossy ones)")
    if not any(c.searchable for c in out):
        raise UserError("sync.tune.candidates: only fsdp2 candidates, which the search cannot switch on the one model; "
                        "name fsdp2 as sync.strategy instead")
    return out


def search_config(cfg: RunConfig, cands: list[Candidate]) -> RunConfig:
    """The profile with `sync` set to the search over `cands`' searchable ones (the trainer attaches it)."""
    raw = cfg.to_dict()
    raw["sync"]["tune"]["candidates"] = {c.name: c.keys for c in cands if c.searchable}
    return from_dict(raw, "sync.tune.candidates")


class SearchRecord:
    """`Trainer.watch` of an `auto` run (called after each step): while the search runs, `tuning.csv` as it stands;
    when it ends, the winner's handle in the trainer's place, `tuned.json`, run.json's `tuning` and the table; after
    it, the drift watch if `sync.tune.retune_drift` asks for one (True: search again from a checkpoint)."""

    def __init__(self, tr: Trainer, cfg: RunConfig, cands: list[Candidate], search: int = 0,
                 from_step: int = 0):
        self.tr, self.cfg, self.cands, self.search, self.from_step = tr, cfg, cands, search, from_step
        self.online: OnlineSearch = tr.sync
        self.main = ddist.is_main()
        self.unsearched = [Entrant(c.name, c.lossless, status="not measured",
                                   reason=f"{c.cfg.sync.strategy} cannot be switched on the one model; predicted only")
                           for c in cands if not c.searchable]
        self.drift: DriftWatch | None = None
        self.done = False
        self._written = None  # the search's state when tuning.csv was last written

    def __call__(self, rec) -> bool:
        if self.done:
            return self.drift(rec) if self.drift is not None else False
        self._predict_unsearched()
        if self.online.winner is None and self.tr.step >= self.cfg.train.max_steps:
            self.online.conclude()  # the run's last step before the search's end
        if self.online.winner is not None:
            self._finish()  # writes the final table
        else:
            self._write()
        return False

    def _predict_unsearched(self) -> None:
        s = self.online
        if s.probe is None or any(e.predicted_ms is not None for e in self.unsearched):
            return
        world = ddist.world_size()
        for e in self.unsearched:
            sync = next(c for c in self.cands if c.name == e.name).cfg.sync
            e.predicted_ms = predict.predict_ms(sync, self.tr.model, s.probe, s.net, world, self.tr.backend)

    def entrants(self) -> list[Entrant]:
        return self.online.entrants + self.unsearched

    def _finish(self) -> None:
        s, tr = self.online, self.tr
        winner = next(c for c in self.cands if c.name == s.winner)
        e = next(e for e in s.entrants if e.name == s.winner)
        e.reason = (f"fastest over {len(e.times)} rounds, each round's median step taken out" if e.times else
                    "best prediction: the run's last step came before any counted round")
        for c in s.entrants:  # the dropped ones against the winner too
            if c.status.startswith("dropped: measured"):
                c.diff = race.paired(c, e) or c.diff
        e.diff = None
        tuning = {"winner": winner.name, "sync": winner.keys, "steps_spent": s.spent, "steps_trained": s.steps_run,
                  "timing_steps": s.timing_steps, "switch_steps": s.switch_steps, "switch_s": round(s.switch_s, 2),
                  "rounds": s.rounds, "budget_steps": s.budget, "search": self.search, "from_step": self.from_step}
        tr.sync = s.current  # the winner's own handle trains on
        tr.cfg = winner.cfg
        tr.facts["tuning"] = run_facts(tuning)
        tr.write_header()  # config.yaml: the winner's profile; run.json: the search's record
        if self.main:
            self._write()
            replace_atomically(tr.run_dir / TUNED, json.dumps(tuning, indent=2) + "\n")
            print(table_text(self.entrants(), e, s.spent), flush=True)
        self.done = True
        if self.cfg.sync.tune.retune_drift is not None:
            t = self.cfg.sync.tune
            self.drift = DriftWatch(t.retune_drift, t.retune_window, tr.device)

    def _write(self) -> None:
        """tuning.csv as it stands, when the search has moved on: a round ended, the probe pruned, a winner."""
        s = self.online
        state = (s.rounds, s.probe is None, s.winner)
        if not self.main or state == self._written:
            return
        self._written = state
        alive = [c for c in s.alive if c.times]
        leader = race.leader(alive) if alive else None
        for c in s.entrants:
            if not c.status and c.times and leader is not None:
                c.diff = race.paired(c, leader) if c is not leader else None
        keys = {c.name: c.keys for c in self.cands}
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=TUNING_COLUMNS, lineterminator="\n")
        w.writeheader()
        w.writerows(row(c, keys[c.name]) for c in sorted(self.entrants(), key=_order))
        replace_atomically(self.tr.run_dir / TUNING, buf.getvalue())


def row(c: Entrant, keys: dict) -> dict:
    """A candidate's line of tuning.csv."""
    r = lambda v: "" if v is None else round(v, 2)  # noqa: E731
    d = c.diff or (None, None, None)
    return {"candidate": c.name, "sync": "; ".join(f"{k}={_text(v)}" for k, v in keys.items()),
            "lossless": str(c.lossless).lower(), "predicted_ms": r(c.predicted_ms),
            "predicted_rank": c.predicted_rank or "", "measured_ms": r(c.measured_ms),
            "diff_ms": r(d[0]), "diff_low": r(d[1]), "diff_high": r(d[2]), "rounds": len(c.times),
            "steps": c.steps, "status": c.status, "reason": c.reason}


def _order(c: Entrant):
    return (c.measured_ms is None, c.measured_ms or 0.0, c.predicted_ms is None, c.predicted_ms or 0.0)


def table_text(cands: list[Entrant], winner: Entrant, spent: int) -> str:
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


def searching(cfg: RunConfig, run_dir: Path, device, backend: str, faults=(), stop=None, resume: bool = False,
              search: int = 0, tr: Trainer | None = None) -> Trainer:
    """A trainer whose synchronization is the search (a new one, resumed from the run's last checkpoint if
    `resume`; or `tr`, whose model and optimizer move to the search: a search again in the middle of the run)."""
    cands = candidates(cfg)
    scfg = search_config(cfg, cands)
    if search and ddist.is_main() and (run_dir / TUNING).exists():  # the earlier search's table is kept
        os.replace(run_dir / TUNING, run_dir / f"tuning.{search - 1}.csv")
    if tr is None:
        tr = Trainer(scfg, run_dir, device, backend, faults, stop)
        if resume:
            tr.resume()
    else:
        tr.resync(scfg)
    tr.watch = SearchRecord(tr, cfg, cands, search, from_step=tr.step)
    return tr


def trainer_for(cfg: RunConfig, run_dir: Path, device, backend: str, faults=(), stop=None,
                resume: bool = False) -> Trainer:
    """The trainer of an `auto` run: on resume, the recorded winner's (no search again); else the search's."""
    choice = tuned(run_dir) if resume else None
    if choice is None:
        return searching(cfg, run_dir, device, backend, faults, stop, resume)
    tr = Trainer(candidate_config(cfg, choice["winner"], choice["sync"]), run_dir, device, backend, faults, stop)
    tr.facts["tuning"] = run_facts(choice)
    tr.resume()
    t = cfg.sync.tune
    if t.retune_drift is not None:
        tr.watch = DriftWatch(t.retune_drift, t.retune_window, device)
    return tr


def fit(cfg: RunConfig, run_dir: Path, device, backend: str, faults=(), stop=None, resume: bool = False) -> dict:
    """An `auto` run from start to end: the search, the winner's training, and with `sync.tune.retune_drift` a new
    search from a checkpoint whenever the step time drifts; returns the last `fit()` summary."""
    tr = trainer_for(cfg, run_dir, device, backend, faults, stop, resume)
    search = tr.facts.get("tuning", {}).get("search", 0)  # the search that chose it (recorded in tuned.json)
    while True:
        summary = tr.fit()
        if not summary.get("retune"):
            return summary
        watch = tr.watch.drift if isinstance(tr.watch, SearchRecord) else tr.watch
        search += 1
        if ddist.is_main():
            print(f"step {tr.step}: the median step moved from {watch.base:.1f} to {watch.last:.1f} ms (more than "
                  f"sync.tune.retune_drift = {cfg.sync.tune.retune_drift:g}); searching again from this checkpoint",
                  flush=True)
        tr = searching(cfg, run_dir, device, backend, faults, stop, search=search, tr=tr)


def search_only(cfg: RunConfig, out: Path, device, backend: str) -> None:
    """The search alone (`dtrain.analysis.tune`): steps until it has a winner (or the run's last), its records in
    `out`, no checkpoint and no training on."""
    with sdpa_backend(cfg.train.sdpa_backend, device):  # the attention kernel training uses
        tr = searching(cfg, out, device, backend)
        tr.write_header()
        while tr.step < cfg.train.max_steps and not tr.watch.done:
            tr.watch(tr.recorded_step())
