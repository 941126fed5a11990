"""The reducer: executes a bucketing plan, issuing the planned strategies' gradient all-reduces.

Each bucket owns one flat buffer and the parameters' `.grad` are views into it, so backward accumulates straight into
the buffer. After `zero_grad(set_to_none=True)` the views are not re-attached before the forward: backward creates
the gradients, and a bucket's launch copies them in, as stock DDP copies gradients into its buckets (one pass over
the bytes instead of zeroing the buffer before the forward and adding into it in backward). Post-accumulate-grad
hooks count a bucket's gradients down; a complete bucket is launched asynchronously (in bucket order, the same on
every rank), averaged and cast back from its wire dtype in the collective's completion callback; `finish()` waits
for all of them and leaves per-bucket timing records. Times are `dtrain.collectives.timing` stamps: host clock on CPU, CUDA
events on a GPU, where hooks and callbacks fire at enqueue time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from dtrain.collectives.plan import Bucket
from dtrain.collectives.spans import comm_span
from dtrain.collectives.timing import Stamp, record_ms, stamp
from dtrain.common.rundir import BucketRecord


@dataclass
class _BucketState:
    bucket: Bucket
    params: list[nn.Parameter]
    buffer: torch.Tensor  # (numel,) in the gradients' dtype; the members' .grad are views into it
    views: list[torch.Tensor]  # one per member, shaped like its parameter
    group: dist.ProcessGroup | None
    # -- per step
    pending: int = 0  # members whose gradient is not ready yet in this backward
    ready_t: Stamp | None = None
    launch_t: Stamp | None = None
    complete_t: Stamp | None = None  # the collective done (on CUDA: on the stream synchronized with it)
    wait_s: float = 0.0  # host time blocked in finish(); on CUDA finish() blocks nothing and records() derives it
    work: object = None  # the future of the all-reduce followed by the averaging
    wire: torch.Tensor | None = None  # what goes on the wire: the buffer itself, or its cast to the wire dtype
    seen: set = field(default_factory=set)


class Reducer:
    """Flat bucket buffers, gradient views, ready hooks and asynchronous all-reduces for one model.

    `groups` maps a tensor class to its process group; buckets of other classes (and "mixed" ones) use
    `default_group` (None: the world). With `overlap` buckets launch from the hooks, else all at `finish()`.
    """

    def __init__(self, named_params: dict[str, nn.Parameter], buckets: list[Bucket], world_size: int,
                 overlap: bool = True, groups: dict[str, dist.ProcessGroup] | None = None,
                 default_group: dist.ProcessGroup | None = None):
        self.named_params, self.world, self.overlap = named_params, world_size, overlap
        self.groups, self.default_group = groups or {}, default_group
        self.armed = False  # the current backward synchronizes (set at forward, outside no_sync)
        self.backward_t: Stamp | None = None
        self.wait_t: Stamp | None = None
        self.observed: list[str] = []  # parameter names in the order their gradients became ready
        self._next = 0  # the next bucket to launch
        self.device = next(iter(named_params.values())).device if named_params else None
        self._released: list[Bucket] | None = None  # the plan while release() has freed its buffers
        self._layout(buckets)
        self._hooks = [p.register_post_accumulate_grad_hook(self._ready_hook(name))
                       for name, p in named_params.items() if p.requires_grad]

    def _layout(self, buckets: list[Bucket]) -> None:
        """Allocate one flat buffer per bucket and make the gradients views into it (keeping their values)."""
        self.buckets, self._where = [], {}
        for b in buckets:
            params = [self.named_params[n] for n in b.names]
            buffer = torch.zeros(self._buffer_numel(b.numel), dtype=b.dtype, device=params[0].device)
            views, offset = [], 0
            for name, p in zip(b.names, params):
                views.append(buffer[offset: offset + p.numel()].view_as(p))
                offset += p.numel()
                self._where[name] = len(self.buckets)
            self.buckets.append(_BucketState(b, params, buffer, views, self.groups.get(b.tensor_class,
                                                                                        self.default_group)))
        self.attach_grads()

    def _buffer_numel(self, numel: int) -> int:
        """A bucket buffer's length for `numel` gradient elements (a reducer that splits buckets pads them)."""
        return numel

    def rebuild(self, buckets: list[Bucket]) -> None:
        """Replace the layout (between steps): the gradients move into the new buffers."""
        self.armed = False
        self._layout(buckets)

    def release(self) -> None:
        """Free the bucket buffers while another handle trains the model (`attach`'s search between candidates),
        keeping only the plan. A `.grad` still viewing a freed buffer keeps it until `zero_grad` or the next layout."""
        if self.buckets:
            self.armed = False
            self._released = [st.bucket for st in self.buckets]
            self.buckets, self._where = [], {}

    def restore(self) -> None:
        """Lay the released plan out again: new zeroed buffers, any gradient copied in."""
        if self._released is not None:
            plan, self._released = self._released, None
            self._layout(plan)

    def bucket_of(self, name: str) -> int:
        """The index of the bucket that holds parameter `name`'s gradient."""
        return self.buckets[self._where[name]].bucket.index

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # -- every forward ----------------------------------------------------------------------------------------

    def attach_grads(self) -> None:
        """Point every `.grad` back at its bucket view; a gradient someone replaced is copied in.

        After `optimizer.zero_grad(set_to_none=True)` every `.grad` of a bucket is unset. Zeroing the buffer here and
        letting backward add into it would write the whole buffer before the forward and read it again in backward;
        instead backward creates each gradient as it would without a reducer, and the launch copies them in (as
        stock DDP copies gradients into its buckets), zeros for a member without one."""
        for st in self.buckets:
            if any(p.grad is not None for p in st.params):
                self._into_buffer(st)

    @staticmethod
    def _into_buffer(st: _BucketState) -> None:
        """Every member's `.grad` the bucket's view: copied in if backward made it elsewhere, zeros if none."""
        for p, v in zip(st.params, st.views):
            if p.grad is None:
                v.zero_()
                p.grad = v
            elif p.grad.data_ptr() != v.data_ptr():
                v.copy_(p.grad)
                p.grad = v

    def prepare(self, sync: bool) -> None:
        """Called at each forward: re-attach the views; arm the hooks if this micro-batch's backward synchronizes."""
        self.attach_grads()
        self.armed = sync
        if sync:
            self.backward_t = self.wait_t = None
            self.observed = []
            self._next = 0  # the next bucket to launch
            for st in self.buckets:
                st.pending = len(st.params)
                st.ready_t = st.launch_t = st.complete_t = None
                st.wait_s, st.work, st.wire = 0.0, None, None
                st.seen = set()

    def mark_backward_start(self) -> None:
        if self.armed and self.backward_t is None:
            self.backward_t = stamp(self.device)

    # -- during backward --------------------------------------------------------------------------------------

    def _ready_hook(self, name: str):
        def hook(param: torch.Tensor) -> None:
            self.ready(name)

        return hook

    def ready(self, name: str) -> None:
        """The gradient of `name` is final for this backward (its hook; the benchmark calls it directly): a bucket
        whose gradients are all ready launches, in bucket order, when overlapping."""
        if not self.armed:
            return
        st = self.buckets[self._where[name]]
        if name in st.seen:
            raise RuntimeError(f"gradient of '{name}' became ready twice in one synchronized backward")
        st.seen.add(name)
        self.observed.append(name)
        st.pending -= 1
        if st.pending == 0:
            st.ready_t = stamp(self.device)
            if self.overlap:
                self._launch_ready()

    def _launch_ready(self) -> None:
        # In bucket order only: every rank must issue the same collectives in the same order on each group.
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            self._start(self.buckets[self._next])
            self._next += 1

    def _start(self, st: _BucketState) -> None:
        self._into_buffer(st)  # gradients backward created outside the buffer (after set_to_none) move in
        self._launch(st)

    def _launch(self, st: _BucketState) -> None:
        st.launch_t = stamp(self.device)
        st.wire = self._to_wire(st)
        b = st.bucket
        with comm_span(b.index, b.tensor_class, b.nbytes, b.settings.wire_dtype) as span:  # profiler label
            work = dist.all_reduce(st.wire, group=st.group, async_op=True)
            fut = span.until(work.get_future())  # inside a profiled window the span ends at completion
        # Averaging (and casting back) runs in the backend's callback as each bucket completes, not in wait():
        # on CPU that is the idle tail of the backward; `finish()` waits for the chained future.
        st.work = fut.then(lambda fut, st=st: self._averaged(st, fut))

    def _to_wire(self, st: _BucketState) -> torch.Tensor:
        """What goes on the wire: the buffer itself (in place), or its cast to the bucket's wire dtype."""
        wire_dtype = st.bucket.settings.torch_wire_dtype
        if wire_dtype == st.buffer.dtype:
            return st.buffer  # in place: the gradients themselves go on the wire
        wire = st.buffer.to(wire_dtype)  # (numel,) cast: the one copy compression costs
        if wire_dtype == torch.float16:
            wire.div_(self.world)  # average before summing so the fp16 sum cannot overflow
        return wire

    def _averaged(self, st: _BucketState, fut) -> torch.Tensor:
        st.complete_t = stamp(self.device)
        fut.value()  # re-raises a failed collective
        return self._average(st)

    def _average(self, st: _BucketState) -> torch.Tensor:
        """The summed wire back into the buffer as the mean (cast back, divided by the world size)."""
        if st.wire is not st.buffer:
            st.buffer.copy_(st.wire)
        if st.wire is st.buffer or st.wire.dtype != torch.float16:
            st.buffer.div_(self.world)  # sum, then divide: the reference's order of operations
        # On CUDA the callback runs on a side stream synchronized with the collective, and its copy and division
        # are asynchronous there. Returning the buffer makes the chained future carry it, so `wait()` orders the
        # caller's stream after them; returning nothing left the optimizer reading half-averaged gradients
        # (on an H200 the benchmark's reducer path then counted wrong results).
        return st.buffer

    # -- wait -------------------------------------------------------------------------------------------------

    def finish(self) -> None:
        """Launch what is left (all buckets without overlap; buckets with unused parameters) and wait for every
        bucket to be all-reduced, averaged and cast back. The time blocked per bucket is its exposed time."""
        if not self.armed:  # no synchronized forward since the last finish: reduce what there is
            self.prepare(True)
        self.wait_t = stamp(self.device)
        for st in self.buckets[self._next:]:
            self._start(st)
        self._next = len(self.buckets)
        for st in self.buckets:
            t0 = time.perf_counter()
            self._wait(st)
            st.wait_s = time.perf_counter() - t0
        self.armed = False

    def _wait(self, st: _BucketState) -> None:
        st.work.wait()  # on CUDA: the current stream waits for the bucket; the host goes on

    def step_start(self) -> Stamp | None:
        """Time zero of the step's records: the start of backward, else the first bucket ready, else wait()."""
        starts = [st.ready_t for st in self.buckets if st.ready_t is not None]
        return self.backward_t or (min(starts, key=lambda s: s.host) if starts else self.wait_t)

    def records(self) -> list[BucketRecord]:
        """One record per bucket for the step just finished; times in ms from the start of the backward."""
        t0 = self.step_start()

        def ms(t):
            return record_ms(t0, t)

        wait_start = ms(self.wait_t)
        on_gpu = self.wait_t is not None and self.wait_t.event is not None
        reached = wait_start  # on CUDA: how far the caller's stream has waited, bucket by bucket in finish()'s order
        out = []
        for st in self.buckets:
            complete = ms(st.complete_t)
            if on_gpu and complete is not None and reached is not None:
                wait_ms = round(max(0.0, complete - reached), 3)  # blocked on this bucket after the ones before
                reached = max(reached, complete)
            else:
                wait_ms = round(st.wait_s * 1000, 3)
            b = st.bucket
            out.append(BucketRecord(b.index, b.tensor_class, dtype=str(st.buffer.dtype)[6:],
                                    wire_dtype=b.settings.wire_dtype, tensors=len(st.params), numel=b.numel,
                                    nbytes=b.nbytes, ready_ms=ms(st.ready_t), launch_ms=ms(st.launch_t),
                                    complete_ms=complete, wait_start_ms=wait_start, wait_ms=wait_ms))
        return out


def allreduce_each(grads: list[torch.Tensor], group: dist.ProcessGroup | None = None) -> None:
    """The reference: every gradient all-reduced on its own, then divided by the world size (in place)."""
    world = dist.get_world_size(group)
    for g in grads:
        dist.all_reduce(g, group=group)
        g.div_(world)
