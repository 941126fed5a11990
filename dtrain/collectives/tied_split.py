"""The tied embedding's gradient in two parts, each sent when backward has it.

One matrix (V, d) serves the encoder's and the decoder's input lookups and the pre-softmax projection (Vaswani et al.
2017, section 3.4; weight tying: Press and Wolf 2017). Backward computes the projection's gradient first, dense (V, d),
and the lookups' last, non-zero only on the rows of the batch's tokens. Sent as one tensor, the whole matrix waits
for the encoder's lookup, the very last thing backward computes. Split:

- projection part: while a synchronized backward runs, the lookups do not accumulate into `.grad`, so the parameter's
  gradient is complete as soon as the projection's is, and its bucket goes out at the start of backward;
- lookup part: the rows that any rank looked up, (|union|, d), are sent whole, each row as soon as no lookup still
  to come in backward touches it: the decoder's rows half-way through backward, the encoder's (the very last thing
  backward computes) when backward ends. Which rows those are is known at forward time: each lookup's forward
  all-reduces a V-length mask of its tokens (V bytes, asynchronously), so the unions are ready when backward needs
  them and backward never waits for another rank.

A sent row is this rank's whole gradient of that row, added up as autograd would have: the gradient accumulated
before this micro-batch, plus ((the projection's row + the first lookup's) + the second's), each lookup's row summed
over its tokens in token order as the embedding's own backward sums them. `finish` overwrites those rows of the
averaged projection part with their sum over the ranks divided by the world size, so the result is the all-reduced
mean of the whole gradient: on two ranks the same bits as DDP's (a + b is b + a, and halving is exact). Micro-batches
under `no_sync()` accumulate as usual (their lookups write `.grad` themselves). The lookups' collectives use a process group of their own: they start inside backward's lookups,
and on a shared group their order relative to the buckets' all-reduces could differ between ranks.

For a matrix sharded by rows (`sharded` with `shard_tied_split`) the split's lookups reduce-scatter their rows to
their owners instead: `dtrain.collectives.sharded.rows`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dtrain.collectives.tensor_classes import WIRE_DTYPES
from dtrain.collectives.timing import Stamp, record_ms, stamp
from dtrain.common.errors import UserError
from dtrain.common.rundir import BucketRecord


def split_params(class_of: dict[str, str], settings: dict) -> list[str]:
    """The parameters to split: those of each class whose settings set `tied_split` (`class_of`: parameter name ->
    class; `settings`: class -> its `ClassSettings`), in rule order; such a class must hold exactly one."""
    names = []
    for c, s in settings.items():
        if not s.tied_split:
            continue
        held = [n for n, k in class_of.items() if k == c]
        if len(held) != 1:
            raise UserError(f"'sync.classes.{c}.tied_split': class '{c}' holds {len(held)} parameters; the "
                            "split applies to a class of one tied embedding weight")
        names += held
    return names


def embedding_lookups(model: nn.Module, param: nn.Parameter) -> list[nn.Embedding]:
    """The `nn.Embedding` modules of `model` whose weight is `param`."""
    return [m for m in model.modules() if isinstance(m, nn.Embedding) and m.weight is param]


def unsplittable(model: nn.Module, name: str) -> str | None:
    """Why parameter `name` of `model` cannot be split into its lookup rows, or None where it can: it must be the
    weight of `nn.Embedding`s that run `nn.Embedding`'s own forward (a subclass that scales its output, as some
    translation models' do, would lose the scaling: the split recomputes the lookup) without max_norm,
    scale_grad_by_freq or sparse gradients."""
    lookups = embedding_lookups(model, dict(model.named_parameters())[name])
    if not lookups:
        return (f"parameter '{name}' is not the weight of an nn.Embedding; only an embedding's gradient can be split "
                "into its lookup rows")
    for m in lookups:
        if type(m).forward is not nn.Embedding.forward:
            return (f"the embedding of '{name}' is a {type(m).__name__} with a forward of its own, which the split "
                    "does not reproduce")
        if m.max_norm is not None or m.scale_grad_by_freq or m.sparse:
            return (f"the embedding of '{name}' uses max_norm, scale_grad_by_freq or sparse gradients, which the "
                    "split does not reproduce")
    return None


@dataclass
class Rows:
    """One lookup's part: the rows any rank looked up, their summed gradient, and its all-reduce."""

    union: torch.Tensor  # (u,) sorted row ids: every rank's tokens of this lookup
    rows: torch.Tensor  # (u, d) this rank's gradient rows, summed over the ranks once `work` completes
    work: object  # the all-reduce's future
    ready_t: Stamp
    launch_t: Stamp | None
    complete_t: Stamp | None = None
    wait_s: float = 0.0  # host time blocked in finish()
    sent_bytes: int = 0
    received: list[torch.Tensor] = field(default_factory=list)  # sharded: per peer, its rows of this rank's part
    own: slice | None = None  # sharded: this rank's rows in `union`
    host_s: float = 0.0  # the split's own work for this lookup on the computing thread (its mask, rows, and adding)


