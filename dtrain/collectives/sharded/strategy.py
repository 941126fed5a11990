"""`sharded`: bucketed's buckets, reduce-scattered in backward; each rank updates its shard of the parameters and of
the optimizer's state, and the updated parameters are all-gathered while the next forward runs, each module waiting
only for its own buckets (`dtrain.collectives.sharded.reducer`), each bucket as its exchange plan says
(`dtrain.collectives.sharded.exchange`). Lossless; optimizer memory divided by the world size.

The loop builds its optimizer over `handle.optimizer_params()` (the shards), clips by `handle.grad_norm()` (the
global norm: an all-reduce of the shards' sums of squares) and calls `handle.stepped()` after the update. Checkpoints
hold the whole model and the optimizer state as if one rank had updated it (`optimizer_state`), so they resume on any
world size and with any strategy. The plan stays in the expected ready order (no re-plan after the first step: the
optimizer already holds the shards). Knobs: bucketed's.

With `sync.classes.<class>.tied_split` the tied embedding is not sharded: its bucket comes first and holds it alone,
its projection part is all-reduced from the start of backward and each lookup's rows as that lookup's backward ends
(`dtrain.collectives.tied_split`), and every rank updates the whole matrix, which the next forward's first lookups need
before anything else (an all-gather there would hold up the first layer).

With `sync.shard_tied_split` as well, the embedding is sharded too, by whole rows: its projection part is
reduce-scattered like any bucket, each lookup's rows reduce-scattered to their owners, and in the next forward each
lookup fetches the rows of its tokens from their owners (`dtrain.collectives.sharded.rows`). The matrix's
all-gather then only has to be done by the module that reads all of it (the pre-softmax projection, an `nn.Linear`
holding the embedding's Parameter), so the all-gathers go in the order the first forward waited for the buckets.

With `sync.gather_dtype: bf16` (training under bf16 autocast), the parameters that only `nn.Linear` modules read are
all-gathered in bf16, half the bytes: autocast casts them to bf16 before any use, so the forward and backward see the
same values as after an fp32 all-gather. Their gradients are reduce-scattered in bf16 too when a step is one backward
of one micro-batch: each is then a bf16 product widened to fp32, which bf16 holds exactly, and the sum is taken in
fp32. Either way each rank's gradients are the exact mean's (on 2 CPU ranks DDP's bit for bit). Such a Linear running
outside that autocast in a synchronized forward, or while its parameters are narrowed, is an error; `wait_params`
gathers them again in fp32.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from dtrain.collectives.dist import all_gather_single
from dtrain.collectives import tensor_classes
from dtrain.collectives.plan import ready_order
from dtrain.collectives.schedule import (ALL_GATHER, ALL_REDUCE, EXCHANGE, FORWARD, FORWARD_START, GRADIENT, P2P,
                                         PROJECTION, REDUCE_SCATTER, RING, STEP, WAIT, Collective, Schedule,
                                         lookup_rows)
from dtrain.collectives.sharded.exchange import ROWS, exchange_plan, member_offsets
from dtrain.collectives.sharded.grads import HiddenGrad, hidden_grad
from dtrain.collectives.sharded.reducer import ShardedReducer
from dtrain.collectives.sharded.rows import ShardedTiedSplit
from dtrain.collectives.registry import CLASS_RULE_KEYS, register
from dtrain.collectives.strategies.bucketed import Bucketed
from dtrain.collectives.strategies.planned import PlannedSync
from dtrain.collectives.sync import param_groups_of, total_norm
from dtrain.collectives.tied_split import split_params
from dtrain.collectives.timeline import through
from dtrain.common.errors import UserError


LOOKUP = object()  # in a recorded forward: a lookup of a sharded matrix ran here
GATHER_AT = {"step": STEP, "forward": FORWARD_START}  # `sync.gather_at`: when the all-gathers start


class ShardedSync(PlannedSync):
    def __init__(self, model, cfg, process_group, strategy, param_groups=None):
        # Each bucket becomes one tensor for the optimizer: buckets never mix the loop's optimizer groups (a
        # parameter in none of them is bucketed apart, and never updated, as under DDP)
        name_of = {id(p): n for n, p in model.named_parameters()}
        strategy.group_of = {name_of[id(p)]: g for g, params in enumerate(param_groups_of(model, param_groups))
                             for p in params}
        strategy.group_of.update({n: -1 for n in set(name_of.values()) - set(strategy.group_of)})
        super().__init__(model, cfg, process_group, strategy, param_groups=param_groups)
        self._hidden: list[tuple[nn.Parameter, torch.Tensor]] = []  # (parameter, its bucket view) while hidden
        self._stand_ins: dict[int, HiddenGrad] = {}  # id of a parameter -> its `.grad`'s stand-in, made once
        if strategy.config.shard_tied_split and not self.splits:
            raise UserError("'sync.shard_tied_split' shards a split tied embedding, but no class sets tied_split")
        for split in self.splits:
            if len(self.reducer.buckets[self.reducer.bucket_of(split.name)].params) != 1:
                raise UserError(f"tied_split: '{split.name}' shares a bucket with other parameters under strategy "
                                f"'{self.name}'; its plan must give it a bucket of its own")
        self._replanned = True  # the optimizer holds the shards of this plan
        self._suspended = False  # another handle trains the model (`suspend`): the modules' waits do nothing
        # Each module with parameters of its own waits, just before it runs, for the buckets that hold them (a tied
        # parameter for every module that holds it), except that the lookups of a sharded matrix fetch their rows
        # themselves: where they stand for the whole matrix (`ShardedTiedSplit.readers`), they mark its place.
        lookups = {id(m): s for s in self.splits if isinstance(s, ShardedTiedSplit) for m in s.lookups}
        self._pre_hooks = []
        for module in model.modules():  # a parameter that does not train (a fixed position table) is no bucket's
            buckets = {self.reducer.bucket_of(name_of[id(p)]) for p in module.parameters(recurse=False)
                       if p.requires_grad}
            if not buckets:
                continue
            if id(module) in lookups:
                buckets.discard(self.reducer.bucket_of(lookups[id(module)].name))
            self._pre_hooks.append(module.register_forward_pre_hook(
                self._waiter(sorted(buckets), id(module) in lookups)))
        # Linear modules whose parameters travel narrowed, and how often each ran in this forward
        narrowed = {n for ex in self.reducer.exchanges for n in ex.narrowed}
        self._narrowed = {id(m) for m in model.modules() if isinstance(m, nn.Linear) and any(
            name_of[id(p)] in narrowed for p in m.parameters(recurse=False))}
        self._calls: dict[int, int] = {}
        # The buckets in the order the first synchronized forward waits for them, and where its lookups of a
        # sharded matrix come (LOOKUP): the all-gathers' waves from then on (None: not recorded).
        self._uses: list | None = [] if lookups else None

    def close(self) -> None:
        """`PlannedSync.close`, and the modules' waits for their buckets removed, the point-to-point thread ended
        (its last task holds the reducer) and its group destroyed."""
        self._show_grads()  # the model trains on without this handle: its `.grad` are tensors again
        for h in self._pre_hooks:
            h.remove()
        self._pre_hooks = []
        self.reducer.completions.close()
        super().close()
        dist.destroy_process_group(self.reducer.group)  # its exchanges' completions ran on the thread just ended

    def _make_reducer(self, named_params, buckets, groups, process_group):
        ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
        group = dist.new_group(ranks)  # the shards' point-to-point traffic, apart from any collective
        exchanges = exchange_plan(self.cfg, self.model, buckets, self.world)
        return ShardedReducer(named_params, exchanges, group, dist.get_rank(group), replicated_group=process_group)

    def _make_split(self, model, name, process_group):
        if not self.strategy.config.shard_tied_split:
            return super()._make_split(model, name, process_group)
        table = self.reducer.row_table(self.reducer.bucket_of(name))
        return ShardedTiedSplit(model, name, process_group, self.world, lambda: self.reducer.armed, table)

    def _waiter(self, indices: list[int], lookup: bool):
        def hook(module, args):
            if self._suspended:
                return
            if self._uses is not None and self.reducer.armed:
                self._uses += [i for i in indices if i not in self._uses] + ([LOOKUP] if lookup else [])
            self.reducer.wait_gathered(indices)
            narrowed = id(module) in self._narrowed
            # it reads narrowed parameters, or its gradients will be reduce-scattered narrowed
            if (narrowed and self.reducer.armed) or any(self.reducer.shards[i].rounded for i in indices):
                self._check_autocast(module)
            if narrowed:
                self._calls[id(module)] = self._calls.get(id(module), 0) + 1

        return hook

    def _check_autocast(self, module: nn.Module) -> None:
        """A Linear with narrowed parameters must cast them to that dtype itself: else it would compute with other
        values than the fp32 parameters', and its gradients would not be values of that dtype."""
        device = self.reducer.device.type
        low = self.reducer.gather_dtype
        if not (torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == low):
            raise UserError(f"sync.gather_dtype: a {type(module).__name__} whose parameters travel in {low} ran "
                            f"outside autocast to {low}; run the forward under that autocast (train.amp)")

    def before_forward(self) -> None:
        self._show_grads()
        super().before_forward()
        self.reducer.gather()  # if the loop did not call stepped(): now
        self._calls = {}

    def after_forward(self, out) -> None:
        super().after_forward(out)
        if self._uses and self.reducer.armed:
            self.reducer.gather_waves = self._waves(self._uses)
            self._uses = None
        self.reducer.wait_params()  # buckets no module waited for (normally all are done)
        if any(n > 1 for n in self._calls.values()):  # its weight's gradient: a sum of bf16 products, not one
            self.reducer.accumulated = True

    def _waves(self, uses: list) -> list[list[int]]:
        """The all-gathers in the order the forward first waited for them, cut at each lookup of a sharded matrix:
        each wave goes once the lookup before it has fetched its rows, so that no fetch queues behind all-gathers
        on the link. A matrix without readers of its own goes in the wave before its last lookup, which waits for
        all of it; buckets no module waited for go last."""
        waves: list[list[int]] = [[]]
        for u in uses:  # each bucket once: the recording keeps only its first wait
            if u is LOOKUP:
                waves.append([])
            else:
                waves[-1].append(u)
        for split in self.splits:
            if isinstance(split, ShardedTiedSplit) and not split.readers:
                waves[max(0, len(waves) - 2)].append(self.reducer.bucket_of(split.name))
        placed = {i for w in waves for i in w}
        waves[-1] += [st.bucket.index for st in reversed(self.reducer.buckets) if st.bucket.index not in placed]
        return waves

    # -- the seam's sharded side --------------------------------------------------------------------------------

    def optimizer_groups(self) -> list[list[torch.Tensor]]:
        """Per group given to `attach`, the shards of its buckets (a replicated bucket's: the parameter itself)."""
        groups: list[list[torch.Tensor]] = [[] for _ in self.groups]
        for st, sh in zip(self.reducer.buckets, self.reducer.shards):
            g = self.strategy.group_of[st.bucket.names[0]]
            if g >= 0:
                groups[g].append(sh.shard)
        return groups

    def _hide_grads(self) -> None:
        """The sharded members' `.grad` (their bucket views, zeroed: the shards hold the mean) replaced by
        `HiddenGrad`s until the next forward, so that reading them (`clip_grad_norm_(model.parameters())`) is an
        error naming the call rather than a norm of zeros."""
        for st, sh in zip(self.reducer.buckets, self.reducer.shards):
            if not sh.replicated:
                for p, view in zip(st.params, st.views):
                    if p.grad is view:
                        if id(p) not in self._stand_ins:
                            self._stand_ins[id(p)] = hidden_grad(p)
                        p.grad = self._stand_ins[id(p)]
                        self._hidden.append((p, view))

    def _show_grads(self) -> None:
        """The bucket views back where `_hide_grads` left its stand-ins (not where the loop has set `.grad` to None
        since)."""
        for p, view in self._hidden:
            if isinstance(p.grad, HiddenGrad):
                p.grad = view
        self._hidden = []

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The model's `zero_grad`: the local gradients are zeroed already once the shards hold their mean."""
        self._show_grads()
        if set_to_none:
            super().zero_grad(set_to_none)

    def grad_norm(self, exact: bool = False) -> torch.Tensor:
        # A replicated parameter's gradient is the same on every rank: its squares are counted once, on rank 0.
        grads = [sh.shard.grad for sh in self.reducer.shards
                 if sh.shard.grad is not None and (not sh.replicated or self.reducer.rank == 0)]
        return total_norm(grads, exact=exact, group=self.reducer.group, sharded=True)

    def stepped(self, optimizer=None, loss=None) -> None:
        self.check_optimizer_once(optimizer)  # one over the model's parameters would update nothing
        if self.strategy.config.gather_at == "step":  # else as the next forward starts (`before_forward`)
            self.reducer.gather()

    def suspend(self) -> None:
        """Every rank's updated shard all-gathered (exact) into the model's parameters, which stay in P, and the
        other buffers freed (a collective). The optimizer still holds this plan's shards: `attach`'s search moves its
        state through the whole-model form (`optimizer_state`) before this."""
        self.wait_params()
        self._show_grads()
        for split in self.splits:
            if isinstance(split, ShardedTiedSplit):
                split.whole()  # while another handle trains, its lookups read the model's matrix as it is
        super().suspend()
        self._suspended = True

    def resume(self) -> None:
        """The plan laid out again from the model's current parameters: new shards for the optimizer
        (`optimizer_params()`), which `load_optimizer_state` fills."""
        super().resume()
        self._suspended = False

    def wait_params(self) -> None:
        self.reducer.wait_params()
        self.reducer.exact_params()  # a narrowed all-gather's chunks again in fp32: they are read whole now

    def wait(self) -> None:
        super().wait()  # the reduce-scatters' records (a sharded matrix's projection part keeps its name)
        t0 = self.reducer.step_start()
        self._records += self.reducer.gather_records(t0, len(self._records))
        self._hide_grads()

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        """The state of an optimizer over the model's parameters in the groups given to `attach` (numbered as torch
        numbers them: group after group), as a DDP loop's optimizer saves it: every shard's state tensors
        all-gathered (a collective: every rank calls it) and cut into the parameters' shapes (views of each bucket's
        gathered buffer: one allocation per bucket and key, not one per parameter). Each group keeps its options."""
        sd = optimizer.state_dict()
        local = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
        index = self._whole_index()
        state = {}
        for st, sh in zip(self.reducer.buckets, self.reducer.shards):
            shard_state = sd["state"].get(local.get(id(sh.shard)), {})
            if sh.replicated:  # the whole parameter's state, the same on every rank (none before its first step)
                if shard_state and id(sh.shard) in index:
                    state[index[id(sh.shard)]] = _cloned(shard_state)
                continue
            for key in sorted(shard_state):  # the same order on every rank
                value = shard_state[key]
                if torch.is_tensor(value) and value.shape == sh.shard.shape:
                    full = value.new_empty(sh.params.numel())
                    all_gather_single(full, value.contiguous(), group=self.reducer.group)
                    for off, p in zip(member_offsets(st.params), st.params):  # views of the one gathered buffer
                        state.setdefault(index[id(p)], {})[key] = full[off: off + p.numel()].view_as(p)
                else:  # a per-tensor scalar such as Adam's step
                    for p in st.params:
                        state.setdefault(index[id(p)], {})[key] = value.clone() if torch.is_tensor(value) else value
        groups = _options(sd, len(self.groups))
        return {"state": state, "param_groups": [{**opts, "params": [index[id(p)] for p in g]}
                                                 for opts, g in zip(groups, self.groups)]}

    def _whole_index(self) -> dict[int, int]:
        """id of each of the model's parameters in the groups given to `attach` -> its number in the whole-model
        optimizer state."""
        return {id(p): i for i, p in enumerate(p for g in self.groups for p in g)}

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, full: dict) -> None:
        """Cut a whole-model state (`optimizer_state`'s form, from any world size or strategy) into this rank's
        shards."""
        optimizer.load_state_dict(self.local_optimizer_state(optimizer, full))

    def local_optimizer_state(self, optimizer: torch.optim.Optimizer, full: dict) -> dict:
        """`full` (the whole-model form) as the state dict of `optimizer` over `optimizer_groups()`: each bucket's
        members' state cut to this rank's chunk, each group's options the saved group's."""
        sizes = [len(g) for g in self.groups]
        saved = [len(g["params"]) for g in full["param_groups"]]
        if saved != sizes:
            raise UserError(f"the checkpoint's optimizer state holds groups of {saved} parameters, this optimizer "
                            f"{sizes}: build the optimizer's groups as the run that wrote it did")
        index = self._whole_index()
        local = {id(p): i for i, p in enumerate(p for g in self.optimizer_groups() for p in g)}
        state = {}
        for st, sh in zip(self.reducer.buckets, self.reducer.shards):
            if id(sh.shard) not in local:
                continue  # in no optimizer group: never updated
            members = [full["state"].get(index[id(p)]) for p in st.params]
            if all(m is None for m in members):
                continue  # never stepped
            if any(m is None for m in members):
                raise UserError("the checkpoint's optimizer state covers only some parameters of a bucket")
            if sh.replicated:
                state[local[id(sh.shard)]] = _cloned(members[0])
                continue
            s, rank = sh.shard.numel(), self.reducer.rank
            lo, hi = rank * s, (rank + 1) * s  # this rank's chunk of the bucket (padding past its members: zeros)
            shard_state = {}
            for key, value in members[0].items():
                if torch.is_tensor(value) and value.shape == st.params[0].shape and value.dim() > 0:
                    chunk = torch.zeros(s, dtype=value.dtype, device=value.device)
                    for off, p, m in zip(member_offsets(st.params), st.params, members):
                        a, b = max(off, lo), min(off + p.numel(), hi)  # the member's part in the chunk
                        if a < b:
                            chunk[a - lo: b - lo].copy_(m[key].reshape(-1)[a - off: b - off])
                    shard_state[key] = chunk
                else:
                    shard_state[key] = value
            state[local[id(sh.shard)]] = shard_state
        numbers = iter(range(len(local)))
        return {"state": state, "param_groups": [{**opts, "params": [next(numbers) for _ in g]} for opts, g in
                                                 zip(_options(full, len(self.groups)), self.optimizer_groups())]}

    def stats(self) -> dict:
        out = super().stats()
        out["shard_numel"] = sum(sh.shard.numel() for sh in self.reducer.shards)
        return out


