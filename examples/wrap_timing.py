"""`auto` on a model no one here wrote, through `wrap`: its pick's step against stock DDP's, interleaved.

    python -m dtrain.analysis.testbed run --profile dtrain/profiles/testbed/1gbit.yaml -- \\
        examples/wrap_timing.py --seed 1 --json runs/wrap-timing/job1.json

Two phases in one job, on `transformers`' Marian (an encoder-decoder translation model, built from a config: no
weights downloaded) in the loop of examples/wrap_models.py (two AdamW groups, clipping, a cosine schedule):

1. The search: `wrap(model, optimizer, "auto")` trains until `auto` has picked (its budget, `--budget` steps).
2. The comparison: the pick (its configuration, on a fresh copy of the model), stock DDP's defaults
   (`DistributedDataParallel(model)`: 25 MiB buckets) and DDP at 2 MiB, each on its own copy of the same model,
   take turns round by round on the same batches. In each turn a configuration runs two steps and the second is
   timed (from its forward to the end of its optimizer step, on every rank, the slowest rank's time counted): the
   first absorbs what the previous configuration left in flight, and the second's own communication that overlaps
   the next forward (`sharded`'s all-gathers) is hidden as it would be in a run of it alone.

Rank 0 prints each configuration's median step and, against each DDP, the median paired difference with its ~95%
interval (order statistics: the pairs are the rounds, so a drift of the machine's speed cancels); `--json` keeps the
steps for pooling several jobs (`--pool job1.json job2.json` prints the pooled table without running anything).
"""

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from dtrain.collectives import wrap
from dtrain.collectives.dist import cleanup
from dtrain.common.stats import median_ci, paired_median
from wrap_models import decay_groups  # this folder's: the GPT scripts' two groups

VOCAB = 8000


def build_model(seed: int) -> torch.nn.Module:
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.MarianConfig(vocab_size=VOCAB, d_model=256, encoder_layers=3, decoder_layers=3,
                                    encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=1024,
                                    decoder_ffn_dim=1024, max_position_embeddings=64, dropout=0.1, pad_token_id=0,
                                    decoder_start_token_id=0, eos_token_id=1, share_encoder_decoder_embeddings=True,
                                    tie_word_embeddings=True)
    return transformers.MarianMTModel(cfg)


class Loop:
    """One configuration's model, optimizer and schedule, and its training step (the GPT scripts' loop)."""

    def __init__(self, seed: int, sync, steps: int):
        model = build_model(seed)
        self.optimizer = torch.optim.AdamW(decay_groups(model), lr=3e-4, betas=(0.9, 0.98))
        self.schedule = torch.optim.lr_scheduler.CosineAnnealingLR(self.optimizer, T_max=steps)
        if isinstance(sync, int):  # stock DDP with this bucket cap (MiB)
            self.model = DistributedDataParallel(model, bucket_cap_mb=sync)
            self.clip = lambda: torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        else:
            self.model, self.optimizer = wrap(model, self.optimizer, sync)
            self.clip = lambda: self.model.clip_grad_norm_(1.0)  # every strategy's global norm

    def step(self, batch: dict) -> None:
        loss = self.model(**batch).loss
        loss.backward()
        self.clip()
        self.optimizer.step()
        self.schedule.step()
        self.optimizer.zero_grad(set_to_none=True)


def batches(seed: int):
    gen = torch.Generator().manual_seed(seed * 1000 + dist.get_rank())
    while True:  # 16 pairs of 32 source and 32 target tokens per rank
        yield {"input_ids": torch.randint(2, VOCAB, (16, 32), generator=gen),
               "labels": torch.randint(2, VOCAB, (16, 32), generator=gen)}


def timed(loop: Loop, batch: dict) -> float:
    """One step's time in ms, the slowest rank's."""
    t0 = time.perf_counter()
    loop.step(batch)
    ms = torch.tensor([(time.perf_counter() - t0) * 1000])
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    return ms.item()


