"""A DDP training loop in the shape of PyTorch's DDP tutorial ("Getting Started with Distributed Data Parallel"),
trained by any of dtrain's strategies: two lines differ from its DDP form, each marked with the line it replaces
(`docs/wrap.md` shows the diff).

    torchrun --nproc_per_node=2 examples/ddp_loop.py                 # sharded
    torchrun --nproc_per_node=2 examples/ddp_loop.py bucketed out.pt # any strategy; rank 0 saves the state dict
"""

import sys

import torch
import torch.distributed as dist
from torch import nn, optim

from dtrain.collectives import wrap  # DDP form: from torch.nn.parallel import DistributedDataParallel as DDP

STRATEGY = sys.argv[1] if len(sys.argv) > 1 else "sharded"


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial model on every rank
    model = ToyModel()
    optimizer = optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model, optimizer = wrap(model, optimizer, STRATEGY)  # DDP form: model = DDP(model)
    loss_fn = nn.MSELoss()
    data = torch.Generator().manual_seed(rank)  # each rank its own batches
    for _ in range(20):
        optimizer.zero_grad()
        outputs = model(torch.randn(20, 10, generator=data))
        labels = torch.randn(20, 5, generator=data)
        loss_fn(outputs, labels).backward()
        optimizer.step()
    state = model.state_dict()  # every rank: a collective under the sharding strategies
    if rank == 0:
        print(f"last loss {loss_fn(outputs, labels).item():.4f}")
        if len(sys.argv) > 2:
            torch.save(state, sys.argv[2])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
