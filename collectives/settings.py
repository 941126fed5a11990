"""Settings of the communication library: the profile sections `dist`, `sync` and `collectives`.

Plain frozen dataclasses, loaded by the strict loader (`common.schema`) as parts of a profile; the engine's
`RunConfig` holds them. `collectives` reads nothing else of a profile.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# NCCL's protocol and algorithm names, in the order of its tuner-plugin indices (NCCL's src/include/nccl_tuner.h and
# the NCCL_PROTO / NCCL_ALGO environment variables in NCCL's documentation). The one list of them in the project.
NCCL_PROTOCOLS = ("LL", "LL128", "Simple")
NCCL_ALGORITHMS = ("Tree", "Ring", "CollNetDirect", "CollNetChain", "NVLS", "NVLSTree", "PAT")

@dataclass(frozen=True)
class DistConfig:
    backend: str = "auto"  # auto: nccl when CUDA is present, else gloo
    timeout_s: float = 600.0


@dataclass(frozen=True)
class SyncConfig:
    strategy: str = "ddp"  # ddp, per_tensor, flat, bucketed, per_class, powersgd, noop (see collectives/strategies)
    bucket_cap_mb: float | None = None  # None: DDP's default (25 MiB, with a 1 MiB first bucket); 25 for the others
    first_bucket_mb: float | None = None  # ddp, bucketed: cap of the bucket ready first; None: as bucket_cap_mb
    hook: str | None = None  # ddp: a stock DDP comm hook: allreduce, fp16_compress, bf16_compress
    classes: dict = field(default_factory=dict)  # tensor class rules and settings: collectives/tensor_classes.py
    powersgd_rank: int = 1  # powersgd: matrix approximation rank
    powersgd_start_iter: int = 2  # powersgd: plain all-reduce before this iteration (error feedback needs >= 2)


@dataclass(frozen=True)
class NcclSettings:
    """One tensor class's NCCL choices; null = NCCL decides. Validated and applied by `collectives.nccl`."""

    proto: str | None = None  # LL, LL128, Simple
    algo: str | None = None  # Ring, Tree, CollNetDirect, CollNetChain, NVLS, NVLSTree, PAT
    min_ctas: int | None = None
    max_ctas: int | None = None


@dataclass(frozen=True)
class CollectivesConfig:
    mode: str = "global"  # global | per_group | tuner
    default: NcclSettings = field(default_factory=NcclSettings)
    classes: dict[str, NcclSettings] = field(default_factory=dict)  # tensor class → settings
    parse_log: bool = False  # NCCL_DEBUG=INFO, SUBSYS=ENV,TUNING into a log file, checked against the bucket plan
    validated: bool = False  # the forced settings passed the benchmark's #wrong check on this platform
