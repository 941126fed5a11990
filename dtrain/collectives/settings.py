"""Settings of the communication library: the profile sections `sync` and `collectives`, in four classes.

- `SyncConfig` (`sync`): the strategy and its keys; a DDP comm hook (`sync.hook`) is a name or a plain mapping that
  `dtrain.collectives.hooks` checks, since its options are the hook's own.
- `ClassSettings` (`sync.classes.<name>`): one tensor class's rule and how its buckets travel. `collectives.default`
  is one too, holding only NCCL keys, and a class's NCCL choices resolve to one (`dtrain.collectives.nccl.classes`):
  each field has one declaration.
- `TuneConfig` (`sync.tune`): how `auto` searches.
- `CollectivesConfig` (`collectives`): the backend, its timeout, and how NCCL's choices are applied.

Plain frozen dataclasses, loaded by the strict loader (`dtrain.common.schema`) as parts of a profile; the engine's
`RunConfig` holds them. `collectives` reads nothing else of a profile.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from dtrain.common.errors import UserError
from dtrain.common.schema import Source, build

# NCCL's protocol and algorithm names, in the order of its tuner-plugin indices (NCCL's src/include/nccl_tuner.h and
# the NCCL_PROTO / NCCL_ALGO environment variables in NCCL's documentation). The one list of them in the project.
NCCL_PROTOCOLS = ("LL", "LL128", "Simple")
NCCL_ALGORITHMS = ("Tree", "Ring", "CollNetDirect", "CollNetChain", "NVLS", "NVLSTree", "PAT")
WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
NCCL_KEYS = ("protocol", "algorithm", "min_ctas", "max_ctas")  # a class's NCCL keys, all `collectives.default` takes
DEFAULT_BUCKET_CAP_MB = 25.0  # DDP's default bucket size, for the planned strategies too


def bucket_cap_mb(cap_mb: float | None) -> float:
    """A bucket cap as given (`sync.bucket_cap_mb`, a class's), DDP's default where null: the one place it is
    resolved."""
    return DEFAULT_BUCKET_CAP_MB if cap_mb is None else cap_mb


@dataclass(frozen=True)
class ClassSettings:
    """One tensor class under `sync.classes.<name>`: which parameters it holds (a rule) and how its buckets travel
    (wire dtype, bucket size, and on NCCL the protocol, algorithm and CTA bounds of its communicator). Every key is
    optional; `dtrain.collectives.tensor_classes` turns these into rules and each class's settings as a bucket
    carries them (the rule's keys left out, `bucket_cap_mb` resolved), and `dtrain.collectives.nccl` reads the NCCL
    keys."""

    match: str | list[str] | None = None  # fnmatch glob(s) of parameter names; needed by a class that is not a default
    min_numel: int | None = None  # the rule matches parameters with at least this many elements
    max_numel: int | None = None  # ... and at most this many
    wire_dtype: str = "fp32"  # fp32, bf16 or fp16: the dtype the gradients travel in
    bucket_cap_mb: float | None = None  # None: sync.bucket_cap_mb
    protocol: str | None = None  # NCCL_PROTOCOLS; None: NCCL (or collectives.default) decides
    algorithm: str | None = None  # NCCL_ALGORITHMS; None: NCCL (or collectives.default) decides
    min_ctas: int | None = None  # the class communicator's ncclConfig_t.minCTAs
    max_ctas: int | None = None  # ... and maxCTAs
    # A tied embedding (one nn.Embedding weight also used as the pre-softmax projection): its gradient goes in two
    # parts, the projection's as soon as backward has it, the rows each lookup touched as its backward ends
    # (dtrain.collectives.tied_split)
    tied_split: bool = False

    @property
    def torch_wire_dtype(self) -> torch.dtype:
        return WIRE_DTYPES[self.wire_dtype]

    @property
    def bucket_cap_bytes(self) -> int:
        return int(bucket_cap_mb(self.bucket_cap_mb) * 1024 * 1024)

    def nccl(self) -> dict:
        """The NCCL choices actually set (for `dtrain.collectives.nccl.class_group`); empty: NCCL decides."""
        return {k: getattr(self, k) for k in NCCL_KEYS if getattr(self, k) is not None}


@dataclass(frozen=True)
class TuneConfig:
    """`sync.tune`: how `sync.strategy: auto` searches (`dtrain.collectives.auto`, through `attach` or in
    dtrain's trainer, `dtrain.engine.autotune`). Budgets count training steps: each measured round runs one step of
    every candidate still in the race (and a lead-in step of each sharding one)."""

    # name -> the candidate's `sync` keys (dotted below `sync`, e.g. {strategy: bucketed, bucket_cap_mb: 0.5,
    # classes.embedding.tied_split: true}); empty: the default space (dtrain.collectives.auto.space.DEFAULT_SPACE)
    candidates: dict[str, dict[str, Any]] = field(default_factory=dict)
    # training steps the search may spend, the probe's included: a tenth of an exhaustive sweep of the default
    # space (18 candidates at 40 steps each)
    budget_steps: int = 72
    # candidates measured: each family's best predicted within 1.3x of the best one, however many, then the best
    # predicted of the rest up to top_k in all (the others are dropped unmeasured)
    top_k: int = 4
    probe_steps: int = 3  # the run's first steps (stock DDP's), timed phase by phase for the prediction
    warmup_rounds: int = 2  # first rounds not counted (DDP rebuilds its buckets after its first step)
    # counted rounds before a candidate may be dropped: from 6 on, the interval of a paired median (the smallest to
    # the largest difference at 6) covers the true one with >= 95% probability
    min_rounds: int = 6
    lossy: bool = False  # also candidates whose averaged gradient is not the exact mean (bf16/fp16 wire, PowerSGD)
    loss_tolerance: float = 0.01  # a lossy candidate is dropped when its loss is this much higher (relative)
    retune_drift: float | None = None  # search again when the median step drifts this much (relative) after a search
    retune_window: int = 20  # steps per median that `retune_drift` compares (the first window is the baseline)


@dataclass(frozen=True)
class SyncConfig:
    # ddp, per_tensor, flat, bucketed, per_class, sharded, fsdp2, powersgd, noop, auto (strategies/)
    strategy: str = "ddp"
    bucket_cap_mb: float | None = None  # None: DDP's default (25 MiB, with a 1 MiB first bucket); 25 for the others
    first_bucket_mb: float | None = None  # ddp, bucketed: cap of the bucket ready first; None: as bucket_cap_mb
    # bucketed, sharded: the last parameters backward completes, as few as hold this many MiB, in a bucket of their
    # own (its communication is exposed: a smaller one is done sooner after backward); None: no such bucket
    last_bucket_mb: float | None = None
    # ddp: a DDP comm hook by name, or a mapping {name, wraps, state} (dtrain.collectives.hooks checks it)
    hook: str | dict[str, Any] | None = None
    classes: dict[str, ClassSettings] = field(default_factory=dict)  # tensor class name -> its rule and settings
    # sharded with a class's tied_split: the tied embedding sharded by rows too, each lookup fetching its rows first
    shard_tied_split: bool = False
    # sharded: the updated parameters that only nn.Linear modules read are all-gathered in this dtype ("bf16"), the
    # dtype the forward's autocast casts them to anyway, and their gradients reduce-scattered in it when a step is one
    # micro-batch (then bf16 holds them exactly); null: in their own. fsdp2: bf16 is its mixed precision (every
    # parameter gathered in bf16, gradients reduced in fp32)
    gather_dtype: str | None = None
    # sharded: when the updated shards' all-gathers start: "step", as the optimizer step ends (`stepped`), so that
    # they run during whatever the loop does before its next forward; "forward", as the next forward starts
    gather_at: str = "step"
    # fsdp2: free a unit's gathered parameters after its forward and gather them again for its backward (FSDP2's
    # default); false: keep them from forward to backward
    reshard_after_forward: bool = True
    # fsdp2 on a CPU device: "stock", FSDP2's own collectives, each waited for on the thread that computes; "async",
    # torch's issued without waiting through FSDP2's hooks; "p2p", `sharded`'s point-to-point exchanges so issued
    # (dtrain.collectives.fsdp2_collectives)
    fsdp2_collectives: str = "stock"
    # bucketed, flat, per_tensor: each bucket reduce-scattered inside the node, its shard all-reduced between the
    # nodes (the ranks of one local index), the sums all-gathered inside the node; a process group per level
    hierarchical: bool = False
    # the ranks of one node, consecutive global ranks (torchrun's layout); null: torchrun's LOCAL_WORLD_SIZE
    ranks_per_node: int | None = None
    powersgd_rank: int = 1  # powersgd: matrix approximation rank
    powersgd_start_iter: int = 2  # powersgd: plain all-reduce before this iteration (error feedback needs >= 2)
    tune: TuneConfig = field(default_factory=TuneConfig)  # auto: how the job searches its configuration

    def __post_init__(self):
        # The strict loader gives ClassSettings; code (tests, the cost model's what-if plans) may give a class as a
        # mapping of the same keys, which goes through the same loader so that a bad key is the same one-line error.
        if not isinstance(self.classes, dict):
            raise UserError(f"'sync.classes' must be a mapping of class names, got {self.classes!r}")
        if not all(isinstance(v, ClassSettings) for v in self.classes.values()):
            src = Source("sync.classes")
            object.__setattr__(self, "classes", {
                name: v if isinstance(v, ClassSettings) else build(ClassSettings, v, f"sync.classes.{name}", src)
                for name, v in self.classes.items()})


@dataclass(frozen=True)
class CollectivesConfig:
    backend: str = "auto"  # auto: nccl when CUDA is present, else gloo
    timeout_s: float = 600.0  # the process group's timeout: a collective waiting longer fails the job
    mode: str = "global"  # global | per_group | tuner
    # NCCL's choices for every communicator (protocol, algorithm, min_ctas, max_ctas only); a class's keys override it
    default: ClassSettings = field(default_factory=ClassSettings)
    parse_log: bool = False  # NCCL_DEBUG=INFO, SUBSYS=ENV,TUNING into a log file, checked against the bucket plan
    validated: bool = False  # the forced settings passed the benchmark's #wrong check on this platform
