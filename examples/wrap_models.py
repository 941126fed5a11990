"""Models no one here wrote, in the loop of the public GPT training scripts, through `dtrain.collectives.wrap`,
each strategy against stock DDP on the same batches.

    torchrun --nproc_per_node=2 examples/wrap_models.py --model gpt2 --strategies ddp,bucketed,sharded,fsdp2,auto
    torchrun --nproc_per_node=2 examples/wrap_models.py --model marian --amp bf16 --json out.json

The models are Hugging Face `transformers`' GPT-2 and Marian (an encoder-decoder translation model), built from small
configs (no weights downloaded; embeddings tied as their configs say: GPT-2's token embedding and output head, Marian's
shared source, target and output matrix). Marian's sinusoidal position tables are parameters that do not train.

The loop is the GPT scripts' (nanoGPT's `train.py` shape): AdamW in two groups (weight decay on the weights of two or
more dimensions, none on biases and norms), gradient accumulation under `model.no_sync()`, clipping, a cosine
learning-rate schedule (a `torch.optim.lr_scheduler` holding the optimizer, built before `wrap`), optional bf16
autocast. Stock DDP runs it with `DistributedDataParallel(model)`; every other run changes only that line, to
`model, optimizer = wrap(model, optimizer, sync)`. Clipping is `torch.nn.utils.clip_grad_norm_(model.parameters(),
c)`, except where the strategy holds the gradient in shards (`sharded`, and `auto`, whose search may pick it): there
`model.clip_grad_norm_(c)`, since the former is an error under `sharded` (`--torch-clip` shows it).

With `--resume N` each strategy starts from stock DDP's checkpoint of step N (the model's and the optimizer's state
dicts, loaded before `wrap`) and trains the remaining steps.

Rank 0 prints one line per strategy: the largest |difference| of any parameter from stock DDP's after the last step
(absolute, and relative to the model's largest parameter value), the same for the optimizer's state dicts (which must be
DDP's form: one group each, the same options), and for `auto` its pick and the steps the search spent.
"""

import argparse
import copy
import json
import math
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from dtrain.collectives import wrap
from dtrain.collectives.dist import cleanup

VOCAB = 96  # small: the embedding stays the largest tensor, as in a real model, and the models build in a second


def build_model(name: str) -> torch.nn.Module:
    """A small `transformers` model from its config, the same on every rank (seeded)."""
    import transformers

    torch.manual_seed(0)
    if name == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=1,
                                      tie_word_embeddings=True)
        return transformers.GPT2LMHeadModel(cfg)
    if name == "marian":
        cfg = transformers.MarianConfig(vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2,
                                        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                                        decoder_ffn_dim=128, max_position_embeddings=32, dropout=0.0,
                                        attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0,
                                        decoder_start_token_id=0, eos_token_id=1, scale_embedding=False,
                                        share_encoder_decoder_embeddings=True, tie_word_embeddings=True)
        return transformers.MarianMTModel(cfg)
    raise SystemExit(f"--model must be gpt2 or marian, not {name!r}")


def decay_groups(model: torch.nn.Module) -> list[dict]:
    """The GPT scripts' two optimizer groups over the parameters that train: weight decay on the matrices and
    embeddings (two or more dimensions), none on the biases and norms."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def batch(name: str, gen: torch.Generator) -> dict:
    """One micro-batch of random tokens (4 sequences of 16), this rank's own."""
    x = torch.randint(2, VOCAB, (4, 16), generator=gen)
    if name == "gpt2":
        return {"input_ids": x, "labels": x}
    y = torch.randint(2, VOCAB, (4, 12), generator=gen)
    return {"input_ids": x, "labels": y}


