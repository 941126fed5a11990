"""The hierarchical plan: each bucket reduce-scattered inside the node, its shard all-reduced between the nodes, the
sums all-gathered inside the node (`sync.hierarchical`).

Horovod's hierarchical all-reduce (`HOROVOD_HIERARCHICAL_ALLREDUCE`, Horovod's docs) and NCCL's tree between nodes
with a ring inside one (NCCL's `src/graph/`) rest on the same fact: the link inside a node is much faster than the
one between nodes. A flat ring over N nodes x R ranks crosses the slow link with 2(NR-1)/NR of every bucket; here each
rank sends only its 1/R shard across, and the R ranks of a node do it at once, each over its own connection.

Ranks are laid out as torchrun lays them out: node k holds the consecutive global ranks kR .. kR+R-1. There is one
process group per level: the node's R ranks (`intra`), and the N ranks of this rank's local index, one per node
(`inter`). The sum runs in another order than a flat all-reduce's (inside the node first): the mean is exact up to
float rounding, not bit for bit (`dtrain.verify` measures it).

The three collectives of a bucket depend on each other, and gloo's reduce-scatter and all-gather futures cannot be
chained with a collective safely from the backend's callback thread. So one thread of the reducer's own
(`dtrain.collectives.p2p.Completions`) runs each bucket's three in launch order, the same on every rank,
while backward goes on; `finish()` waits for each bucket's event.
"""

from __future__ import annotations

import threading

import torch.distributed as dist
from torch import nn

from dtrain.collectives.dist import all_gather_single, local_world_size, reduce_scatter_single
from dtrain.collectives.plan import Bucket
from dtrain.collectives.reducer import Reducer, _BucketState
from dtrain.collectives.p2p import Completions
from dtrain.collectives.settings import SyncConfig
from dtrain.collectives.timing import stamp
from dtrain.common.errors import UserError


def ranks_per_node(cfg: SyncConfig, world: int) -> int:
    """R: `sync.ranks_per_node`, else torchrun's LOCAL_WORLD_SIZE; it must split the world into N > 1 nodes of R > 1
    ranks (with one rank per node, or one node, the plan is a flat all-reduce with extra steps)."""
    r = cfg.ranks_per_node or local_world_size()
    if r is None:
        raise UserError("'sync.hierarchical' needs 'sync.ranks_per_node' when the job is not started by "
                        "torchrun (no LOCAL_WORLD_SIZE)")
    if world % r or not 1 < r < world:
        raise UserError(f"'sync.hierarchical' needs nodes of more than one rank and more than one node: "
                        f"{r} ranks per node of a world of {world}")
    return r


class Levels:
    """The two process groups of this rank: its node's ranks (`intra`) and its local index's ranks (`inter`).
    Creating them is a collective of every rank of `ranks` (each group is made on every rank, in the same order)."""

    def __init__(self, ranks: list[int], per_node: int):
        self.per_node = per_node
        nodes = [ranks[k: k + per_node] for k in range(0, len(ranks), per_node)]
        peers = [[node[i] for node in nodes] for i in range(per_node)]
        me = dist.get_rank()
        self.intra = self.inter = None
        for members in nodes:
            group = dist.new_group(members)
            if me in members:
                self.intra = group
        for members in peers:
            group = dist.new_group(members)
            if me in members:
                self.inter = group

    def destroy(self) -> None:
        for group in (self.intra, self.inter):
            dist.destroy_process_group(group)


class _Pending:
    """A bucket's work as `Reducer.finish` waits for it: its event, then the pipeline's failure re-raised, if any."""

    def __init__(self, done: threading.Event, pipeline: Completions):
        self.done, self.pipeline = done, pipeline

    def wait(self) -> None:
        self.done.wait()
        self.pipeline.check()


class HierarchicalReducer(Reducer):
    """A `Reducer` whose buckets go through the three levels. Its buffers are padded to a multiple of R (zeros, which
    sum to zeros) so that each rank of a node owns an equal shard."""

    def __init__(self, named_params: dict[str, nn.Parameter], buckets: list[Bucket], world_size: int,
                 overlap: bool, levels: Levels):
        self.levels = levels
        self.pipeline = Completions("dtrain-hierarchy")
        super().__init__(named_params, buckets, world_size, overlap)

    def _buffer_numel(self, numel: int) -> int:
        r = self.levels.per_node
        return -(-numel // r) * r

    def _launch(self, st: _BucketState) -> None:
        st.launch_t = stamp(self.device)
        st.wire = self._to_wire(st)
        done = threading.Event()
        self.pipeline.put([], lambda st=st: self._reduce(st), done)
        st.work = _Pending(done, self.pipeline)

    def _reduce(self, st: _BucketState) -> None:
        """On the pipeline's thread: the bucket's three collectives, then its mean into the buffer."""
        wire = st.wire  # (padded,) summed in place: after the all-gather it holds the world's sum
        shard = wire.new_empty(wire.numel() // self.levels.per_node)  # (padded / R,)
        reduce_scatter_single(shard, wire, group=self.levels.intra)  # this rank's shard, summed over its node
        dist.all_reduce(shard, group=self.levels.inter)  # ... and over the nodes
        all_gather_single(wire, shard, group=self.levels.intra)  # every shard, on every rank of the node
        st.complete_t = stamp(self.device)
        self._average(st)

    def remove(self) -> None:
        """The hooks removed, and the pipeline's thread ended once the buckets put on it are done."""
        super().remove()
        self.pipeline.close()
