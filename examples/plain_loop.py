"""dtrain's gradient synchronization in a plain PyTorch training loop, without dtrain's trainer.

    torchrun --nproc_per_node=2 examples/plain_loop.py [--strategy bucketed] [--steps 20]

`collectives.attach(model, SyncConfig(...))` returns a handle: run forward through `handle.module`, call `backward()`
as usual, then `handle.wait()` before `optimizer.step()`. Any `nn.Module` works: its parameters fall into the
catch-all tensor class unless `sync.classes` names others. Prints the last loss and checks that every rank ends
with the same parameters.
"""

import argparse

import torch
import torch.distributed as dist
from torch import nn

import collectives
from collectives.settings import SyncConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--strategy", default="bucketed", help="any of collectives.strategies.available()")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    dist.init_process_group("gloo")  # torchrun's environment: rank, world size, rendezvous
    rank = dist.get_rank()

    torch.manual_seed(0)  # the same initial model on every rank
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    handle = collectives.attach(model, SyncConfig(strategy=args.strategy, bucket_cap_mb=0.01))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(rank)  # each rank its own batches
    for _ in range(args.steps):
        x, y = torch.randn(16, 32, generator=data), torch.randint(0, 4, (16,), generator=data)
        loss = nn.functional.cross_entropy(handle.module(x), y)  # (16, 4) logits
        loss.backward()
        handle.wait()  # every gradient now holds the mean over the ranks
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    spread = flat.clone()
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    largest = (spread - flat).abs().max()
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"{args.strategy}: last loss {loss.item():.4f}; parameters equal on every rank: "
              f"{largest.item() == 0.0}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
