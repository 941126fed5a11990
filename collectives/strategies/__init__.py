"""Registry of gradient synchronization strategies: `register(name)` on a `GradSync` subclass, `build(name, ...)`."""

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


def build(name: str, model, cfg, process_group=None):
    from dtrain.errors import UserError

    if name not in _REGISTRY:
        raise UserError(f"unknown strategy '{name}' for 'sync.strategy' (available: {', '.join(available())})")
    return _REGISTRY[name](model, cfg, process_group)


# Importing the modules registers their strategies.
from collectives.strategies import ddp, noop  # noqa: E402,F401
