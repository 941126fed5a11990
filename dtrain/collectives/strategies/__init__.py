"""Gradient synchronization strategies, each registered by its module in `dtrain.collectives.registry`, and
`build`/`attach`, which make a strategy's handle. Importing this package imports every strategy (and so registers
it); the registry's names are handed on from here for the layers above.

A registered `BucketingStrategy` (per_tensor, flat, bucketed, per_class; `sharded`, whose package builds on these) is
executed by its `handle` class (`PlannedSync` unless it names its own); a registered `GradSync` (ddp, powersgd, noop,
fsdp2) is its own handle. `auto` (`dtrain.collectives.auto`) is a `GradSync` that builds the others through `build`.
`sharded` and `auto` register themselves when `dtrain.collectives` is imported, above this package.
"""

from __future__ import annotations

from dtrain.collectives.registry import (  # noqa: F401 (handed on)
    CLASS_RULE_KEYS, CLASS_SETTING_KEYS, HIERARCHY_KEYS, attachable, available, get, register, schedule_for,
    unused_keys)
from dtrain.collectives.plan import BucketingStrategy
from dtrain.collectives.strategies import (  # noqa: F401 (each registers itself)
    bucketed, ddp, flat, fsdp2, noop, per_class, per_tensor, powersgd)
from dtrain.collectives.strategies.planned import PlannedSync


def build(name: str, model, cfg, process_group=None, param_groups=None):
    cls = get(name)
    if issubclass(cls, BucketingStrategy):
        return (cls.handle or PlannedSync)(model, cfg, process_group, cls.from_sync(cfg), param_groups=param_groups)
    return cls(model, cfg, process_group, param_groups=param_groups)


def attach(model, cfg, process_group=None, param_groups=None):
    """The seam: a `GradSync` handle that synchronizes `model`'s gradients as `cfg` (a `SyncConfig`) says, over
    `process_group` (None: the world). `param_groups`: the loop's optimizer groups as lists of the model's own
    parameters (None: one group), which `handle.optimizer_groups()` maps to what the strategy updates. Exported as
    `collectives.attach`; `dtrain.collectives.wrap` does it for a loop's existing model and optimizer."""
    return build(cfg.strategy, model, cfg, process_group, param_groups)
