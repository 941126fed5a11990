"""`powersgd`: DDP with PyTorch's PowerSGD comm hook (low-rank gradient compression with error feedback). Lossy.

Knobs: `sync.powersgd_rank` (the matrix approximation rank), `sync.powersgd_start_iter` (plain all-reduce before it),
and DDP's `sync.bucket_cap_mb` / `sync.first_bucket_mb`.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

from collectives.strategies import CLASS_RULE_KEYS, register
from collectives.strategies.ddp import DDPSync


@register("powersgd")
class PowerSGDSync(DDPSync):
    serialize_buckets = True  # each bucket's P and Q all-reduces are chained from callbacks (see DDPSync)
    plans_like = None  # compressed: no bucket plan of the lossless strategies models it
    # DDP's bucket knobs, not its `sync.hook`: PowerSGD is the hook
    sync_keys = ("bucket_cap_mb", "first_bucket_mb", "powersgd_rank", "powersgd_start_iter") + CLASS_RULE_KEYS

    def __init__(self, model, cfg, process_group=None):
        super().__init__(model, cfg, process_group)
        self.lossless = False

    def comm_hook(self):
        if not hasattr(self, "_powersgd"):
            # Fixed seed: every rank draws the same initial Q (the hook requires it).
            self._powersgd = powerSGD_hook.PowerSGDState(
                process_group=self.process_group if self.process_group is not None else dist.group.WORLD,
                matrix_approximation_rank=self.cfg.powersgd_rank,
                start_powerSGD_iter=self.cfg.powersgd_start_iter, random_seed=0)
        return self._powersgd, powerSGD_hook.powerSGD_hook

    def wire_dtype(self) -> str:
        return "powersgd"

    def stats(self):
        return {**super().stats(), "powersgd_rank": self.cfg.powersgd_rank,
                "powersgd_start_iter": self.cfg.powersgd_start_iter}
