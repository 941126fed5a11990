"""The handle of the one seam between a training loop and gradient communication.

A training loop calls `collectives.attach(model, sync_config)` once and gets a `GradSync`: it runs forward through
`handle.module`,
wraps all but the last micro-batch of an accumulation in `handle.no_sync()`, and calls `handle.wait()` before
`optimizer.step()`. It never branches on which strategy is behind the handle.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch.distributed as dist
from torch import nn

from collectives.settings import SyncConfig
from common.rundir import BucketRecord


class GradSync:
    """Base handle. Subclasses synchronize gradients so that after `wait()` each holds the mean over ranks."""

    name = "base"
    lossless = True  # False for strategies whose averaged gradients differ from the exact mean
    communicates = True  # False only for the no-communication headroom baseline
    class_groups = False  # each tensor class gets its own process group
    uses_cap = False  # its buckets follow `sync.bucket_cap_mb`
    plans_like: str | None = None  # a planned strategy whose bucket layout models this one's (cost model, simulator)
    sync_keys: tuple[str, ...] = ()  # the `sync` keys it reads; a profile setting another one is refused

    def __init__(self, model: nn.Module, cfg: SyncConfig, process_group: dist.ProcessGroup | None = None):
        self.model, self.cfg, self.process_group = model, cfg, process_group
        self.module: nn.Module = model  # what forward is called on

    def no_sync(self) -> AbstractContextManager:
        """Inside: backward accumulates locally and communicates nothing (all but the last micro-batch)."""
        return nullcontext()

    def wait(self) -> None:
        """Block until every gradient is averaged across ranks; the time spent here is exposed communication."""

    def step_records(self) -> list[BucketRecord]:
        """Per-bucket records of the step just synchronized, drained by the trainer after `wait()` and written to
        `<run>/buckets.jsonl` with the step number (bytes, class, dtype, ready/launch/complete times ...)."""
        return []

    def stats(self) -> dict:
        """Per-strategy facts for the run header (bucket count, sizes ...)."""
        return {"strategy": self.name, "lossless": self.lossless, "communicates": self.communicates}

