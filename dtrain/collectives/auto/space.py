"""The space `auto` searches: named candidate configurations (dotted `sync` keys), and what each one is: its
`SyncConfig` read strictly (`candidate_sync`), whether its averaged gradient is the exact mean (`is_lossless`),
whether it hands the optimizer shards (`shards`), whether its split applies to a model (`splits_apply`). The search
inside a loop (`dtrain.collectives.auto.search`) and dtrain's trainer (`dtrain.engine.autotune`) read it from here.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from dtrain.collectives import tensor_classes
from dtrain.collectives.tensor_classes import DEFAULT_RULES
from dtrain.collectives.dist import local_world_size
from dtrain.collectives.registry import CLASS_RULE_KEYS, get, unused_keys
from dtrain.collectives.settings import ClassSettings, SyncConfig
from dtrain.collectives.tied_split import unsplittable
from dtrain.common.errors import UserError
from dtrain.common.schema import Source, build as build_section, set_dotted

# The configurations that keep the parameters whole, at caps around the sizes of the base model's tensors. The
# hierarchical plan joins only where the job's nodes hold several ranks (`multi_rank_nodes`).
REPLICATED_SPACE: dict[str, dict[str, Any]] = {
    "ddp-25": {"strategy": "ddp", "bucket_cap_mb": 25},  # stock DDP's defaults
    "ddp-2": {"strategy": "ddp", "bucket_cap_mb": 2},
    "bucketed-0.5": {"strategy": "bucketed", "bucket_cap_mb": 0.5},
    "bucketed-2": {"strategy": "bucketed", "bucket_cap_mb": 2},
    "bucketed-8": {"strategy": "bucketed", "bucket_cap_mb": 8},
    "bucketed-8-first1": {"strategy": "bucketed", "bucket_cap_mb": 8, "first_bucket_mb": 1},
    "bucketed-8-last1": {"strategy": "bucketed", "bucket_cap_mb": 8, "last_bucket_mb": 1},
    "per_class-2-embedding16": {"strategy": "per_class", "bucket_cap_mb": 2, "classes.embedding.bucket_cap_mb": 16},
    "bucketed-0.5-split": {"strategy": "bucketed", "bucket_cap_mb": 0.5, "classes.embedding.tied_split": True},
    "bucketed-2-split": {"strategy": "bucketed", "bucket_cap_mb": 2, "classes.embedding.tied_split": True},
    "bucketed-2-hierarchical": {"strategy": "bucketed", "bucket_cap_mb": 2, "hierarchical": True},
    "bucketed-8-hierarchical": {"strategy": "bucketed", "bucket_cap_mb": 8, "hierarchical": True},
}
# `sharded` at the same caps, with and without the split (and the split sharded by rows): the optimizer updates
# shards, so switching to or from one moves its state (the module's docstring).
SHARDED_SPACE: dict[str, dict[str, Any]] = {
    "sharded-0.5": {"strategy": "sharded", "bucket_cap_mb": 0.5},
    "sharded-2": {"strategy": "sharded", "bucket_cap_mb": 2},
    "sharded-8": {"strategy": "sharded", "bucket_cap_mb": 8},
    "sharded-1-split": {"strategy": "sharded", "bucket_cap_mb": 1, "classes.embedding.tied_split": True},
    "sharded-2-split": {"strategy": "sharded", "bucket_cap_mb": 2, "classes.embedding.tied_split": True},
    "sharded-2-split-rows": {"strategy": "sharded", "bucket_cap_mb": 2, "classes.embedding.tied_split": True,
                             "shard_tied_split": True},
}
# Per-class NCCL choices, only where the job's group runs on NCCL (`per_class`: each tensor class on its own
# communicator, created with its class's NCCL_PROTO/NCCL_ALGO and ncclConfig_t CTA bounds; NCCL's documentation of
# its environment variables and of ncclConfig_t): the small, latency-bound classes on LL in 1 MiB buckets and the
# embedding's large gradient on Simple with at most 16 CTAs; LL128 for every class but the embedding; Tree for all.
_EVERY_CLASS = tuple(r.name for r in DEFAULT_RULES)
NCCL_SPACE: dict[str, dict[str, Any]] = {
    "per_class-1-LL": {"strategy": "per_class", "bucket_cap_mb": 2,
                       "classes.projection.bucket_cap_mb": 1, "classes.projection.protocol": "LL",
                       "classes.norm_bias.bucket_cap_mb": 1, "classes.norm_bias.protocol": "LL",
                       "classes.embedding.protocol": "Simple", "classes.embedding.max_ctas": 16},
    "per_class-2-LL128": {"strategy": "per_class", "bucket_cap_mb": 2,
                          **{f"classes.{c}.protocol": "LL128" for c in _EVERY_CLASS if c != "embedding"}},
    "per_class-2-Tree": {"strategy": "per_class", "bucket_cap_mb": 2,
                         **{f"classes.{c}.algorithm": "Tree" for c in _EVERY_CLASS}},
}
# bf16 exchanges (any candidate with `gather_dtype`): exact only under bf16 autocast, so in the space only where the
# loop is known to train so (the trainer's search; `attach` does not see the loop's autocast).
BF16_SPACE: dict[str, dict[str, Any]] = {
    "sharded-2-split-bf16": {"strategy": "sharded", "bucket_cap_mb": 2, "classes.embedding.tied_split": True,
                             "gather_dtype": "bf16"},
    "sharded-8-split-bf16": {"strategy": "sharded", "bucket_cap_mb": 8, "classes.embedding.tied_split": True,
                             "gather_dtype": "bf16"},
}
# Stock FSDP2 at each reshard setting, and its mixed precision (which rounds every parameter: lossy, searched only
# with `sync.tune.lossy`): `fully_shard` replaces the model's parameters for good, so no search switches it in and
# out; the trainer's search predicts and lists it, never measures it.
FSDP2_SPACE: dict[str, dict[str, Any]] = {
    "fsdp2": {"strategy": "fsdp2"},
    "fsdp2-keep": {"strategy": "fsdp2", "reshard_after_forward": False},
    "fsdp2-bf16": {"strategy": "fsdp2", "gather_dtype": "bf16"},
}
# The one default space of both searches, `attach`'s and the trainer's; `default_space` takes what applies to a job.
DEFAULT_SPACE: dict[str, dict[str, Any]] = {**REPLICATED_SPACE, **SHARDED_SPACE, **NCCL_SPACE, **BF16_SPACE,
                                            **FSDP2_SPACE}


PROBE = "ddp-25"  # the probe's candidate where the space holds it: stock DDP's defaults, the step users start from


def default_space(world: int, class_nccl: bool, bf16_autocast: bool = False, predicted_only: bool = False
                  ) -> dict[str, dict[str, Any]]:
    """The candidates of DEFAULT_SPACE that apply to this job: the hierarchical plan where nodes hold several ranks
    (`multi_rank_nodes`), NCCL_SPACE where each class's communicator can get its own NCCL choices (`class_nccl`),
    BF16_SPACE where the loop is known to train under bf16 autocast, FSDP2_SPACE where a candidate may be predicted
    and listed without being measured (`predicted_only`: the trainer's search)."""
    return {name: keys for name, keys in DEFAULT_SPACE.items()
            if (not keys.get("hierarchical") or multi_rank_nodes(world)) and (name not in NCCL_SPACE or class_nccl)
            and (not keys.get("gather_dtype") or bf16_autocast)
            and (get(keys["strategy"]).switchable or predicted_only)}


def multi_rank_nodes(world: int) -> bool:
    """Whether `world` ranks run as more than one node of more than one rank each (torchrun's LOCAL_WORLD_SIZE)."""
    local = local_world_size() or 1
    return 1 < local < world and world % local == 0


def candidate_raw(base: SyncConfig, name: str, keys: Any) -> dict:
    """Candidate `name`'s raw `sync` mapping, for both searches: its dotted `sync` keys over `base`'s class rules
    (which parameters form each class). Keys that are not a mapping naming a strategy are a one-line error."""
    where = f"sync.tune.candidates.{name}"
    if not isinstance(keys, dict) or keys.get("strategy") is None or "tune" in keys or get(keys["strategy"]).searches:
        raise UserError(f"'{where}' must name a strategy other than auto (and no 'tune'), got {keys}")
    rules = [k.split(".", 1)[1] for k in CLASS_RULE_KEYS]
    raw: dict = {"classes": {c: {k: getattr(spec, k) for k in rules if getattr(spec, k) != getattr(ClassSettings, k)}
                             for c, spec in base.classes.items()}}
    for key, value in keys.items():
        set_dotted(raw, str(key), value, f"{where}: '{key}'")
    return raw


def candidate_sync(base: SyncConfig, name: str, keys: Any) -> SyncConfig:
    """Candidate `name`'s `SyncConfig` (`candidate_raw`), read by the strict loader. A bad key is a one-line error
    naming `sync.tune.candidates.<name>`."""
    where = f"sync.tune.candidates.{name}"
    raw = candidate_raw(base, name, keys)
    try:
        sync = build_section(SyncConfig, raw, "sync", Source(where))
    except UserError as e:
        raise UserError(f"'{where}': {e}") from None
    for key, message in unused_keys(sync):
        raise UserError(f"'{where}': '{key}' {message}")
    return sync


def is_lossless(sync, model: nn.Module, world: int, ranks_per_node: int | None = None) -> bool:
    """Whether every rank's averaged gradient is the exact mean under `sync` on `model` (meta tensors do): its
    strategy's schedule says (`Schedule.exact`); a strategy that decides what it sends as it runs (powersgd, torch's
    other comm hooks) has no schedule, and is not known to be exact."""
    try:
        return get(sync.strategy).schedule(sync, model, world, ranks_per_node=ranks_per_node).exact
    except UserError:
        return False


def shards(strategy: str) -> bool:
    """Whether `strategy` hands the optimizer shards instead of the model's parameters (sharded, fsdp2)."""
    return get(strategy).shards


def splits_apply(sync: SyncConfig, model: nn.Module) -> bool:
    """Whether every class `sync` splits (`tied_split`) holds exactly one of `model`'s parameters."""
    split = [c for c, spec in sync.classes.items() if spec.tied_split]
    if not split:
        return True
    of = tensor_classes.from_config(sync).assign(model.named_parameters())
    held = {c: [n for n, k in of.items() if k == c] for c in split}
    return all(len(names) == 1 and unsplittable(model, names[0]) is None for names in held.values())
