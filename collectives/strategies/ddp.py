"""`ddp`: stock `DistributedDataParallel`, optionally with a stock comm hook; the baseline for every comparison."""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from collectives.strategies import register
from collectives.sync import GradSync

_HOOKS = {
    "allreduce": default_hooks.allreduce_hook,
    "fp16_compress": default_hooks.fp16_compress_hook,
    "bf16_compress": default_hooks.bf16_compress_hook,
}


@register("ddp")
class DDPSync(GradSync):
    """DDP overlaps bucketed all-reduces with backward and waits for them inside `backward()` itself, so its exposed
    communication shows up in backward time, not in `wait()`."""

    def __init__(self, model, cfg, process_group=None):
        super().__init__(model, cfg, process_group)
        device_ids = None
        if next(model.parameters()).is_cuda:
            device_ids = [torch.cuda.current_device()]
        # The model's only buffer (the positional table) is a constant: never broadcast it with each forward.
        # torch >= 2.13 names that switch `forward_sync_buffers`, earlier releases `broadcast_buffers`.
        params = inspect.signature(DistributedDataParallel.__init__).parameters
        no_buffer_sync = {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {
            "broadcast_buffers": False}
        self.module = DistributedDataParallel(
            model, device_ids=device_ids, process_group=process_group, bucket_cap_mb=cfg.bucket_cap_mb,
            **no_buffer_sync,
        )
        if cfg.hook is not None:
            state = process_group if process_group is not None else dist.group.WORLD
            self.module.register_comm_hook(state, _HOOKS[cfg.hook])
        self.lossless = cfg.hook in (None, "allreduce")

    def no_sync(self):
        return self.module.no_sync()

    def stats(self):
        return {**super().stats(), "bucket_cap_mb": self.cfg.bucket_cap_mb, "hook": self.cfg.hook}
