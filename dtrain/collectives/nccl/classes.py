"""Each tensor class's NCCL choices, from their one home in the profile: `sync.classes.<name>` (protocol, algorithm,
min_ctas, max_ctas), field by field over `collectives.default`."""

from __future__ import annotations

from dtrain.collectives.nccl.settings import as_record, class_nccl, describe
from dtrain.collectives.settings import NCCL_KEYS, ClassSettings, CollectivesConfig, SyncConfig
from dtrain.collectives.tensor_classes import from_config
from dtrain.common.errors import UserError


def class_names(sync: SyncConfig) -> list[str]:
    """Every tensor class a per-class strategy may create a group for, in rule order."""
    return [r.name for r in from_config(sync).rules]


def merge(*layers: ClassSettings) -> ClassSettings:
    """The NCCL keys, field by field: the first layer that sets a value wins (the other keys stay unset)."""
    return ClassSettings(**{k: next((getattr(s, k) for s in layers if getattr(s, k) is not None), None)
                            for k in NCCL_KEYS})


def resolve(sync: SyncConfig, coll: CollectivesConfig, name: str, passed=None) -> ClassSettings:
    """Class `name`'s NCCL choices: what the strategy passed to `class_group` (a class's `ClassSettings` or its
    `.nccl()` mapping; None: the profile's `sync.classes.<name>`), then `collectives.default`."""
    own = class_nccl(sync.classes.get(name) if passed is None else passed)
    if coll.mode == "global" and own.nccl():
        raise UserError(f"'sync.classes.{name}' sets NCCL choices ({describe(own)}), which need "
                        f"collectives.mode per_group or tuner")
    return merge(own, coll.default)


def resolved(sync: SyncConfig, coll: CollectivesConfig) -> dict[str, ClassSettings]:
    """Every class's NCCL choices as the profile requests them (`resolve` of each of `class_names`)."""
    return {n: resolve(sync, coll, n) for n in class_names(sync)}


def requested(sync: SyncConfig, coll: CollectivesConfig) -> dict[str, dict]:
    """{class: {protocol, algorithm, min_ctas, max_ctas}} as requested: for the run header and the cost model."""
    return {n: as_record(s) for n, s in resolved(sync, coll).items()}
