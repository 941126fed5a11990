"""The bucket plan of a profile's model, built on meta tensors: what the simulator replays and `dtrain.analysis.recommend`
searches over.

The parameters come in the expected gradient-ready order (`dtrain.collectives.plan.ready_order`, the reverse of
registration) and the schedule is the strategy's own (`dtrain.collectives.strategies.schedule_for`), so no memory is
spent even for the `big` model.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from dtrain.collectives import strategies
from dtrain.collectives.plan import ready_order
from dtrain.collectives.schedule import Schedule
from dtrain.collectives.settings import ClassSettings
from dtrain.engine.model import Transformer


@functools.lru_cache(maxsize=8)
def _meta_model(model_cfg, vocab: int) -> Transformer:
    with torch.device("meta"):
        return Transformer.from_config(model_cfg, vocab)


def meta_model(cfg, vocab: int | None = None) -> Transformer:
    """`cfg`'s model on meta tensors (no memory), whose schedule a prediction plays; `vocab` defaults to the
    profile's."""
    return _meta_model(cfg.model, vocab or cfg.data.vocab_size)


@functools.lru_cache(maxsize=8)
def _ready_params(model_cfg, vocab: int) -> tuple:
    """The model's parameters as meta tensors, in the expected gradient-ready order (dtrain.collectives.plan)."""
    return tuple(ready_order(_meta_model(model_cfg, vocab)))


def ready_params(cfg, vocab: int | None = None) -> tuple:
    """(name, meta parameter) pairs of `cfg`'s model in expected ready order; `vocab` defaults to the profile's."""
    return _ready_params(cfg.model, vocab or cfg.data.vocab_size)


def sync_for(cfg, strategy: str | None = None, bucket_cap_mb: float | None = None,
             classes: dict[str, dict] | None = None):
    """`cfg.sync` under `strategy` (default: the profile's) and `bucket_cap_mb`; `classes` overrides
    `sync.classes.<class>` settings ({class: {"bucket_cap_mb": 4}} ...)."""
    merged = dict(cfg.sync.classes or {})
    for c, over in (classes or {}).items():
        merged[c] = dataclasses.replace(merged.get(c, ClassSettings()), **over)
    return dataclasses.replace(cfg.sync, strategy=strategy or cfg.sync.strategy, classes=merged,
                               bucket_cap_mb=bucket_cap_mb if bucket_cap_mb is not None else cfg.sync.bucket_cap_mb)


def schedule_of(cfg, strategy: str | None = None, bucket_cap_mb: float | None = None,
                classes: dict[str, dict] | None = None, vocab: int | None = None, world: int = 2,
                ranks_per_node: int | None = None) -> Schedule:
    """The schedule of `cfg`'s model (meta tensors) under `sync_for(cfg, strategy, bucket_cap_mb, classes)` on
    `world` ranks (`ranks_per_node` of them a node): its buckets in launch order as training runs them after its
    first step, whether each class has its own group, what each collective sends."""
    return strategies.schedule_for(sync_for(cfg, strategy, bucket_cap_mb, classes), meta_model(cfg, vocab), world,
                                   cfg.train.accum_steps, ranks_per_node)
