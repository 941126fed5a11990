"""DDP comm hooks: the one a profile names in `sync.hook`, and the project's per-class hook for anyone's DDP.

A DDP comm hook is `hook(state, bucket) -> Future[Tensor]`, registered with `DistributedDataParallel
.register_comm_hook(state, hook)`; DDP calls it once per gradient bucket (a `GradBucket`: `buffer()`, the flat
gradients; `parameters()`, `gradients()`, `index()`, `is_last()`) and copies the future's tensor back (torch docs,
"DDP Communication Hooks").

`sync.hook` (for strategy `ddp`) is a name, or a mapping {name, wraps, state}, checked here (`hook_problems`):

    hook: bf16_compress                                     # a short name: STOCK_HOOKS, or per_class
    hook: {name: torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.batched_powerSGD_hook,
           state: {matrix_approximation_rank: 1, start_powerSGD_iter: 2}}
    hook: {name: torch.distributed.algorithms.ddp_comm_hooks.default_hooks.bf16_compress_wrapper,
           wraps: powersgd, state: {matrix_approximation_rank: 2}}

A dotted name must lie under `torch.distributed.algorithms.ddp_comm_hooks` (nothing else is imported). A hook whose
state is a process group gets the strategy's group; one whose state is an object (PowerSGDState, PostLocalSGDState)
gets it built from `state` (its keyword arguments, checked against the class's signature; a ProcessGroup argument
such as post-local SGD's `subgroup` takes a group size: the ranks split into groups of that many, in order). A wrapper
(a function of one `hook`) takes the hook it wraps from `wraps`, and that hook's state.

`per_class_hook(model, sync)` is the project's per-class behaviour as a comm hook: each bucket's gradients go grouped
by tensor class (`dtrain.collectives.tensor_classes`), each class on its own process group (`dtrain.collectives.nccl.class_group`,
where its NCCL settings hang) in its wire dtype. DDP still decides the buckets, so a class's `bucket_cap_mb` and
`tied_split` do not apply.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import typing
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, post_localSGD_hook, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from dtrain.collectives import nccl
from dtrain.collectives import tensor_classes as tc
from dtrain.collectives.settings import SyncConfig
from dtrain.common.errors import UserError

TORCH_HOOKS = "torch.distributed.algorithms.ddp_comm_hooks"
STOCK_HOOKS = {  # short names of torch's hooks
    "allreduce": default_hooks.allreduce_hook,
    "fp16_compress": default_hooks.fp16_compress_hook,
    "bf16_compress": default_hooks.bf16_compress_hook,
    "powersgd": powerSGD_hook.powerSGD_hook,
}
PER_CLASS = "per_class"  # sync.hook naming `per_class_hook`
# The sync.classes.<class> keys the per-class hook reads (DDP's buckets make bucket_cap_mb and tied_split moot).
PER_CLASS_KEYS = ("classes.wire_dtype", "classes.protocol", "classes.algorithm", "classes.min_ctas",
                  "classes.max_ctas")

# What travels on the wire, for the bucket records; hooks not listed are named after themselves.
_WIRE = {default_hooks.allreduce_hook: "fp32", default_hooks.fp16_compress_hook: "fp16",
         default_hooks.bf16_compress_hook: "bf16", default_hooks.fp16_compress_wrapper: "fp16",
         default_hooks.bf16_compress_wrapper: "bf16", powerSGD_hook.powerSGD_hook: "powersgd",
         powerSGD_hook.batched_powerSGD_hook: "powersgd"}
# Hooks that issue their bucket's one collective from the hook itself. Any other may chain collectives from the
# backend's callback threads, and then runs one bucket at a time (`dtrain.collectives.strategies.ddp`).
_ONE_COLLECTIVE = {default_hooks.allreduce_hook, default_hooks.fp16_compress_hook, default_hooks.bf16_compress_hook,
                   post_localSGD_hook.post_localSGD_hook}


class HookError(UserError):
    """A bad `sync.hook`: the dotted key and the message, for `dtrain.collectives.config` to place at its line."""

    def __init__(self, key: str, msg: str):
        super().__init__(f"'{key}' {msg}")
        self.key, self.msg = key, msg


@dataclass(frozen=True)
class ResolvedHook:
    """What `sync.hook` names, checked, before anything is created."""

    label: str  # the name as given (a wrapper: "wrapper(wrapped)")
    fn: Callable  # the hook to register: the wrapper already applied
    state_cls: type | None  # the state object to build; None: the process group is the state
    state_kwargs: dict
    wire: str  # BucketRecord.wire_dtype; whether the result is the exact mean is DDP's schedule's to say
    one_collective: bool
    per_class: bool = False


# A hook's mapping: `name`, a short name (STOCK_HOOKS, per_class) or a dotted one under TORCH_HOOKS; `wraps`, for a
# wrapper (fp16_compress_wrapper, bf16_compress_wrapper), the hook it wraps; `state`, the keyword arguments of the
# (wrapped) hook's state object. A plain string is `{name: <string>}`.
HOOK_KEYS = {"name": str, "wraps": str, "state": dict}


def _spec(hook: str | dict | None) -> tuple[str | None, str | None, dict] | None:
    """`sync.hook`'s (name, wraps, state), each checked for its type (a plain string is the name alone)."""
    if hook is None or isinstance(hook, str):
        return None if hook is None else (hook, None, {})
    for key, value in hook.items():
        if key not in HOOK_KEYS:
            near = difflib.get_close_matches(str(key), HOOK_KEYS, n=1)
            hint = f"; did you mean 'sync.hook.{near[0]}'?" if near else ""
            raise HookError(f"sync.hook.{key}",
                            f"is not a key of a hook's mapping{hint} (known: {', '.join(HOOK_KEYS)})")
        if value is not None and not isinstance(value, HOOK_KEYS[key]):
            need = "a mapping" if HOOK_KEYS[key] is dict else "a string"
            raise HookError(f"sync.hook.{key}", f"must be {need}, got {value!r}")
    return hook.get("name"), hook.get("wraps"), hook.get("state") or {}


