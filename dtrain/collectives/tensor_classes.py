"""Tensor classes: ordered rules that give every parameter exactly one class, and each class its collective settings.

Sits between the model and the bucketing plan: `dtrain.collectives.plan` never mixes classes when asked not to, and the
reducer sends each bucket with its class's settings (wire dtype, bucket cap, NCCL choices) through its class's group.
Profiles change the defaults under `sync.classes.<name>` (a `dtrain.collectives.settings.ClassSettings`; see `from_config`).
"""

from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import dataclass, field

import torch

from dtrain.collectives.settings import (  # noqa: F401 (WIRE_DTYPES handed on)
    DEFAULT_BUCKET_CAP_MB, WIRE_DTYPES, ClassSettings, bucket_cap_mb)
from dtrain.common.errors import UserError



@dataclass(frozen=True)
class ClassRule:
    """Parameters whose name matches one of `match` (fnmatch globs) and whose numel lies in [min_numel, max_numel]."""

    name: str
    match: tuple[str, ...]
    min_numel: int | None = None
    max_numel: int | None = None

    def matches(self, param_name: str, numel: int) -> bool:
        if self.min_numel is not None and numel < self.min_numel:
            return False
        if self.max_numel is not None and numel > self.max_numel:
            return False
        return any(fnmatch.fnmatchcase(param_name, g) for g in self.match)

    @property
    def catch_all(self) -> bool:
        return "*" in self.match and self.min_numel is None and self.max_numel is None


# The defaults for this Transformer (parameter names from dtrain.engine.model). Order matters: biases of the projections
# and of the FFN are `norm_bias`, not `projection`/`ffn`, because the bias rule comes first.
DEFAULT_RULES: tuple[ClassRule, ...] = (
    ClassRule("embedding", ("embed.weight",)),  # shared by source, target and the pre-softmax projection
    ClassRule("norm_bias", ("*.norm.weight", "*.norm.bias", "*_norm.weight", "*_norm.bias", "*.bias")),
    ClassRule("projection", ("*.W_Q.weight", "*.W_K.weight", "*.W_V.weight", "*.W_O.weight")),
    ClassRule("ffn", ("*.feed_forward.*",)),
    ClassRule("other", ("*",)),  # the catch-all: empty for this model, required for any other
)

RULE_KEYS = ("match", "min_numel", "max_numel")  # a class's keys that say which parameters it holds


@dataclass(frozen=True)
class TensorClasses:
    """Ordered rules (first match wins, the last one a catch-all) and the settings of each class."""

    rules: tuple[ClassRule, ...] = DEFAULT_RULES
    settings: dict[str, ClassSettings] = field(default_factory=dict)  # each resolved (`from_config`)

    def __post_init__(self):
        names = [r.name for r in self.rules]
        if len(set(names)) != len(names):
            raise UserError(f"tensor classes: duplicate class name in {names}")
        if not self.rules or not self.rules[-1].catch_all:
            raise UserError("tensor classes: the last rule must be a catch-all (match ['*'], no size bounds)")
        for r in self.rules[:-1]:
            if r.catch_all:
                raise UserError(f"sync.classes.{r.name}.match: a catch-all before the last rule leaves the "
                                f"classes after it empty")

    def setting(self, name: str) -> ClassSettings:
        return self.settings.get(name, ClassSettings(bucket_cap_mb=DEFAULT_BUCKET_CAP_MB))

    def classify(self, param_name: str, numel: int) -> str:
        return next(r.name for r in self.rules if r.matches(param_name, numel))  # the catch-all always matches

    def assign(self, named_params) -> dict[str, str]:
        """{parameter name: class name} for (name, tensor) pairs; meta tensors do (only numel is read)."""
        return {name: self.classify(name, p.numel()) for name, p in named_params}

    def used(self, class_of: dict[str, str]) -> dict[str, ClassSettings]:
        """The settings of the classes `class_of` (an `assign`) uses, in rule order."""
        held = set(class_of.values())
        return {r.name: self.setting(r.name) for r in self.rules if r.name in held}


def tied_embedding(model: torch.nn.Module) -> str | None:
    """The name of `model`'s one tied embedding: a trainable `nn.Embedding` weight that another module holds too (the
    output projection, tied by assignment as `tie_word_embeddings` ties it), or None where there is not exactly one.
    """
    holders: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        holders[id(p)] = holders.get(id(p), 0) + 1
    name_of = {id(p): n for n, p in model.named_parameters()}
    tied = {name_of[id(m.weight)] for m in model.modules() if isinstance(m, torch.nn.Embedding)
            and m.weight.requires_grad and holders.get(id(m.weight), 0) > 1 and id(m.weight) in name_of}
    return tied.pop() if len(tied) == 1 else None


