"""`fsdp2`: stock PyTorch FSDP2 (`torch.distributed.fsdp.fully_shard`), the sharded baseline a user reaches for first.

Each block of the model's layer stacks is one FSDP unit, and the root holds the rest (`units`): for the paper's
Transformer, every encoder and decoder layer, and a root with the tied embedding (FSDP2 keeps a parameter shared by
several modules in the one unit that holds them all). In a unit's backward its gradients are reduce-scattered; each
rank updates its shard (the parameters are DTensors sharded on dim 0, and the optimizer runs over them); the next
forward all-gathers each unit just before it runs. `sync.reshard_after_forward` frees a unit's gathered parameters
after its forward and gathers them again for its backward (FSDP2's default, the ZeRO-3 layout; false keeps them from
forward to backward, ZeRO-2's); the root keeps them either way, as FSDP2 does by default. `sync.gather_dtype: bf16`
(under bf16 autocast) is FSDP2's mixed precision, `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`: every
parameter gathered and computed with in bf16, the gradients reduced in fp32. Unlike `sharded`'s it rounds the
parameters that autocast would keep in fp32 too (layer norms, the embedding): a different forward, not a lossless
exchange.

FSDP2 overlaps its collectives with computation through CUDA streams. On a CPU device it issues each one on the
thread that computes and waits for it there: on gloo its communication overlaps nothing. `sync.fsdp2_collectives`
(`dtrain.collectives.fsdp2_collectives`; CPU only) gives FSDP2 collectives that do not wait, through its own public
hooks: `async`, torch's own; `p2p`, the point-to-point exchanges `sharded` runs. Every unit's all-gather is then
issued as the optimizer step ends (`stepped`, `unshard(async_op=True)`; else as the next forward starts), root first,
and FSDP2 waits for each as the unit is about to run (with `reshard_after_forward`, FSDP2's own backward prefetch
issues each unit's gather again as the unit after it starts its backward); each reduce-scatter is left in flight, to
be waited for by `wait()` after backward.

With `sync.classes.<class>.tied_split` (CPU only) the tied embedding stays outside FSDP2 (`ignored_params`), whole on
every rank, and is reduced as `bucketed` reduces it with the split (`dtrain.collectives.tied_split`): its projection
part all-reduced as soon as backward completes it, each lookup's rows as that lookup's backward ends; every rank
updates the whole matrix. The loop's optimizer then holds FSDP2's DTensors and that plain tensor.

Through the seam: the loop's optimizer is built over the model's own (sharded) parameters; `grad_norm` all-reduces the
shards' sums of squares; `no_sync` is FSDP2's `set_requires_gradient_sync(False)`; checkpoints hold the whole model and
the optimizer state as if one rank had updated it (`torch.distributed.checkpoint.state_dict` for the model), so they
resume under any strategy and world size. Stock FSDP2 waits for its reduce-scatters at the end of backward itself:
its communication not hidden by backward shows in backward time, as DDP's does, and `wait()` has nothing left to do
(with `fsdp2_collectives`, `wait()` waits for them).
"""

from __future__ import annotations

import dataclasses
import re
from contextlib import contextmanager
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn

from dtrain.collectives.fsdp2_collectives import MODES as FSDP2_COLLECTIVES
from dtrain.collectives.fsdp2_collectives import AsyncAllGather, Exchanges, ReduceScatters
from dtrain.collectives.plan import BucketingStrategy, pack, ready_order
from dtrain.collectives.registry import register
from dtrain.collectives.schedule import (ALL_GATHER, ALL_REDUCE, BACKWARD, FORWARD, FORWARD_START, GRADIENT,
                                         IN_BACKWARD, LOOKUP_GROUP, P2P, PREFETCH, PROJECTION, REDUCE_SCATTER, STEP,
                                         TORCH, WAIT, Collective, HostWork, Schedule, lookup_rows)
from dtrain.collectives.sync import GradSync, total_norm
from dtrain.collectives.settings import WIRE_DTYPES, ClassSettings
from dtrain.collectives.tensor_classes import from_config
from dtrain.collectives.timeline import through
from dtrain.collectives.tied_split import TiedEmbeddingSplit, split_params
from dtrain.common.errors import UserError
from dtrain.common.torch_version import require_torch

