"""`bucketed`: size-capped buckets in gradient-ready order, each launched asynchronously from the
post-accumulate-grad hooks the moment it is complete; the gradients live as views into the flat buckets (no copy).
Knobs: `sync.bucket_cap_mb`, `sync.first_bucket_mb` (the bucket ready first, so communication starts early) and
`sync.last_bucket_mb` (the bucket ready last, whose communication backward no longer hides, so that it is short)."""

from __future__ import annotations

from dataclasses import dataclass

from dtrain.collectives.plan import BucketingStrategy, pack
from dtrain.collectives.registry import CLASS_RULE_KEYS, HIERARCHY_KEYS, register
from dtrain.collectives.settings import ClassSettings, bucket_cap_mb

DDP_FIRST_BUCKET_MB = 1.0  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES


@register("bucketed")
class Bucketed(BucketingStrategy):
    uses_cap = True
    sync_keys = (("bucket_cap_mb", "first_bucket_mb", "last_bucket_mb") + CLASS_RULE_KEYS + ("classes.tied_split",)
                 + HIERARCHY_KEYS)

    @dataclass(frozen=True)
    class Config:
        bucket_cap_mb: float | None = None  # None: DDP's defaults, 25 MiB with a 1 MiB first bucket
        first_bucket_mb: float | None = None  # None: as bucket_cap_mb (as DDP does once a cap is given)
        last_bucket_mb: float | None = None  # None: the last bucket is whatever the others leave

    def plan(self, named_params, classes, settings):
        c = self.config
        first_mb = c.first_bucket_mb
        if first_mb is None and c.bucket_cap_mb is None:
            first_mb = DDP_FIRST_BUCKET_MB  # the same layout as stock DDP, for a like-for-like comparison
        fp32 = ClassSettings(bucket_cap_mb=bucket_cap_mb(c.bucket_cap_mb))
        first = None if first_mb is None else int(first_mb * 2**20)
        last = None if c.last_bucket_mb is None else int(c.last_bucket_mb * 2**20)
        # Classes mix freely; the gradients' dtype separates buckets, and the optimizer's groups where they are given
        # (a sharding strategy's).
        return pack(named_params, classes, key=lambda n, p: (p.dtype, self.group_of.get(n, 0)),
                    settings_of=lambda k: fp32,
                    first_cap_bytes=first, last_cap_bytes=last)
