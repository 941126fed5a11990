"""`flat`: every gradient in one buffer, one all-reduce after backward. Full fusion, no overlap: the fewest
collectives, with all of the communication exposed."""

from __future__ import annotations

from dtrain.collectives.plan import Bucket, BucketingStrategy
from dtrain.collectives.registry import CLASS_RULE_KEYS, HIERARCHY_KEYS, register
from dtrain.collectives.settings import ClassSettings


@register("flat")
class Flat(BucketingStrategy):
    overlap = False  # launched in wait(), after the whole backward
    sync_keys = CLASS_RULE_KEYS + ("classes.tied_split", *HIERARCHY_KEYS)  # no cap: one bucket per dtype

    def plan(self, named_params, classes, settings):
        by_dtype: dict = {}  # one flat buffer holds one dtype (all fp32 for dtrain's model)
        for n, p in named_params:
            by_dtype.setdefault(p.dtype, []).append((n, p))
        buckets = []
        for dtype, members in by_dtype.items():
            numel = sum(p.numel() for _, p in members)
            fp32 = ClassSettings()  # no cap: the one bucket holds everything
            names = tuple(n for n, _ in members)
            kinds = {classes[n] for n in names}
            buckets.append(Bucket(len(buckets), names, numel, numel * fp32.torch_wire_dtype.itemsize,
                                  kinds.pop() if len(kinds) == 1 else "mixed", fp32, dtype))
        return buckets
