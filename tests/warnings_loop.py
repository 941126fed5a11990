"""Every attachable strategy trained for a few steps in one torchrun job, as the trainer drives a handle, under a
warnings filter that makes FutureWarning an error: tests/test_torch_floor.py runs it on 2 gloo ranks.

    PYTHONWARNINGS=error::FutureWarning torchrun --standalone --nproc_per_node=2 tests/warnings_loop.py [--steps 3]
        [--only fsdp2,fsdp2+async]

Each run: attach (the strategy's default keys, small buckets so that there are several), then per step forward,
backward, `wait`, the gradient norm both ways (`exact`, as clipping takes it, and torch's `get_total_norm`), clipping
(`clip_grads_with_norm_`), Adam's step, `stepped`, `zero_grad(set_to_none=True)`; then what validation and a
checkpoint do (`wait_params`, a forward without gradients, the model's and the optimizer's whole state, loaded back
as a resume would) and `close`. Rank 0 prints `ran <name>` after each.

The filter comes from PYTHONWARNINGS, which torchrun's ranks inherit and which covers what importing does too. Each
rank first checks that a FutureWarning is an error in it, and stops with status 2 where it is not (the job would check
nothing).
"""

import argparse
import datetime
import sys
import warnings

import torch
import torch.distributed as dist

from dtrain.collectives import attach
from dtrain.collectives.dist import cleanup
from dtrain.collectives.strategies import attachable
from dtrain.engine import verify


def runs() -> dict[str, list[str]]:
    """name -> `--set`-style overrides of `sync`: every attachable strategy under its defaults, and fsdp2 with each
    of its own collectives."""
    out = {name: [] for name in attachable()}
    for mode in ("async", "p2p"):
        out[f"fsdp2+{mode}"] = [f"sync.fsdp2_collectives={mode}"]
    return out


def train(name: str, overrides: list[str], steps: int) -> None:
    rank = dist.get_rank()
    strategy = name.split("+")[0]
    cfg = verify.sync_config(strategy, 0.01, overrides)  # 10 kB buckets where the strategy takes a cap
    model = verify.tiny_model()
    handle = attach(model, cfg)
    optimizer = torch.optim.Adam(handle.optimizer_params(), lr=1e-3)  # Adam: moments to save (DTensors under fsdp2)
    for step in range(steps):
        src, tgt_in, tgt_out = verify.batch(rank, step, 0)
        loss = verify.loss_fn(handle.module(src, tgt_in), tgt_out, 1)
        loss.backward()
        handle.wait()
        handle.step_records()
        handle.grad_norm()  # the trainer's norm without clipping
        norm = handle.grad_norm(exact=True)  # ... and with it
        params = handle.optimizer_params()
        for kind in dict.fromkeys(type(p) for p in params):  # as the trainer clips: one kind of tensor per call
            torch.nn.utils.clip_grads_with_norm_([p for p in params if type(p) is kind], 1.0, norm)
        optimizer.step()
        handle.stepped(optimizer, loss.item())
        optimizer.zero_grad(set_to_none=True)
    handle.wait_params()  # validation and checkpoints
    with torch.no_grad():
        handle.module(src, tgt_in)
    model_state, optimizer_state = handle.model_state(), handle.optimizer_state(optimizer)
    handle.load_model_state(model_state)  # a resume
    handle.load_optimizer_state(optimizer, optimizer_state)
    handle.close()
    if rank == 0:
        print(f"ran {name}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3, help="training steps per run (powersgd compresses from the third)")
    ap.add_argument("--only", help="comma-separated names of runs (default: all of them)")
    args = ap.parse_args()
    try:
        warnings.warn("warnings_loop: is a FutureWarning an error here?", FutureWarning, stacklevel=1)
    except FutureWarning:
        pass
    else:
        print("warnings_loop: a FutureWarning is not an error here: run with PYTHONWARNINGS=error::FutureWarning",
              file=sys.stderr)
        sys.exit(2)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    todo = runs()
    if args.only:
        todo = {n: todo[n] for n in args.only.split(",")}
    for name, overrides in todo.items():
        train(name, overrides, args.steps)
    cleanup()


if __name__ == "__main__":
    main()
