"""`noop`: no gradient communication at all. The headroom baseline for step-time measurements only: ranks drift
apart, so its runs are marked `communicates: false` in their records and never scored as training results."""

from dtrain.collectives.registry import register
from dtrain.collectives.sync import GradSync


@register("noop")
class NoopSync(GradSync):
    communicates = False
    lossless = False
    sync_keys = ()  # nothing is sent or recorded, so no knob means anything
