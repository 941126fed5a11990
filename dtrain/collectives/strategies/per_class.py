"""`per_class`: like `bucketed`, but a bucket never mixes tensor classes, and each class brings its own bucket size,
wire dtype (fp32; bf16 or fp16: cast, all-reduce, cast back) and process group, created by
`dtrain.collectives.nccl.class_group` (where the per-class NCCL settings hang). Settings: `sync.classes.<class>.*`."""

from __future__ import annotations

from dtrain.collectives.plan import BucketingStrategy, pack
from dtrain.collectives.registry import CLASS_RULE_KEYS, CLASS_SETTING_KEYS, register


@register("per_class")
class PerClass(BucketingStrategy):
    class_groups = True
    uses_cap = True
    sync_keys = ("bucket_cap_mb",) + CLASS_RULE_KEYS + CLASS_SETTING_KEYS  # the cap: each class's default

    def plan(self, named_params, classes, settings):
        return pack(named_params, classes, key=lambda n, p: (classes[n], p.dtype),
                    settings_of=lambda k: settings[k[0]])
