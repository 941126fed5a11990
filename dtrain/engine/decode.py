"""Greedy and beam search (section 6.1: beam 4, length penalty α = 0.6, maximum length source + 50).

Batched over sentences and beams; the encoder runs once per batch, its cross-attention keys/values are computed
once, and the decoder extends a key/value cache one position per step instead of re-running the prefix.
"""

from __future__ import annotations

import torch

from dtrain.engine.model import Transformer
from dtrain.engine.tokenizer import BOS, EOS


def length_penalty(length: int, alpha: float) -> float:
    """GNMT's lp(Y) = ((5 + |Y|) / 6)^α, the normalization the paper's α refers to."""
    return ((5.0 + length) / 6.0) ** alpha


def _reorder(caches: list[list], index: torch.Tensor) -> None:
    for cache in caches:
        if cache:
            cache[:] = [t.index_select(0, index) for t in cache]


@torch.no_grad()
def beam_search(model: Transformer, src: torch.Tensor, beam: int = 4, alpha: float = 0.6, max_len_b: int = 50
                ) -> list[list[int]]:
    """src (B, S) padded source ids → B hypotheses (ids without BOS/EOS). beam=1 is greedy search."""
    model.eval()
    B, K, device = src.size(0), beam, src.device
    src_mask = model.src_mask(src)  # (B, 1, 1, S)
    memory = model.encode(src, src_mask)  # (B, S, d_model)
    # Every beam of sentence b sits at rows b*K .. b*K+K-1.
    rows = torch.arange(B, device=device).repeat_interleave(K)
    src_mask, memory = src_mask[rows], memory[rows]
    memory_kv = model.memory_kv(memory)
    caches: list[list] = [[] for _ in model.decoder]
    src_len = (src != model.pad_id).sum(1).tolist()
    max_len = [n + max_len_b for n in src_len]

    scores = torch.full((B, K), float("-inf"), device=device)
    scores[:, 0] = 0.0  # all beams start identical: expand only the first
    tokens = torch.full((B * K, 1), BOS, dtype=torch.long, device=device)
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(B)]
    done = [False] * B

    for t in range(max(max_len)):
        logp = model.decode_step(tokens[:, -1:], t, memory_kv, src_mask, caches)  # (B*K, V)
        V = logp.size(-1)
        cand = (scores.view(B * K, 1) + logp).view(B, K * V)
        top_scores, top_idx = cand.topk(2 * K, dim=1)  # 2K so that K survivors remain after EOS picks
        top_scores, top_idx = top_scores.tolist(), top_idx.tolist()
        new_parent, new_token, new_score = [], [], []
        for b in range(B):
            alive = []
            if not done[b]:
                for rank, (s, idx) in enumerate(zip(top_scores[b], top_idx[b])):
                    if s == float("-inf"):
                        break
                    parent, tok = b * K + idx // V, idx % V
                    if tok == EOS or t + 1 >= max_len[b]:
                        if rank < K:  # an EOS counts only if it is among the K best continuations
                            hyp = tokens[parent, 1:].tolist() + ([] if tok == EOS else [tok])
                            finished[b].append((s / length_penalty(len(hyp) + 1, alpha), hyp))
                        continue
                    alive.append((s, parent, tok))
                    if len(alive) == K:
                        break
                if len(finished[b]) >= K or t + 1 >= max_len[b] or not alive:
                    done[b] = True
            if done[b]:
                alive = []
            alive += [(float("-inf"), b * K, EOS)] * (K - len(alive))  # dead rows keep shapes aligned
            for s, parent, tok in alive:
                new_score.append(s)
                new_parent.append(parent)
                new_token.append(tok)
        if all(done):
            break
        parent = torch.tensor(new_parent, device=device)
        tokens = torch.cat([tokens[parent], torch.tensor(new_token, device=device)[:, None]], dim=1)
        scores = torch.tensor(new_score, device=device).view(B, K)
        _reorder(caches, parent)

    return [max(f)[1] if f else [] for f in finished]


def translate(model: Transformer, tokenizer, sentences: list[str], beam: int, alpha: float, max_len_b: int,
              batch_size: int, device, progress=None) -> list[str]:
    """Detokenized translations of `sentences`, decoded in length-sorted batches, returned in input order."""
    src_ids = [ids + [EOS] for ids in tokenizer.encode(sentences)]
    order = sorted(range(len(src_ids)), key=lambda i: len(src_ids[i]))
    out: list[str] = [""] * len(src_ids)
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        src = torch.nn.utils.rnn.pad_sequence([torch.tensor(src_ids[i]) for i in idx], batch_first=True,
                                              padding_value=model.pad_id).to(device)
        hyps = beam_search(model, src, beam, alpha, max_len_b)
        for i, text in zip(idx, tokenizer.decode(hyps)):
            out[i] = text
        if progress is not None:
            progress.update(len(idx))
    return out
