"""Correctness check of the gradient synchronization strategies on real gloo ranks.

Each rank feeds different batches to a small Transformer; every strategy's averaged gradients, as an optimizer
update reads them through the seam (`synchronized_grads`: a sharded strategy's shards gathered back), are compared
with a reference, each gradient all-reduced on its own and divided by the world size, over a few steps (so the re-planned
buckets and `zero_grad(set_to_none=True)` between steps are covered), with or without gradient accumulation.

    python -m dtrain.engine.verify --nproc 2 --strategies all
    python -m dtrain.engine.verify --nproc 3 --strategies bucketed,per_class --accum 2 --json
    python -m dtrain.engine.verify --nproc 2 --strategies per_class --set sync.classes.ffn.wire_dtype=bf16
    python -m dtrain.engine.verify --nproc 4 --strategies bucketed --set sync.hierarchical=true --set sync.ranks_per_node=2
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import sys
import tempfile
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtrain.collectives import attach
from dtrain.collectives import dist as ddist
from dtrain.collectives.hierarchy import ranks_per_node
from dtrain.collectives.reducer import allreduce_each
from dtrain.collectives.strategies import attachable, get
from dtrain.common.errors import UserError, exit_on_user_error
from dtrain.common.schema import apply_override
from dtrain.engine import config
from dtrain.engine.model import Transformer

TOLERANCE = 1e-6  # relative, for lossless strategies
ZERO = 1e-6  # a gradient whose entries are all below this times the step's largest is zero but for rounding
VOCAB, PAD = 96, 0


def sync_config(name: str, bucket_mb: float, overrides: list[str]):
    """A validated `SyncConfig` for strategy `name` (small buckets, so that there are many) plus `--set` overrides."""
    raw = {"strategy": name, **({"bucket_cap_mb": bucket_mb} if get(name).uses_cap else {})}
    for assignment in overrides:
        key, sep, _ = assignment.partition("=")
        if not key.startswith("sync.") or not sep:
            raise UserError(f"--set '{assignment}': only sync.* keys apply here, e.g. sync.classes.ffn.wire_dtype=bf16")
        apply_override(raw, assignment[len("sync."):])
    return config.from_dict({"sync": raw}, "verify").sync


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial model on every rank
    return Transformer(VOCAB, N=2, d_model=32, d_ff=64, h=4, dropout=0.0, pad_id=PAD)


def batch(rank: int, step: int, micro: int):
    """Different data on every rank, micro-batch and step: (src (B, S), tgt_in (B, T), tgt_out (B, T))."""
    g = torch.Generator().manual_seed(10_000 * rank + 100 * step + micro)
    B, S, T = 3 + rank % 2, 5 + rank, 6 + (step + micro) % 3
    src = torch.randint(1, VOCAB, (B, S), generator=g)
    tgt = torch.randint(1, VOCAB, (B, T + 1), generator=g)
    return src, tgt[:, :-1], tgt[:, 1:]


def loss_fn(logits, tgt_out, accum: int):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), tgt_out.reshape(-1)) / accum


def synchronized_grads(handle, model: torch.nn.Module) -> list[torch.Tensor]:
    """Each parameter's synchronized gradient as an update sees it, read through the seam: the handle's optimizer
    parameters set to zero and stepped by SGD with lr 1 (to exactly -gradient), published to the model
    (`stepped`, `wait_params`: a sharded strategy all-gathers them), read back, and the parameters restored."""
    saved = [p.detach().clone() for p in model.parameters()]
    params = handle.optimizer_params()
    with torch.no_grad():
        for p in params:
            p.zero_()
    torch.optim.SGD(params, lr=1.0).step()
    handle.stepped()
    handle.wait_params()
    state = handle.model_state()  # whole tensors (fsdp2's parameters are shards)
    grads = [-state[name].detach().clone() for name, _ in model.named_parameters()]
    with torch.no_grad():
        for p, s in zip(model.parameters(), saved):
            p.copy_(s)
    return grads


def check_strategy(name: str, accum: int, steps: int, bucket_mb: float, overrides: list[str]) -> dict:
    """On this rank: the largest absolute and relative gradient difference to the reference, over `steps` steps
    (maxima over all ranks). Relative: per tensor, the largest difference over the reference's largest magnitude in
    that tensor, or in the step's whole gradient for a tensor that is zero but for rounding (`ZERO`)."""
    rank = dist.get_rank()
    cfg = sync_config(name, bucket_mb, overrides)
    model = tiny_model()
    reference = copy.deepcopy(model)
    handle = attach(model, cfg)
    max_abs = max_rel = 0.0
    for step in range(steps):
        for micro in range(accum):
            src, tgt_in, tgt_out = batch(rank, step, micro)
            with handle.no_sync() if micro < accum - 1 else nullcontext():
                loss_fn(handle.module(src, tgt_in), tgt_out, accum).backward()
            loss_fn(reference(src, tgt_in), tgt_out, accum).backward()
        handle.wait()
        handle.step_records()
        ref = [p.grad.clone() for p in reference.parameters()]
        allreduce_each(ref)
        scale = max(r.abs().max().item() for r in ref)  # the step's largest gradient entry
        for g, r in zip(synchronized_grads(handle, model), ref):
            diff = (g - r).abs().max().item()
            max_abs = max(max_abs, diff)
            own = r.abs().max().item()
            # A gradient that is zero but for rounding (the attention keys' biases: softmax ignores a shift of all
            # of a query's scores) has no scale of its own: its difference counts against the step's.
            max_rel = max(max_rel, diff / max(own if own >= ZERO * scale else scale, 1e-30))
        # As the trainer does: gradients dropped, then rebuilt by the next step's backward.
        for p in handle.optimizer_params():
            p.grad = None
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
    handle.close()
    worst = torch.tensor([max_abs, max_rel], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return {"max_abs": worst[0].item(), "max_rel": worst[1].item(), "lossless": bool(handle.lossless),
            "communicates": bool(handle.communicates)}


def _worker(rank: int, world: int, init_file: str, out_file: str, accums: list[int], steps: int, bucket_mb: float,
            cases: dict[str, tuple[list[str], list[str]]]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    with ddist.rank_process():
        results = {case: {str(a): {s: check_strategy(s, a, steps, bucket_mb, overrides) for s in strategies}
                          for a in accums} for case, (strategies, overrides) in cases.items()}
        if rank == 0:
            with open(out_file, "w") as f:
                json.dump(results, f)


def run_cases(nproc: int, strategies: list[str] | dict[str, list[str]], cases: dict[str, list[str]],
              accums: list[int] = (1,), steps: int = 3, bucket_mb: float = 0.01) -> dict:
    """`run` once per case of `cases` (its name -> its overrides), every case in one spawn of `nproc` gloo ranks (the
    ranks' start-up is most of a check's time); returns {case: {accum: {strategy: result}}}. `strategies`: the names
    checked in every case, or {case: its names}, for cases whose overrides only some strategies take (a setting a
    strategy does not use is refused)."""
    names = strategies if isinstance(strategies, dict) else {case: strategies for case in cases}
    jobs = {case: (list(names[case]), list(overrides)) for case, overrides in cases.items()}
    for case_names, overrides in jobs.values():
        for s in case_names:
            cfg = sync_config(s, bucket_mb, overrides)  # bad input fails here, not in nproc tracebacks
            if cfg.hierarchical:
                ranks_per_node(cfg, nproc)
    with tempfile.TemporaryDirectory() as tmp:
        init_file, out_file = os.path.join(tmp, "init"), os.path.join(tmp, "out.json")
        ddist.spawn(_worker, (nproc, init_file, out_file, list(accums), steps, bucket_mb, jobs), nproc)
        with open(out_file) as f:
            return json.load(f)


def run(nproc: int, strategies: list[str], accums: list[int] = (1,), steps: int = 3, bucket_mb: float = 0.01,
        overrides: list[str] = ()) -> dict:
    """Spawn `nproc` gloo ranks and check `strategies`; returns {accum: {strategy: result}} (accum as a string)."""
    return run_cases(nproc, strategies, {"": list(overrides)}, accums, steps, bucket_mb)[""]


def passed(result: dict) -> bool:
    return not result["lossless"] or result["max_rel"] <= TOLERANCE


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="dtrain.engine.verify", description="Check every strategy's averaged gradients "
                                 "against per-tensor all-reduces on real gloo ranks.")
    ap.add_argument("--nproc", type=int, default=2, help="ranks to spawn (default 2)")
    ap.add_argument("--strategies", default="all", help="comma-separated names, or 'all' (default)")
    ap.add_argument("--accum", type=int, default=1, help="micro-batches per step (gradient accumulation)")
    ap.add_argument("--steps", type=int, default=3, help="steps compared (default 3)")
    ap.add_argument("--bucket-mb", type=float, default=0.01, help="sync.bucket_cap_mb (small: many buckets)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="sync.KEY=VALUE")
    ap.add_argument("--json", action="store_true", help='print {strategy: {"max_abs", "max_rel", "lossless"}}')
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    with exit_on_user_error("dtrain.engine.verify"):
        names = attachable() if args.strategies == "all" else [s for s in args.strategies.split(",") if s]
        for s in names:
            if s not in attachable():
                raise UserError(f"--strategies: unknown strategy '{s}' (available: {', '.join(attachable())})")
        if args.nproc < 1 or args.accum < 1 or args.steps < 1:
            raise UserError("--nproc, --accum and --steps must be positive")
        results = run(args.nproc, names, [args.accum], args.steps, args.bucket_mb, args.overrides)[str(args.accum)]
    ok = all(passed(r) for r in results.values())
    if args.json:
        print(json.dumps({s: {k: r[k] for k in ("max_abs", "max_rel", "lossless")} for s, r in results.items()}))
        return 0 if ok else 1
    print(f"# {args.nproc} gloo ranks, {args.steps} steps, {args.accum} micro-batch(es) per step; reference: each "
          f"gradient all-reduced on its own / {args.nproc}")
    print(f"{'strategy':<12} {'lossless':>8} {'max_abs':>11} {'max_rel':>11}  check")
    for s, r in results.items():
        verdict = ("ok" if passed(r) else "WRONG") if r["lossless"] else (
            "lossy (reported)" if r["communicates"] else "no communication (headroom baseline)")
        print(f"{s:<12} {'yes' if r['lossless'] else 'no':>8} {r['max_abs']:11.3e} {r['max_rel']:11.3e}  {verdict}")
    print(f"# lossless strategies must agree within {TOLERANCE:g} relative: {'all ok' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