def with_tied_embedding(sync_cfg, model: torch.nn.Module):
    """`sync_cfg` with the `embedding` class's rule naming `model`'s tied embedding (`tied_embedding`) where the
    rules find no embedding in it (a model that is not dtrain's: "transformer.wte.weight", "model.shared.weight"),
    so that the split (`tied_split`) and the search's split candidates apply to it; else `sync_cfg` as it is."""
    name = tied_embedding(model)
    spec = sync_cfg.classes.get("embedding", ClassSettings())
    if name is None or spec.match is not None:
        return sync_cfg
    if "embedding" in from_config(sync_cfg).assign(model.named_parameters()).values():
        return sync_cfg
    classes = {**sync_cfg.classes, "embedding": dataclasses.replace(spec, match=name)}
    return dataclasses.replace(sync_cfg, classes=classes)


def from_config(sync_cfg) -> TensorClasses:
    """The classes of a `SyncConfig`: each `sync.classes.<name>` (a `ClassSettings`) gives a rule (match, min_numel,
    max_numel) and settings (wire_dtype, bucket_cap_mb, protocol, algorithm, min_ctas, max_ctas, tied_split). NCCL's
    choices are handed to `dtrain.collectives.nccl.class_group` with each class's group; on gloo nothing applies them.

    A class given with `match` is a rule of the profile: those come first, in the order written, followed by the
    default rules not redefined, so the catch-all `other` stays last. A default class given without `match` keeps its
    rule and place and only changes its settings. Every class's `bucket_cap_mb` defaults to `sync.bucket_cap_mb`.
    """
    problems = config_problems(sync_cfg)
    if problems:
        path, msg = problems[0]
        raise UserError(f"'{path}' {msg}")
    own = [ClassRule(name, _globs(spec.match), spec.min_numel, spec.max_numel)
           for name, spec in sync_cfg.classes.items()
           if spec.match is not None and name != "other"]  # 'other' is always '*' and always last
    own_names = {r.name for r in own}
    rules = tuple(own) + tuple(r for r in DEFAULT_RULES if r.name not in own_names)
    cap = bucket_cap_mb(sync_cfg.bucket_cap_mb)
    settings = {}
    for r in rules:
        spec = sync_cfg.classes.get(r.name, ClassSettings())
        settings[r.name] = dataclasses.replace(spec, **{k: None for k in RULE_KEYS},
                                               bucket_cap_mb=spec.bucket_cap_mb or cap)
    return TensorClasses(rules, settings)


def _globs(match: str | list[str]) -> tuple[str, ...]:
    return (match,) if isinstance(match, str) else tuple(match)


def config_problems(sync_cfg) -> list[tuple[str, str]]:
    """What the strict loader cannot see in `sync.classes` (it checks keys and types): rules that leave a parameter
    without a class, bounds, dtypes. As (dotted key, message) pairs for `dtrain.collectives.config` to report with a line.
    The NCCL keys (protocol, algorithm, CTA bounds) are checked by `dtrain.collectives.nccl.validate_config`."""
    defaults = {r.name for r in DEFAULT_RULES}
    out = []

    def bad(path, msg):
        out.append((path, msg))

    for name, spec in sync_cfg.classes.items():
        base = f"sync.classes.{name}"
        if name not in defaults and spec.match is None:
            bad(f"{base}.match", f"is required for a class that is not a default one "
                                 f"({', '.join(r.name for r in DEFAULT_RULES)})")
        if spec.match is not None:
            globs = _globs(spec.match)
            if not (globs and all(globs)):
                bad(f"{base}.match", f"must be a glob or a non-empty list of globs, got {spec.match!r}")
            elif "*" in globs and spec.min_numel is None and spec.max_numel is None and name != "other":
                bad(f"{base}.match", "is a catch-all: only the last class, 'other', may match everything")
        if name == "other" and spec.match is not None and _globs(spec.match) != ("*",):
            bad(f"{base}.match", "must stay '*': 'other' is the catch-all that gives every parameter a class")
        for key in ("min_numel", "max_numel"):
            v = getattr(spec, key)
            if v is not None and v < 0:
                bad(f"{base}.{key}", f"must be a non-negative integer or null, got {v!r}")
        lo, hi = spec.min_numel, spec.max_numel
        if lo is not None and hi is not None and lo > hi:
            bad(f"{base}.min_numel", f"must not exceed max_numel ({lo} > {hi})")
        if spec.bucket_cap_mb is not None and spec.bucket_cap_mb <= 0:
            bad(f"{base}.bucket_cap_mb", f"must be a positive number of MiB, got {spec.bucket_cap_mb!r}")
        if spec.wire_dtype not in WIRE_DTYPES:
            bad(f"{base}.wire_dtype", f"must be one of {', '.join(WIRE_DTYPES)}, got {spec.wire_dtype!r}")
    return out
