"""Bucketing plans: which gradients travel together, in which order, with which settings.

A `BucketingStrategy` turns the parameters (in the order their gradients are expected to become ready), their tensor
classes and the per-class settings into a list of `Bucket`s. Planning is pure: no process group, no gradients, so
it runs on meta tensors and in unit tests. `dtrain.collectives.reducer` executes a plan.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Sequence

import torch
from torch import nn

from dtrain.collectives import tensor_classes
from dtrain.collectives.schedule import Schedule, all_reduce_schedule, nodes_of, split_first
from dtrain.collectives.sync import StrategyFacts
from dtrain.collectives.settings import ClassSettings
from dtrain.collectives.tensor_classes import TensorClasses
from dtrain.collectives.tied_split import split_params
from dtrain.common.errors import UserError, unknown


@dataclass(frozen=True)
class Bucket:
    """Gradients reduced by one collective: laid out back to back in one flat buffer, in `names` order."""

    index: int  # launch order: every rank launches bucket i before bucket i + 1
    names: tuple[str, ...]  # parameter names, in expected ready order
    numel: int
    nbytes: int  # on the wire (numel x the wire dtype's size)
    tensor_class: str  # the class of every member, or "mixed"
    settings: ClassSettings  # its class's, resolved (`dtrain.collectives.tensor_classes.from_config`)
    dtype: torch.dtype = torch.float32  # of the gradients (and of the flat buffer holding them)


def ready_order(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The expected order in which gradients become ready: the reverse of registration order (DDP's guess too;
    the reducer replaces it by the order observed in the first backward)."""
    return [(n, p) for n, p in reversed(list(model.named_parameters())) if p.requires_grad]


def plan_params(strategy: "BucketingStrategy", classes: TensorClasses, named_params
                ) -> tuple[list[Bucket], dict[str, str], dict[str, ClassSettings]]:
    """The one way a strategy plans: (buckets, each parameter's class, the settings of the classes in use) for
    `named_params` in expected ready order. Training (`PlannedSync`) and the profile's modeled plan
    (each strategy's `schedule`) both go through here."""
    class_of = classes.assign(named_params)
    settings = classes.used(class_of)
    return strategy.plan(named_params, class_of, settings), class_of, settings


def pack(named_params: Sequence[tuple[str, torch.Tensor]], classes: dict[str, str], key, settings_of,
         first_cap_bytes: int | None = None, last_cap_bytes: int | None = None) -> list[Bucket]:
    """Size-capped buckets in ready order.

    Parameters with the same `key(name, tensor)` share open buckets; a bucket closes once it holds at least its cap
    (the first one of each key `first_cap_bytes` when given, the others `settings_of(key).bucket_cap_bytes`), so a
    tensor larger than the cap gets a bucket of its own. With `last_cap_bytes`, each key's last parameters, as few as
    hold at least that many bytes, form a bucket of their own: the one backward completes last, whose communication
    no computation is left to hide. Buckets are ordered by their last member, i.e. by the moment they are expected
    to be complete.
    """
    last: dict = {}  # key -> its last bucket's members (positions in named_params), when `last_cap_bytes` is given
    if last_cap_bytes is not None:
        held: dict = {}
        for pos in reversed(range(len(named_params))):
            name, p = named_params[pos]
            k = key(name, p)
            if held.get(k, 0) < last_cap_bytes:
                held[k] = held.get(k, 0) + p.numel() * settings_of(k).torch_wire_dtype.itemsize
                last.setdefault(k, set()).add(pos)
    open_: dict = {}  # key -> (members, nbytes, position of the last member)
    count: dict = {}  # key -> buckets closed so far
    closed: list[tuple[int, object, list]] = []  # (position of the last member, key, members)
    for pos, (name, p) in enumerate(named_params):
        k = key(name, p)
        if pos in last.get(k, ()):
            continue  # in the key's last bucket, made below
        s = settings_of(k)
        members, nbytes, _ = open_.pop(k, ([], 0, pos))
        members.append((name, p))
        nbytes += p.numel() * s.torch_wire_dtype.itemsize
        cap = first_cap_bytes if (first_cap_bytes is not None and count.get(k, 0) == 0) else s.bucket_cap_bytes
        if nbytes >= cap:
            closed.append((pos, k, members))
            count[k] = count.get(k, 0) + 1
        else:
            open_[k] = (members, nbytes, pos)
    closed += [(end, k, members) for k, (members, _, end) in open_.items()]
    closed += [(max(positions), k, [named_params[i] for i in sorted(positions)]) for k, positions in last.items()]
    closed.sort(key=lambda c: c[0])

    buckets = []
    for index, (_, k, members) in enumerate(closed):
        s = settings_of(k)
        numel = sum(p.numel() for _, p in members)
        names = tuple(n for n, _ in members)
        member_classes = {classes[n] for n in names}
        buckets.append(Bucket(index, names, numel, numel * s.torch_wire_dtype.itemsize,
                              member_classes.pop() if len(member_classes) == 1 else "mixed", s, members[0][1].dtype))
    return buckets