def run(args, strategy: str, steps: int, start: dict | None = None) -> dict:
    """Train `steps` steps under `strategy` ("ddp-stock": DistributedDataParallel) and return the final parameters,
    the state dicts of the model, the optimizer and the schedule and, under a wrap, its handle's stats. `start`: a
    run's returned states to resume from, loaded as a DDP loop loads its checkpoint, before DDP or `wrap`."""
    model = build_model(args.model)
    optimizer = torch.optim.AdamW(decay_groups(model), lr=args.lr, betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    gen = torch.Generator().manual_seed(1000 + dist.get_rank())
    if start is not None:
        start = copy.deepcopy(start)  # loading shares tensors (Adam's step), which training then advances
        model.load_state_dict(start["params"])
        optimizer.load_state_dict(start["optimizer"])
        schedule.load_state_dict(start["schedule"])
        gen.set_state(start["batches"])
    if strategy == "ddp-stock":
        model = DistributedDataParallel(model)
    else:
        sync = {"strategy": strategy}
        if strategy == "auto":  # the search ends within the run: its budget, then the pick trains alone
            sync["tune.budget_steps"] = args.auto_budget
        if strategy in ("sharded", "bucketed") and args.split:
            sync["classes.embedding.tied_split"] = True
        model, optimizer = wrap(model, optimizer, sync)
    sharded_grads = strategy in ("sharded", "auto") and not args.torch_clip
    amp = torch.autocast("cpu", torch.bfloat16) if args.amp == "bf16" else nullcontext()
    for _ in range(steps):
        for micro in range(args.accum):
            last = micro == args.accum - 1
            with (nullcontext() if last else model.no_sync()):
                with amp:
                    loss = model(**batch(args.model, gen)).loss / args.accum
                loss.backward()
        if args.clip:
            if sharded_grads:
                model.clip_grad_norm_(args.clip)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
    state = {k.removeprefix("module."): v.detach().clone() for k, v in model.state_dict().items()}
    opt_state = optimizer.state_dict()
    stats = model.handle.stats() if strategy != "ddp-stock" else {}
    if strategy != "ddp-stock":
        model.close()
    return {"params": state, "optimizer": opt_state, "schedule": schedule.state_dict(), "batches": gen.get_state(),
            "stats": stats}


def max_diff(a: dict, b: dict) -> tuple[float, float]:
    """The largest |a - b| over the tensors of two state dicts, absolute and relative to the largest |b| of all."""
    absolute = largest = 0.0
    for k, ref in b.items():
        if torch.is_tensor(ref) and ref.is_floating_point():
            absolute = max(absolute, (a[k].float() - ref.float()).abs().max().item())
            largest = max(largest, ref.float().abs().max().item())
    return absolute, absolute / largest


def optimizer_diff(a: dict, b: dict) -> float:
    """The largest |difference| of the optimizer states, after checking they have DDP's form (groups, options)."""
    strip = [{k: v for k, v in g.items() if k != "params"} for g in a["param_groups"]]
    ref = [{k: v for k, v in g.items() if k != "params"} for g in b["param_groups"]]
    if strip != ref or [g["params"] for g in a["param_groups"]] != [g["params"] for g in b["param_groups"]]:
        raise SystemExit(f"optimizer state dict's groups differ from DDP's: {strip} vs {ref}")
    worst = 0.0
    for i, s in b["state"].items():
        for k, v in s.items():
            worst = max(worst, (a["state"][i][k].float() - v.float()).abs().max().item())
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2", help="gpt2 or marian")
    ap.add_argument("--strategies", default="ddp,bucketed,sharded,fsdp2,auto")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--accum", type=int, default=2, help="micro-batches per step (all but the last under no_sync)")
    ap.add_argument("--clip", type=float, default=0.5, help="clip the gradient's norm to this (0: no clipping)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--amp", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--split", action="store_true", help="bucketed and sharded split the tied embedding")
    ap.add_argument("--torch-clip", action="store_true", help="clip with torch's clip_grad_norm_ under every strategy")
    ap.add_argument("--resume", type=int, default=0,
                    help="each strategy resumes from stock DDP's checkpoint (model, optimizer) after this many steps")
    ap.add_argument("--auto-budget", type=int, default=14, help="auto: the steps its search may spend")
    ap.add_argument("--json", help="rank 0 writes the table here")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    reference = run(args, "ddp-stock", args.steps)
    # --resume N: every strategy resumes from stock DDP's checkpoint after N steps, for the rest of the run
    start = run(args, "ddp-stock", args.resume) if args.resume else None
    rows = []
    for strategy in args.strategies.split(","):
        out = run(args, strategy, args.steps - args.resume, start)
        absolute, relative = max_diff(out["params"], reference["params"])
        row = {"model": args.model, "strategy": strategy, "ranks": dist.get_world_size(), "steps": args.steps,
               "amp": args.amp, "clip": args.clip, "split": args.split, "resumed_at": args.resume,
               "max_abs": absolute, "max_rel": relative,
               "optimizer_max_abs": optimizer_diff(out["optimizer"], reference["optimizer"])}
        if strategy == "auto":
            row["pick"], row["steps_spent"] = out["stats"].get("winner"), out["stats"].get("steps_spent")
        rows.append(row)
        if dist.get_rank() == 0:
            print(f"{args.model} {strategy}: max |d| {absolute:.3g} (relative {relative:.3g}), optimizer state "
                  f"{row['optimizer_max_abs']:.3g}" + (f", pick {row['pick']} after {row['steps_spent']} steps"
                                                       if strategy == "auto" else ""), flush=True)
    if args.json and dist.get_rank() == 0:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    cleanup()


if __name__ == "__main__":
    main()
