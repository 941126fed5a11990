"""The handle of the one seam between a training loop and gradient communication.

A training loop calls `collectives.attach(model, sync_config)` once and gets a `GradSync`. It builds its optimizer
over `handle.optimizer_params()`, runs forward through `handle.module`, wraps all but the last micro-batch of an
accumulation in `handle.no_sync()`, calls `handle.wait()` before the update and clips by `handle.grad_norm()`, and
calls `handle.stepped(optimizer)` after `optimizer.step()` (`auto` switches candidates there). Before reading the
model's parameters outside training (validation, a checkpoint) it calls `handle.wait_params()`; it saves and loads
the model through `handle.model_state()` and `handle.load_model_state()`, the optimizer through
`handle.optimizer_state()` and `handle.load_optimizer_state()`, and the strategy's own state (PowerSGD's error
feedback: this rank's, so gathered per rank) through `handle.state_dict()` and `handle.load_state_dict()`. It never branches on which strategy is behind the
handle: for all but a sharded strategy these calls are the plain ones (the model's parameters and state dict, the
optimizer's own state dict; no state of its own).
"""

from __future__ import annotations

import functools
from contextlib import AbstractContextManager, nullcontext
from typing import ClassVar

import torch
import torch.distributed as dist
from torch import nn

from dtrain.collectives.dist import local_world_size
from dtrain.collectives.schedule import Schedule
from dtrain.collectives.settings import SyncConfig
from dtrain.common.errors import UserError
from dtrain.common.rundir import BucketRecord


class StrategyFacts:
    """What every registered strategy says of itself, for the profile's checks, the cost model and the simulator;
    both kinds of strategy (`GradSync` and `dtrain.collectives.plan.BucketingStrategy`) carry them."""

    name: ClassVar[str] = "base"
    communicates: ClassVar[bool] = True  # False only for the no-communication headroom baseline
    class_groups: ClassVar[bool] = False  # each tensor class gets its own process group
    uses_cap: ClassVar[bool] = False  # its buckets follow `sync.bucket_cap_mb`
    # The keys of `sync` it reads besides `strategy` ("classes.<key>": that key of every `sync.classes.<class>`); a
    # profile that sets another one is refused (`dtrain.collectives.config.validate`).
    sync_keys: ClassVar[tuple[str, ...]] = ()
    # It hands the optimizer shards of the parameters instead of the parameters (sharded, fsdp2)
    shards: ClassVar[bool] = False
    # It searches the others (`auto`): not a candidate of a search, nor attached on its own by the search
    searches: ClassVar[bool] = False
    # `attach`'s search can switch it in and out between steps on the one model (not fsdp2: `fully_shard` replaces
    # the model's parameters and modules for good)
    switchable: ClassVar[bool] = True

    @classmethod
    def problems(cls, sync) -> list[tuple[str, str]]:
        """(dotted key, message) for each bad value of the keys this strategy reads (`sync_keys`), which only it
        knows; `dtrain.collectives.config.validate` reports them where the profile sets them."""
        return []

    @classmethod
    def schedule(cls, sync, model: nn.Module, world: int, accum_steps: int = 1, ranks_per_node: int | None = None):
        """The collectives this strategy issues in one synchronized step of `model` (meta tensors do) under `sync`
        on `world` ranks, with `accum_steps` micro-batches a step: a `dtrain.collectives.schedule.Schedule`, which
        says what each sends, when and whether it is exact. `ranks_per_node`: the job's layout where `sync` does
        not give it. A strategy that decides what it sends only as it runs has none (a one-line error)."""
        raise UserError(f"strategy '{cls.name}' decides what it sends as it runs: it has no schedule to predict")


class Front(nn.Module):
    """What a loop runs forward on when the handle acts around the model's forward (`handle.module`): the call goes
    to `handle.forward(model, ...)`. The handle is not a submodule, so the parameters keep one path."""

    def __init__(self, model: nn.Module, handle: "GradSync"):
        super().__init__()
        self.model = model
        object.__setattr__(self, "_handle", handle)

    def forward(self, *args, **kwargs):
        return self._handle.forward(self.model, *args, **kwargs)


