"""`per_tensor`: one all-reduce per gradient, launched the moment that gradient is ready. No fusion: the
latency-bound extreme, whose cost shows what bucketing buys."""

from __future__ import annotations

from dtrain.collectives.plan import Bucket, BucketingStrategy
from dtrain.collectives.registry import CLASS_RULE_KEYS, HIERARCHY_KEYS, register
from dtrain.collectives.settings import ClassSettings


@register("per_tensor")
class PerTensor(BucketingStrategy):
    sync_keys = CLASS_RULE_KEYS + ("classes.tied_split", *HIERARCHY_KEYS)  # no cap: a bucket per tensor

    def plan(self, named_params, classes, settings):
        fp32 = ClassSettings()  # no cap: every tensor is a bucket of its own
        return [Bucket(i, (n,), p.numel(), p.numel() * fp32.torch_wire_dtype.itemsize, classes[n], fp32, p.dtype)
                for i, (n, p) in enumerate(named_params)]
