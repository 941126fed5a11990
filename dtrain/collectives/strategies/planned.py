"""The handle shared by the planned strategies (per_tensor, flat, bucketed, per_class): plan → reducer → `GradSync`.

`build` wraps a registered `BucketingStrategy` in a `PlannedSync`: it classifies the parameters, asks the strategy for
a plan, creates the per-class process groups the strategy wants (through `dtrain.collectives.nccl.class_group`) and hands
the plan to a `Reducer`. After the first synchronized step it re-plans once in the gradient order actually observed.
A class with `tied_split` (a tied embedding) has its lookups' rows reduced apart (`dtrain.collectives.tied_split`).
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager

import torch.distributed as dist
from torch import nn

from dtrain.collectives import nccl
from dtrain.collectives import tensor_classes as tc
from dtrain.collectives.hierarchy import HierarchicalReducer, Levels, ranks_per_node
from dtrain.collectives.plan import BucketingStrategy, plan_params, ready_order
from dtrain.collectives.reducer import Reducer
from dtrain.collectives.sync import Front, GradSync, first_tensor
from dtrain.collectives.tied_split import TiedEmbeddingSplit, split_params
from dtrain.common.errors import UserError
from dtrain.common.rundir import BucketRecord


class PlannedSync(GradSync):
    def __init__(self, model, cfg, process_group, strategy: BucketingStrategy, param_groups=None):
        super().__init__(model, cfg, process_group, param_groups)
        self.strategy = strategy
        self.name = strategy.name
        self.world = dist.get_world_size(process_group)
        self.classes = tc.from_config(cfg)
        buckets, self.class_of, self.settings = plan_params(strategy, self.classes, ready_order(model))
        used = list(self.settings)  # the classes of this model's parameters, in rule order
        groups = {}
        if strategy.class_groups:
            # One group per class, created in rule order on every rank (a collective call).
            ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
            groups = {c: nccl.class_group(c, self.settings[c], ranks) for c in used}
        self.levels: Levels | None = None  # the hierarchical plan's two process groups
        self.reducer = self._make_reducer(dict(model.named_parameters()), buckets, groups, process_group)
        self.splits = self._tied_splits(model, process_group)
        self.module = Front(model, self)  # arms the reducer, marks the start of backward on the output
        self._sync_enabled = True
        self._replanned = False
        self._records: list[BucketRecord] = []

    def forward(self, model: nn.Module, *args, **kwargs):
        """`handle.module`'s forward: the reducer armed around the model's."""
        self.before_forward()
        out = model(*args, **kwargs)
        self.after_forward(out)
        return out

    def before_forward(self) -> None:
        """Arm the reducer (and the splits) for this micro-batch."""
        self.reducer.prepare(sync=self._sync_enabled)
        if self.reducer.armed:
            for split in self.splits:
                split.prepare()

    def after_forward(self, out) -> None:
        first = first_tensor(out)
        if self.reducer.armed and first is not None and first.requires_grad:
            # The output's gradient is among the first computed: the backward of this micro-batch has started.
            first.register_hook(lambda grad: self.reducer.mark_backward_start())

    def close(self) -> None:
        """The reducer's and the splits' hooks removed, and the splits' process groups destroyed. The per-class
        groups are not: each bucket's completion callback holds the reducer, and so its group, and runs (and is
        released) on that group's own thread, where a group's last release would join the thread itself."""
        self.reducer.remove()
        for split in self.splits:
            split.close()
        self.splits = []
        if self.levels is not None:  # the reducer's own thread, which used them, has ended
            self.levels.destroy()
            self.levels = None

    def _make_reducer(self, named_params, buckets, groups, process_group) -> Reducer:
        if self.cfg.hierarchical:
            if process_group is not None and self.world != dist.get_world_size():
                raise UserError("'sync.hierarchical' runs on the whole world: its levels' groups are made by every "
                                f"rank, and this handle's group holds {self.world} of {dist.get_world_size()}")
            self.levels = Levels(list(range(self.world)), ranks_per_node(self.cfg, self.world))
            return HierarchicalReducer(named_params, buckets, self.world, self.strategy.overlap, self.levels)
        return Reducer(named_params, buckets, self.world, self.strategy.overlap, groups, process_group)

    @contextmanager
    def no_sync(self):
        # Read at forward time (like DDP): backward of a forward run inside accumulates without communicating.
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = True

    def suspend(self) -> None:
        self.reducer.release()  # the bucket buffers: a copy of the gradients each

    def resume(self) -> None:
        self.reducer.restore()

    def _tied_splits(self, model: nn.Module, process_group) -> list[TiedEmbeddingSplit]:
        """One split per class with `tied_split` (created in rule order on every rank: each makes a process
        group)."""
        return [self._make_split(model, n, process_group) for n in split_params(self.class_of, self.settings)]

    def _make_split(self, model: nn.Module, name: str, process_group) -> TiedEmbeddingSplit:
        return TiedEmbeddingSplit(model, name, process_group, self.world, lambda: self.reducer.armed)

    def wait(self) -> None:
        self.reducer.finish()
        for split in self.splits:
            split.finish()
        self._records = self._with_split_records(self.reducer.records())
        if not self._replanned:
            self._replanned = True
            self._replan()

    def _replan(self) -> None:
        """Re-plan in the gradient-ready order of the first backward (rank 0's, so every rank agrees), as DDP
        rebuilds its buckets after its first iteration. A plan without overlap does not depend on the order."""
        if not self.strategy.overlap:
            return
        observed = list(self.reducer.observed)
        if self.world > 1:
            box = [observed]
            src = 0 if self.process_group is None else dist.get_global_rank(self.process_group, 0)
            dist.broadcast_object_list(box, src=src, group=self.process_group)
            observed = box[0]
        params = dict(self.model.named_parameters())
        planned = [n for n, _ in ready_order(self.model)]
        order = [n for n in observed if n in params] + [n for n in planned if n not in set(observed)]
        if order == [n for b in self.reducer.buckets for n in b.bucket.names]:
            return
        self.reducer.rebuild(self.strategy.plan([(n, params[n]) for n in order], self.class_of, self.settings))

    def _with_split_records(self, records: list[BucketRecord]) -> list[BucketRecord]:
        """The buckets' records, the bucket of each split parameter marked as its projection part, then each split's
        lookup parts."""
        for split in self.splits:
            where = self.reducer.bucket_of(split.name)
            for r in records:
                if r.bucket == where and r.tensors == 1:  # a bucket shared with other tensors is not the part
                    r.part = "projection"
        wait_start = records[0].wait_start_ms if records else None
        lookups = []
        for s in self.splits:
            lookups += s.records(len(records) + len(lookups), self.reducer.step_start(), wait_start,
                                 self.class_of[s.name])
        return records + lookups

    def step_records(self) -> list[BucketRecord]:
        records, self._records = self._records, []
        return records

    def stats(self) -> dict:
        buckets = [st.bucket for st in self.reducer.buckets]
        per_class = {}
        for name, c in self.class_of.items():
            entry = per_class.setdefault(c, {"tensors": 0, "bytes": 0})
            p = self.reducer.named_params[name]
            entry["tensors"] += 1
            entry["bytes"] += p.numel() * p.element_size()
        out = {**super().stats(), "overlap": self.strategy.overlap, **dataclasses.asdict(self.strategy.config),
               "buckets": len(buckets), "bytes_per_step": sum(b.nbytes for b in buckets), "classes": per_class}
        if self.levels is not None:
            out["hierarchical"] = {"ranks_per_node": self.levels.per_node, "nodes": self.world // self.levels.per_node}
        if self.strategy.class_groups:
            out["class_settings"] = {c: dataclasses.asdict(s) for c, s in self.settings.items()}
        return out
