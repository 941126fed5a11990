"""`sharded`: bucketed's buckets, reduce-scattered in backward; each rank updates its shard of the parameters and of
the optimizer's state, and the updated parameters are all-gathered while the next forward runs, each module waiting
only for its own buckets (`collectives.shards`). Lossless; optimizer memory divided by the world size.

The loop builds its optimizer over `handle.optimizer_params()` (the shards), clips by `handle.grad_norm()` (the
global norm: an all-reduce of the shards' sums of squares) and calls `handle.stepped()` after the update. Checkpoints
hold the whole model and the optimizer state as if one rank had updated it (`optimizer_state`), so they resume on any
world size and with any strategy. The plan stays in the expected ready order (no re-plan after the first step: the
optimizer already holds the shards). Knobs: bucketed's.

With `sync.classes.<class>.tied_split` the tied embedding is not sharded: its bucket comes first and holds it alone,
its projection part is all-reduced from the start of backward and each lookup's rows as that lookup's backward ends
(`collectives.tied_split`), and every rank updates the whole matrix, which the next forward's first lookups need
before anything else (an all-gather there would hold up the first layer).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import torch
import torch.distributed as dist

from collectives.shards import ShardedReducer, member_offsets
from collectives.strategies import CLASS_RULE_KEYS, register
from collectives.strategies.bucketed import Bucketed
from collectives.strategies.planned import PlannedSync
from collectives.sync import total_norm
from common.errors import UserError


class ShardedSync(PlannedSync):
    def __init__(self, model, cfg, process_group, strategy):
        super().__init__(model, cfg, process_group, strategy)
        for split in self.splits:
            if not self.reducer.shards[self.reducer.bucket_of(split.name)].replicated:
                raise UserError(f"tied_split: '{split.name}' shares a bucket with other parameters under strategy "
                                f"'{self.name}'; its plan must give it a bucket of its own")
        self._replanned = True  # the optimizer holds the shards of this plan
        # Each module with parameters of its own waits, just before it runs, for the buckets that hold them.
        module_buckets = defaultdict(set)
        for mname, module in model.named_modules():
            for pname, _ in module.named_parameters(recurse=False):
                full = f"{mname}.{pname}" if mname else pname
                module_buckets[module].add(self.reducer.bucket_of(full))
        self._pre_hooks = [m.register_forward_pre_hook(self._waiter(sorted(b))) for m, b in module_buckets.items()]

    def _make_reducer(self, named_params, buckets, groups, process_group):
        ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
        group = dist.new_group(ranks)  # the shards' point-to-point traffic, apart from any collective
        return ShardedReducer(named_params, buckets, self.world, group, dist.get_rank(group),
                              replicated_group=process_group)

    def _waiter(self, indices: list[int]):
        def hook(module, args):
            self.reducer.wait_gathered(indices)

        return hook

    def before_forward(self) -> None:
        super().before_forward()
        self.reducer.gather()  # if the loop did not call stepped(): now

    def after_forward(self, out) -> None:
        super().after_forward(out)
        self.reducer.wait_params()  # buckets no module waited for (normally all are done)

    # -- the seam's sharded side --------------------------------------------------------------------------------

    def optimizer_params(self) -> list[torch.Tensor]:
        return [sh.shard for sh in self.reducer.shards]

    def grad_norm(self, exact: bool = False) -> torch.Tensor:
        # A replicated parameter's gradient is the same on every rank: its squares are counted once, on rank 0.
        grads = [sh.shard.grad for sh in self.reducer.shards
                 if sh.shard.grad is not None and (not sh.replicated or self.reducer.rank == 0)]
        return total_norm(grads, exact=exact, group=self.reducer.group, sharded=True)

    def stepped(self) -> None:
        self.reducer.gather()

    def wait_params(self) -> None:
        self.reducer.wait_params()

    def wait(self) -> None:
        super().wait()
        for r in self._records:
            if r.part is None:
                r.part = "reduce_scatter"
                r.nbytes = r.nbytes * (self.world - 1) // self.world  # each rank sends all chunks but its own
        t0 = self.reducer.step_start()
        self._records += self.reducer.gather_records(t0, len(self._records))

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        """The state of an optimizer over `model.parameters()`: every shard's state tensors all-gathered (a
        collective: every rank calls it) and cut into the parameters' shapes."""
        sd = optimizer.state_dict()
        group = _one_group(sd)
        index = {id(p): i for i, p in enumerate(self.model.parameters())}
        state = {}
        for i, (st, sh) in enumerate(zip(self.reducer.buckets, self.reducer.shards)):
            shard_state = sd["state"].get(i, {})
            if sh.replicated:  # the whole parameter's state, the same on every rank (none before its first step)
                if shard_state:
                    state[index[id(sh.shard)]] = _cloned(shard_state)
                continue
            for key in sorted(shard_state):  # the same order on every rank
                value = shard_state[key]
                if torch.is_tensor(value) and value.shape == sh.shard.shape:
                    full = value.new_empty(sh.params.numel())
                    dist.all_gather_into_tensor(full, value.contiguous(), group=self.reducer.group)
                    for off, p in zip(member_offsets(st.params), st.params):
                        state.setdefault(index[id(p)], {})[key] = full[off: off + p.numel()].view_as(p).clone()
                else:  # a per-tensor scalar such as Adam's step
                    for p in st.params:
                        state.setdefault(index[id(p)], {})[key] = value.clone() if torch.is_tensor(value) else value
        return {"state": state, "param_groups": [{**group, "params": sorted(index.values())}]}

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, full: dict) -> None:
        """Cut a whole-model state (`optimizer_state`'s form, from any world size or strategy) into this rank's
        shards."""
        group = _one_group(full)
        n_params = len(list(self.model.parameters()))
        covered = len(full["param_groups"][0]["params"])
        if covered != n_params:
            raise UserError(f"the checkpoint's optimizer state covers {covered} parameters, the model has {n_params}")
        index = {id(p): i for i, p in enumerate(self.model.parameters())}
        state = {}
        for i, (st, sh) in enumerate(zip(self.reducer.buckets, self.reducer.shards)):
            members = [full["state"].get(index[id(p)]) for p in st.params]
            if all(m is None for m in members):
                continue  # never stepped
            if any(m is None for m in members):
                raise UserError("the checkpoint's optimizer state covers only some parameters of a bucket")
            if sh.replicated:
                state[i] = _cloned(members[0])
                continue
            s, rank = sh.shard.numel(), self.reducer.rank
            shard_state = {}
            for key, value in members[0].items():
                if torch.is_tensor(value) and value.shape == st.params[0].shape and value.dim() > 0:
                    flat = torch.zeros(sh.params.numel(), dtype=value.dtype, device=value.device)
                    for off, p, m in zip(member_offsets(st.params), st.params, members):
                        flat[off: off + p.numel()].copy_(m[key].reshape(-1))
                    shard_state[key] = flat[rank * s: (rank + 1) * s].clone()
                else:
                    shard_state[key] = value
            state[i] = shard_state
        optimizer.load_state_dict({"state": state,
                                   "param_groups": [{**group, "params": list(range(len(self.reducer.shards)))}]})

    def stats(self) -> dict:
        out = super().stats()
        out["shard_numel"] = sum(sh.shard.numel() for sh in self.reducer.shards)
        return out


