"""A small GPT-style language model trained with dtrain's `auto` search in a plain loop: the tuner knows nothing of
the paper's encoder-decoder, only the model it is handed.

    torchrun --nproc_per_node=2 examples/gpt_lm.py                      # auto over attach's default space
    torchrun --nproc_per_node=2 examples/gpt_lm.py --strategy ddp       # any one strategy instead
    torchrun --nproc_per_node=2 examples/gpt_lm.py --candidates '{a: {strategy: ddp}, b: {strategy: bucketed}}'

The model is decoder-only (Radford et al. 2018): token and learned position embeddings, pre-norm blocks of causal
multi-head self-attention and a feed-forward network, and the token embedding tied to the output projection (Press
and Wolf 2017), so that `auto`'s split candidates apply to it as to the paper's model. The text is dtrain's own
Python source, which every install ships, read as bytes (vocabulary 256): each rank trains on windows drawn at
random positions with its own generator.

The loop is the plain loop of `examples/plain_loop.py`: forward through `handle.module`, backward, `handle.wait()`,
the optimizer's step, `handle.stepped(optimizer)`. At the end rank 0 prints the loss, the pick, what the search spent of the
loop's steps, and each candidate's step time against the pick's, paired over the rounds both ran (the race's own
interleaved measurement): among them stock DDP's defaults, `ddp-25`.
"""

import argparse
import math
import os
import resource
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from torch import nn

import dtrain
from dtrain import collectives
from dtrain.collectives.dist import cleanup
from dtrain.collectives.auto.race import summary
from dtrain.collectives.settings import SyncConfig, TuneConfig
from dtrain.collectives.auto.space import DEFAULT_SPACE, candidate_sync


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which position t attends to positions <= t."""

    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape  # (batch, tokens, d_model)
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))  # (b, h, t, d/h)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, h, t, d/h)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads)
        self.ffn = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.ffn(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int = 256, d_model: int = 128, layers: int = 4, heads: int = 4, context: int = 128):
        super().__init__()
        # `embed`: the name dtrain's default class rules give the class `embedding` (here the one tied matrix)
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]  # tokens: (batch, t) byte values
        x = self.embed(tokens) + self.pos(torch.arange(t, device=tokens.device))  # (batch, t, d_model)
        for block in self.blocks:
            x = block(x)
        return F.linear(self.norm(x), self.embed.weight)  # (batch, t, vocab): the projection tied to the lookup


def source_text() -> torch.Tensor:
    """dtrain's Python source as one byte tensor (n,), files in path order: the same text on every rank."""
    root = Path(dtrain.__file__).parent
    data = b"".join(p.read_bytes() for p in sorted(root.rglob("*.py")))
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--strategy", default="auto",
                    help="auto, any of dtrain.collectives.strategies.available(), or one of auto's candidates by name "
                         "(e.g. bucketed-8-last1: a plain run of a pick)")
    ap.add_argument("--candidates", help="sync.tune.candidates as YAML (default: attach's space)")
    ap.add_argument("--bucket-cap-mb", type=float, help="sync.bucket_cap_mb of a single strategy (default: its own)")
    ap.add_argument("--budget", type=int, default=120, help="sync.tune.budget_steps: steps the search may take")
    ap.add_argument("--steps", type=int, default=160)
    ap.add_argument("--batch", type=int, default=16, help="windows per rank and step")
    ap.add_argument("--context", type=int, default=128, help="tokens per window")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--save", help="write the final parameters here (rank 0)")
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"], help="nccl: the model on this rank's GPU")
    args = ap.parse_args()
    dist.init_process_group(args.backend)
    if args.backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    train(args)
    cleanup()  # as in examples/plain_loop.py: the groups go after the model and the handle


def train(args) -> None:
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if args.backend == "nccl" else torch.device("cpu")
    torch.manual_seed(0)  # the same initial model on every rank
    model = GPT(d_model=args.d_model, layers=args.layers, heads=4, context=args.context).to(device)
    tune = TuneConfig(candidates=yaml.safe_load(args.candidates) if args.candidates else {},
                      budget_steps=args.budget)
    if args.strategy in DEFAULT_SPACE:
        sync = candidate_sync(SyncConfig(), args.strategy, DEFAULT_SPACE[args.strategy])
    else:
        sync = SyncConfig(strategy=args.strategy, bucket_cap_mb=args.bucket_cap_mb, tune=tune)
    handle = collectives.attach(model, sync)
    optimizer = torch.optim.AdamW(handle.optimizer_params(), lr=1e-3)

    text = source_text()
    draw = torch.Generator().manual_seed(1000 + rank)  # each rank its own windows
    offsets = torch.arange(args.context + 1)  # (context + 1,): a window's positions from its start
    for step in range(args.steps):
        at = torch.randint(0, len(text) - args.context - 1, (args.batch,), generator=draw)
        window = text[at[:, None] + offsets].to(device)  # (batch, context + 1)
        logits = handle.module(window[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), window[:, 1:].reshape(-1))
        loss.backward()
        handle.wait()
        optimizer.step()
        handle.stepped(optimizer)
        optimizer.zero_grad(set_to_none=True)
    handle.wait_params()
    state = handle.model_state()  # name -> whole tensor (a sharded strategy's state dict gathers its shards)

    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024], device=device)  # MiB (Linux: KiB)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"peak RSS {peak.item():.0f} MiB (the largest rank's)")
        print(f"gpt ({sum(p.numel() for p in model.parameters()):,} parameters), {args.strategy}: step {args.steps} "
              f"loss {loss.item():.3f} ({loss.item() / math.log(2):.2f} bits per byte)")
        if args.strategy == "auto":
            print("\n".join(summary(handle.stats())))
        if args.save:
            torch.save({n: t.detach().clone() for n, t in state.items()}, args.save)


if __name__ == "__main__":
    main()
