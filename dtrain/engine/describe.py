"""Show how a profile's tensor-class rules split the model's parameters (dtrain.collectives.tensor_classes).

    python -m dtrain.engine.describe --profile dtrain/profiles/multi30k-cpu.yaml
    python -m dtrain.engine.describe --profile dtrain/profiles/smoke.yaml --set sync.classes.ffn.wire_dtype=bf16 --list

Per class, in rule order: tensor count, total bytes, the size range, and the class's collective settings; then the
strategy's schedule on `--world` ranks: what it sends in a step, when, what waits for it, whether it is exact. The
model is built on the meta device, so even `big` costs no memory.
"""

from __future__ import annotations

import argparse
import sys

import torch

from dtrain.collectives import strategies
from dtrain.collectives import tensor_classes as tc
from dtrain.collectives.dist import local_world_size
from dtrain.common.errors import UserError, exit_on_user_error
from dtrain.engine import config as config_mod
from dtrain.engine.model import Transformer


def human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1024
    return ""


def summary(named_params, classes: tc.TensorClasses) -> list[dict]:
    """One row per class (rule order, empty classes included): tensors, bytes, smallest and largest tensor."""
    assigned = classes.assign(named_params)
    rows = []
    for rule in classes.rules:
        sizes = [(p.numel(), p.numel() * p.element_size()) for n, p in named_params if assigned[n] == rule.name]
        s = classes.setting(rule.name)
        rows.append({"class": rule.name, "tensors": len(sizes), "bytes": sum(b for _, b in sizes),
                     "min_numel": min((n for n, _ in sizes), default=0),
                     "max_numel": max((n for n, _ in sizes), default=0),
                     "wire_dtype": s.wire_dtype, "bucket_cap_mb": s.bucket_cap_mb, "nccl": s.nccl(),
                     "match": list(rule.match)})
    return rows


def table(rows: list[dict]) -> list[str]:
    lines = [f"{'class':<11} {'tensors':>7} {'bytes':>11} {'smallest':>10} {'largest':>10}  {'wire':>4} "
             f"{'cap MiB':>7}  rule"]
    for r in rows:
        size = (lambda n: f"{n:,}") if r["tensors"] else (lambda n: "-")
        lines.append(f"{r['class']:<11} {r['tensors']:>7} {human(r['bytes']):>11} {size(r['min_numel']):>10} "
                     f"{size(r['max_numel']):>10}  {r['wire_dtype']:>4} {r['bucket_cap_mb']:>7g}  "
                     f"{' '.join(r['match'])}" + (f"  nccl {r['nccl']}" if r["nccl"] else ""))
    total = sum(r["bytes"] for r in rows)
    lines.append(f"{'total':<11} {sum(r['tensors'] for r in rows):>7} {human(total):>11}   (sizes in elements)")
    return lines


def schedule_lines(cfg, model, world: int) -> list[str]:
    """What `cfg.sync`'s strategy sends in one step of `model` on `world` ranks (`dtrain.collectives.schedule`), or
    why it has no schedule before it runs."""
    try:
        return strategies.schedule_for(cfg.sync, model, world, cfg.train.accum_steps, local_world_size()).lines()
    except UserError as e:
        return [f"schedule of {cfg.sync.strategy}: none before it runs ({e})"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="dtrain.engine.describe", description="Per tensor class: count, bytes, size range.")
    ap.add_argument("--profile", required=True, help="a run profile (its model and sync.classes)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--list", action="store_true", help="also list every parameter with its class")
    ap.add_argument("--world", type=int, default=2, help="ranks the schedule is for (default 2)")
    args = ap.parse_args(argv)
    with exit_on_user_error("dtrain.engine.describe"):
        cfg = config_mod.load(args.profile, args.overrides)
        with torch.device("meta"):
            model = Transformer.from_config(cfg.model, cfg.data.vocab_size)
        named = list(model.named_parameters())
        classes = tc.from_config(cfg.sync)
        if args.world < 1:
            raise UserError(f"--world must be at least 1, got {args.world}")
    print(f"# {args.profile}: {len(named)} parameter tensors, vocab {cfg.data.vocab_size}; first matching rule wins")
    for line in table(summary(named, classes)):
        print(line)
    for line in schedule_lines(cfg, model, args.world):
        print("# " + line)
    if args.list:
        assigned = classes.assign(named)
        for n, p in named:
            print(f"  {assigned[n]:<11} {n} {tuple(p.shape)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
