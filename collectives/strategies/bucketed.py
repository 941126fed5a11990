"""`bucketed`: size-capped buckets in gradient-ready order, each launched asynchronously from the
post-accumulate-grad hooks the moment it is complete; the gradients live as views into the flat buckets (no copy).
Knobs: `sync.bucket_cap_mb` and `sync.first_bucket_mb` (the bucket ready first, so communication starts early)."""

from __future__ import annotations

from dataclasses import dataclass

from collectives.plan import BucketingStrategy, pack
from collectives.strategies import register
from collectives.tensor_classes import DEFAULT_BUCKET_CAP_MB, CollectiveSettings


@register("bucketed")
class Bucketed(BucketingStrategy):
    @dataclass(frozen=True)
    class Config:
        bucket_cap_mb: float | None = None  # None: 25 MiB, DDP's default
        first_bucket_mb: float | None = None  # None: the same as bucket_cap_mb

    def plan(self, named_params, classes, settings):
        c = self.config
        fp32 = CollectiveSettings(bucket_cap_mb=c.bucket_cap_mb or DEFAULT_BUCKET_CAP_MB)
        first = None if c.first_bucket_mb is None else int(c.first_bucket_mb * 2**20)
        # Classes mix freely; only the gradients' dtype separates buckets.
        return pack(named_params, classes, key=lambda n, p: p.dtype, settings_of=lambda k: fp32,
                    first_cap_bytes=first)
