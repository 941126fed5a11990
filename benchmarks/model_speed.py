"""Model speed: dtrain's Transformer against the same-size `torch.nn.Transformer`, one training step on one real
batch of a profile, in one process. Prints the median step time of each and the ratio (> 1: dtrain is faster).

    python benchmarks/model_speed.py --profile dtrain/profiles/multi30k-cpu.yaml [--iters 20] [--threads 1]

Both models get the same embedding (shared, scaled by sqrt(d_model)), sinusoidal positions, tied output
projection, label-smoothed loss, Adam, the same batch and the same masks; the runs alternate step by step so
that machine noise hits both alike.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dtrain.engine import config as config_mod  # noqa: E402
from dtrain.common.paths import cache_root  # noqa: E402
from dtrain.engine.data import Pairs, TokenBatcher, collate, multi30k_dir, multi30k_split  # noqa: E402
from dtrain.engine.loss import LabelSmoothing  # noqa: E402
from dtrain.engine.model import PositionalEncoding, Transformer, sdpa_backend  # noqa: E402
from dtrain.engine.tokenizer import PAD, train_or_load  # noqa: E402


class TorchTransformer(nn.Module):
    """torch.nn.Transformer wrapped with the paper's embedding, positions and tied output, like dtrain's model."""

    def __init__(self, vocab, N, d_model, d_ff, h, dropout):
        super().__init__()
        self.d_model = d_model
        self.embed = nn.Embedding(vocab, d_model, padding_idx=PAD)
        self.pos = PositionalEncoding(d_model, dropout)
        self.core = nn.Transformer(d_model, h, N, N, d_ff, dropout, batch_first=True)

    def forward(self, src, tgt_in):
        src_pad = src == PAD  # (B, S): True = padding, torch's convention
        T = tgt_in.size(1)
        causal = nn.Transformer.generate_square_subsequent_mask(T, device=src.device)
        x = self.core(self.pos(self.embed(src) * math.sqrt(self.d_model)),
                      self.pos(self.embed(tgt_in) * math.sqrt(self.d_model)),
                      tgt_mask=causal, tgt_is_causal=True, src_key_padding_mask=src_pad,
                      memory_key_padding_mask=src_pad)
        return F.linear(x, self.embed.weight)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", default="dtrain/profiles/multi30k-cpu.yaml")
    ap.add_argument("--iters", type=int, default=20, help="timed steps per model (after 3 warm-up steps)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 = one rank of a 2-rank job here)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = config_mod.load(args.profile)
    d = cfg.data
    directory = multi30k_dir(d.dir, d.cache_dir, d.src, d.tgt)
    src, tgt = multi30k_split(directory, "train", d.src, d.tgt)
    tok = train_or_load(src, tgt, d.vocab_size, cache_root(d.cache_dir) / "bpe")
    pairs = Pairs.encode(tok, src[:5000], tgt[:5000], d.max_len)
    batches = TokenBatcher(pairs.lengths(), d.max_tokens, cfg.seed).epoch_batches(0)
    batch = collate(pairs, batches[0])  # the first training batch of epoch 0
    m = cfg.model
    torch.manual_seed(0)
    models = {"dtrain": Transformer.from_config(m, tok.vocab_size),
              "torch.nn.Transformer": TorchTransformer(tok.vocab_size, m.N, m.d_model, m.d_ff, m.h, m.dropout)}
    crit = LabelSmoothing(tok.vocab_size, PAD, cfg.optim.label_smoothing)
    optims = {k: torch.optim.Adam(v.parameters(), lr=1e-4, betas=cfg.optim.betas, eps=cfg.optim.eps)
              for k, v in models.items()}
    amp = cfg.train.amp == "bf16"

    def step(name):
        model, opt = models[name], optims[name]
        model.train()
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            loss = crit(model(batch.src, batch.tgt_in), batch.tgt_out) / batch.ntokens
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    times = {k: [] for k in models}
    with sdpa_backend(cfg.train.sdpa_backend, torch.device("cpu")):  # the same attention kernel for both
        for i in range(3 + args.iters):
            for name in models:
                t = step(name)
                if i >= 3:
                    times[name].append(t)
    params = {k: sum(p.numel() for p in v.parameters()) for k, v in models.items()}
    print(f"batch: {tuple(batch.src.shape)} source, {tuple(batch.tgt_in.shape)} target, {batch.ntokens} target "
          f"tokens; amp {cfg.train.amp}; sdpa {cfg.train.sdpa_backend}; threads {args.threads}; {args.iters} timed steps each")
    for name in models:
        ts = sorted(times[name])
        print(f"{name:22s} params {params[name]:>10,}  median {statistics.median(ts) * 1000:8.1f} ms  "
              f"p90 {ts[int(0.9 * (len(ts) - 1))] * 1000:8.1f} ms")
    ratio = statistics.median(times["torch.nn.Transformer"]) / statistics.median(times["dtrain"])
    print(f"speed ratio torch.nn.Transformer / dtrain step time: {ratio:.3f} (>= 1.0: dtrain at least as fast)")


if __name__ == "__main__":
    main()