def hook_name(hook: str | dict | None) -> str | None:
    try:
        spec = _spec(hook)
    except HookError:  # a bad mapping names no hook; validation reports it
        return None
    return None if spec is None else spec[0]


def _lookup(name: str, key: str) -> Callable:
    """A short name, or a dotted name imported from under TORCH_HOOKS."""
    if name in STOCK_HOOKS:
        return STOCK_HOOKS[name]
    short = ", ".join(list(STOCK_HOOKS) + [PER_CLASS])
    if not name.startswith(TORCH_HOOKS + "."):
        raise HookError(key, f"must be one of {short} or a dotted name under {TORCH_HOOKS}, got '{name}'")
    module, _, attr = name.rpartition(".")
    try:
        fn = getattr(importlib.import_module(module), attr, None)
    except ImportError:
        fn = None
    if not callable(fn):
        raise HookError(key, f"'{name}' is not in this PyTorch ({torch.__version__})")
    return fn


def _is_wrapper(fn: Callable) -> bool:
    return list(inspect.signature(fn).parameters) == ["hook"]


def _state_class(fn: Callable, key: str) -> type | None:
    """The class of the hook's first argument; None when it is a process group (or untyped)."""
    params = list(inspect.signature(fn).parameters)
    if len(params) != 2:
        raise HookError(key, f"'{fn.__module__}.{fn.__name__}' is not a DDP comm hook (state, bucket) nor a "
                             f"wrapper of one")
    try:
        hint = typing.get_type_hints(fn).get(params[0], typing.Any)
    except (NameError, TypeError):  # an annotation this PyTorch cannot evaluate: treat it as untyped
        hint = typing.Any
    if hint is typing.Any or hint is object or not isinstance(hint, type) or issubclass(hint, dist.ProcessGroup):
        return None
    return hint


def _check_state(cls: type | None, kwargs: dict, label: str) -> None:
    key = "sync.hook.state"
    if cls is None:
        if kwargs:
            raise HookError(f"{key}.{next(iter(kwargs))}", f"is not an option of '{label}': its state is the "
                                                           "process group")
        return
    sig = inspect.signature(cls.__init__)
    known = [p for p in list(sig.parameters)[1:] if p != "process_group"]
    for k, v in kwargs.items():
        if k not in known:
            raise HookError(f"{key}.{k}", f"is not an option of {cls.__name__} (its options: {', '.join(known)})")
        if not isinstance(v, (bool, int, float, str)) and v is not None:
            raise HookError(f"{key}.{k}", f"must be a number, a boolean or a string, got {v!r}")
    for p in known:
        if sig.parameters[p].default is inspect.Parameter.empty and p not in kwargs:
            raise HookError(f"{key}.{p}", f"is required by {cls.__name__} (for '{label}')")


