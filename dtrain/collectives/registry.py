"""The registry of gradient synchronization strategies: `register(name)`, `get(name)`, `available()`,
`attachable()`, `unused_keys(sync)` and `schedule_for(sync, model, world)`, what a sync section's strategy sends in
a step (its own `schedule`), which the tuner, the simulator, the records and the dry run read. It imports none of its
members: each strategy's module registers itself here (`dtrain.collectives.strategies` imports them all, and builds
their handles).

A registered class is either a `GradSync` subclass (ddp, powersgd, noop, fsdp2, auto: they synchronize by themselves)
or a `BucketingStrategy` (per_tensor, flat, bucketed, per_class: a pure plan that `PlannedSync` executes with the
reducer; sharded: one that `ShardedSync` executes with the sharded reducer). Each declares the `sync` keys it reads
(`sync_keys`); `unused_keys(sync)` names those a profile sets in vain, which `dtrain.collectives.config.validate`
refuses.
"""

from __future__ import annotations

import dataclasses

from dtrain.collectives.settings import ClassSettings, SyncConfig
from dtrain.common.errors import UserError

_REGISTRY: dict[str, type] = {}

# What strategies declare in `sync_keys` for the keys under each `sync.classes.<class>`. The rule keys say which
# parameters form a class: every strategy that records its buckets labels them with their class. The setting keys
# say how a class's buckets travel (wire dtype, bucket cap, the NCCL choices of its own communicator): only a
# strategy that buckets and sends each class on its own reads them.
CLASS_RULE_KEYS = ("classes.match", "classes.min_numel", "classes.max_numel")
# The hierarchical plan (`dtrain.collectives.hierarchy`), which the planned strategies without class groups offer.
HIERARCHY_KEYS = ("hierarchical", "ranks_per_node")
CLASS_SETTING_KEYS = tuple(f"classes.{f.name}" for f in dataclasses.fields(ClassSettings)
                           if f"classes.{f.name}" not in CLASS_RULE_KEYS)


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


def attachable() -> list[str]:
    """The strategies `attach` builds, each on its own (`auto`, a search over them, is attached too)."""
    return [n for n in available() if not _REGISTRY[n].searches]


def get(name: str) -> type:
    if name not in _REGISTRY:
        raise UserError(f"unknown strategy '{name}' for 'sync.strategy' (available: {', '.join(available())})")
    return _REGISTRY[name]


def _is_default(f: dataclasses.Field, value) -> bool:
    default = f.default_factory() if f.default is dataclasses.MISSING else f.default
    return value == default


def unused_keys(sync: SyncConfig) -> list[tuple[str, str]]:
    """(dotted key, message) for every key of `sync` set to a non-default value that its strategy does not read
    (its `sync_keys`). A key at its default counts as not set: a resolved config (config.yaml) names every key."""
    if sync.strategy not in _REGISTRY:
        return []  # the unknown name is the error to report
    used = _REGISTRY[sync.strategy].sync_keys
    found = [f"sync.{f.name}" for f in dataclasses.fields(SyncConfig)
             if f.name not in ("strategy", "classes") and f.name not in used
             and not _is_default(f, getattr(sync, f.name))]
    for name, spec in sync.classes.items():
        found += [f"sync.classes.{name}.{f.name}" for f in dataclasses.fields(ClassSettings)
                  if f"classes.{f.name}" not in used and not _is_default(f, getattr(spec, f.name))]
    own = [f"sync.{k}" for k in used if not k.startswith("classes.")]
    class_keys = [k.split(".", 1)[1] for k in used if k.startswith("classes.")]
    if class_keys:
        own.append(f"sync.classes.<class>.({', '.join(class_keys)})")
    return [(key, f"is not used by strategy '{sync.strategy}' (its keys: {', '.join(own) or 'none'})")
            for key in found]


def schedule_for(sync, model, world: int, accum_steps: int = 1, ranks_per_node: int | None = None):
    """The schedule of `sync`'s strategy on `model` (meta tensors do) and `world` ranks: what it sends in a step
    (`StrategyFacts.schedule`; a one-line error for a strategy without one)."""
    return get(sync.strategy).schedule(sync, model, world, accum_steps, ranks_per_node)
