"""Registry of gradient synchronization strategies: `register(name)`, `available()`, `build(name, ...)`.

A registered class is either a `GradSync` subclass (ddp, powersgd, noop: they synchronize by themselves) or a
`BucketingStrategy` (per_tensor, flat, bucketed, per_class: a pure plan that `PlannedSync` executes with the reducer).
"""

from __future__ import annotations

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
    from common.errors import UserError

    if name not in _REGISTRY:
        raise UserError(f"unknown strategy '{name}' for 'sync.strategy' (available: {', '.join(available())})")
    return _REGISTRY[name]


def build(name: str, model, cfg, process_group=None):
    from collectives.plan import BucketingStrategy
    from collectives.strategies.planned import PlannedSync

    cls = get(name)
    if issubclass(cls, BucketingStrategy):
        return PlannedSync(model, cfg, process_group, cls.from_sync(cfg))
    return cls(model, cfg, process_group)


# Importing the modules registers their strategies.
from collectives.strategies import bucketed, ddp, flat, noop, per_class, per_tensor, powersgd  # noqa: E402,F401