class GradSync(StrategyFacts):
    """Base handle. Subclasses synchronize gradients so that after `wait()` each holds the mean over ranks."""

    strategy: StrategyFacts | None = None  # the registered strategy a generic handle runs (None: the handle's own)

    def __init__(self, model: nn.Module, cfg: SyncConfig, process_group: dist.ProcessGroup | None = None,
                 param_groups: list[list[nn.Parameter]] | None = None):
        self.model, self.cfg, self.process_group = model, cfg, process_group
        self.module: nn.Module = model  # what forward is called on
        # The loop's optimizer groups as lists of the model's own parameters (its groups' options stay the
        # optimizer's): what `optimizer_groups()` maps to what this handle updates, and the numbering of the
        # whole-model optimizer state (`optimizer_state`), which is then what the loop's optimizer would save under DDP
        self.groups: list[list[nn.Parameter]] = param_groups_of(model, param_groups)
        self._optimizer_checked = False  # `check_optimizer_once` has checked the loop's optimizer

    @functools.cached_property
    def schedule_now(self) -> Schedule | None:
        """What this handle sends in a step (`StrategyFacts.schedule` of its model on its world); None for a strategy
        that decides it as it runs."""
        world = dist.get_world_size(self.process_group) if dist.is_initialized() else 1
        strategy = self.strategy or type(self)
        try:
            return strategy.schedule(self.cfg, self.model, world, ranks_per_node=local_world_size())
        except UserError:
            return None

    @functools.cached_property
    def lossless(self) -> bool:
        """Every rank's synchronized gradient (and the parameters the next forward reads) is the exact mean: its
        schedule's answer (`Schedule.exact`); a strategy without one is not known to be exact."""
        return self.schedule_now is not None and self.schedule_now.exact

    def close(self) -> None:
        """Release what the handle made besides the model's parameters: its hooks on the model, its threads, its
        process groups. A collective (every rank calls it); the handle is not used again. Nothing here."""

    def no_sync(self) -> AbstractContextManager:
        """Inside: backward accumulates locally and communicates nothing (all but the last micro-batch)."""
        return nullcontext()

    def wait(self) -> None:
        """Block until every gradient is averaged across ranks; the time spent here is exposed communication."""

    def optimizer_groups(self) -> list[list[torch.Tensor]]:
        """What the optimizer updates, one list per group given to `attach` (`param_groups`): the model's parameters
        (a sharded strategy: this rank's shards of them, never mixing groups)."""
        return [list(g) for g in self.groups]

    def optimizer_params(self) -> list[torch.Tensor]:
        """`optimizer_groups()` as one list."""
        return [p for g in self.optimizer_groups() for p in g]

    def check_optimizer_once(self, optimizer: torch.optim.Optimizer | None) -> None:
        """`check_optimizer` at the first step the loop passes its optimizer (`stepped`), not at every step."""
        if optimizer is not None and not self._optimizer_checked:
            self.check_optimizer(optimizer)
            self._optimizer_checked = True

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """A one-line error unless `optimizer` updates what this handle's gradients land in, group by group
        (`optimizer_groups()`): an optimizer built over the model's parameters before a strategy that shards them
        (or replaces them, as fsdp2 does) would otherwise update nothing, or decay what it does not see."""
        held = [[id(p) for p in g["params"]] for g in optimizer.param_groups]
        mine = [[id(p) for p in g] for g in self.optimizer_groups()]
        if held != mine:
            raise UserError(f"optimizer.step: under sync.strategy '{self.name}' the optimizer must update "
                            "handle.optimizer_groups() (one group per group given to attach), not the parameters it "
                            "was built over; build it from those, or use dtrain.collectives.wrap(model, optimizer, "
                            "sync), which points the loop's own optimizer at them")

    def grad_norm(self, exact: bool = False) -> torch.Tensor:
        """The L2 norm of the synchronized gradient, equal on every rank (call after `wait()`); see `total_norm`.
        `exact`: the same float32 value however the gradient is split over ranks (when the norm scales the update,
        as clipping does)."""
        return total_norm([p.grad for p in self.optimizer_params() if p.grad is not None], exact=exact)

    def stepped(self, optimizer: torch.optim.Optimizer | None = None, loss: float | None = None) -> None:
        """The optimizer has updated `optimizer_params()`: a sharded strategy starts sending the updated shards now
        rather than when the next forward starts (the next forward waits, module by module, for what it needs).
        `attach`'s search needs the call, with the loop's `optimizer` where a candidate shards the parameters: it
        switches candidates here, and moves the optimizer's state when what the optimizer updates changes; with
        lossy candidates (`sync.tune.lossy`) it judges them by the step's mean `loss`."""

    def suspend(self) -> None:
        """Another handle trains the model for now (`attach`'s search): free what `resume()` can rebuild."""

    def resume(self) -> None:
        """This handle trains the model again: rebuild what `suspend()` freed (before its step is timed)."""

    def wait_params(self) -> None:
        """Block until the model's parameters are current on this rank (before validation or a checkpoint)."""

    def model_state(self) -> dict:
        """The whole model's state dict, on every rank (after `wait_params()`; a collective for fsdp2, whose
        parameters are shards)."""
        return self.model.state_dict()

    def load_model_state(self, state: dict) -> None:
        """Load a whole-model state dict (`model_state()`'s form, as every checkpoint holds), on every rank."""
        self.model.load_state_dict(state)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        """The optimizer's state dict as if it updated the whole model (a collective for a sharded strategy)."""
        return optimizer.state_dict()

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """Load a state dict of `optimizer_state()`'s form, whatever the world size that wrote it."""
        optimizer.load_state_dict(self.local_optimizer_state(optimizer, state))

    def local_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> dict:
        """`state` (`optimizer_state()`'s form) as `optimizer`'s own state dict over `optimizer_groups()`, for
        `optimizer.load_state_dict`: itself where the optimizer updates the whole parameters."""
        return state

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The model's `zero_grad`, as the loop calls it on the model (`dtrain.collectives.wrap`)."""
        self.model.zero_grad(set_to_none)

    def state_dict(self) -> dict:
        """This rank's state of the strategy itself, for a checkpoint (tensors and plain data, keyed so that it
        survives a new bucket layout); empty for a strategy that carries nothing from step to step."""
        return {}

    def load_state_dict(self, state: dict, own: bool = True) -> None:
        """Restore a `state_dict()`, before the first step. `own`: False when it is another rank's (this rank has
        none of its own, as after a change of world size): only what every rank holds alike is taken from it."""

    def step_records(self) -> list[BucketRecord]:
        """Per-bucket records of the step just synchronized, drained by the trainer after `wait()` and written to
        `<run>/buckets.jsonl` with the step number (bytes, class, dtype, ready/launch/complete times ...)."""
        return []

    def stats(self) -> dict:
        """Per-strategy facts for the run header (bucket count, sizes ...)."""
        return {"strategy": self.name, "lossless": self.lossless, "communicates": self.communicates,
                "schedule": self.schedule_now.lines() if self.schedule_now is not None else None}


