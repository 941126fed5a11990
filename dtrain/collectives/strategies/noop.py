"""`noop`: no gradient communication at all. The headroom baseline for step-time measurements only: ranks drift
apart, so its runs are marked `communicates: false` in their records and never scored as training results."""

from dtrain.collectives.registry import register
from dtrain.collectives.schedule import Schedule
from dtrain.collectives.sync import GradSync


@register("noop")
class NoopSync(GradSync):
    communicates = False
    sync_keys = ()  # nothing is sent or recorded, so no knob means anything

    @classmethod
    def schedule(cls, sync, model, world, accum_steps=1, ranks_per_node=None) -> Schedule:
        return Schedule(cls.name, (), (), world, communicates=False)