def search(args):
    """Phase 1: auto until it picks; its pick's name and `SyncConfig`, and the steps the search spent."""
    loop = Loop(args.seed, {"strategy": "auto", "tune.budget_steps": args.budget}, args.budget + 10)
    data = batches(args.seed + 100)
    for step in range(args.budget + 10):
        loop.step(next(data))
        stats = loop.model.handle.stats()
        if stats["winner"] is not None:
            break
    handle = loop.model.handle
    winner = stats["winner"]
    if winner is None:
        raise SystemExit(f"auto did not pick within {args.budget + 10} steps")
    sync = handle.syncs[winner]
    spent = stats["steps_spent"]
    loop.model.close()
    return winner, sync, spent


def compare(args, pick) -> dict[str, list[float]]:
    """Phase 2: the configurations take turns on the same batches; each turn's second step timed."""
    configs = {"pick": pick, "ddp-25": 25, "ddp-2": 2}
    loops = {name: Loop(args.seed, sync, 2 * args.rounds) for name, sync in configs.items()}
    data = batches(args.seed)
    times: dict[str, list[float]] = {name: [] for name in configs}
    order = list(configs)
    for r in range(args.rounds):
        pair = [next(data), next(data)]
        for name in order[r % 3:] + order[: r % 3]:  # each configuration first in turn
            loops[name].step(pair[0])
            times[name].append(timed(loops[name], pair[1]))
        if dist.get_rank() == 0 and (r + 1) % 10 == 0:
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{n} {statistics.median(t):.0f} ms"
                                                              for n, t in times.items()), flush=True)
    for loop in loops.values():
        if hasattr(loop.model, "close"):
            loop.model.close()
    return times


def table(jobs: list[dict], warmup: int) -> str:
    """Each configuration's median step, and the pick against each DDP, pooled over `jobs` (rounds after
    `warmup`)."""
    times = {n: [t for j in jobs for t in j["times"][n][warmup:]] for n in jobs[0]["times"]}
    lines = [f"jobs: {len(jobs)} (seeds {', '.join(str(j['seed']) for j in jobs)}); pick: "
             f"{', '.join(sorted({j['pick'] for j in jobs}))}; rounds counted: {len(times['pick'])}"]
    for n, t in times.items():
        lo, hi = median_ci(t)
        lines.append(f"  {n:8s} median {statistics.median(t):7.1f} ms  (~95%: {lo:.1f} .. {hi:.1f})")
    for base in ("ddp-25", "ddp-2"):
        d, lo, hi = paired_median(times["pick"], times[base])
        ratio = statistics.median(times["pick"]) / statistics.median(times[base])
        lines.append(f"  pick vs {base}: {ratio:.3f}x, paired {d:+.1f} ms (~95%: {lo:+.1f} .. {hi:+.1f})")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--budget", type=int, default=40, help="auto's tune.budget_steps")
    ap.add_argument("--rounds", type=int, default=30, help="phase 2: rounds of every configuration")
    ap.add_argument("--warmup", type=int, default=3, help="rounds not counted")
    ap.add_argument("--json", help="rank 0 writes the job's steps here")
    ap.add_argument("--pool", nargs="+", help="print the table of these jobs' JSON files, pooled; run nothing")
    args = ap.parse_args()
    if args.pool:
        print(table([json.load(open(f)) for f in args.pool], args.warmup))
        return
    dist.init_process_group("gloo")
    pick, sync, spent = search(args)
    if dist.get_rank() == 0:
        print(f"auto picked {pick} after {spent} steps", flush=True)
    times = compare(args, sync)
    job = {"seed": args.seed, "pick": pick, "steps_spent": spent, "ranks": dist.get_world_size(),
           "cpu": torch.backends.cpu.get_cpu_capability(), "times": times}
    if dist.get_rank() == 0:
        print(table([job], args.warmup))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(job, f)
    cleanup()


if __name__ == "__main__":
    main()
