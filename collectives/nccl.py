"""Per-tensor-class process groups, and (to come) the NCCL protocol/algorithm settings applied to them.

`class_group` is the one place that creates a tensor class's process group; strategies call it, in the same order
on every rank. On gloo it is a plain group; on NCCL it will carry the class's settings (see nccl-facts.md §1).
"""

from __future__ import annotations

import torch.distributed as dist


def class_group(name: str, settings: dict | None = None, ranks: list[int] | None = None) -> dist.ProcessGroup:
    """A new process group serving tensor class `name` (collective call: every rank, same order)."""
    return dist.new_group(ranks=ranks)
