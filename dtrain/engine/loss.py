"""Label-smoothed cross-entropy (section 5.4, ε_ls = 0.1): the target distribution puts 1 − ε on the reference
token and spreads ε evenly over every other token except padding; padded positions contribute nothing."""

from __future__ import annotations

import torch
from torch import nn


class LabelSmoothing(nn.Module):
    def __init__(self, vocab: int, pad_id: int = 0, smoothing: float = 0.1):
        super().__init__()
        self.vocab, self.pad_id, self.smoothing = vocab, pad_id, smoothing

    def target_distribution(self, target: torch.Tensor) -> torch.Tensor:
        """The smoothed distribution (N, vocab) for targets (N,); spelled out for tests and inspection only."""
        dist = torch.full((target.numel(), self.vocab), self.smoothing / (self.vocab - 2))
        dist[:, self.pad_id] = 0.0
        dist.scatter_(1, target.reshape(-1, 1), 1.0 - self.smoothing)
        dist[target.reshape(-1) == self.pad_id] = 0.0
        return dist

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Summed cross-entropy against `target_distribution`, without building it: logits (B, T, V), target (B, T).

        Equal to -Σ q·log p with q the smoothed distribution: (1-ε)·nll(y) + ε/(V-2)·Σ_{j ∉ {y, pad}} nll(j).
        """
        logp = torch.log_softmax(logits.float(), dim=-1).view(-1, self.vocab)  # (N, V)
        target = target.reshape(-1)
        nll_y = -logp.gather(1, target[:, None]).squeeze(1)  # (N,)
        nll_sum = -logp.sum(dim=1)
        nll_pad = -logp[:, self.pad_id]
        smooth = (nll_sum - nll_y - nll_pad) / (self.vocab - 2)
        loss = (1.0 - self.smoothing) * nll_y + self.smoothing * smooth
        return loss.masked_fill(target == self.pad_id, 0.0).sum()