def _cloned(state: dict) -> dict:
    """One parameter's optimizer state with its tensors copied (a replicated parameter's state, whole)."""
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}


def _options(sd: dict, groups: int) -> list[dict]:
    """The options of each of a state dict's groups (lr, weight decay, betas ...), without their parameters."""
    if len(sd["param_groups"]) != groups:
        raise UserError(f"the optimizer has {len(sd['param_groups'])} parameter groups, the handle {groups} (the "
                        "groups given to attach: build the optimizer with one group per group given there)")
    return [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]


@register("sharded")
class Sharded(Bucketed):
    sync_keys = ("bucket_cap_mb", "first_bucket_mb", "last_bucket_mb") + CLASS_RULE_KEYS + (
        "classes.tied_split", "shard_tied_split", "gather_dtype", "gather_at")
    handle = ShardedSync
    shards = True

    @dataclass(frozen=True)
    class Config(Bucketed.Config):
        shard_tied_split: bool = False  # a tied_split embedding sharded by rows too, not replicated
        gather_dtype: str | None = None  # "bf16": Linear-only parameters all-gathered as the autocast reads them
        gather_at: str = "step"  # the all-gathers start as the optimizer step ends, or as the next forward starts

    def plan(self, named_params, classes, settings):
        """Bucketed's plan; a `tied_split` parameter gets a bucket of its own, first: with the split its gradient is
        complete when the pre-softmax projection's is, the first that backward computes. The rest is planned on its
        own, so its first bucket follows `first_bucket_mb` as bucketed's would. How each bucket travels (sharded,
        replicated, by rows) is its exchange plan's (`exchange_plan`)."""
        split = [(n, p) for n, p in named_params if settings[classes[n]].tied_split]
        rest = [(n, p) for n, p in named_params if not settings[classes[n]].tied_split]
        buckets = []
        for one in split:
            buckets += super().plan([one], classes, settings)
        buckets += super().plan(rest, classes, settings)
        return [dataclasses.replace(b, index=i) for i, b in enumerate(buckets)]

    @classmethod
    def problems(cls, sync) -> list[tuple[str, str]]:
        if sync.gather_at not in GATHER_AT:
            return [("sync.gather_at", f"must be one of {', '.join(GATHER_AT)}, got '{sync.gather_at}'")]
        return []

    @classmethod
    def schedule(cls, sync, model, world, accum_steps=1, ranks_per_node=None) -> Schedule:
        """Each bucket as its exchange plan moves it (`exchange_plan`): a sharded one reduce-scattered point to
        point when its last gradient is ready and all-gathered for the next forward from the optimizer step (or as
        that forward starts, `gather_at`); a
        replicated one (a split tied embedding) all-reduced, or exchanged whole in bf16, from its projection part;
        narrowed members in their bytes (the reduce-scatter's only in a step of one micro-batch, `accum_steps` 1);
        each lookup's rows of a split embedding, all-reduced (reduce-scattered to their owners by rows). Every
        rank's optimizer updates its shard of the sharded buckets and all of the replicated ones."""
        strategy = cls.from_sync(sync)
        named = ready_order(model)
        classes = tensor_classes.from_config(sync)
        class_of = classes.assign(named)
        settings = classes.used(class_of)
        plan = strategy.plan(named, class_of, settings)
        exchanges = exchange_plan(sync, model, plan, world)
        accumulated = accum_steps > 1
        colls, gathers = [], []
        for ex, after in zip(exchanges, through(plan, named)):
            b, n = ex.bucket, ex.nbytes("reduce_scatter", accumulated)
            whole = ex.whole and not accumulated
            kind = EXCHANGE if whole else REDUCE_SCATTER if ex.gathered else ALL_REDUCE
            dtype = (ex.wire if len(ex.narrowed) == len(b.names) else "mixed") if ex.narrowed else "fp32"
            colls.append(Collective(kind, n, "fp32" if accumulated and not whole else dtype, b.index,
                                    PROJECTION if ex.split else GRADIENT, WAIT, True, None, after,
                                    RING if kind == ALL_REDUCE else P2P))
            if ex.gathered:
                gathers.append(Collective(ALL_GATHER, ex.nbytes("all_gather"), dtype, b.index, GATHER_AT[sync.gather_at],
                                          FORWARD, True, None, 0, P2P))
        split = any(ex.split for ex in exchanges)
        rows = any(ex.layout == ROWS for ex in exchanges)
        if split_params(class_of, settings):
            colls.append(lookup_rows(REDUCE_SCATTER if rows else ALL_REDUCE, P2P if rows else RING))
        sharded = sum(ex.bucket.numel for ex in exchanges if ex.gathered)
        return Schedule(cls.name, tuple(plan), tuple(colls + gathers), world,
                        updated=1 - (1 - 1 / world) * sharded / (sum(b.numel for b in plan) or 1), split=split,
                        label=("+split" if split else "") + ("+rows" if rows else "")
                        + (f"+{sync.gather_dtype}" if sync.gather_dtype else ""))