def _cloned(state: dict) -> dict:
    """One parameter's optimizer state with its tensors copied (a replicated parameter's state, whole)."""
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}


def _one_group(sd: dict) -> dict:
    if len(sd["param_groups"]) != 1:
        raise UserError(f"strategy 'sharded' needs an optimizer with one parameter group, not "
                        f"{len(sd['param_groups'])}")
    return {k: v for k, v in sd["param_groups"][0].items() if k != "params"}


@register("sharded")
class Sharded(Bucketed):
    sync_keys = ("bucket_cap_mb", "first_bucket_mb") + CLASS_RULE_KEYS + ("classes.tied_split",)
    handle = ShardedSync
    shards = True

    def plan(self, named_params, classes, settings):
        """Bucketed's plan; a `tied_split` parameter gets a bucket of its own, first: with the split its gradient is
        complete when the pre-softmax projection's is, the first that backward computes. The rest is planned on its
        own, so its first bucket follows `first_bucket_mb` as bucketed's would."""
        split = [(n, p) for n, p in named_params if settings[classes[n]].tied_split]
        rest = [(n, p) for n, p in named_params if not settings[classes[n]].tied_split]
        buckets = []
        for one in split:
            buckets += super().plan([one], classes, settings)
        buckets += super().plan(rest, classes, settings)
        return [dataclasses.replace(b, index=i, replicated=i < len(split)) for i, b in enumerate(buckets)]

