"""The sharded reducer: each bucket's gradient reduce-scattered during backward, each rank updating its shard, the
updated parameters all-gathered while the next forward runs (ZeRO stage 1/2's partitioning: Rajbhandari et al. 2020;
DeAR's reduce-scatter in backward and all-gather in the next forward: Zhang et al. 2023). Each bucket runs as its
`Exchange` (`dtrain.collectives.sharded.exchange`) says: its layout, its padding, which members travel narrowed.

Layout of a SHARDS bucket of N elements padded to Np = world x s (`Exchange.padded`):

    grads  G (Np,)   the members' `.grad` are views into it, as in `Reducer` (backward accumulates there)
    params P (Np,)   the members' `.data` are views into it
    shard  P[r*s:(r+1)*s] is rank r's `nn.Parameter` for the optimizer; its `.grad` the reduced slice (s,)

A REPLICATED bucket is all-reduced whole by `Reducer`'s path on `replicated_group` (or, `Exchange.whole`, exchanged
whole in bf16 with every peer), and every rank updates all of it. A ROWS bucket is sharded by whole rows
(`RowTable`): each lookup of the next forward fetches just the rows of its tokens
(`dtrain.collectives.sharded.rows.ShardedTiedSplit`).

A reduce-scatter sends (world - 1)/world of the bucket, half of what an all-reduce sends, and the rest (the
all-gather of the updated shard) moves out of backward into the next forward. Both run as point-to-point sends on a
process group of their own: on gloo, `reduce_scatter_tensor` moves as many bytes as an all-reduce, while `isend` and
`irecv` move the chunks at the link's rate (history/2026-11-30-to-2026-12-05-notebook.md). Each rank sums its shard
in rank order, so on two ranks the sum is the all-reduce's a + b, bit for bit.

Narrowed members (`Exchange.narrowed`, bf16) travel the all-gather in bf16 and the received chunk is widened back into
P: under autocast at that dtype the Linear casts its fp32 weight and bias to bf16 before using them, and
bf16(fp32(w16)) = w16 = bf16(w), so forward and backward read the same values as with an fp32 all-gather (FSDP's
mixed precision, `param_dtype`, gathers so too). Each rank's own shard stays exact, for its optimizer. Before the
parameters are read whole (validation, a checkpoint) `exact_params` gathers the rounded chunks again in fp32. Their
gradients go through the reduce-scatter in bf16 too when the step's gradient is one backward's (not `accumulated`),
and each rank widens what it receives and sums in fp32 as before.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from dtrain.collectives.reducer import Reducer, _BucketState
from dtrain.collectives.sharded.exchange import REPLICATED, Exchange, member_offsets
from dtrain.collectives.p2p import Completions, exchange, rank_order_sum
from dtrain.collectives.tensor_classes import WIRE_DTYPES
from dtrain.collectives.timing import Stamp, record_ms, stamp
from dtrain.common.rundir import BucketRecord


@dataclass
class _Shard:
    params: torch.Tensor  # P (Np,): the members' parameters, back to back, zero-padded
    shard: nn.Parameter  # P[rank*s:(rank+1)*s], what this rank's optimizer updates
    # per peer, (s,): its partial sum of this rank's chunk (a bucket exchanged whole, `Exchange.whole`: its gradient)
    received: list[torch.Tensor]
    scatter: list = field(default_factory=list)  # the reduce-scatter's sends and receives in flight
    gather: list = field(default_factory=list)  # the all-gather's
    reduced: threading.Event = field(default_factory=threading.Event)  # the shard's gradient is summed
    gathered: threading.Event = field(default_factory=threading.Event)  # the bucket's parameters are current
    replicated: bool = False  # all-reduced whole; `shard` is then the model's parameter itself
    gather_launch: Stamp | None = None
    gather_complete: Stamp | None = None
    gather_wait_s: float = 0.0  # how long the forward blocked on this all-gather (the host's wait)
    # With a gather dtype: per chunk j, the indices in it of members read outside a Linear (exact: sent in fp32)
    exact_idx: list[torch.Tensor] = field(default_factory=list)
    rounded: bool = False  # the other ranks' chunks in P hold the narrowed values (the gather dtype's, widened)
    scatter_narrowed: bool = False  # this step's reduce-scatter went narrowed


def _kept_flat(params: list[torch.Tensor], padded: int) -> torch.Tensor | None:
    """P (padded,) where the bucket's `params` still view one, laid out as this bucket's (a layout released and
    restored, and no other plan laid them out since): the storage holds exactly `padded` elements with each member at
    its offset. Else None."""
    storage = params[0].data.untyped_storage()
    if storage.nbytes() != padded * params[0].element_size():
        return None
    if any(p.data.untyped_storage().data_ptr() != storage.data_ptr() or p.data.storage_offset() != off
           or not p.data.is_contiguous() for off, p in zip(member_offsets(params), params)):
        return None
    return params[0].data.new_empty(0).set_(storage, 0, (padded,))


@dataclass
class RowTable:
    """A 2-D parameter (a tied embedding) sharded by whole rows: rank r owns rows [r*per_rank, (r+1)*per_rank)."""

    table: torch.Tensor  # (world*per_rank, d): the bucket's parameters P (rows past the matrix's own: zeros)
    per_rank: int
    rank: int
    shard: nn.Parameter  # (per_rank*d,) this rank's rows, flat; `.grad`: their reduced projection part
    completions: Completions  # where the owner of the table waits for point-to-point work
    wait_whole: Callable[[], None]  # blocks until the whole table is all-gathered
    fetched: Callable[[], None]  # a lookup's rows are in: the next wave of all-gathers may go
    launched: int = 0  # all-gathers started (`gather`) so far: every rank counts the same at the same point


class ShardedReducer(Reducer):
    """`Reducer` whose buckets are reduce-scattered into per-rank shards and whose parameters are all-gathered back.

    `exchanges`: the plan's buckets, each with its `Exchange`. `group` carries the point-to-point traffic (a group
    of its own); `rank` is this rank's index in it. Replicated buckets are all-reduced on `replicated_group` (None:
    the world).
    """

    def __init__(self, named_params: dict[str, nn.Parameter], exchanges: list[Exchange], group: dist.ProcessGroup,
                 rank: int, replicated_group: dist.ProcessGroup | None = None):
        self.group, self.rank, self.replicated_group = group, rank, replicated_group
        self.exchanges = exchanges
        wires = {ex.wire for ex in exchanges if ex.wire}
        self.gather_dtype = WIRE_DTYPES[wires.pop()] if wires else None  # the narrowed members' dtype
        # The step's gradients are not one backward's (micro-batches accumulated, or a module ran twice): their
        # Linear members are sums of bf16 values, which bf16 does not hold, so the reduce-scatter goes in fp32
        self.accumulated = False
        world_size = exchanges[0].world if exchanges else 1
        self.peers = [dist.get_global_rank(group, j) for j in range(world_size)]
        self.others = [j for j in range(world_size) if j != rank]  # the peers' indices in `group`
        self.shards: list[_Shard] = []
        self.gather_pending = False  # shards may have changed since the last all-gather: launch one
        # bucket indices in the order the all-gathers go, in waves launched one after the other; None: one wave,
        # last bucket first
        self.gather_waves: list[list[int]] | None = None
        self._waves: list[list[int]] = []  # this step's waves not launched yet
        self._unlaunched: set[int] = set()
        self._launch_order: list[int] = []
        self.tables: dict[int, RowTable] = {}  # bucket index -> its rows, once `row_table` was asked for
        self.completions = Completions("shards-waiter")  # stamps each exchange's completion, sums each shard
        super().__init__(named_params, [ex.bucket for ex in exchanges], world_size, overlap=True, groups={},
                         default_group=group)

    def _layout(self, buckets) -> None:
        super()._layout(buckets)
        self.shards = []
        for st, ex in zip(self.buckets, self.exchanges):
            if ex.layout == REPLICATED:
                if len(st.params) != 1:
                    raise ValueError(f"a replicated bucket holds one parameter, not {len(st.params)}")
                st.group = self.replicated_group
                p = st.params[0]
                self.shards.append(_Shard(p.data.view(-1), p, [], replicated=True))
                self.shards[-1].reduced.set()
                self.shards[-1].gathered.set()
                continue
            padded = ex.padded
            if st.buffer.numel() < padded:  # G padded with zeros: every rank's chunk has s elements
                st.buffer = torch.cat([st.buffer, st.buffer.new_zeros(padded - st.buffer.numel())])
                st.views = [st.buffer[off: off + p.numel()].view_as(p)
                            for off, p in zip(member_offsets(st.params), st.params)]
            flat = _kept_flat(st.params, padded)
            if flat is None:
                flat = st.buffer.new_zeros(padded)
                with torch.no_grad():
                    for off, p in zip(member_offsets(st.params), st.params):
                        flat[off: off + p.numel()].copy_(p.reshape(-1))
                        p.data = flat[off: off + p.numel()].view_as(p)  # the model reads P from now on
            s = ex.chunk
            shard = nn.Parameter(flat[self.rank * s: (self.rank + 1) * s])  # shares P's storage
            self.shards.append(_Shard(flat, shard, [flat.new_empty(s) for _ in range(self.world - 1)],
                                      exact_idx=self._exact_idx(st, ex)))
            self.shards[-1].reduced.set()
            self.shards[-1].gathered.set()
        for i, t in self.tables.items():  # a layout again (`restore`): the split's rows view the new P
            t.table, t.shard = self.shards[i].params.view(-1, t.table.shape[1]), self.shards[i].shard
        self.attach_grads()

    def release(self) -> None:
        """`Reducer.release`: the gradient buffers, the peers' chunks and the shards go, while another handle trains
        the model (call after `wait_params`: every rank's chunk must be in P). P stays as the storage of the
        parameters, which the model holds anyway: another handle trains them in place, and `restore` lays P out
        from them again (the same P where they still view it, else a copy)."""
        if not self.buckets:
            return
        self.shards = []
        for t in self.tables.values():  # a split's rows view P: it goes too (`_layout` points them at the new one)
            t.table, t.shard = t.table.new_empty(0, t.table.shape[1]), None
        super().release()

    def _exact_idx(self, st: _BucketState, ex: Exchange) -> list[torch.Tensor]:
        """Per chunk (s,) of a bucket with narrowed members: the indices of its elements that stay exact. Empty when
        the bucket has no member to narrow (then the whole bucket goes in fp32)."""
        if not ex.narrowed:
            return []
        s = ex.chunk
        keep = torch.zeros(ex.padded, dtype=torch.bool, device=st.params[0].device)  # index_copy_ wants P's device
        for off, n, p in zip(member_offsets(st.params), st.bucket.names, st.params):
            keep[off: off + p.numel()] = n not in ex.narrowed
        return [keep[j * s: (j + 1) * s].nonzero().view(-1) for j in range(self.world)]

    def row_table(self, index: int) -> RowTable:
        """Bucket `index` (a ROWS exchange) as rows: the view a tied embedding's split works on."""
        st, sh = self.buckets[index], self.shards[index]
        row = self.exchanges[index].row_size
        if not row or len(st.params) != 1:
            raise ValueError(f"bucket {index} is not one parameter sharded by rows")
        if index not in self.tables:
            self.tables[index] = RowTable(sh.params.view(-1, row), sh.shard.numel() // row, self.rank, sh.shard,
                                          self.completions, lambda: self.wait_gathered([index]), self.launch_wave)
        return self.tables[index]

    def chunk(self, st: _BucketState, j: int) -> torch.Tensor:
        s = st.buffer.numel() // self.world
        return st.buffer[j * s: (j + 1) * s]

    # -- backward: reduce-scatter --------------------------------------------------------------------------------

    def _launch(self, st: _BucketState) -> None:
        sh = self.shards[st.bucket.index]
        sh.scatter_narrowed = not self.accumulated and bool(self.exchanges[st.bucket.index].narrowed)
        if sh.replicated:
            if sh.scatter_narrowed:
                self._launch_whole_narrowed(st, sh)
            else:
                super()._launch(st)  # all-reduced and averaged in place: `.grad` is the bucket's view
            return
        st.launch_t = stamp(self.device)
        tag = 2 * st.bucket.index
        others = self.others
        if sh.scatter_narrowed:  # each peer's chunk of this rank's gradient, and this rank's chunk from each peer
            mine = sh.exact_idx[self.rank]
            sh.scatter, widen = self._exchange_narrowed({j: self.chunk(st, j) for j in others},
                                                        {j: sh.exact_idx[j] for j in others},
                                                        {j: mine for j in others}, tag)

            def then():
                for j, buf in zip(others, sh.received):
                    widen(j, buf)
                self._reduce(st)
        else:
            sh.scatter = exchange([(self.chunk(st, j), self.peers[j]) for j in others],
                                  [(buf, self.peers[j]) for j, buf in zip(others, sh.received)], self.group, tag)

            def then():
                self._reduce(st)
        st.work = sh.scatter
        self.completions.put(sh.scatter, then, sh.reduced)

    def _launch_whole_narrowed(self, st: _BucketState, sh: _Shard) -> None:
        """A replicated bucket's gradient, a bf16 value widened (`Exchange.whole`): the whole of it in
        `gather_dtype` to every peer, each peer's widened on arrival, summed in rank order and divided as the
        all-reduce's callback does."""
        st.launch_t = stamp(self.device)
        others = self.others
        none = torch.zeros(0, dtype=torch.long, device=st.buffer.device)  # every element is a bf16 value
        sh.scatter, widen = self._exchange_narrowed({j: st.buffer for j in others}, {j: none for j in others},
                                                    {j: none for j in others}, 2 * st.bucket.index)
        if not sh.received:  # per peer, its gradient widened: kept from step to step
            sh.received = [torch.empty_like(st.buffer) for _ in others]

        def then():
            for j, buf in zip(others, sh.received):
                widen(j, buf)
            st.complete_t = stamp(self.device)
            st.buffer.copy_(rank_order_sum(st.buffer, sh.received, self.rank).div_(self.world))

        st.work = sh.scatter
        self.completions.put(sh.scatter, then, sh.reduced)

    def _reduce(self, st: _BucketState) -> None:
        st.complete_t = stamp(self.device)
        sh = self.shards[st.bucket.index]
        total = rank_order_sum(self.chunk(st, self.rank), sh.received, self.rank)  # chunk_0 + chunk_1 + ...
        total.div_(self.world)  # sum, then divide: the reference's order of operations
        sh.shard.grad = total  # (s,)
        sh.scatter = []

    def _wait(self, st: _BucketState) -> None:
        sh = self.shards[st.bucket.index]
        if sh.replicated and not sh.scatter_narrowed:
            st.work.wait()
        else:
            self.shards[st.bucket.index].reduced.wait()  # the waiter thread's sum

    def prepare(self, sync: bool) -> None:
        if not sync or self.armed:  # a micro-batch that only accumulates, or a second one before finish()
            self.accumulated = True
        super().prepare(sync)

    def finish(self) -> None:
        """`Reducer.finish`, then: the local gradients are consumed, so they are zeroed for the next step's
        accumulation, and the next forward all-gathers the updated shards."""
        if not self.armed:  # gradients of no synchronized forward: whatever backward left there
            self.accumulated = True
        super().finish()
        self.accumulated = False
        self.completions.check()
        for st, sh in zip(self.buckets, self.shards):
            if not sh.replicated:  # a replicated bucket's buffer is its parameter's `.grad`, for the optimizer
                st.buffer.zero_()
        self.gather_pending = True

    # -- the next forward: all-gather ------------------------------------------------------------------------

    def gather(self) -> None:
        """Start the all-gathers of the shards updated since the last ones: the first of `gather_waves`, the rest as
        `launch_wave` or a wait asks for them. Without waves, all at once, last bucket first: the buckets whose
        gradients backward produced last hold the parameters the next forward needs first."""
        if not self.gather_pending:
            return
        self.gather_pending = False
        waves = self.gather_waves or [[st.bucket.index for st in reversed(self.buckets)]]
        self._waves = [[i for i in w if not self.shards[i].replicated] for w in waves]
        self._unlaunched = {i for w in self._waves for i in w}
        self._launch_order = []
        for table in self.tables.values():
            table.launched += 1  # stale from here until its all-gather, or a lookup's fetch, brings its rows
        self.launch_wave()

    def launch_wave(self) -> None:
        """Launch the next wave of all-gathers, if one is left (a sharded matrix's lookup calls it once its rows are
        fetched, so each fetch finds the link free of all-gathers)."""
        if not self._waves:
            return
        for i in self._waves.pop(0):
            sh = self.shards[i]
            tag = 2 * i + 1
            sh.gather_launch, sh.gather_complete = stamp(self.device), None
            if sh.exact_idx:
                self._launch_narrow(sh, self.others, tag)
            else:
                sh.gather = self._gather_exact(sh, tag)
                self.completions.put(sh.gather, lambda sh=sh: setattr(sh, "gather_complete", stamp(self.device)),
                                     sh.gathered)
            self._unlaunched.discard(i)
            self._launch_order.append(i)

    def _launch_narrow(self, sh: _Shard, others: list[int], tag: int) -> None:
        """The all-gather of a bucket with members to narrow: this rank's shard to each peer, each peer's chunk
        widened into P."""
        s, shard = sh.shard.numel(), sh.shard.detach()
        sh.gather, widen = self._exchange_narrowed({j: shard for j in others},
                                                   {j: sh.exact_idx[self.rank] for j in others},
                                                   {j: sh.exact_idx[j] for j in others}, tag)

        def then():
            for j in others:
                widen(j, sh.params[j * s: (j + 1) * s])
            sh.rounded = True
            sh.gather_complete = stamp(self.device)

        self.completions.put(sh.gather, then, sh.gathered)

    def _exchange_narrowed(self, sends: dict[int, torch.Tensor], send_idx: dict[int, torch.Tensor],
                           recv_idx: dict[int, torch.Tensor], tag: int) -> tuple[list, Callable]:
        """Post an exchange of (s,) fp32 chunks (`sends[j]` to peer j) in `gather_dtype`, with the elements that must
        stay exact (indices `send_idx[j]` of what goes to j, `recv_idx[j]` of what comes from j) in the same message:
        their fp32 bits as pairs of `gather_dtype` words, first, then the narrowed chunk. One message per peer, as
        with fp32, since each costs the host a point-to-point operation. Returns the work and `widen(j, out)`, which
        writes what peer j sent into `out` (s,) once it is in."""
        low, bufs, out_sends, out_recvs = self.gather_dtype, {}, [], []
        ratio = torch.float32.itemsize // low.itemsize
        for j, chunk in sends.items():
            packed = torch.cat([chunk[send_idx[j]].view(low), chunk.to(low)])  # (ratio*k + s,), a copy
            out_sends.append((packed, self.peers[j]))
            bufs[j] = chunk.new_empty(ratio * recv_idx[j].numel() + chunk.numel(), dtype=low)
            out_recvs.append((bufs[j], self.peers[j]))
        works = exchange(out_sends, out_recvs, self.group, tag)

        def widen(j: int, out: torch.Tensor) -> None:
            out_sends.clear()  # sent: the packed copies can go
            exact = ratio * recv_idx[j].numel()
            out.copy_(bufs[j][exact:])
            out.index_copy_(0, recv_idx[j], bufs[j][:exact].view(torch.float32))

        return works, widen

    def exact_params(self) -> None:
        """All-gather in fp32 the buckets last gathered narrowed, so that P holds every rank's exact parameters (a
        collective: every rank calls it at the same point; call after `wait_params`)."""
        rounded = [(i, sh) for i, sh in enumerate(self.shards) if sh.rounded]
        works = [w for i, sh in rounded for w in self._gather_exact(sh, 2 * i + 1)]
        for w in works:
            w.wait()
        for _, sh in rounded:
            sh.rounded = False

    def _gather_exact(self, sh: _Shard, tag: int) -> list:
        """Post a bucket's all-gather in fp32: this rank's shard to each peer, each peer's straight into P."""
        s = sh.shard.numel()
        return exchange([(sh.shard.detach(), self.peers[j]) for j in self.others],
                        [(sh.params[j * s: (j + 1) * s], self.peers[j]) for j in self.others], self.group, tag)

    def wait_gathered(self, indices) -> None:
        """Block until the parameters of buckets `indices` are all-gathered (launching their waves if need be)."""
        for i in indices:
            while i in self._unlaunched:
                self.launch_wave()
            sh = self.shards[i]
            if not sh.gathered.is_set():
                t = time.perf_counter()
                sh.gathered.wait()
                sh.gather_wait_s += time.perf_counter() - t
        self.completions.check()

    def wait_params(self) -> None:
        self.gather()
        self.wait_gathered(range(len(self.shards)))

    def records(self) -> list[BucketRecord]:
        """`Reducer.records`, a sharded bucket's as its reduce-scatter, and any bucket exchanged point to point with
        the wire dtype and the bytes to all peers it went with (the all-gathers: `gather_records`)."""
        out = super().records()
        for r in out:
            sh = self.shards[r.bucket]
            if not sh.replicated:
                r.part = "reduce_scatter"
            if not sh.replicated or sh.scatter_narrowed:
                r.nbytes = self.sent_bytes(r.bucket, scatter=True)
                r.wire_dtype = self.wire(r.bucket, scatter=True)
        return out

    def gather_records(self, t0: Stamp | None, first_index: int) -> list[BucketRecord]:
        """One record per bucket's all-gather, the part of its communication that ran in this step's forward;
        times in ms from `t0` (negative: before backward started); `wait_ms`: how long the forward blocked on it."""
        out = []
        for k, i in enumerate(self._launch_order):
            st, sh = self.buckets[i], self.shards[i]
            if sh.gather_launch is None:
                continue
            b = st.bucket
            nbytes = self.sent_bytes(i, scatter=False)
            out.append(BucketRecord(first_index + k, b.tensor_class, dtype=str(st.buffer.dtype)[6:],
                                    wire_dtype=self.wire(i, scatter=False), tensors=len(st.params), numel=b.numel,
                                    nbytes=nbytes, ready_ms=record_ms(t0, sh.gather_launch),
                                    launch_ms=record_ms(t0, sh.gather_launch),
                                    complete_ms=record_ms(t0, sh.gather_complete), wait_start_ms=None,
                                    wait_ms=round(sh.gather_wait_s * 1000, 3), part="all_gather"))
            sh.gather_launch, sh.gather_wait_s = None, 0.0
        return out

    def sent_bytes(self, i: int, scatter: bool) -> int:
        """The bytes bucket `i`'s reduce-scatter (`scatter`) or all-gather sends to all peers together: the chunks,
        narrowed where they were."""
        sh = self.shards[i]
        s = sh.shard.numel()
        if not self._went_narrowed(sh, scatter):
            return s * sh.shard.element_size() * len(self.others)
        if sh.replicated:  # exchanged whole (`Exchange.whole`)
            return s * self.gather_dtype.itemsize * len(self.others)
        exact = [sh.exact_idx[j if scatter else self.rank].numel() for j in self.others]
        return sum(s * self.gather_dtype.itemsize + k * sh.shard.element_size() for k in exact)

    @staticmethod
    def _went_narrowed(sh: _Shard, scatter: bool) -> bool:
        return sh.scatter_narrowed if scatter else bool(sh.exact_idx)

    def wire(self, i: int, scatter: bool) -> str:
        """The wire dtype of bucket `i`'s last reduce-scatter (`scatter`) or all-gather, by its narrowed part."""
        if not self._went_narrowed(self.shards[i], scatter):
            return self.buckets[i].bucket.settings.wire_dtype
        return next(name for name, t in WIRE_DTYPES.items() if t == self.gather_dtype)  # its exact members: fp32

