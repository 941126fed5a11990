"""`sync.strategy: auto`: the configuration is chosen by measurement while the job trains.

`attach(model, SyncConfig(strategy="auto"))` gives `OnlineSearch`, which needs no trainer and no replica: it holds
one handle per candidate on the one model and lets each run the loop's own next training steps in turn (dtrain's
trainer searches through it too, `dtrain.engine.autotune`). Every search step is a training step of the run, and
with lossless candidates the run is an untuned run that used that sequence of configurations.

Only the current handle is armed: a planned strategy's hooks do nothing while its reducer is not armed, and DDP's
reducer ignores its autograd hooks unless its own forward prepared the backward. So the candidates can all stay
attached while the race runs, and each step is the candidate's own. Candidates switch between steps (in
`stepped()`), never inside an accumulation. A planned candidate frees its bucket buffers (a copy of the gradients
each; `sharded`'s peers' chunks too, its flat parameters staying as the parameters' storage) while another one
trains and lays them out again when its turn comes, so the search holds one planned candidate's buffers at a time;
each DDP candidate keeps its own buckets. Where the process keeps freed host memory (dtrain's trainer by default),
the search serves large blocks with their own mmap until the winner is laid out
(`dtrain.common.host_memory.map_large_blocks`): otherwise the heap would end holding every candidate's layout of
freed blocks. Its steps then fault their large blocks in, every candidate's alike.

A sharding candidate (`sharded`) changes what the optimizer updates: its shards instead of the model's parameters.
Switching to or from one moves the optimizer's state through the whole-model form that checkpoints hold
(`optimizer_state`, `load_optimizer_state`: each shard's state all-gathered, or the whole state cut into shards)
and points the optimizer's one parameter group at the new handle's `optimizer_params()`; so the loop passes its
optimizer: `handle.stepped(optimizer)`. Such a candidate's first step after a switch is a lead-in, a training step
that is not timed: its parameters were whole when it started, so it did not wait for the all-gathers that every
later step of a run of it overlaps with its forward; its second step, timed, does. `fsdp2` cannot be switched
(`fully_shard` replaces the model's parameters and modules for good): named as a candidate, it is a one-line error.
A lossy candidate is searched only with `sync.tune.lossy`, judged by the loss the loop passes to `stepped`.

Where more candidates than `sync.tune.top_k` are in the space, the run's first `probe_steps` steps (under stock
DDP's defaults where the space holds them) are timed phase by phase and the job's group is timed at a few sizes;
`dtrain.collectives.auto.predict` predicts each candidate's step from that and keeps `top_k` for the race (each
family's best predicted first). A candidate's handle is built at its first turn, so the dropped ones never are.

The loop must call `stepped()` after `optimizer.step()`: a candidate's step is timed from its first forward to there.
"""

from __future__ import annotations

import math
import random
import time
from contextlib import AbstractContextManager

import torch
import torch.distributed as dist
from torch import nn

from dtrain.collectives.auto import predict, race
from dtrain.collectives.auto.space import (
    PROBE, candidate_sync, default_space, is_lossless, shards, splits_apply)
from dtrain.collectives.dist import local_world_size
from dtrain.collectives.registry import CLASS_RULE_KEYS, attachable, get, register
from dtrain.collectives.settings import SyncConfig
from dtrain.collectives.strategies import build
from dtrain.collectives.sync import Front, GradSync, move_optimizer
from dtrain.common import host_memory
from dtrain.common.errors import UserError
from dtrain.common.rundir import BucketRecord


