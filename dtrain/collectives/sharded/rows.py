"""The split tied embedding of a matrix sharded by whole rows (`sharded` with `shard_tied_split`, a ROWS exchange):
each lookup's rows reduce-scattered to their owners instead of all-reduced (a rank adds only its own rows into its
shard), and the next forward's lookups, which would otherwise wait for the whole matrix's all-gather, fetching just
the rows of their tokens from their owners. The split itself (its projection part, the unions of the lookups' rows)
is `dtrain.collectives.tied_split`'s.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist
from torch import nn

from dtrain.collectives.p2p import exchange, rank_order_sum
from dtrain.collectives.sharded.reducer import RowTable
from dtrain.collectives.tied_split import Rows, TiedEmbeddingSplit
from dtrain.collectives.timing import stamp


class ShardedTiedSplit(TiedEmbeddingSplit):
    """The split of a matrix sharded by whole rows (`table`): each lookup's rows reduce-scattered to their owners,
    and each synchronized forward's lookups fetching their tokens' rows from their owners instead of waiting for the
    matrix's all-gather.

    The matrix's other readers must wait for all of it. `readers`: the other modules that hold it as a parameter
    (the pre-softmax projection, an `nn.Linear` whose weight is the embedding's: weight tying as PyTorch does it);
    the caller has them wait for the matrix's all-gather. A model that reads it only functionally has none, and then
    the last lookup of each forward waits for the whole matrix instead: whatever follows may read all of it (until
    one synchronized forward has counted its lookups, every lookup is taken for the last)."""

    def __init__(self, model: nn.Module, name: str, group: dist.ProcessGroup | None, world: int, is_armed,
                 table: RowTable):
        super().__init__(model, name, group, world, is_armed)
        self.table = table
        self.peers = [dist.get_global_rank(self.group, j) for j in range(world)]
        self.others = [j for j in range(world) if j != table.rank]
        self.readers = [m for m in model.modules() if all(m is not k for k in self.lookups)
                        and any(p is self.param for p in m.parameters(recurse=False))]
        self.lookups_per_forward = 0  # counted in the last synchronized forward (0: not yet)
        self._current = table.launched  # the table's all-gathers this split has seen complete
        self._hooks += [m.register_forward_pre_hook(self._fetch) for m in self.lookups]

    def prepare(self) -> None:
        if getattr(self, "_lookups", 0):
            self.lookups_per_forward = self._lookups
        super().prepare()

    def _owned(self, union: torch.Tensor) -> list[slice]:
        """Per rank, the slice of `union` (sorted row ids) that its shard holds."""
        bounds = torch.arange(self.world + 1, device=union.device) * self.table.per_rank
        cut = torch.searchsorted(union, bounds).tolist()
        return [slice(cut[j], cut[j + 1]) for j in range(self.world)]

    def whole(self) -> None:
        """The matrix was all-gathered whole (`wait_params`): no lookup has rows to fetch until the next all-gather."""
        self._current = self.table.launched

    def _fetch(self, module: nn.Embedding, args) -> None:
        """Before a lookup: make the rows it reads current. Every rank takes the same branch (no test of whether the
        all-gather happens to be done): the rows' exchange needs every rank."""
        t = self.table
        if self._current == t.launched:
            return  # no all-gather since the matrix was last whole
        last = not self.readers and self._lookups + 1 >= self.lookups_per_forward
        if not (self.is_armed() and torch.is_grad_enabled()) or last:
            t.wait_whole()
            self._current = t.launched
            return
        tokens = args[0]
        mask, work = self._union_mask(tokens, module.padding_idx)
        self.masks.append((mask, work))  # the lookup's own hook and backward use it
        work.wait()
        union = mask.nonzero().squeeze(1)  # (u,) every rank's rows: each rank sends the ones it owns to all
        owned = self._owned(union)
        mine = t.table[union[owned[t.rank]]]  # (m, d) the current rows of this rank's shard
        tag = 2 * self._lookups
        received = {j: t.table.new_empty(owned[j].stop - owned[j].start, t.table.shape[1]) for j in self.others}
        works = exchange([(mine, self.peers[j]) for j in self.others],
                         [(received[j], self.peers[j]) for j in self.others], self.group, tag)
        for w in works:
            w.wait()
        with torch.no_grad():
            for j in self.others:  # the same values the matrix's all-gather will write there
                t.table.index_copy_(0, union[owned[j]], received[j])
        t.fetched()

    def _reduce_rows(self, part: Rows, index: int) -> None:
        """Start a reduce-scatter of `part.rows` by owner: to each peer its rows, from each its part of ours."""
        owned = self._owned(part.union)
        part.own = me = owned[self.table.rank]
        part.received = [part.rows.new_empty(me.stop - me.start, self.dim) for _ in self.others]
        tag = 2 * index + 1
        works = exchange([(part.rows[owned[j]], self.peers[j]) for j in self.others],
                         [(buf, self.peers[j]) for j, buf in zip(self.others, part.received)], self.group, tag)
        part.sent_bytes = sum(owned[j].stop - owned[j].start for j in self.others) * self.dim * part.rows.element_size()
        done = threading.Event()
        part.work = done

        def completed():
            part.complete_t = stamp(self.param.device)

        self.table.completions.put(works, completed, done)

    def _add(self, part: Rows) -> None:
        """Sum this rank's rows in rank order; their mean replaces them in its shard's gradient."""
        self.table.completions.check()
        t, me = self.table, part.own
        total = rank_order_sum(part.rows[me], part.received, t.rank)
        t.shard.grad.view(t.per_rank, self.dim).index_copy_(0, part.union[me] - t.rank * t.per_rank,
                                                             total / self.world)