class BucketingStrategy(StrategyFacts):
    """A named way of grouping gradients into buckets, with its own small `Config` of knobs (its fields are among
    its `sync_keys`).

    `overlap`: buckets are launched from the gradient hooks as soon as they are complete (in index order); otherwise
    all of them at `wait()`. Whether the averaged gradients are the exact mean is its schedule's to say
    (`Schedule.exact`).
    """

    overlap: ClassVar[bool] = True
    handle: ClassVar[type | None] = None  # the `GradSync` that executes the plan (None: `PlannedSync`)
    # A parameter's optimizer group (by name; absent: 0), where a bucket must not mix groups: a sharding strategy's
    # bucket is one tensor for the optimizer, which has one set of options (lr, weight decay ...) per group
    group_of: dict[str, int] = {}

    @dataclass(frozen=True)
    class Config:
        pass

    def __init__(self, config=None):
        self.config = config if config is not None else self.Config()

    @classmethod
    def from_args(cls, **args) -> "BucketingStrategy":
        """Build from keyword knobs; an unknown knob is an error naming it and the known ones."""
        known = [f.name for f in dataclasses.fields(cls.Config)]
        for k in args:
            if k not in known:
                raise UserError(f"strategy '{cls.name}': {unknown('argument', k, known)}")
        return cls(cls.Config(**args))

    @classmethod
    def from_sync(cls, sync_cfg) -> "BucketingStrategy":
        """Build from a `SyncConfig`: the knobs are the fields of the same name."""
        return cls(cls.Config(**{f.name: getattr(sync_cfg, f.name) for f in dataclasses.fields(cls.Config)}))

    @classmethod
    def schedule(cls, sync, model: nn.Module, world: int, accum_steps: int = 1,
                 ranks_per_node: int | None = None) -> Schedule:
        """Each bucket all-reduced as its last gradient is ready (`dtrain.collectives.schedule`), as `PlannedSync`
        runs the plan after its first step: with a split tied embedding (`tied_split`) re-planned in the order that
        step observed, the embedding first. `model`: meta tensors do."""
        strategy = cls.from_sync(sync)
        named = ready_order(model)
        classes = tensor_classes.from_config(sync)
        class_of = classes.assign(named)
        settings = classes.used(class_of)
        split = set(split_params(class_of, settings)) if "classes.tied_split" in cls.sync_keys else set()
        buckets = strategy.plan(split_first(named, split) if split and cls.overlap else named, class_of, settings)
        per_node = None
        if sync.hierarchical and "hierarchical" in cls.sync_keys:
            per_node = nodes_of(sync.ranks_per_node or ranks_per_node, world, f"{cls.name} with 'sync.hierarchical'")
        return all_reduce_schedule(cls.name, buckets, named, world, cls.overlap, cls.class_groups, split, per_node)

    def plan(self, named_params: Sequence[tuple[str, torch.Tensor]], classes: dict[str, str],
             settings: dict[str, ClassSettings]) -> list[Bucket]:
        """Buckets for `named_params` (in expected ready order; only numel and dtype are read), given each
        parameter's class and each class's settings."""
        raise NotImplementedError