def first_tensor(out, requires_grad: bool = False) -> torch.Tensor | None:
    """The first tensor in a model's output (a tensor, a tuple or list, a dict, a Hugging Face `ModelOutput`), or the
    first that requires a gradient: its gradient is among the first backward computes."""
    if isinstance(out, torch.Tensor):
        return out if out.requires_grad or not requires_grad else None
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (list, tuple)):
        return next((t for t in (first_tensor(o, requires_grad) for o in out) if t is not None), None)
    return None


def param_groups_of(model: nn.Module, groups: list[list[nn.Parameter]] | None) -> list[list[nn.Parameter]]:
    """`groups` (lists of `model`'s own parameters, as a loop builds its optimizer's groups) checked against the model,
    or one group of all its parameters. A tensor that is not one of the model's parameters, or one named in two
    groups, is a one-line error."""
    if groups is None:
        return [list(model.parameters())]
    own = {id(p) for p in model.parameters()}
    seen: set[int] = set()
    for i, group in enumerate(groups):
        for p in group:
            if id(p) not in own:
                raise UserError(f"optimizer group {i} holds a tensor of shape {tuple(p.shape)} that is not one of the "
                                "model's parameters: build the optimizer over the model's own parameters")
            if id(p) in seen:
                raise UserError(f"optimizer group {i} holds a parameter of shape {tuple(p.shape)} that an earlier "
                                "group holds too")
            seen.add(id(p))
    return [list(g) for g in groups]


def move_optimizer(optimizer: torch.optim.Optimizer, state: dict, handle: GradSync) -> None:
    """Point each of `optimizer`'s groups at that group of `handle.optimizer_groups()` and load `state` (the
    whole-model form of `optimizer_state`, from any handle) into it: the optimizer follows the model to another
    strategy between steps, as a checkpoint would carry it; each group keeps its own options."""
    optimizer.state.clear()
    for group, params in zip(optimizer.param_groups, handle.optimizer_groups(), strict=True):
        group["params"] = params
    handle.load_optimizer_state(optimizer, state)


def total_norm(grads: list[torch.Tensor], exact: bool = False, group: dist.ProcessGroup | None = None,
               sharded: bool = False) -> torch.Tensor:
    """The L2 norm of `grads` as a float32 0-dim tensor; with `sharded`, each rank holds a disjoint part and the
    sums of squares are all-reduced over `group`.

    `exact` sums the squares in float64: the square of a float32 is exact there, so the sum hardly depends on its
    order and any split of the gradient gives the same float32 norm (a different norm would scale a clipped update
    differently, and Adam carries the difference on). Otherwise torch's float32 norm of the per-tensor norms, which
    is cheaper but depends on how the gradient is split into tensors."""
    device = grads[0].device if grads else torch.device("cpu")
    if not (exact or sharded):
        return torch.nn.utils.get_total_norm(grads).to(device) if grads else torch.zeros((), device=device)
    dtype = torch.float64 if exact else torch.float32
    squares = torch.zeros((), dtype=dtype, device=device)
    for g in grads:
        flat = g.reshape(-1).to(dtype)  # (numel,) exact: a float64 copy, whose products are exact
        squares += torch.dot(flat, flat)
    if sharded:
        dist.all_reduce(squares, group=group)
    return squares.sqrt().float()
