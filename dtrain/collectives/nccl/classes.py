"""Each tensor class's NCCL choices, from their one home in the profile: `sync.classes.<name>` (protocol, algorithm,
min_ctas, max_ctas), field by field over `collectives.default`."""

from __future__ import annotations

import dataclasses

from dtrain.collectives.nccl.settings import NCCL_KEYS, class_nccl, describe
from dtrain.collectives.settings import NcclSettings
from dtrain.collectives.tensor_classes import from_config
from dtrain.common.errors import UserError


def class_names(cfg) -> list[str]:
    """Every tensor class a per-class strategy may create a group for, in rule order."""
    return [r.name for r in from_config(cfg.sync).rules]


def merge(*layers: NcclSettings) -> NcclSettings:
    """Field by field, the first layer that sets a value wins."""
    return NcclSettings(**{k: next((getattr(s, k) for s in layers if getattr(s, k) is not None), None)
                           for k in NCCL_KEYS})


def resolve(cfg, name: str, passed=None) -> NcclSettings:
    """Class `name`'s NCCL choices: what the strategy passed to `class_group` (a class's `ClassSettings`, its `.nccl()`
    mapping or NcclSettings; None: the profile's `sync.classes.<name>`), then `collectives.default`."""
    c = cfg.collectives
    own = class_nccl(cfg.sync.classes.get(name) if passed is None else passed)
    if c.mode == "global" and own != NcclSettings():
        raise UserError(f"'sync.classes.{name}' sets NCCL choices ({describe(own)}), which need "
                        f"collectives.mode per_group or tuner")
    return merge(own, c.default)


def resolved(cfg) -> dict[str, NcclSettings]:
    """Every class's NCCL choices as the profile requests them (`resolve` of each of `class_names`)."""
    return {n: resolve(cfg, n) for n in class_names(cfg)}


def requested(cfg) -> dict[str, dict]:
    """{class: {protocol, algorithm, min_ctas, max_ctas}} as requested: for the run header and the cost model."""
    return {n: dataclasses.asdict(s) for n, s in resolved(cfg).items()}