@register("auto")
class OnlineSearch(GradSync):
    """`auto` inside any training loop (see the module's docstring). `winner` is the chosen candidate's name once
    the race has ended, `entrants` the race's record. Registered as `auto`: a profile naming it is checked like any
    other (its keys are `sync.tune` and the class rules, which hold for every candidate)."""

    sync_keys = ("tune", *CLASS_RULE_KEYS)
    searches = True
    lossless = True  # lossless candidates only, unless sync.tune.lossy

    def __init__(self, model: nn.Module, cfg: SyncConfig, process_group=None, param_groups=None):
        super().__init__(model, cfg, process_group, param_groups)
        t = cfg.tune
        world = dist.get_world_size(process_group)
        space = t.candidates or default_space(world, dist.get_backend(process_group) == "nccl")
        syncs = {name: candidate_sync(cfg, name, keys) for name, keys in space.items()}
        if not t.candidates:  # the default space: the split only where the model has one tied embedding to split
            syncs = {name: sync for name, sync in syncs.items() if splits_apply(sync, model)}
        exact = {name: is_lossless(sync, model, world, local_world_size()) for name, sync in syncs.items()}
        for name, sync in syncs.items():
            if not get(sync.strategy).switchable:
                raise UserError(f"'sync.tune.candidates.{name}': {sync.strategy} replaces the model's parameters "
                                "for good and cannot be switched between steps; attach's search takes the other "
                                f"strategies ({', '.join(n for n in attachable() if get(n).switchable)})")
            if not exact[name] and not t.lossy:
                raise UserError(f"'sync.tune.candidates.{name}' is lossy; set sync.tune.lossy: true to search it "
                                "(the loop then passes each step's loss: handle.stepped(optimizer, loss))")
        # A candidate's handle is built when its first turn comes (`_handle`), so that those the prediction drops
        # never hold memory; every rank builds the same handles in the same order (some make process groups).
        self.handles: dict[str, GradSync] = {}
        self.syncs = syncs
        self.lossless = all(exact.values())
        self.sharding = {name: shards(sync.strategy) for name, sync in syncs.items()}
        self.entrants = [race.Entrant(name, exact[name]) for name in syncs]
        self.alive = list(self.entrants)
        self.budget, self.steps_run, self.rounds = t.budget_steps, 0, 0
        self.order = random.Random(0)  # the same order on every rank
        self.queue: list[race.Entrant] = self._round_order()
        self.round_ms: dict[str, float] = {}  # this round's steps so far, this rank's
        self.round_loss: dict[str, float] = {}
        self.winner: str | None = None
        # The probe (pruning to `top_k` by prediction) where more candidates than that race: the run's first
        # `probe_steps` steps under stock DDP's defaults if the space holds them, timed phase by phase.
        self.probing = t.probe_steps if len(self.entrants) > t.top_k else 0
        self.probe_steps: list[tuple[float, float, float, float]] = []  # (forward, backward, optimizer, compute)
        self.probe: predict.Probe | None = None
        self.net = None  # the fitted all-reduce cost of the job's group, after the probe
        # Kept host memory (the trainer's default) would end the search with the heap holding every candidate's
        # layout of freed blocks: large blocks are mapped apart until the winner is laid out (`_next`).
        host_memory.map_large_blocks()
        first = (PROBE if PROBE in syncs else self.queue[0].name) if self.probing else self.queue[0].name
        self.current = self._handle(first)  # before the loop builds its optimizer over `optimizer_params()`
        self.optimizer: torch.optim.Optimizer | None = None  # the loop's, from `stepped(optimizer)`
        self.lead_in = False  # the current step is a sharding candidate's first after a switch: not timed
        self.switch_s = 0.0  # this rank's time spent moving the optimizer's state between layouts
        self.moves = 0  # the optimizer state's moves so far
        self.mean_ms: float | None = None  # the last round's mean step (ms, rank-averaged): what a move's time is in steps
        self._moved_ms = 0.0  # the moves' time (rank-averaged) counted into `_moved_steps` so far
        self._moved_steps = 0.0  # ... as steps, each round's at that round's mean step (`switch_steps`)
        self.module = Front(model, self)  # the current candidate's module (the loop may keep this one object)
        self.device = next(model.parameters()).device
        self._t0: float | None = None
        self._phases = [0.0, 0.0]  # this step's forward time, and the time wait() blocked (s)
        self._waited = 0.0  # when wait() returned
        self.timing_steps = 0  # the steps the probe's network timing counts as

    # -- the race, one training step at a time -------------------------------------------------------------------

    def forward(self, model: nn.Module, *args, **kwargs):
        """`handle.module`'s forward: the current candidate's, its step timed from the first micro-batch (after the
        search: the winner's, untimed)."""
        if self.winner is not None:
            return self.current.module(*args, **kwargs)
        t = time.perf_counter()
        if self._t0 is None:
            self._t0, self._phases = t, [0.0, 0.0]
        out = self.current.module(*args, **kwargs)
        self._phases[0] += time.perf_counter() - t
        return out

    def wait(self) -> None:
        if self.winner is not None:
            return self.current.wait()
        t = time.perf_counter()
        self.current.wait()
        self._phases[1] += time.perf_counter() - t
        self._waited = time.perf_counter()

    def stepped(self, optimizer: torch.optim.Optimizer | None = None, loss: float | None = None) -> None:
        if optimizer is not None and self.optimizer is None and any(self.sharding.values()):
            self.current.check_optimizer(optimizer)  # each switch points its groups at the next candidate's
        self.optimizer = optimizer or self.optimizer
        self.current.stepped(optimizer)
        if self.winner is not None or self._t0 is None:
            self._t0 = None
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the step's kernels are part of its time
        now = time.perf_counter()
        elapsed_ms = (now - self._t0) * 1000
        self._t0 = None
        self.steps_run += 1
        if self.probing:
            self._probe_step(elapsed_ms, now)
            return
        entrant = self.queue[0]
        entrant.steps += 1
        if self.lead_in:  # the same candidate's next step is the one timed
            self.lead_in = False
            return
        if not entrant.lossless or not self.lossless:
            if loss is None:
                raise UserError("sync.tune.lossy: the search judges lossy candidates by the loss; pass each "
                                "step's loss to handle.stepped(optimizer, loss)")
            self.round_loss[entrant.name] = float(loss)
        self.queue.pop(0)
        self.round_ms[entrant.name] = elapsed_ms
        if not self.queue:
            self._end_round()
        self._next()

    def _next(self) -> None:
        """Switch to the next step's candidate (the winner's once there is one); the losers' handles go."""
        name = self.winner or self.queue[0].name
        if self.handles.get(name) is not self.current:
            if self._switch(self.current, name) and self.winner is not None:
                self._count_moves()  # the move to the winner is the search's too
            # a lead-in only where its time would be counted (the warm-up rounds' are not)
            self.lead_in = self.winner is None and self.sharding[name] and self.rounds >= self.cfg.tune.warmup_rounds
        keep = {self.winner} if self.winner else {c.name for c in self.alive}
        for loser in sorted(set(self.handles) - keep):  # hooks, threads and groups (name order on every rank)
            self.handles.pop(loser).close()
        if self.winner is not None:  # the search is over: freed host memory is kept again, as before it
            host_memory.keep_again()

    def _probe_step(self, elapsed_ms: float, now: float) -> None:
        forward_ms, exposed_ms = (x * 1000 for x in self._phases)
        optimizer_ms = (now - self._waited) * 1000
        backward_ms = elapsed_ms - forward_ms - exposed_ms - optimizer_ms
        self.probe_steps.append((forward_ms, backward_ms, optimizer_ms, elapsed_ms - exposed_ms))
        next(c for c in self.entrants if c.name == self._name(self.current)).steps += 1
        self.probing -= 1
        if self.probing:
            return
        # Averaged over the ranks, so every rank predicts and prunes alike.
        t0 = time.perf_counter()
        sizes = predict.bench_sizes(sum(p.numel() * p.element_size() for p in self.model.parameters()))
        mine = predict.probe_of(self.probe_steps) + predict.time_allreduce(self.device, sizes, self.process_group)
        timing_ms = (time.perf_counter() - t0) * 1000
        world = dist.get_world_size(self.process_group)
        total = torch.tensor(mine + [timing_ms], dtype=torch.float64, device=self.device)
        dist.all_reduce(total, group=self.process_group)
        avg = [v / world for v in total.tolist()]
        self.probe = predict.Probe(*avg[:4])
        self.net = predict.network_model(sizes, avg[4:-1], world)
        # the network timing counts as the steps its time would have held
        self.timing_steps = math.ceil(avg[-1] / max(self.probe.step_ms, 1e-3))
        backend = dist.get_backend(self.process_group)
        for c in self.entrants:
            c.predicted_ms = predict.predict_ms(self.syncs[c.name], self.model, self.probe, self.net, world,
                                                   backend)
        # stock DDP's defaults (the probe's) race too, where the space holds them: every search then shows its pick
        # against the stock configuration, paired
        self.alive = predict.prune(self.entrants, self.syncs, self.cfg.tune.top_k, keep={PROBE})
        self.queue = self._round_order()
        self._next()

    def _handle(self, name: str) -> GradSync:
        """Candidate `name`'s handle, built at its first turn (a collective: every rank builds it at the same step)."""
        if name not in self.handles:
            sync = self.syncs[name]
            self.handles[name] = build(sync.strategy, self.model, sync, self.process_group, self.groups)
        return self.handles[name]

    def _switch(self, previous: GradSync, name: str) -> bool:
        """The model from `previous` to candidate `name` between steps (a collective: every rank switches alike).
        Where either shards, the optimizer's state moves through its whole-model form into what the new one
        updates. Returns whether it moved."""
        moves = self.sharding[self._name(previous)] or self.sharding[name]
        if moves and self.optimizer is None:
            raise UserError("sync.strategy 'auto' switches to or from a sharding candidate after this step: pass the "
                            "loop's optimizer to handle.stepped(optimizer)")
        t0 = time.perf_counter()
        whole = None
        if moves:
            # The step's gradients are spent: the loop's zero_grad after this call reaches only the new tensors
            self.optimizer.zero_grad(set_to_none=True)
            for p in self.model.parameters():
                p.grad = None
            whole = previous.optimizer_state(self.optimizer)  # a collective for a sharded handle
            self.optimizer.state.clear()  # a sharded one's shard states go before the next layout is made
        previous.suspend()  # a sharded one: the updated shards all-gathered into the model first
        built = name in self.handles
        self.current = self._handle(name)  # a new one is laid out already
        if built:
            self.current.resume()
        if moves:
            move_optimizer(self.optimizer, whole, self.current)
            self.switch_s += time.perf_counter() - t0
            self.moves += 1
        return moves

    def _name(self, handle: GradSync) -> str:
        return next(n for n, h in self.handles.items() if h is handle)

    def _end_round(self) -> None:
        names = [c.name for c in self.alive]
        mine = [self.round_ms[n] for n in names] + [self.round_loss.get(n, 0.0) for n in names]
        total = torch.tensor(mine + [self.switch_s * 1000], dtype=torch.float64, device=self.device)
        dist.all_reduce(total, group=self.process_group)  # every rank decides on the same means
        world = dist.get_world_size(self.process_group)
        # the moves' time since the last count counts as the steps it would have held (this round's mean step)
        self.mean_ms = total[:len(names)].mean().item() / world
        self._count_moved(total[-1].item() / world)
        if self.rounds >= self.cfg.tune.warmup_rounds:
            for i, c in enumerate(self.alive):
                c.times[self.rounds] = total[i].item() / world
                if c.name in self.round_loss:
                    c.losses[self.rounds] = total[len(names) + i].item() / world
        self.rounds += 1
        self.round_ms, self.round_loss = {}, {}
        self.alive = race.drop(self.alive, self.cfg.tune.min_rounds, self.cfg.tune.loss_tolerance)
        if len(self.alive) == 1 or self.spent + self._round_steps() + self._moves_ahead() > self.budget:
            self._pick()
        else:
            self.queue = self._round_order()

    def _moves_ahead(self) -> int:
        """The steps that another round's moves of the optimizer's state and the move to the winner after it may
        cost, each at the mean cost of a move so far: a round moves it at most once into each sharding candidate
        and once out of their group (none where no sharding candidate is left)."""
        sharding = sum(self.sharding[c.name] for c in self.alive)
        return math.ceil((sharding + 2) * self._moved_steps / self.moves) if sharding and self.moves else 0

    def _count_moves(self) -> None:
        """Count the move to the winner (a collective: every rank moves to it at the same step)."""
        if self.mean_ms is None:  # no round ended: no step to count the time in
            return
        total = torch.tensor([self.switch_s * 1000], dtype=torch.float64, device=self.device)
        dist.all_reduce(total, group=self.process_group)
        self._count_moved(total.item() / dist.get_world_size(self.process_group))

    def _count_moved(self, moved_ms: float) -> None:
        """Count the moves' time so far (`moved_ms`, rank-averaged) in steps: what is new since the last count at
        the last round's mean step, so that what was counted stays counted whatever later rounds' steps take."""
        self._moved_steps += (moved_ms - self._moved_ms) / max(self.mean_ms, 1e-3)
        self._moved_ms = moved_ms

    @property
    def switch_steps(self) -> int:
        """The steps the optimizer state's moves count as (at each round's end and the move to the winner); a part
        of a step counts as a step."""
        return math.ceil(self._moved_steps - 1e-9)

    @property
    def spent(self) -> int:
        """What the search has spent of `budget_steps`: its training steps, and the probe's network timing and the
        optimizer state's moves as the steps their time would have held."""
        return self.steps_run + self.timing_steps + self.switch_steps

    def _round_order(self) -> list[race.Entrant]:
        """A round's order, the same on every rank: the sharding candidates together and the others together, each
        group shuffled and the groups' order drawn (a move of the optimizer's state between the groups, or between
        two sharding candidates, costs an all-gather of it; within the others it costs nothing)."""
        sharding = [c for c in self.alive if self.sharding[c.name]]
        groups = [self.order.sample(g, len(g)) for g in (sharding, [c for c in self.alive if c not in sharding])]
        if self.order.random() < 0.5:
            groups.reverse()
        return groups[0] + groups[1]

    def conclude(self) -> None:
        """End the search now (the run's last step came first): the fastest so far wins (`_pick`), or where no round
        was counted, the best prediction (else the first candidate); the model switches to it."""
        if self.winner is not None:
            return
        self.probing = 0
        self._pick()
        self.lead_in, self._t0 = False, None
        self._next()

    def _pick(self) -> None:
        """The winner among those left: the fastest over the counted rounds (`race.leader`: each round a block), or
        where no round was counted (a tiny budget, a run cut short) the best prediction, else the first."""
        if not any(c.times for c in self.alive):
            self.alive.sort(key=lambda c: c.predicted_ms if c.predicted_ms is not None else math.inf)
        self.winner = race.pick(self.alive, self.budget).name

    def _round_steps(self) -> int:
        """The training steps the next round may take: one per candidate, and a lead-in per sharding one."""
        counted = self.rounds >= self.cfg.tune.warmup_rounds
        return sum(1 + (counted and self.sharding[c.name]) for c in self.alive)

    # -- the seam: the current candidate's ------------------------------------------------------------------------

    def close(self) -> None:
        for name in sorted(self.handles):
            self.handles[name].close()
        self.handles = {}
        host_memory.keep_again()

    def no_sync(self) -> AbstractContextManager:
        return self.current.no_sync()

    def optimizer_groups(self) -> list[list[torch.Tensor]]:
        return self.current.optimizer_groups()  # the model's parameters, or a sharding candidate's shards

    def grad_norm(self, exact: bool = False) -> torch.Tensor:
        return self.current.grad_norm(exact)

    def wait_params(self) -> None:
        self.current.wait_params()

    def model_state(self) -> dict:
        return self.current.model_state()

    def load_model_state(self, state: dict) -> None:
        self.current.load_model_state(state)

    def state_dict(self) -> dict:
        return self.current.state_dict()

    def load_state_dict(self, state: dict, own: bool = True) -> None:
        self.current.load_state_dict(state, own)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        return self.current.optimizer_state(optimizer)

    def local_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> dict:
        return self.current.local_optimizer_state(optimizer, state)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.current.zero_grad(set_to_none)

    def step_records(self) -> list[BucketRecord]:
        return self.current.step_records()

    def stats(self) -> dict:
        """The search's state, and per candidate its race: status, median step (ms, over its counted rounds) and
        its step minus the winner's, paired over the rounds both ran (median, low, high; None before the pick)."""
        winner = next((c for c in self.entrants if c.name == self.winner), None)
        racing = {c.name: {"status": c.status or "racing", "median_ms": c.measured_ms, "rounds": len(c.times),
                           "vs_winner": race.paired(c, winner) if winner and c is not winner else None}
                  for c in self.entrants}
        return {**super().stats(), "searching": self.winner is None, "winner": self.winner,
                "candidates": [c.name for c in self.entrants], "steps_spent": self.spent, "race": racing}
