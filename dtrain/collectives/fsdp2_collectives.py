"""FSDP2's all-gathers and reduce-scatters as the `fsdp2` strategy gives them to FSDP2 on a CPU device, through
FSDP2's own hooks (`FSDPModule.set_custom_all_gather` and `set_custom_reduce_scatter`: an object with
`allocate(size, *, dtype, device)` and a call that may return a `Work`).

Stock FSDP2 overlaps its collectives with computation through CUDA streams; on a CPU device it issues each one on the
thread that computes and waits for it there, so on gloo nothing overlaps (`sync.fsdp2_collectives: stock`). Here:

- `async`: torch's own collectives (`all_gather_single`, `reduce_scatter_single`; before torch 2.13
  `all_gather_into_tensor` and `reduce_scatter_tensor`, which 2.13 deprecates: `dtrain.collectives.dist` picks the
  name) issued with `async_op=True`, so that gloo runs them on its own threads.
- `p2p`: the exchanges `sharded` runs (`dtrain.collectives.p2p`), point-to-point sends on a process group of
  their own, issued the same way. On gloo the reduce-scatter moves as many bytes as an all-reduce, and the
  all-gather more than the (world - 1)/world of the output each rank must send; `isend` and `irecv`
  move each chunk once, at the link's rate. Each rank sums its chunk in rank order (on two ranks a + b, the
  all-reduce's sum bit for bit) on the completions' thread, while backward computes.

FSDP2 waits for an all-gather's returned work where it copies the gathered parameters out, as the unit is about to
run. It ignores a reduce-scatter's work and at once views the output (this rank's shard of the unit's gradients,
(shard,)) as the parameters' gradients: `ReduceScatters.wait()` is what the loop's `handle.wait()` waits for. FSDP2
only reads that output at once to divide it (a divide factor of its own: not set here), to cast it (a reduce dtype
other than the parameters': fp32 here) or to add it to a gradient already there (the loop drops its gradients after
each update; the strategy refuses a training forward with gradients left over).
"""

from __future__ import annotations

import itertools
import threading

import torch
import torch.distributed as dist

from dtrain.collectives.dist import all_gather_single, reduce_scatter_single
from dtrain.collectives.p2p import Completions, exchange, rank_order_sum
from dtrain.common.errors import UserError

MODES = ("stock", "async", "p2p")  # `sync.fsdp2_collectives`


class _Hook:
    """What FSDP2's collective hooks must also offer: the buffers it fills and sends, plain tensors here."""

    @staticmethod
    def allocate(size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class AllOf(dist.Work):
    """Several point-to-point works as the one `Work` FSDP2 waits for."""

    def __init__(self, works: list):
        super().__init__()
        self.works = works

    def wait(self, timeout=None) -> bool:
        for w in self.works:
            w.wait()
        return True


class AsyncAllGather(_Hook):
    """torch's all-gather, issued without waiting whatever FSDP2 asks."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work:
        return all_gather_single(output_tensor, input_tensor, group=group, async_op=True)


class ReduceScatters(_Hook):
    """Reduce-scatters left in flight until `wait()`. FSDP2 drops its reference to the input (the unit's gradients,
    cut and padded per rank: (world x shard,)) as the call returns; it is kept here until the collective is done."""

    def __init__(self):
        self.pending: list = []

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False) -> None:
        self.pending.append((reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=True),
                             input_tensor))

    def wait(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


class Exchanges:
    """The point-to-point exchanges of `p2p`, on `group` (made for them alone): `gather` is FSDP2's all-gather,
    `scatter` its reduce-scatter. Both are issued in the same order on every rank (FSDP2's units in its order), and
    their tags count up together."""

    def __init__(self, group: dist.ProcessGroup):
        self.group, self.rank, self.world = group, group.rank(), group.size()
        self.peers = [dist.get_global_rank(group, j) for j in range(self.world)]
        self.others = [j for j in range(self.world) if j != self.rank]
        self.tags = itertools.count()
        self.completions = Completions("fsdp2-p2p")
        self.pending: list[threading.Event] = []
        self.gather, self.scatter = _Gather(self), _Scatter(self)

    def wait(self) -> None:
        for done in self.pending:
            done.wait()
        self.pending.clear()
        self.completions.check()

    def close(self) -> None:
        self.wait()
        self.completions.close()


class _Gather(_Hook):
    def __init__(self, ex: Exchanges):
        self.ex = ex

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work:
        ex = self.ex
        chunks = output_tensor.view(ex.world, -1)  # (world, shard): rank j's shard in row j
        if chunks[ex.rank].data_ptr() != input_tensor.data_ptr():  # FSDP2 copies its shard in there itself
            chunks[ex.rank].copy_(input_tensor)
        return AllOf(exchange([(input_tensor, ex.peers[j]) for j in ex.others],
                              [(chunks[j], ex.peers[j]) for j in ex.others], ex.group, next(ex.tags)))


class _Scatter(_Hook):
    def __init__(self, ex: Exchanges):
        self.ex = ex

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False) -> None:
        ex = self.ex
        if op == dist.ReduceOp.AVG:
            divisor = ex.world
        elif op == dist.ReduceOp.SUM:
            divisor = 1
        else:
            raise UserError(f"sync.fsdp2_collectives: p2p sums or averages, FSDP2 asked for {op}")
        chunks = input_tensor.view(ex.world, -1)  # (world, shard): row j goes to rank j
        received = [torch.empty_like(output_tensor) for _ in ex.others]
        works = exchange([(chunks[j], ex.peers[j]) for j in ex.others],
                         [(buf, ex.peers[j]) for j, buf in zip(ex.others, received)], ex.group, next(ex.tags))

        def reduce() -> None:
            total = rank_order_sum(chunks[ex.rank], received, ex.rank)
            if divisor > 1:
                torch.div(total, divisor, out=output_tensor)
            else:
                output_tensor.copy_(total)

        done = threading.Event()
        ex.completions.put(works, reduce, done)
        ex.pending.append(done)