def resolve(hook: str | dict | None) -> ResolvedHook | None:
    """Check `sync.hook` and say what it names; a `HookError` names the bad key."""
    spec = _spec(hook)
    if spec is None:
        return None
    name, wraps, state = spec
    if not name:
        raise HookError("sync.hook.name", "is required: a hook's short or dotted name")
    key = "sync.hook.name" if isinstance(hook, dict) else "sync.hook"
    if name == PER_CLASS:
        if wraps is not None or state:
            raise HookError("sync.hook.wraps" if wraps else "sync.hook.state",
                            "is not an option of per_class (its options are sync.classes.<class>)")
        return ResolvedHook(PER_CLASS, per_class_allreduce_hook, None, {}, "per_class", True, True)
    fn = _lookup(name, key)
    if _is_wrapper(fn):
        if wraps is None:
            raise HookError("sync.hook.wraps", f"is required: '{name}' wraps another hook (name it)")
        inner = _lookup(wraps, "sync.hook.wraps")
        if wraps == PER_CLASS or _is_wrapper(inner):
            raise HookError("sync.hook.wraps", f"must name a hook of torch's, not '{wraps}'")
        cls = _state_class(inner, "sync.hook.wraps")
        label = f"{name.rsplit('.', 1)[-1]}({wraps.rsplit('.', 1)[-1]})"
        _check_state(cls, state, label)
        inner_wire = _WIRE.get(inner, inner.__name__.removesuffix("_hook"))
        wire = _WIRE.get(fn, fn.__name__)
        wire = wire if inner_wire == "fp32" else f"{inner_wire}-{wire}"
        # A compress wrapper casts around the wrapped hook's collectives: it issues what that hook issues
        return ResolvedHook(label, fn(inner), cls, dict(state), wire, inner in _ONE_COLLECTIVE)
    if wraps is not None:
        raise HookError("sync.hook.wraps", f"is only for a wrapper hook; '{name}' wraps nothing")
    cls = _state_class(fn, key)
    _check_state(cls, state, name)
    return ResolvedHook(name, fn, cls, dict(state), _WIRE.get(fn, fn.__name__.removesuffix("_hook")),
                        fn in _ONE_COLLECTIVE)


def hook_problems(sync: SyncConfig) -> list[tuple[str, str]]:
    """(dotted key, message) for a bad `sync.hook`, for `dtrain.collectives.config.validate`."""
    try:
        resolve(sync.hook)
    except HookError as e:
        return [(e.key, e.msg)]
    return []


def build_state(resolved: ResolvedHook, model, sync: SyncConfig, process_group=None):
    """The state to register the hook with (collective: every rank, the same order). `model`: the module DDP
    wraps."""
    group = process_group if process_group is not None else dist.group.WORLD
    if resolved.per_class:
        return PerClassState(model, sync, process_group)
    if resolved.state_cls is None:
        return group
    kwargs = dict(resolved.state_kwargs)
    sig = inspect.signature(resolved.state_cls.__init__)
    hints = typing.get_type_hints(resolved.state_cls.__init__) if sig.parameters else {}
    for name in sig.parameters:  # e.g. post-local SGD's subgroup: given as a group size
        if name != "process_group" and (hints.get(name) is dist.ProcessGroup or name == "subgroup"):
            kwargs[name] = _subgroup(group, kwargs.get(name), f"sync.hook.state.{name}")
    return resolved.state_cls(process_group=group, **kwargs)


def _subgroup(group, size, key: str):
    """This rank's group among consecutive groups of `size` ranks of `group` (None: one group per node, as
    torch.distributed.new_subgroups makes them)."""
    if size is None:
        return dist.new_subgroups()[0]
    ranks = dist.get_process_group_ranks(group)
    if not isinstance(size, int) or isinstance(size, bool) or size < 1 or len(ranks) % size:
        raise HookError(key, f"must be a group size that divides the {len(ranks)} ranks, got {size!r}")
    return dist.new_subgroups_by_enumeration([ranks[i: i + size] for i in range(0, len(ranks), size)])[0]


