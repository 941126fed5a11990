"""`wrap(model, optimizer, sync)`: any strategy in a training loop written for DDP, changed in two lines.

    model = DistributedDataParallel(model)                        # before
    model, optimizer = dtrain.collectives.wrap(model, optimizer, "sharded")   # after (the optimizer built before)

The loop then runs as it did under DDP:

- `loss.backward()`: when it returns, every gradient is the mean over the ranks (the handle's `wait()` runs as
  backward's last callback, where DDP waits for its buckets); `with model.no_sync():` or
  `model.require_backward_grad_sync = False` accumulates a micro-batch without communicating.
- `torch.nn.utils.clip_grad_norm_(model.parameters(), c)` clips as under DDP with every strategy that keeps whole
  gradients on each rank (and `fsdp2`, whose DTensor gradients torch's clipping reduces itself). Under `sharded` each
  rank holds only its shard of the gradient: that call is an error at the first step, naming it, and
  `model.clip_grad_norm_(c)` (as FSDP1's `FullyShardedDataParallel.clip_grad_norm_`) clips by the global norm.
- `optimizer.step()`, `optimizer.zero_grad()`, `model.zero_grad()`: the loop's own optimizer, in any number of
  groups with their own options, now updates what the strategy's gradients land in (a sharding strategy's shards,
  never mixing groups; fsdp2's DTensors) and tells the handle after each step (`stepped`: `sharded` starts its
  all-gathers, `auto` may switch candidates). An `lr_scheduler` holding it keeps working: its groups are the same
  dicts.
- `model.state_dict()` and `optimizer.state_dict()` are DDP's: the whole model under `module.` and the optimizer's
  state as if one rank had updated the whole model, numbered over the loop's groups; `load_state_dict` takes them
  back from any strategy and world size. Under `fsdp2` and `sharded` both are collectives: call them on every rank
  (as FSDP's full state dicts require). `model.module.state_dict()` waits for the parameters' all-gathers first.
- autocast: the forward runs inside whatever autocast the loop opened.

Parameters that do not train (`requires_grad=False`: a frozen layer, a fixed position table) are left alone. The
explicit handle (`attach`, `dtrain.collectives.sync.GradSync`) stays for loops that want control.
"""

from __future__ import annotations

from collections import OrderedDict
from contextlib import ExitStack, contextmanager

import torch
import torch.distributed as dist
from torch import nn

from dtrain.collectives.config import from_dict
from dtrain.collectives.settings import SyncConfig
from dtrain.collectives.strategies import attach
from dtrain.collectives.sync import GradSync, first_tensor
from dtrain.collectives.tensor_classes import with_tied_embedding
from dtrain.common.errors import UserError
from dtrain.common.schema import set_dotted

PREFIX = "module."  # DDP's: a checkpoint of the wrapped model loads into DDP, and DDP's into it


def sync_config(sync: str | dict | SyncConfig) -> SyncConfig:
    """`sync` as a `SyncConfig`: one already, a strategy's name, or a mapping of `sync` keys (dotted keys allowed:
    {"strategy": "sharded", "bucket_cap_mb": 2, "classes.embedding.tied_split": True}), read and checked as a
    profile's `sync` section is (`dtrain.collectives.config.from_dict`)."""
    if isinstance(sync, SyncConfig):
        return sync
    raw: dict = {}
    if isinstance(sync, str):
        raw = {"strategy": sync}
    elif isinstance(sync, dict):
        for key, value in sync.items():
            set_dotted(raw, str(key), value, f"wrap's sync: '{key}'")
    else:
        raise UserError(f"wrap: sync must be a strategy's name, a mapping of sync keys or a SyncConfig, not "
                        f"{type(sync).__name__}")
    sync, _ = from_dict({"sync": raw}, "wrap's sync")
    return sync


def wrap(model: nn.Module, optimizer: torch.optim.Optimizer, sync: str | dict | SyncConfig = "bucketed",
         process_group: dist.ProcessGroup | None = None) -> tuple["Synced", torch.optim.Optimizer]:
    """Attach `sync`'s strategy to `model` over `process_group` (None: the world) and point `optimizer`, built over
    the model's own parameters in any groups, at what the strategy updates. Returns the model to train through
    (DDP's surface, `Synced`) and the same optimizer object (see the module's docstring)."""
    cfg = with_tied_embedding(sync_config(sync), model)
    groups = [list(g["params"]) for g in optimizer.param_groups]
    # An optimizer that has stepped (or loaded a checkpoint) carries its state over: its DDP form, moved below
    saved = optimizer.state_dict() if optimizer.state else None
    handle = attach(model, cfg, process_group, param_groups=groups)
    for group, params in zip(optimizer.param_groups, handle.optimizer_groups(), strict=True):
        group["params"] = params
    if saved is not None:
        optimizer.state.clear()
        handle.load_optimizer_state(optimizer, saved)
    return Synced(model, handle, optimizer), optimizer


