"""dtrain's gradient synchronization in a plain PyTorch training loop, without dtrain's trainer.

    torchrun --nproc_per_node=2 examples/plain_loop.py [--strategy bucketed] [--steps 20]
    torchrun --nproc_per_node=2 examples/plain_loop.py --strategy auto --steps 80   # the search, in this loop
    torchrun --nproc_per_node=2 examples/plain_loop.py --own-ddp [--wire-dtype bf16]

`collectives.attach(model, SyncConfig(...))` returns a handle: build the optimizer over `handle.optimizer_params()`,
run forward through `handle.module`, call `backward()` as usual, then `handle.wait()` before `optimizer.step()` and
`handle.stepped(optimizer)` after it (the strategy `sharded` then all-gathers the updated shards during the next
forward; `auto` may switch candidates there, moving the optimizer's state). Any `nn.Module` works: its parameters fall into the
catch-all tensor class unless `sync.classes` names others (here the biases fall into `norm_bias` by the default
rule `*.bias`, the weights into `other`).

With `--own-ddp` the loop wraps the model in its own `DistributedDataParallel` and registers the project's per-class
comm hook on it (`dtrain.collectives.hooks.per_class_hook`): each class goes on its own process group in its wire dtype.
Prints the last loss and checks that every rank ends with the same parameters; `--save FILE` writes them (rank 0).
"""

import argparse
import os

import torch
import torch.distributed as dist
import yaml
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dtrain import collectives
from dtrain.collectives.dist import cleanup
from dtrain.collectives.hooks import per_class_hook
from dtrain.collectives.auto.race import summary
from dtrain.collectives.settings import SyncConfig, TuneConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--strategy", default="bucketed", help="any of dtrain.collectives.strategies.available()")
    ap.add_argument("--hook", help="sync.hook, for --strategy ddp (a short or dotted name, or per_class)")
    ap.add_argument("--own-ddp", action="store_true", help="the loop's own DDP with the per-class comm hook")
    ap.add_argument("--wire-dtype", default="fp32", choices=["fp32", "bf16", "fp16"],
                    help="wire dtype of the weights' class ('other')")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--save", help="write the final parameters here (rank 0)")
    ap.add_argument("--candidates", help="--strategy auto: sync.tune.candidates as YAML, e.g. "
                                         "'{a: {strategy: ddp}, b: {strategy: bucketed, bucket_cap_mb: 0.5}}'")
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"], help="nccl: the model on this rank's GPU")
    args = ap.parse_args()
    dist.init_process_group(args.backend)  # torchrun's environment: rank, world size, rendezvous
    if args.backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    train(args)
    # The model and the handle hold the process groups, often through reference cycles; with `train` returned
    # nothing else does, and `cleanup` collects the cycles before it destroys the groups (left to the interpreter's
    # shutdown, a gloo group can abort the process).
    cleanup()


def train(args) -> None:
    rank = dist.get_rank()

    device = torch.device("cuda", torch.cuda.current_device()) if args.backend == "nccl" else torch.device("cpu")
    torch.manual_seed(0)  # the same initial model on every rank
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)).to(device)
    classes = {"other": {"wire_dtype": args.wire_dtype}}
    if args.own_ddp:
        ddp = DistributedDataParallel(model, bucket_cap_mb=0.01)
        state, hook = per_class_hook(model, SyncConfig(classes=classes))
        ddp.register_comm_hook(state, hook)
        forward, wait, label = ddp, (lambda: None), "own DDP + per_class hook"  # DDP waits inside backward()
        params, stepped, settle, whole = list(model.parameters()), (lambda: None), (lambda: None), model.state_dict
    else:
        tune = TuneConfig(candidates=yaml.safe_load(args.candidates) if args.candidates else {})
        strategy = SyncConfig(strategy=args.strategy, bucket_cap_mb=0.01 if args.strategy != "auto" else None,
                              hook=args.hook, tune=tune,
                              classes=classes if args.strategy == "per_class" or args.hook == "per_class" else {})
        handle = collectives.attach(model, strategy)
        forward, wait, label = handle.module, handle.wait, args.strategy + (f" + {args.hook}" if args.hook else "")
        # What this rank updates (a sharded strategy: its shards), the calls that publish the update, and the whole
        # model's state (fsdp2's parameters are shards: its state dict gathers them)
        params, stepped = handle.optimizer_params(), (lambda: handle.stepped(optimizer))
        settle, whole = handle.wait_params, handle.model_state
    optimizer = torch.optim.SGD(params, lr=0.1)
    data = torch.Generator().manual_seed(rank)  # each rank its own batches
    for _ in range(args.steps):
        x, y = torch.randn(16, 32, generator=data), torch.randint(0, 4, (16,), generator=data)
        x, y = x.to(device), y.to(device)
        loss = nn.functional.cross_entropy(forward(x), y)  # (16, 4) logits
        loss.backward()
        wait()  # every gradient now holds the mean over the ranks
        optimizer.step()
        stepped()  # a sharded strategy sends the updated shards while the next forward runs
        optimizer.zero_grad(set_to_none=True)
    settle()  # the model's parameters current on this rank
    state = whole()  # name -> whole tensor, on every rank

    flat = torch.cat([state[n].detach().reshape(-1) for n, _ in model.named_parameters()])
    spread = flat.clone()
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    largest = (spread - flat).abs().max()
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"{label}: last loss {loss.item():.4f}; parameters equal on every rank: {largest.item() == 0.0}")
        if args.strategy == "auto" and not args.own_ddp:  # the search's pick, and what it spent of the loop's steps
            print("\n".join(summary(handle.stats())))
        if args.save:
            torch.save({n: state[n].detach().clone() for n, _ in model.named_parameters()}, args.save)


if __name__ == "__main__":
    main()
