"""The sharded reducer: each bucket's gradient reduce-scattered during backward, each rank updating its shard, the
updated parameters all-gathered while the next forward runs (ZeRO stage 1/2's partitioning: Rajbhandari et al. 2020;
DeAR's reduce-scatter in backward and all-gather in the next forward: Zhang et al. 2023).

Layout, per bucket of N elements padded to Np = world x s:

    grads  G (Np,)   the members' `.grad` are views into it, as in `Reducer` (backward accumulates there)
    params P (Np,)   the members' `.data` are views into it
    shard  P[r*s:(r+1)*s] is rank r's `nn.Parameter` for the optimizer; its `.grad` the reduced slice (s,)

A `replicated` bucket (the plan's: a tied embedding with `tied_split`) is all-reduced whole instead, by `Reducer`'s
path on `replicated_group`, and every rank updates all of it: the lookups at the very start of the next forward need
the whole matrix, so an all-gather there would hold up the first layer (docs/results.md).

A reduce-scatter sends (world - 1)/world of the bucket, half of what an all-reduce sends, and the rest (the
all-gather of the updated shard) moves out of backward into the next forward. Both run as point-to-point sends on a
process group of their own: on gloo, `reduce_scatter_tensor` moves as many bytes as an all-reduce, while `isend` and
`irecv` move the chunks at the link's rate (docs/results.md). Each rank sums its shard in rank order, so on two
ranks the sum is the all-reduce's a + b, bit for bit.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from collectives.plan import Bucket
from collectives.reducer import Reducer, _BucketState
from collectives.timing import Stamp, record_ms, stamp
from common.rundir import BucketRecord


@dataclass
class _Shard:
    params: torch.Tensor  # P (Np,): the members' parameters, back to back, zero-padded
    shard: nn.Parameter  # P[rank*s:(rank+1)*s], what this rank's optimizer updates
    received: list[torch.Tensor]  # per peer, (s,): its partial sum of this rank's chunk
    scatter: list = field(default_factory=list)  # the reduce-scatter's sends and receives in flight
    gather: list = field(default_factory=list)  # the all-gather's
    reduced: threading.Event = field(default_factory=threading.Event)  # the shard's gradient is summed
    gathered: threading.Event = field(default_factory=threading.Event)  # the bucket's parameters are current
    replicated: bool = False  # all-reduced whole; `shard` is then the model's parameter itself
    gather_launch: Stamp | None = None
    gather_complete: Stamp | None = None


class ShardedReducer(Reducer):
    """`Reducer` whose buckets are reduce-scattered into per-rank shards and whose parameters are all-gathered back.

    `group` carries the point-to-point traffic (a group of its own); `rank` is this rank's index in it. Replicated
    buckets are all-reduced on `replicated_group` (None: the world) and not sharded.
    """

    def __init__(self, named_params: dict[str, nn.Parameter], buckets: list[Bucket], world_size: int,
                 group: dist.ProcessGroup, rank: int, replicated_group: dist.ProcessGroup | None = None):
        self.group, self.rank, self.replicated_group = group, rank, replicated_group
        self.peers = [dist.get_global_rank(group, j) for j in range(world_size)]
        self.shards: list[_Shard] = []
        self.gather_pending = False  # shards may have changed since the last all-gather: launch one
        # gloo's point-to-point work has no future to chain a callback on: a thread waits for each exchange in
        # launch order, stamps its completion and sums the shard (on CPU while backward computes).
        self._waiting: queue.Queue = queue.Queue()
        self._failure: BaseException | None = None
        threading.Thread(target=self._waiter, name="shards-waiter", daemon=True).start()
        super().__init__(named_params, buckets, world_size, overlap=True, groups={}, default_group=group)

    def _padded(self, numel: int) -> int:
        return -(-numel // self.world) * self.world

    def _layout(self, buckets: list[Bucket]) -> None:
        super()._layout(buckets)
        self.shards = []
        for st in self.buckets:
            if st.bucket.replicated:
                if len(st.params) != 1:
                    raise ValueError(f"a replicated bucket holds one parameter, not {len(st.params)}")
                st.group = self.replicated_group
                p = st.params[0]
                self.shards.append(_Shard(p.data.view(-1), p, [], replicated=True))
                self.shards[-1].reduced.set()
                self.shards[-1].gathered.set()
                continue
            padded = self._padded(st.bucket.numel)
            if st.buffer.numel() < padded:  # G padded with zeros: every rank's chunk has s elements
                st.buffer = torch.cat([st.buffer, st.buffer.new_zeros(padded - st.buffer.numel())])
                st.views = [st.buffer[off: off + p.numel()].view_as(p)
                            for off, p in zip(member_offsets(st.params), st.params)]
            flat = st.buffer.new_zeros(padded)
            with torch.no_grad():
                for off, p in zip(member_offsets(st.params), st.params):
                    flat[off: off + p.numel()].copy_(p.reshape(-1))
                    p.data = flat[off: off + p.numel()].view_as(p)  # the model reads P from now on
            s = padded // self.world
            shard = nn.Parameter(flat[self.rank * s: (self.rank + 1) * s])  # shares P's storage
            self.shards.append(_Shard(flat, shard, [flat.new_empty(s) for _ in range(self.world - 1)]))
            self.shards[-1].reduced.set()
            self.shards[-1].gathered.set()
        self.attach_grads()

    def chunk(self, st: _BucketState, j: int) -> torch.Tensor:
        s = st.buffer.numel() // self.world
        return st.buffer[j * s: (j + 1) * s]

    # -- backward: reduce-scatter --------------------------------------------------------------------------------

    def _launch(self, st: _BucketState) -> None:
        sh = self.shards[st.bucket.index]
        if sh.replicated:
            super()._launch(st)  # all-reduced and averaged in place: `.grad` is the bucket's view
            return
        st.launch_t = stamp(self.device)
        tag = 2 * st.bucket.index
        sh.reduced.clear()
        others = [j for j in range(self.world) if j != self.rank]
        sh.scatter = [dist.irecv(buf, src=self.peers[j], group=self.group, tag=tag)
                      for j, buf in zip(others, sh.received)]
        sh.scatter += [dist.isend(self.chunk(st, j), dst=self.peers[j], group=self.group, tag=tag) for j in others]
        st.work = sh.scatter
        self._waiting.put(("scatter", st))

    def _waiter(self) -> None:
        while True:
            kind, st = self._waiting.get()
            sh = self.shards[st.bucket.index]
            try:
                for w in (sh.scatter if kind == "scatter" else sh.gather):
                    w.wait()
                if kind == "scatter":
                    st.complete_t = stamp(self.device)
                    self._reduce(st)
                else:
                    sh.gather_complete = stamp(self.device)
            except BaseException as e:  # noqa: BLE001 - handed to the training thread, which re-raises it
                self._failure = e
            (sh.reduced if kind == "scatter" else sh.gathered).set()

    def _check(self) -> None:
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure

    def _reduce(self, st: _BucketState) -> None:
        sh = self.shards[st.bucket.index]
        # In rank order: chunk_0 + chunk_1 + ..., this rank's own chunk in its place.
        partial = iter(sh.received)
        parts = [self.chunk(st, self.rank) if j == self.rank else next(partial) for j in range(self.world)]
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        total.div_(self.world)  # sum, then divide: the reference's order of operations
        sh.shard.grad = total  # (s,)
        sh.scatter = []

    def _wait(self, st: _BucketState) -> None:
        if self.shards[st.bucket.index].replicated:
            st.work.wait()
        else:
            self.shards[st.bucket.index].reduced.wait()  # the waiter thread's sum

    def finish(self) -> None:
        """`Reducer.finish`, then: the local gradients are consumed, so they are zeroed for the next step's
        accumulation, and the next forward all-gathers the updated shards."""
        super().finish()
        self._check()
        for st, sh in zip(self.buckets, self.shards):
            if not sh.replicated:  # a replicated bucket's buffer is its parameter's `.grad`, for the optimizer
                st.buffer.zero_()
        self.gather_pending = True

    # -- the next forward: all-gather ------------------------------------------------------------------------

    def gather(self) -> None:
        """Send this rank's (updated) shards and receive the others', last bucket first: the buckets whose
        gradients backward produced last hold the parameters the next forward needs first."""
        if not self.gather_pending:
            return
        self.gather_pending = False
        others = [j for j in range(self.world) if j != self.rank]
        for st in reversed(self.buckets):
            sh = self.shards[st.bucket.index]
            if sh.replicated:
                continue
            s = sh.shard.numel()
            tag = 2 * st.bucket.index + 1
            sh.gathered.clear()
            sh.gather_launch, sh.gather_complete = stamp(self.device), None
            sh.gather = [dist.irecv(sh.params[j * s: (j + 1) * s], src=self.peers[j], group=self.group, tag=tag)
                         for j in others]
            sh.gather += [dist.isend(sh.shard.detach(), dst=self.peers[j], group=self.group, tag=tag)
                          for j in others]
            self._waiting.put(("gather", st))

    def wait_gathered(self, indices) -> None:
        """Block until the parameters of buckets `indices` are all-gathered."""
        for i in indices:
            self.shards[i].gathered.wait()
        self._check()

    def wait_params(self) -> None:
        self.gather()
        self.wait_gathered(range(len(self.shards)))

    def gather_records(self, t0: Stamp | None, first_index: int) -> list[BucketRecord]:
        """One record per bucket's all-gather, the part of its communication that ran in this step's forward;
        times in ms from `t0` (negative: before backward started)."""
        out = []
        for k, st in enumerate(reversed(self.buckets)):
            sh = self.shards[st.bucket.index]
            if sh.gather_launch is None:
                continue
            b = st.bucket
            nbytes = sh.shard.numel() * sh.shard.element_size() * (self.world - 1)  # received
            out.append(BucketRecord(first_index + k, b.tensor_class, dtype=str(st.buffer.dtype)[6:],
                                    wire_dtype=b.settings.wire_dtype, tensors=len(st.params), numel=b.numel,
                                    nbytes=nbytes, ready_ms=record_ms(t0, sh.gather_launch),
                                    launch_ms=record_ms(t0, sh.gather_launch),
                                    complete_ms=record_ms(t0, sh.gather_complete), wait_start_ms=None,
                                    wait_ms=None, part="all_gather"))
            sh.gather_launch = None
        return out


def member_offsets(params: list[torch.Tensor]) -> list[int]:
    """Where each member starts in its bucket's flat buffers."""
    out, off = [], 0
    for p in params:
        out.append(off)
        off += p.numel()
    return out
