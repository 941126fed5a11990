"""The handle of the one seam between a training loop and gradient communication.

A training loop calls `collectives.attach(model, sync_config)` once and gets a `GradSync`: it runs forward through
`handle.module`,
wraps all but the last micro-batch of an accumulation in `handle.no_sync()`, and calls `handle.wait()` before
`optimizer.step()`. It never branches on which strategy is behind the handle.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import ClassVar

import torch.distributed as dist
from torch import nn

from collectives.settings import SyncConfig
from common.rundir import BucketRecord


class StrategyFacts:
    """What every registered strategy says of itself, for the profile's checks, the cost model and the simulator;
    both kinds of strategy (`GradSync` and `collectives.plan.BucketingStrategy`) carry them."""

    name: ClassVar[str] = "base"
    communicates: ClassVar[bool] = True  # False only for the no-communication headroom baseline
    class_groups: ClassVar[bool] = False  # each tensor class gets its own process group
    uses_cap: ClassVar[bool] = False  # its buckets follow `sync.bucket_cap_mb`
    # The keys of `sync` it reads besides `strategy` ("classes.<key>": that key of every `sync.classes.<class>`); a
    # profile that sets another one is refused (`collectives.config.validate`).
    sync_keys: ClassVar[tuple[str, ...]] = ()
    plans_like: ClassVar[str | None] = None  # a planned strategy whose buckets model this one's (None: its own)


class GradSync(StrategyFacts):
    """Base handle. Subclasses synchronize gradients so that after `wait()` each holds the mean over ranks."""

    lossless = True  # False for strategies whose averaged gradients differ from the exact mean

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

