"""The paper's learning rate (section 5.3): lrate = d_model^-0.5 · min(step^-0.5, step · warmup^-1.5), times a
factor; linear warm-up to a peak at step = warmup, then inverse-square-root decay. Stepped once per optimizer step."""

from __future__ import annotations

import torch


def rate(step: int, d_model: int, warmup: int, factor: float = 1.0) -> float:
    step = max(step, 1)  # LambdaLR asks for step 0 before the first update
    return factor * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


def make_scheduler(optimizer: torch.optim.Optimizer, d_model: int, warmup: int, factor: float):
    # The optimizer's base lr is 1.0, so the lambda's value is the learning rate itself.
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: rate(s + 1, d_model, warmup, factor))