class Synced(nn.Module):
    """The model as `wrap` returns it: DDP's surface over a `GradSync` handle (`handle`), the loop's model as
    `module`. `close()` removes what `wrap` added (a collective, like the handle's)."""

    def __init__(self, model: nn.Module, handle: GradSync, optimizer: torch.optim.Optimizer):
        super().__init__()
        self.module = model
        object.__setattr__(self, "handle", handle)  # not a submodule: the parameters keep one path
        object.__setattr__(self, "optimizer", optimizer)
        self._no_sync = ExitStack()  # the handle's no_sync while `require_backward_grad_sync` is False
        self._syncing = True  # the next forward's backward synchronizes
        self._queued = False  # this backward's wait is queued
        self._inside = False  # the handle is using the optimizer: its state-dict hooks leave it alone
        self._hooks = [
            optimizer.register_step_post_hook(self._stepped),
            optimizer.register_state_dict_post_hook(self._whole_optimizer_state),
            optimizer.register_load_state_dict_pre_hook(self._local_optimizer_state),
            model.register_state_dict_pre_hook(lambda *args: handle.wait_params()),
        ]

    # -- training ---------------------------------------------------------------------------------------------

    def forward(self, *args, **kwargs):
        out = self.handle.module(*args, **kwargs)
        if torch.is_grad_enabled() and self._syncing:
            first = first_tensor(out, requires_grad=True)
            if first is not None:  # its gradient is among backward's first: the wait goes after backward's end
                first.register_hook(self._queue_wait)
        return out

    def _queue_wait(self, grad: torch.Tensor) -> None:
        if not self._queued:
            self._queued = True
            # Queued again from the callback, so that it runs after the callbacks the model's own hooks queued
            # during backward (FSDP2 reduce-scatters its root's gradients in one).
            engine = torch.autograd.Variable._execution_engine
            engine.queue_callback(lambda: engine.queue_callback(self._wait))

    def _wait(self) -> None:
        self._queued = False
        self.handle.wait()

    @contextmanager
    def no_sync(self):
        """Forward and backward inside accumulate this rank's gradients without communicating (DDP's)."""
        with self.handle.no_sync():
            self._syncing = False
            try:
                yield
            finally:
                self._syncing = True

    @property
    def require_backward_grad_sync(self) -> bool:
        """DDP's attribute, set by loops that accumulate without `no_sync()`: False until set True again."""
        return self._syncing

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        if not value and self._syncing:
            self._no_sync.enter_context(self.handle.no_sync())
        elif value and not self._syncing:
            self._no_sync.close()
            self._no_sync = ExitStack()
        self._syncing = bool(value)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the synchronized gradients so that their global L2 norm is at most `max_norm`; returns the norm
        before clipping (torch's `clip_grad_norm_` over the whole model, for every strategy)."""
        if float(norm_type) != 2.0:
            raise UserError(f"model.clip_grad_norm_: norm_type {norm_type} is not supported (the L2 norm only)")
        norm = self.handle.grad_norm()
        params = [p for p in self.handle.optimizer_params() if p.grad is not None]
        for kind in {type(p) for p in params}:  # fsdp2's DTensors apart from a whole split matrix
            torch.nn.utils.clip_grads_with_norm_([p for p in params if type(p) is kind], max_norm, norm)
        return norm

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.handle.zero_grad(set_to_none)

    def _stepped(self, optimizer, args, kwargs) -> None:
        self._handle_call(self.handle.stepped, optimizer)

    def _handle_call(self, method, *args):
        """`method(*args)` of the handle, with the optimizer's state-dict hooks off while it runs: the handle reads
        and loads the optimizer's own (local) state dicts itself (`optimizer_state`, `auto`'s switches). None where
        a call is already in progress (the hooks then leave the state dict as it is)."""
        if self._inside:
            return None
        self._inside = True
        try:
            return method(*args)
        finally:
            self._inside = False

    # -- checkpoints --------------------------------------------------------------------------------------------

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """The whole model's state under DDP's `module.` prefix, current on every rank (a collective under fsdp2)."""
        self.handle.wait_params()
        out = OrderedDict() if destination is None else destination
        for key, value in self.handle.model_state().items():
            out[prefix + PREFIX + key] = value
        return out

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """A whole-model state dict, DDP's (`module.` keys) or the bare model's, from any strategy and world size."""
        self.handle.load_model_state({k.removeprefix(PREFIX): v for k, v in state_dict.items()})

    def _whole_optimizer_state(self, optimizer, state: dict) -> dict | None:
        return self._handle_call(self.handle.optimizer_state, optimizer)

    def _local_optimizer_state(self, optimizer, state: dict) -> dict | None:
        return self._handle_call(self.handle.local_optimizer_state, optimizer, state)

    def close(self) -> None:
        """`wrap`'s hooks removed and the handle closed (its hooks, threads and process groups)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._no_sync.close()
        self.handle.close()