# ---------------------------------------------------------------------------------------------------------------
# The per-class hook


class PerClassState:
    """The per-class hook's state: each parameter's tensor class, each class's process group and wire dtype.

    Creating it creates one process group per class the model's parameters fall into, in rule order, on every rank
    (a collective call, as the `per_class` strategy does)."""

    def __init__(self, model, sync: SyncConfig, process_group=None):
        if isinstance(model, DistributedDataParallel):
            model = model.module  # the parameter names the class rules match, without DDP's "module." prefix
        classes = tc.from_config(sync)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        of_name = classes.assign(named)
        self.class_of = {p: of_name[n] for n, p in named}  # keyed by the parameter tensor itself
        self.settings = classes.used(of_name)
        for c, s in self.settings.items():
            if s.tied_split:
                raise UserError(f"'sync.classes.{c}.tied_split' does not apply to the per_class comm hook: DDP "
                                "synchronizes each gradient whole (use sync.strategy per_class)")
        self.wire = {c: s.torch_wire_dtype for c, s in self.settings.items()}
        self.world = dist.get_world_size(process_group)
        ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
        self.groups = {c: nccl.class_group(c, self.settings[c], ranks) for c in self.settings}


def per_class_hook(model, sync: SyncConfig, process_group=None) -> tuple[PerClassState, Callable]:
    """(state, hook) for `DistributedDataParallel.register_comm_hook(state, hook)`: the classes, groups and wire
    dtypes of `sync` (a `SyncConfig`; its `sync.classes`) over `model` (the module DDP wraps, or the DDP itself)."""
    return PerClassState(model, sync, process_group), per_class_allreduce_hook


def _class_spans(state: PerClassState, bucket) -> dict[str, list[tuple[int, int]]]:
    """{class: [(offset, numel), ...]} of the bucket's flat buffer, classes in order of first appearance (the bucket
    layout, hence this order, is the same on every rank). DDP lays the gradients out back to back in parameter
    order."""
    spans: dict[str, list[tuple[int, int]]] = {}
    offset = 0
    for p, g in zip(bucket.parameters(), bucket.gradients()):
        spans.setdefault(state.class_of[p], []).append((offset, g.numel()))
        offset += g.numel()
    return spans


def per_class_allreduce_hook(state, bucket):  # no annotations: DDP checks them, and they would be strings here
    """`state`: a `PerClassState`; `bucket`: DDP's GradBucket; returns a Future of the averaged bucket.

    All-reduce one DDP bucket's gradients class by class, each on its class's group in its wire dtype, and
    average: the `per_class` strategy's arithmetic (the reducer's): fp32 and bf16 are summed, then divided by the
    world size; fp16 is divided first so that its sum cannot overflow. With every class in fp32 the result is the
    exact mean."""
    buffer = bucket.buffer()  # (numel,) the bucket's flat gradients
    parts = []
    for c, segs in _class_spans(state, bucket).items():
        start, (last, n_last) = segs[0][0], segs[-1]
        contiguous = last + n_last - start == sum(n for _, n in segs)
        # (class numel,) a view when the class's gradients sit together in the bucket, else a gathered copy
        flat = buffer[start: last + n_last] if contiguous else torch.cat([buffer[o: o + n] for o, n in segs])
        wire = flat if state.wire[c] == flat.dtype else flat.to(state.wire[c])
        if wire is not flat and wire.dtype == torch.float16:
            wire.div_(state.world)
        fut = dist.all_reduce(wire, group=state.groups[c], async_op=True).get_future()
        parts.append((segs, flat, wire, contiguous, fut))

    def averaged(_):
        for segs, flat, wire, contiguous, fut in parts:
            fut.value()  # re-raises a failed collective
            if wire is not flat:
                flat.copy_(wire)  # cast back
            if wire is flat or wire.dtype != torch.float16:
                flat.div_(state.world)
            if not contiguous:
                k = 0
                for o, n in segs:
                    buffer[o: o + n].copy_(flat[k: k + n])
                    k += n
        return buffer  # DDP copies the future's tensor back into the gradients

    return torch.futures.collect_all([p[-1] for p in parts]).then(averaged)