class _Lookup(torch.autograd.Function):
    """`F.embedding(tokens, weight)` whose backward hands (tokens, grad_out) to the split instead of `weight.grad`.

    `weight` comes in detached, so the parameter's own gradient node no longer waits for the lookups; `anchor`
    (an empty leaf that requires grad) keeps this node in the backward graph."""

    @staticmethod
    def forward(ctx, tokens, weight, anchor, split, padding_idx, index):
        ctx.split, ctx.padding_idx, ctx.index = split, padding_idx, index
        ctx.save_for_backward(tokens)
        return F.embedding(tokens, weight, padding_idx)  # (..., d)

    @staticmethod
    def backward(ctx, grad_out):
        (tokens,) = ctx.saved_tensors
        ctx.split.lookup_backward(tokens, grad_out, ctx.padding_idx, ctx.index)
        return None, None, None, None, None, None


class TiedEmbeddingSplit:
    """Splits the gradient of parameter `name` (the weight of one or more `nn.Embedding` modules, also used
    elsewhere) into its projection part, reduced by the caller's bucket, and its lookup rows, reduced here."""

    def __init__(self, model: nn.Module, name: str, group: dist.ProcessGroup | None, world: int, is_armed):
        self.name, self.world, self.is_armed = name, world, is_armed  # is_armed(): this backward synchronizes
        self.param = dict(model.named_parameters())[name]
        self.lookups = embedding_lookups(model, self.param)  # the nn.Embedding modules that hold it
        why = unsplittable(model, name)
        if why:
            raise UserError(f"tied_split: {why}")
        self.vocab, self.dim = self.param.shape
        ranks = None if group is None else dist.get_process_group_ranks(group)
        self.group = dist.new_group(ranks)  # a collective call: every rank builds its splits in the same order
        self.anchor = torch.empty(0, device=self.param.device, requires_grad=True)
        self._hooks = [m.register_forward_hook(self._lookup_forward) for m in self.lookups]
        # The projection's gradient, before autograd accumulates it into `.grad` (alone: the lookups are detached)
        self._hooks.append(self.param.register_hook(self._projection_grad))
        self.prepare()

    def prepare(self) -> None:
        """At each forward: forget the last step's rows."""
        # (mask (V,) uint8, its all-reduce) per lookup, in forward order
        self.masks: list[tuple[torch.Tensor, object]] = []
        # The split's own work on the computing thread, which the same model without the split does not do (the
        # simulator takes it out of a step it replays without the split): per mask, in forward order, and the
        # union's start where the projection part started it, before any lookup's backward (claimed by the first)
        self._mask_s: list[float] = []
        self._start_s = 0.0
        self.parts: list[Rows] = []  # per lookup, in backward's order
        self._lookups = 0  # synchronized lookups run in this forward
        # this backward's rows: every lookup's union (u,), this rank's gradient there so far (u, d), what is sent
        self.union: torch.Tensor | None = None
        self.touched: list[torch.Tensor] = []  # per lookup, (u,) bool: the rows of the union it looked up
        self.acc: torch.Tensor | None = None
        self.before: torch.Tensor | None = None  # (u, d) `.grad` there before this micro-batch, or None
        self.sent: torch.Tensor | None = None  # (u,) bool
        self.pending: set[int] = set()  # lookups whose backward has not run yet
        self.applied = True  # nothing to add in finish() until a synchronized lookup's backward

    def close(self) -> None:
        """Its hooks removed and the process group it made destroyed (a collective: every rank closes its splits in
        the same order)."""
        for h in self._hooks:
            h.remove()
        dist.destroy_process_group(self.group)

    def _lookup_forward(self, module: nn.Embedding, inputs, output):
        if not (self.is_armed() and torch.is_grad_enabled()):
            return None  # no_sync(), evaluation: the lookup stays as it is
        tokens = inputs[0]
        if len(self.masks) == self._lookups:  # (a sharded matrix's pre-hook may have sent this lookup's mask)
            self.masks.append(self._union_mask(tokens, module.padding_idx))
        self._lookups += 1
        return _Lookup.apply(tokens, module.weight.detach(), self.anchor, self, module.padding_idx,
                             len(self.masks) - 1)

    def _union_mask(self, tokens: torch.Tensor, padding_idx: int | None) -> tuple[torch.Tensor, object]:
        """A (V,) mask of `tokens`' rows, maxed over the ranks asynchronously: the rows any rank looked up. In
        forward order, the same on every rank."""
        t0 = time.perf_counter()
        mask = torch.zeros(self.vocab, dtype=torch.uint8, device=tokens.device)
        mask[tokens.reshape(-1)] = 1
        if padding_idx is not None:
            mask[padding_idx] = 0  # F.embedding gives the padding row no gradient
        work = dist.all_reduce(mask, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        self._mask_s.append(time.perf_counter() - t0)
        return mask, work

    def _projection_grad(self, grad: torch.Tensor) -> None:
        """The projection part (V, d) as autograd hands it to the parameter, before `.grad` accumulates it: keep this
        rank's rows of every lookup's union, and those of `.grad` from earlier micro-batches."""
        if not (self.is_armed() and self.masks) or self.union is not None:
            return  # not a synchronized backward of the split (its lookups write `.grad` themselves)
        t0 = time.perf_counter()
        self._start(grad)
        self._start_s = time.perf_counter() - t0

    def _start(self, projection: torch.Tensor | None) -> None:
        """This backward's rows: every lookup's union, with this rank's projection part there (if any)."""
        looked_up = torch.zeros(self.vocab, dtype=torch.bool, device=self.param.device)
        for mask, work in self.masks:
            work.wait()  # sent during forward: long done
            looked_up |= mask.bool()
        self.union = looked_up.nonzero().squeeze(1)  # (u,) sorted row ids
        self.touched = [mask[self.union].bool() for mask, _ in self.masks]
        self.acc = (projection[self.union] if projection is not None  # (u, d)
                    else torch.zeros(len(self.union), self.dim, dtype=self.param.dtype, device=self.param.device))
        self.before = None if self.param.grad is None else self.param.grad[self.union]
        self.sent = torch.zeros(len(self.union), dtype=torch.bool, device=self.param.device)
        self.pending = set(range(len(self.masks)))

    def lookup_backward(self, tokens: torch.Tensor, grad_out: torch.Tensor, padding_idx: int | None,
                        index: int) -> None:
        """Lookup `index`'s rows added to this rank's gradient; the rows that no lookup still to come touches are
        sent at once."""
        ready_t = stamp(self.param.device)
        t0 = time.perf_counter()
        ids = tokens.reshape(-1)
        grads = grad_out.reshape(-1, self.dim).to(self.param.dtype)  # (tokens, d)
        if padding_idx is not None:  # as F.embedding: the padding row gets no gradient
            keep = ids != padding_idx
            ids, grads = ids[keep], grads[keep]
        if self.union is None:  # the matrix has no use besides its lookups: no projection part came first
            self._start(None)
        rows = torch.zeros(len(self.union), self.dim, dtype=grads.dtype, device=grads.device)
        rows.index_add_(0, torch.searchsorted(self.union, ids), grads)  # per row in token order, as F.embedding
        self.acc = self.acc + rows  # autograd's order: the projection's, then each lookup's as backward reaches it
        self.pending.discard(index)
        later = torch.zeros_like(self.sent)  # (u,) rows a lookup still to come touches
        for j in self.pending:
            later |= self.touched[j]
        ready = ~self.sent & ~later
        self.sent |= ready
        mine = self.acc[ready] if self.before is None else self.before[ready] + self.acc[ready]
        part = Rows(self.union[ready], mine, None, ready_t, None)
        if len(part.union):  # (the same on every rank: the masks are)
            part.launch_t = stamp(self.param.device)
            self._reduce_rows(part, index)
        # this lookup's own work (the union's start too where it ran here), its mask's, and a start not yet claimed
        part.host_s = time.perf_counter() - t0 + self._mask_s[index] + self._start_s
        self._start_s = 0.0
        self.parts.append(part)
        self.applied = False

    def _reduce_rows(self, part: Rows, index: int) -> None:
        """Start summing `part.rows` over the ranks: an all-reduce."""
        device = self.param.device

        def completed(fut):  # run, and released, on the group's own thread: it must not hold the split (the group)
            part.complete_t = stamp(device)
            return fut.value()

        part.sent_bytes = part.rows.numel() * part.rows.element_size()
        part.work = dist.all_reduce(part.rows, group=self.group, async_op=True).get_future().then(completed)

    def _add(self, part: Rows) -> None:
        """Those rows of `.grad` (the projection part's mean) become their whole gradient's mean."""
        self.param.grad.index_copy_(0, part.union, part.rows / self.world)

    def finish(self) -> None:
        """Wait for each lookup's rows; their mean over the ranks replaces those rows of `.grad`, which holds the mean
        of the projection part.
        Once per synchronized step: a step whose forwards all ran under no_sync() has no rows here (its lookups wrote
        `.grad` themselves)."""
        if self.applied:
            return
        for part in self.parts:
            if part.work is None:
                continue  # no row left for this lookup
            t0 = time.perf_counter()
            part.work.wait()
            part.wait_s = time.perf_counter() - t0
            self._add(part)
            part.host_s += time.perf_counter() - t0 - part.wait_s
        self.applied = True  # a second finish() without a synchronized forward adds nothing
        self.union = None  # the next synchronized backward starts its rows afresh

    def records(self, first_index: int, t0: Stamp | None, wait_start_ms: float | None, tensor_class: str
                ) -> list[BucketRecord]:
        """One record per lookup's part (indices from `first_index`, after the buckets'), in backward's order; times
        in ms from `t0`, the step's time zero. Its bytes are what the rows' reduction sends (the masks' V bytes per
        lookup went during forward)."""

        def ms(t):
            return record_ms(t0, t)

        out = []
        for k, part in enumerate(self.parts):
            numel, dtype = part.rows.numel(), str(part.rows.dtype)[6:]
            wire = next((name for name, t in WIRE_DTYPES.items() if t == part.rows.dtype), dtype)
            complete = ms(part.complete_t)
            if part.complete_t is not None and part.complete_t.event is not None:  # CUDA: finish() blocks no host
                wait_ms = None
                if complete is not None and wait_start_ms is not None:
                    wait_ms = round(max(0.0, complete - wait_start_ms), 3)
            else:
                wait_ms = round(part.wait_s * 1000, 3)
            out.append(BucketRecord(first_index + k, tensor_class, dtype, wire, 1, numel,
                                    part.sent_bytes, ms(part.ready_t), ms(part.launch_t), complete,
                                    wait_start_ms, wait_ms, part="lookup", host_ms=round(part.host_s * 1000, 3)))
        return out

