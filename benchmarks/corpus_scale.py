"""Corpus scale: what the tokenised, memory-mapped cache (`dtrain.engine.token_cache`) costs and saves on a large corpus.

    python benchmarks/corpus_scale.py [--pairs 1000000] [--vocab 8000] [--bpe-sample 200000] [--work DIR]

Generates a synthetic parallel corpus of --pairs sentence pairs (Zipf-distributed made-up words, 1-60 words a
sentence, the target a word-for-word image of the source; nothing is written to the repository), then measures:

- the BPE model's training on --bpe-sample sampled pairs, then the token cache's build (one process each, as one rank
  per machine builds it): wall time, the process's peak resident memory (getrusage ru_maxrss), the cache's size;
- the start-up of a 2-rank job (torchrun, gloo) that reads it: from launching torchrun to the moment both ranks hold
  their first training batch, each rank's own corpus time (after the process group is up) and memory (peak RSS;
  resident anonymous and file-backed memory at the first batch), warm (second run);
- the same for Multi30k through dtrain.engine.startup.load_corpus (each rank encodes the 29,000 pairs itself);
- the cached corpus with 1 rank, to show that start-up does not grow with the number of ranks.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dtrain.engine import config as config_mod  # noqa: E402
from dtrain.engine import corpus as corpora  # noqa: E402


def generate(directory: Path, pairs: int, seed: int = 0) -> dict:
    """train/val/test.{en,de}: made-up words (Zipf's law over a 20,000-word vocabulary a language)."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    vocab = {lang: ["".join(rng.choices(letters, k=rng.randint(2, 10))) for _ in range(20_000)] for lang in "xy"}
    weights = list(itertools.accumulate(1 / (r + 1) for r in range(20_000)))
    sizes = {"train": pairs, "val": 3000, "test": 3003}
    for split, n in sizes.items():
        with open(directory / f"{split}.en", "w") as fe, open(directory / f"{split}.de", "w") as fd:
            for _ in range(n):
                idx = rng.choices(range(20_000), cum_weights=weights, k=rng.randint(1, 60))
                fe.write(" ".join(vocab["x"][i] for i in idx) + ".\n")
                fd.write(" ".join(vocab["y"][i] for i in idx) + ".\n")
    return {"train_bytes": sum((directory / f"train.{l}").stat().st_size for l in ("en", "de"))}


def profile(args, corpus: str) -> dict:
    data = {"vocab_size": args.vocab, "max_tokens": 4096, "max_len": 256, "cache_dir": str(args.work / "cache")}
    if corpus == "files":
        d = args.work / "text"
        data |= {"corpus": "files", "bpe_sample": args.bpe_sample, "clean": True,
                 "files": {s: [str(d / f"{s}.en"), str(d / f"{s}.de")] for s in ("train", "val", "test")}}
    return {"data": data, "eval": {"at_end": False}}


def peak_rss_mib() -> int:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def rss_parts_mib() -> dict:
    """Resident memory now, split (Linux): anonymous (this process's own) and file-backed (mapped files, shared
    with every process mapping them, the token cache's pages among them)."""
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        return {}
    return {k.lower() + "_mib": round(int(v.split()[0]) / 1024) for k, v in (line.split(":", 1) for line in lines)
            if k in ("RssAnon", "RssFile")}


def phase_build(args) -> None:
    """One process: the BPE model on a sample (--step bpe), or the training and validation caches (--step cache),
    each in its own process so that each peak RSS is its own."""
    cfg = config_mod.from_dict(profile(args, "files"))
    t0 = time.perf_counter()
    tokenizer = corpora.shared_tokenizer(cfg.data, cfg.seed, clean=True)
    if args.step == "bpe":
        print(json.dumps({"bpe_s": round(time.perf_counter() - t0, 1), "peak_rss_mib": peak_rss_mib()}))
        return
    t1 = time.perf_counter()
    train = corpora.cached_split(cfg.data, tokenizer, "train", clean=True)
    corpora.cached_split(cfg.data, tokenizer, "val", clean=True)
    t2 = time.perf_counter()
    size = sum(p.stat().st_size for p in train.directory.iterdir())
    print(json.dumps({"cache_build_s": round(t2 - t1, 1), "peak_rss_mib": peak_rss_mib(), "cache_bytes": size,
                      "stats": train.meta["stats"]}))


def phase_startup(args) -> None:
    """One rank of a torchrun job: process group, corpus, batcher, first batch; prints when it got there."""
    import torch.distributed as dist

    from dtrain.engine.data import BatchStream, TokenBatcher
    from dtrain.engine.startup import load_corpus

    dist.init_process_group("gloo")
    t0 = time.perf_counter()
    cfg = config_mod.from_dict(profile(args, args.corpus))
    if args.corpus == "files":
        _, _, train, _ = corpora.load(cfg.data, cfg.seed)
    else:
        train = load_corpus(cfg).train
    stream = BatchStream(train, TokenBatcher(train.lengths(), cfg.data.max_tokens, cfg.seed, dist.get_rank(),
                                             dist.get_world_size()))
    stream.next()
    print(json.dumps({"rank": dist.get_rank(), "corpus_s": round(time.perf_counter() - t0, 2),
                      "ready": time.time(), "pairs": len(train), "rss_mib": peak_rss_mib(), **rss_parts_mib()}),
          flush=True)
    dist.destroy_process_group()


def startup(args, corpus: str, nproc: int) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           __file__, "--phase", "startup", "--corpus", corpus, "--work", str(args.work), "--vocab", str(args.vocab),
           "--bpe-sample", str(args.bpe_sample), "--pairs", str(args.pairs)]
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=REPO,
                       check=False)
    if r.returncode:
        sys.exit(f"startup run failed:\n{r.stderr[-3000:]}")
    ranks = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    return {"corpus": corpus, "ranks": nproc, "pairs": ranks[0]["pairs"],
            "launch_to_first_batch_s": round(max(x["ready"] for x in ranks) - t0, 2),
            "corpus_s_per_rank": [x["corpus_s"] for x in sorted(ranks, key=lambda x: x["rank"])],
            "peak_rss_mib_per_rank": [x["rss_mib"] for x in sorted(ranks, key=lambda x: x["rank"])],
            "anon_mib_per_rank": [x.get("rssanon_mib") for x in sorted(ranks, key=lambda x: x["rank"])],
            "file_mib_per_rank": [x.get("rssfile_mib") for x in sorted(ranks, key=lambda x: x["rank"])]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=1_000_000)
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--bpe-sample", type=int, default=200_000)
    ap.add_argument("--work", type=Path, help="scratch folder (default: a temporary one, removed at the end)")
    ap.add_argument("--phase", choices=["all", "build", "startup"], default="all")
    ap.add_argument("--corpus", choices=["files", "multi30k"], default="files")
    ap.add_argument("--step", choices=["bpe", "cache"], default="cache")
    args = ap.parse_args()
    if args.phase == "build":
        return phase_build(args)
    if args.phase == "startup":
        return phase_startup(args)
    with tempfile.TemporaryDirectory() as tmp:
        args.work = args.work or Path(tmp)
        (args.work / "text").mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        gen = generate(args.work / "text", args.pairs)
        print(f"generated {args.pairs:,} pairs ({gen['train_bytes'] / 2**20:.0f} MiB of text) in "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
        build = {}
        for step in ("bpe", "cache"):
            r = subprocess.run([sys.executable, __file__, "--phase", "build", "--step", step, "--work", str(args.work),
                                "--vocab", str(args.vocab), "--bpe-sample", str(args.bpe_sample), "--pairs",
                                str(args.pairs)], capture_output=True, text=True, check=False)
            if r.returncode:
                sys.exit(f"build ({step}) failed:\n{r.stderr[-3000:]}")
            build[step] = json.loads(r.stdout.strip().splitlines()[-1])
        bpe, cache = build["bpe"], build["cache"]
        print(f"BPE ({args.vocab} pieces) on {args.bpe_sample:,} sampled pairs: {bpe['bpe_s']} s, peak RSS "
              f"{bpe['peak_rss_mib']} MiB")
        print(f"token cache build (train + val, one process): {cache['cache_build_s']} s, peak RSS "
              f"{cache['peak_rss_mib']} MiB, training cache {cache['cache_bytes'] / 2**20:.0f} MiB on disk; "
              f"{json.dumps(cache['stats'])}", flush=True)
        runs = []
        for corpus, nproc in (("files", 2), ("files", 1), ("multi30k", 2)):
            startup(args, corpus, nproc)  # warm-up: caches (BPE, tokens, page cache) in place
            runs.append(startup(args, corpus, nproc))
            print(json.dumps(runs[-1]), flush=True)


if __name__ == "__main__":
    sys.exit(main())
