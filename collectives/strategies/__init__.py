"""Registry of gradient synchronization strategies: `register(name)`, `available()`, `build(name, ...)`, and
`plan_for(sync, params)`, the one bucket plan of a sync section that training, the cost model and the simulator use.

A registered class is either a `GradSync` subclass (ddp, powersgd, noop: they synchronize by themselves) or a
`BucketingStrategy` (per_tensor, flat, bucketed, per_class: a pure plan that `PlannedSync` executes with the reducer).
"""

from __future__ import annotations

from typing import NamedTuple

from collectives import tensor_classes
from collectives.plan import Bucket, BucketingStrategy
from common.errors import UserError

_REGISTRY: dict[str, type] = {}


def register(name: str):
    def deco(cls):
        if name in _REGISTRY:
            raise ValueError(f"strategy '{name}' is already registered by {_REGISTRY[name].__module__}")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def available() -> list[str]:
    return sorted(_REGISTRY)


def get(name: str) -> type:
    if name not in _REGISTRY:
        raise UserError(f"unknown strategy '{name}' for 'sync.strategy' (available: {', '.join(available())})")
    return _REGISTRY[name]


def build(name: str, model, cfg, process_group=None):
    cls = get(name)
    if issubclass(cls, BucketingStrategy):
        return PlannedSync(model, cfg, process_group, cls.from_sync(cfg))
    return cls(model, cfg, process_group)


class Plan(NamedTuple):
    buckets: list[Bucket]  # in launch order
    overlap: bool  # launched from the gradient hooks (else all at wait())
    class_groups: bool  # each tensor class on its own communicator, with its own NCCL settings


def planner(name: str) -> type[BucketingStrategy]:
    """The bucketing strategy whose plan models strategy `name` (itself, or what it `plans_like`)."""
    cls = get(name)
    cls = get(cls.plans_like) if cls.plans_like else cls
    if not (isinstance(cls, type) and issubclass(cls, BucketingStrategy)):
        names = [n for n in available() if get(n).plans_like]
        names += [n for n in available() if issubclass(get(n), BucketingStrategy)]
        raise UserError(f"strategy '{name}' has no bucket plan to model (planned strategies: {', '.join(names)})")
    return cls


def plan_for(sync, named_params) -> Plan:
    """The buckets of `sync` (a `SyncConfig`) over `named_params`, (name, tensor) pairs in expected ready order (meta
    tensors do: only numel and dtype are read)."""
    classes = tensor_classes.from_config(sync)
    class_of = classes.assign(named_params)
    settings = {r.name: classes.setting(r.name) for r in classes.rules}
    strategy = planner(sync.strategy).from_sync(sync)
    return Plan(strategy.plan(named_params, class_of, settings), strategy.overlap, strategy.class_groups)


# Importing the modules registers their strategies; PlannedSync runs the plans.
from collectives.strategies.planned import PlannedSync  # noqa: E402
from collectives.strategies import bucketed, ddp, flat, noop, per_class, per_tensor, powersgd  # noqa: E402,F401
