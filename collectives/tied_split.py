"""The tied embedding's gradient in two parts, each sent when backward has it.

One matrix (V, d) serves the encoder's and the decoder's input lookups and the pre-softmax projection (Vaswani et al.
2017, section 3.4; weight tying: Press and Wolf 2017). Backward computes the projection's gradient first, dense (V, d),
and the lookups' last, non-zero only on the rows of the batch's tokens. Sent as one tensor, the whole matrix waits
for the encoder's lookup, the very last thing backward computes. Split:

- projection part: while a synchronized backward runs, the lookups do not accumulate into `.grad`, so the parameter's
  gradient is complete as soon as the projection's is, and its bucket goes out at the start of backward;
- lookup part: each lookup's backward keeps (its unique token ids, their summed gradient rows); after the last one
  the ranks all-reduce the rows that any rank touched, (|union|, d). Which rows those are is known at forward time:
  each lookup's forward all-reduces a V-length mask of its tokens (V bytes, asynchronously), so the union is ready
  when backward needs it and backward never waits for another rank.

`finish` adds the mean of the rows into the mean of the projection part: the exact mean of the whole gradient, up to
float rounding. Micro-batches under `no_sync()` accumulate as usual (their lookups write `.grad` themselves). The two
lookup collectives use a process group of their own: they start from backward's last lookup, and on a shared group
their order relative to the buckets' all-reduces could differ between ranks.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from collectives.timing import Stamp, record_ms, stamp
from common.errors import UserError
from common.rundir import BucketRecord


class _Lookup(torch.autograd.Function):
    """`F.embedding(tokens, weight)` whose backward hands (tokens, grad_out) to the split instead of `weight.grad`.

    `weight` comes in detached, so the parameter's own gradient node no longer waits for the lookups; `anchor`
    (an empty leaf that requires grad) keeps this node in the backward graph."""

    @staticmethod
    def forward(ctx, tokens, weight, anchor, split, padding_idx):
        ctx.split, ctx.padding_idx = split, padding_idx
        ctx.save_for_backward(tokens)
        return F.embedding(tokens, weight, padding_idx)  # (..., d)

    @staticmethod
    def backward(ctx, grad_out):
        (tokens,) = ctx.saved_tensors
        ctx.split.lookup_backward(tokens, grad_out, ctx.padding_idx)
        return None, None, None, None, None


class TiedEmbeddingSplit:
    """Splits the gradient of parameter `name` (the weight of one or more `nn.Embedding` modules, also used
    elsewhere) into its projection part, reduced by the caller's bucket, and its lookup rows, reduced here."""

    def __init__(self, model: nn.Module, name: str, group: dist.ProcessGroup | None, world: int, is_armed):
        self.name, self.world, self.is_armed = name, world, is_armed  # is_armed(): this backward synchronizes
        self.param = dict(model.named_parameters())[name]
        lookups = [m for m in model.modules() if isinstance(m, nn.Embedding) and m.weight is self.param]
        if not lookups:
            raise UserError(f"tied_split: parameter '{name}' is not the weight of an nn.Embedding; only an "
                            "embedding's gradient can be split into its lookup rows")
        for m in lookups:
            if m.max_norm is not None or m.scale_grad_by_freq or m.sparse:
                raise UserError(f"tied_split: the embedding of '{name}' uses max_norm, scale_grad_by_freq or "
                                "sparse gradients, which the split does not reproduce")
        self.vocab, self.dim = self.param.shape
        ranks = None if group is None else dist.get_process_group_ranks(group)
        self.group = dist.new_group(ranks)  # a collective call: every rank builds its splits in the same order
        self.anchor = torch.empty(0, device=self.param.device, requires_grad=True)
        self._hooks = [m.register_forward_hook(self._lookup_forward) for m in lookups]
        self.prepare()

    def prepare(self) -> None:
        """At each forward: forget the last step's rows."""
        self.pending = 0  # lookups of this forward whose backward has not run yet
        self.masks: list[tuple[torch.Tensor, object]] = []  # (mask (V,) uint8, its all-reduce) per lookup
        self.parts: list[tuple[torch.Tensor, torch.Tensor]] = []  # (ids (k,), rows (k, d)) per lookup
        self.union: torch.Tensor | None = None
        self.rows: torch.Tensor | None = None
        self.work = None
        self.ready_t: Stamp | None = None
        self.launch_t: Stamp | None = None
        self.complete_t: Stamp | None = None
        self.wait_s = 0.0  # host time blocked in finish()

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()

    def _lookup_forward(self, module: nn.Embedding, inputs, output):
        if not (self.is_armed() and torch.is_grad_enabled()):
            return None  # no_sync(), evaluation: the lookup stays as it is
        self.pending += 1
        tokens = inputs[0]
        mask = torch.zeros(self.vocab, dtype=torch.uint8, device=tokens.device)
        mask[tokens.reshape(-1)] = 1
        if module.padding_idx is not None:
            mask[module.padding_idx] = 0  # F.embedding gives the padding row no gradient
        # In forward order, the same on every rank; maxed over the ranks: the rows any rank looked up.
        self.masks.append((mask, dist.all_reduce(mask, op=dist.ReduceOp.MAX, group=self.group, async_op=True)))
        return _Lookup.apply(tokens, module.weight.detach(), self.anchor, self, module.padding_idx)

    def lookup_backward(self, tokens: torch.Tensor, grad_out: torch.Tensor, padding_idx: int | None) -> None:
        """One lookup's gradient as (unique ids, summed rows); after the last lookup of the step, the exchange."""
        ids = tokens.reshape(-1)
        grads = grad_out.reshape(-1, self.dim).to(self.param.dtype)  # (tokens, d)
        if padding_idx is not None:  # as F.embedding: the padding row gets no gradient
            keep = ids != padding_idx
            ids, grads = ids[keep], grads[keep]
        ids, inverse = torch.unique(ids, return_inverse=True)
        rows = torch.zeros(len(ids), self.dim, dtype=grads.dtype, device=grads.device).index_add_(0, inverse, grads)
        self.parts.append((ids, rows))
        self.pending -= 1
        if self.pending == 0:
            self._exchange()

    def _exchange(self) -> None:
        self.ready_t = stamp(self.param.device)
        ids = torch.cat([i for i, _ in self.parts])
        rows = torch.cat([r for _, r in self.parts])
        for _, work in self.masks:
            work.wait()  # sent during forward: long done
        mask = self.masks[0][0]
        for m, _ in self.masks[1:]:
            mask = torch.maximum(mask, m)
        self.union = mask.nonzero().squeeze(1)  # (u,) sorted row ids: every rank's tokens
        self.rows = torch.zeros(len(self.union), self.dim, dtype=rows.dtype, device=rows.device)
        self.rows.index_add_(0, torch.searchsorted(self.union, ids), rows)
        self.launch_t = stamp(self.param.device)
        work = dist.all_reduce(self.rows, group=self.group, async_op=True)
        self.work = work.get_future().then(self._completed)

    def _completed(self, fut):
        self.complete_t = stamp(self.param.device)
        return fut.value()

    def finish(self) -> None:
        """Wait for the rows and add their mean into `.grad`, which holds the mean of the projection part. Once per
        synchronized step: a step whose forwards all ran under no_sync() has no rows here (its lookups wrote
        `.grad` themselves)."""
        if self.work is None:
            return
        t0 = time.perf_counter()
        self.work.wait()
        self.wait_s = time.perf_counter() - t0
        self.work = None  # applied: a second finish() without a synchronized forward adds nothing
        self.param.grad.index_add_(0, self.union, self.rows / self.world)

    def record(self, index: int, t0: Stamp | None, wait_start_ms: float | None, tensor_class: str
               ) -> BucketRecord | None:
        """The lookup part's record (index after the buckets'); times in ms from `t0`, the step's time zero. Its
        bytes are the rows' all-reduce (the masks' V bytes per lookup went during forward)."""
        if self.rows is None:
            return None

        def ms(t):
            return record_ms(t0, t)

        numel, dtype = self.rows.numel(), str(self.rows.dtype)[6:]
        wire = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(dtype, dtype)
        complete = ms(self.complete_t)
        if self.complete_t is not None and self.complete_t.event is not None:  # CUDA: finish() blocks no host
            wait_ms = None
            if complete is not None and wait_start_ms is not None:
                wait_ms = round(max(0.0, complete - wait_start_ms), 3)
        else:
            wait_ms = round(self.wait_s * 1000, 3)
        return BucketRecord(index, tensor_class, dtype, wire, 1, numel, numel * self.rows.element_size(),
                            ms(self.ready_t), ms(self.launch_t), complete, wait_start_ms, wait_ms, part="lookup")