_BLOCK = re.compile(r"^((?:[^.]+\.)*?\d+)\.")  # a parameter's path up to its first numbered module: "decoder.3."


def unit_of(name: str) -> str:
    """The FSDP unit of parameter `name`: the first numbered module on its path (a child of a layer stack, an
    `nn.ModuleList` or `nn.Sequential`: "encoder.0.self_attn.W_Q.weight" -> "encoder.0"), or "" for the root."""
    m = _BLOCK.match(name)
    return m.group(1) if m else ""


def units(model: nn.Module) -> list[nn.Module]:
    """The modules `fully_shard` wraps before the root: each numbered child on a parameter's path (`unit_of`), once."""
    names = dict.fromkeys(unit_of(n) for n, _ in model.named_parameters())
    return [model.get_submodule(n) for n in names if n]


def fsdp2_api() -> SimpleNamespace:
    """FSDP2, DTensor and torch's distributed state-dict helpers. Imported when an fsdp2 handle is built, not with
    this module: they take about 0.8 s to import (sympy, DTensor's operator tables), and every dtrain process imports
    the strategy registry, this module included."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor, distribute_tensor

    return SimpleNamespace(
        DeviceMesh=DeviceMesh, MixedPrecisionPolicy=MixedPrecisionPolicy, fully_shard=fully_shard, DTensor=DTensor, distribute_tensor=distribute_tensor,
        get_model_state_dict=get_model_state_dict, set_model_state_dict=set_model_state_dict,
        whole=StateDictOptions(full_state_dict=True))  # every rank gets (and gives) the whole model's tensors


class Fsdp2Units(BucketingStrategy):
    """FSDP2's communication as a bucket plan, for the cost model and the simulator (never executed: FSDP2 runs itself):
    one bucket per unit, reduce-scattered when its last gradient is ready, the root's last (its post-backward runs
    when backward ends). A split tied embedding (`tied_split`), outside FSDP2, is a bucket of its own, first."""

    name = "fsdp2"
    shards = True
    overlap = True

    def plan(self, named_params, classes, settings):
        fp32 = ClassSettings(bucket_cap_mb=2.0**30)  # 1 PiB: a unit's bucket never closes early
        split = [(n, p) for n, p in named_params if settings[classes[n]].tied_split]
        rest = [(n, p) for n, p in named_params if not settings[classes[n]].tied_split]
        whole = pack(split, classes, key=lambda n, p: n, settings_of=lambda k: fp32)
        blocks = pack([(n, p) for n, p in rest if unit_of(n)], classes, key=lambda n, p: unit_of(n),
                      settings_of=lambda k: fp32)
        root = pack([(n, p) for n, p in rest if not unit_of(n)], classes, key=lambda n, p: "",
                    settings_of=lambda k: fp32)
        return [dataclasses.replace(b, index=i) for i, b in enumerate(whole + blocks + root)]


@register("fsdp2")
class Fsdp2Sync(GradSync):
    sync_keys = ("reshard_after_forward", "gather_dtype", "fsdp2_collectives", "classes.tied_split")
    shards = True
    switchable = False

    @classmethod
    def problems(cls, sync) -> list[tuple[str, str]]:
        if sync.fsdp2_collectives not in FSDP2_COLLECTIVES:
            return [("sync.fsdp2_collectives",
                     f"must be one of {', '.join(FSDP2_COLLECTIVES)}, got '{sync.fsdp2_collectives}'")]
        return []

    @classmethod
    def schedule(cls, sync, model, world, accum_steps=1, ranks_per_node=None) -> Schedule:
        """Per unit (`Fsdp2Units`' buckets): its reduce-scatter when its last gradient is ready, waited for by `wait()`;
        its all-gather (in `gather_dtype`, FSDP2's mixed precision: not the exact parameters) issued as the next
        forward starts (with `fsdp2_collectives`: at the optimizer step, `stepped`) and, with
        `reshard_after_forward`, again as the unit after it starts its backward (FSDP2's prefetch), but for the root
        (the last), which keeps its parameters. Stock FSDP2 waits for each on the computing thread where the device
        has no streams (`blocking`); `fsdp2_collectives: p2p` moves them point to point. FSDP2's work for each unit
        on the computing thread (its hooks, and its copies into and out of the flat buffers of its all-gathers and
        reduce-scatter) and its optimizer over DTensors are host work. A split tied embedding, outside FSDP2, is
        all-reduced as the split does it: its projection part and each lookup's rows, on the split's group."""
        named = ready_order(model)
        classes = from_config(sync)
        class_of = classes.assign(named)
        settings = classes.used(class_of)
        plan = Fsdp2Units().plan(named, class_of, settings)
        split = set(split_params(class_of, settings))
        stock = sync.fsdp2_collectives == "stock"
        path = P2P if sync.fsdp2_collectives == "p2p" else TORCH
        low = WIRE_DTYPES[sync.gather_dtype].itemsize if sync.gather_dtype else None
        colls, units, host = [], [], []
        for b, after in zip(plan, through(plan, named)):
            if split & set(b.names):
                colls.append(Collective(ALL_REDUCE, b.nbytes, "fp32", b.index, PROJECTION, WAIT, True, LOOKUP_GROUP))
                continue
            units.append((b, after))
            colls.append(Collective(REDUCE_SCATTER, b.nbytes, "fp32", b.index, GRADIENT, IN_BACKWARD if stock else WAIT,
                                    True, None, after, path, blocking=stock))
            # FSDP2's own work for the unit: its hooks; its shard into the all-gather's input and the gathered
            # parameters out (again for backward where resharded after forward: not the root); its gradients into
            # the reduce-scatter's input and the reduced shard out
            resharded = sync.reshard_after_forward and unit_of(b.names[0])
            host.append(HostWork("fsdp2_unit_resharded" if resharded else "fsdp2_unit", b.nbytes,
                                 "forward and backward", len(b.names)))
        gather = [Collective(ALL_GATHER, b.numel * low if low else b.nbytes, sync.gather_dtype or "fp32", b.index,
                             FORWARD_START if stock else STEP, FORWARD, low is None, None, 0, path, blocking=stock)
                  for b, _ in units]
        if sync.reshard_after_forward:  # unit i gathered again as unit i - 1 starts its backward (unit i - 2 ends it)
            ends = [0, 0] + [after for _, after in units]
            gather += [dataclasses.replace(g, ready=PREFETCH, waits=BACKWARD, after=ends[i])
                       for i, g in enumerate(gather[:-1])]
        sharded = sum(b.numel for b, _ in units)
        params = [n for b, _ in units for n in b.names]  # the optimizer steps each as a DTensor
        host.append(HostWork("dtensor_step", 4 * sharded, "optimizer", len(params)))
        return Schedule(cls.name, tuple(plan), tuple(colls + gather + ([lookup_rows(ALL_REDUCE)] if split else [])),
                        world, updated=1 - (1 - 1 / world) * sharded / (sum(b.numel for b in plan) or 1),
                        host=tuple(host), split=bool(split),
                        label=("+split" if split else "") + (f"+{sync.gather_dtype}" if sync.gather_dtype else "")
                        + ("" if sync.reshard_after_forward else "+keep") + ("" if stock else f"+{sync.fsdp2_collectives}"))

    def __init__(self, model: nn.Module, cfg, process_group: dist.ProcessGroup | None = None, param_groups=None):
        super().__init__(model, cfg, process_group, param_groups)
        name_of = {id(p): n for n, p in model.named_parameters()}
        group_names = [[name_of[id(p)] for p in g] for g in self.groups]  # `fully_shard` replaces the Parameters
        self.api = api = fsdp2_api()
        device = next(model.parameters()).device
        group = process_group if process_group is not None else dist.group.WORLD
        mesh = api.DeviceMesh.from_group(group, device.type)
        policy = api.MixedPrecisionPolicy()
        if cfg.gather_dtype == "bf16":
            policy = api.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if cfg.fsdp2_collectives != "stock":
            require_torch("2.9", "sync.fsdp2_collectives")
        if cfg.fsdp2_collectives != "stock" and device.type != "cpu":
            raise UserError(f"'sync.fsdp2_collectives: {cfg.fsdp2_collectives}' is for a CPU device: on "
                            f"{device.type} FSDP2 overlaps its collectives through its own streams")
        self.units = units(model)
        named = dict(model.named_parameters())
        classes = from_config(cfg)
        class_of = classes.assign(named.items())
        split = split_params(class_of, classes.used(class_of))  # FSDP2 leaves these whole; the split reduces them
        if split and device.type != "cpu":
            raise UserError(f"'tied_split' under fsdp2 is for a CPU device: on {device.type} torch's foreach "
                            "optimizers would get DTensors and the whole embedding in one list (not tested there)")
        for unit in self.units:
            api.fully_shard(unit, mesh=mesh, reshard_after_forward=cfg.reshard_after_forward, mp_policy=policy)
        # The root never reshards after forward (FSDP2's own rule when not told: backward needs it at once).
        api.fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=policy,
                        ignored_params={named[n] for n in split})
        self.world = dist.get_world_size(process_group)
        self._sync = True  # not inside `no_sync`
        self._armed = True  # this micro-batch's backward synchronizes (set at its forward, as DDP reads no_sync)
        self.splits = [TiedEmbeddingSplit(model, n, process_group, self.world, lambda: self._armed) for n in split]
        self._projections: list = []  # the splits' projection parts' all-reduces in flight: (split, work)
        for s in self.splits:
            s.param.register_post_accumulate_grad_hook(self._projection_ready(s))
        named = dict(model.named_parameters())  # FSDP2's DTensors (and a split matrix, whole), under the same names
        self.groups = [[named[n] for n in g] for g in group_names]
        whole = {id(s.param) for s in self.splits}
        self._sharded = [p for p in model.parameters() if id(p) not in whole]  # FSDP2's DTensors
        # FSDP2's collectives where they are not its own (`sync.fsdp2_collectives`); None: stock
        self.collectives: ReduceScatters | Exchanges | None = None
        if cfg.fsdp2_collectives == "async":
            self.collectives = ReduceScatters()
            gather, scatter = AsyncAllGather(), self.collectives
        elif cfg.fsdp2_collectives == "p2p":
            ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
            self.collectives = Exchanges(dist.new_group(ranks))  # its point-to-point traffic, apart from FSDP2's
            gather, scatter = self.collectives.gather, self.collectives.scatter
        if self.collectives is not None:
            for m in (*self.units, model):
                m.set_custom_all_gather(gather)
                m.set_custom_reduce_scatter(scatter)
        self._gathered = False  # `wait_params` left every unit's parameters gathered
        self._ahead = False  # with `fsdp2_collectives`: this step's all-gathers are issued
        model.register_forward_pre_hook(self._before_forward, prepend=True)

    @contextmanager
    def no_sync(self):
        self.model.set_requires_gradient_sync(False)
        self._sync = False
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)
            self._sync = True

    def _projection_ready(self, split: TiedEmbeddingSplit):
        """A split matrix's `.grad`, complete as soon as the projection's gradient is in it (the lookups' go apart in
        a synchronized backward): its sum over the ranks started, on the split's own group."""
        def hook(param: torch.Tensor) -> None:
            if self._armed and split.masks:
                self._projections.append((split, dist.all_reduce(param.grad, group=split.group, async_op=True)))
        return hook

    def wait(self) -> None:
        """With `fsdp2_collectives`, the reduce-scatters left in flight (stock FSDP2 waited for each in backward);
        with the split, the embedding's mean: its projection part's, then its looked-up rows'."""
        if self.collectives is not None:
            self.collectives.wait()
            self._ahead = False
        for split, work in self._projections:  # the projection part's mean, then the looked-up rows' own
            work.wait()
            split.param.grad.div_(self.world)
            split.finish()
        self._projections = []

    def close(self) -> None:
        """With `p2p`, the exchanges' thread ended and their group destroyed; the splits' hooks and groups too."""
        if isinstance(self.collectives, Exchanges):
            self.collectives.close()
            dist.destroy_process_group(self.collectives.group)
        self.collectives = None
        for split in self.splits:
            split.close()
        self.splits = []

    def stepped(self, optimizer: torch.optim.Optimizer | None = None, loss: float | None = None) -> None:
        """With `fsdp2_collectives`, every unit's updated shards all-gathered from now, in the order the forward
        needs them (the root holds the embedding, which the forward reads first). An optimizer built over the
        parameters `fully_shard` replaced is an error here, at the first step: it would update nothing."""
        self.check_optimizer_once(optimizer)
        if self.collectives is not None:
            self._gather_ahead()

    def _gather_ahead(self) -> None:
        """Every unit's all-gather issued, root first, unless this step's are already (FSDP2's own pre-forward
        waits for each, and does not issue it again)."""
        if not self._ahead:
            for m in (self.model, *self.units):
                m.unshard(async_op=True)
            self._ahead = True

    def grad_norm(self, exact: bool = False) -> torch.Tensor:
        """Each rank's shards' sums of squares, all-reduced (float64 with `exact`)."""
        local = [p.grad.to_local() for p in self._sharded if p.grad is not None]
        # a split matrix's gradient is the same on every rank: its squares counted once, on rank 0
        if dist.get_rank(self.process_group) == 0:
            local += [s.param.grad for s in self.splits if s.param.grad is not None]
        return total_norm(local, exact=exact, group=self.process_group, sharded=True)

    def wait_params(self) -> None:
        """Every unit's parameters gathered and kept so until the next forward with gradients: any method of the
        model then runs without a collective (decoding calls `encode` and `decode_step`, not `forward`, and ranks
        decode different numbers of batches; so do they in validation)."""
        for m in (*self.units, self.model):
            m.unshard()
        for unit in self.units:
            unit.set_reshard_after_forward(False, recurse=False)
        self._gathered = True

    def _drop_gathered(self) -> None:
        """The copies `wait_params` gathered dropped, each unit back to its own reshard setting."""
        if self._gathered:
            for unit in self.units:
                unit.set_reshard_after_forward(self.cfg.reshard_after_forward, recurse=False)
            for m in (*self.units, self.model):
                m.reshard()
            self._gathered = False
            self._ahead = False  # what was gathered ahead went with them

    def _before_forward(self, module, args) -> None:
        """A forward with gradients (training) gathers what the optimizer has updated since `wait_params`
        (FSDP2's own pre-forward keeps what is already gathered); one without (validation) reads the copies."""
        if torch.is_grad_enabled():
            if self.collectives is not None and any(p.grad is not None for p in self._sharded):
                raise UserError(f"'sync.fsdp2_collectives: {self.cfg.fsdp2_collectives}' needs the gradients "
                                "dropped after each update (optimizer.zero_grad(set_to_none=True)): FSDP2 would add a "
                                "reduce-scatter still in flight to them")
            self._drop_gathered()
            if self.collectives is not None:  # where `stepped` did not (a loop taking turns with others), now
                self._gather_ahead()
            self._armed = self._sync
            if self._armed:
                for split in self.splits:
                    split.prepare()

    def model_state(self) -> dict:
        return self.api.get_model_state_dict(self.model, options=self.api.whole)

    def load_model_state(self, state: dict) -> None:
        self._drop_gathered()
        self.api.set_model_state_dict(self.model, state, options=self.api.whole)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        """The optimizer's state dict with each DTensor state (Adam's moments) gathered whole: the form a DDP run's
        optimizer writes (a collective: every rank calls it)."""
        sd = optimizer.state_dict()
        state = {i: {k: v.full_tensor() if isinstance(v, self.api.DTensor) else v for k, v in s.items()}
                 for i, s in sd["state"].items()}
        return {**sd, "state": state}

    def local_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> dict:
        """A whole-model state dict (any strategy's, any world size): each whole tensor cut to this rank's shard
        of the parameter it belongs to."""
        params = [p for g in optimizer.param_groups for p in g["params"]]
        ids = [i for g in state["param_groups"] for i in g["params"]]
        if len(ids) != len(params):
            raise UserError(f"the checkpoint's optimizer state has {len(ids)} parameters, this model {len(params)}")
        by_id = dict(zip(ids, params))
        shards = {}
        for i, s in state["state"].items():
            p = by_id[i]
            if not isinstance(p, self.api.DTensor):  # a split matrix, whole on every rank
                shards[i] = s
                continue
            shards[i] = {k: self.api.distribute_tensor(v.to(p.device), p.device_mesh, p.placements, src_data_rank=None)
                         if isinstance(v, torch.Tensor) and v.shape == p.shape else v for k, v in s.items()}
        return {**state, "state": shards}

    def stats(self) -> dict:
        return {**super().stats(), "units": len(self.units) + 1,
                "reshard_after_forward": self.cfg.reshard_after_forward,
                "collectives": self.cfg.fsdp2_collectives, "split": [s.name for s in self.splits],
                "param_dtype": "bf16" if self.cfg.gather_dtype == "bf16" else "fp32"}
