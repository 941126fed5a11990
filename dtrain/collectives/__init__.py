"""The communication library: gradient synchronization strategies behind one seam, `attach(model, sync_config)`,
with tensor classes, bucket plans, the reducer, per-class NCCL settings, NCCL's cost model and a benchmark. It knows
nothing of the trainer or the study (`dtrain.engine`, `dtrain.analysis`)."""

from dtrain.collectives.strategies import attach  # noqa: F401 (the seam)
from dtrain.collectives import auto  # noqa: F401 (registers `auto`, which attach builds like the others)
from dtrain.collectives.sharded import strategy as _sharded  # noqa: F401 (registers `sharded`)
from dtrain.collectives.sync import GradSync  # noqa: F401 (what it returns)
from dtrain.collectives.wrap import wrap  # noqa: F401 (the seam for a DDP loop)
