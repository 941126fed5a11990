"""`ddp`: stock `DistributedDataParallel`, optionally with a comm hook; the baseline for every comparison.

Knobs: `sync.bucket_cap_mb`, `sync.first_bucket_mb` (DDP's `bucket_cap_mb_list=[first, cap]`), `sync.hook`: any of
torch's hooks by short or dotted name, with its state and the hook a wrapper wraps, or the project's `per_class` hook
(`dtrain.collectives.hooks`; with it, `sync.classes.<class>` wire dtypes and NCCL settings).
Records: without a hook DDP's C++ reducer runs untouched and only the bucket sizes are known; with a hook each bucket
is timed from the hook (ready = launch, complete = the hook's future).
"""

from __future__ import annotations

import dataclasses
import inspect

import torch
from torch.nn.parallel import DistributedDataParallel

from dtrain.collectives import hooks
from dtrain.collectives import tensor_classes as tc
from dtrain.collectives.registry import CLASS_RULE_KEYS, register
from dtrain.collectives.schedule import IN_BACKWARD, HostWork, Schedule
from dtrain.collectives.settings import bucket_cap_mb
from dtrain.collectives.strategies.bucketed import Bucketed
from dtrain.collectives.sync import GradSync
from dtrain.collectives.timing import Stamp, record_ms, stamp
from dtrain.common.errors import UserError
from dtrain.common.rundir import BucketRecord
from dtrain.common.torch_version import require_torch


@register("ddp")
class DDPSync(GradSync):
    """DDP overlaps bucketed all-reduces with backward and waits for them inside `backward()` itself, so its exposed
    communication shows up in backward time, not in `wait()`."""

    # A hook that chains several collectives per bucket issues the later ones from the backend's callback threads;
    # with more than one bucket in flight their order then differs between ranks (gloo aborts on the mismatch).
    # Such hooks run one bucket at a time: a bucket's hook first waits for the previous bucket's future.
    serialize_buckets = False
    uses_cap = True
    sync_keys = ("bucket_cap_mb", "first_bucket_mb", "hook") + CLASS_RULE_KEYS

    def __init__(self, model, cfg, process_group=None, param_groups=None):
        super().__init__(model, cfg, process_group, param_groups)
        device_ids = None
        if next(model.parameters()).is_cuda:
            device_ids = [torch.cuda.current_device()]
        # The model's only buffer (the positional table) is a constant: never broadcast it with each forward.
        # torch >= 2.13 names that switch `forward_sync_buffers`, earlier releases `broadcast_buffers`.
        params = inspect.signature(DistributedDataParallel.__init__).parameters
        no_buffer_sync = {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {
            "broadcast_buffers": False}
        caps = {"bucket_cap_mb": cfg.bucket_cap_mb}
        if cfg.first_bucket_mb is not None:
            require_torch("2.11", "sync.first_bucket_mb")
            # A per-bucket cap list (torch >= 2.11): the first bucket gets its own size, the rest the last entry.
            caps = {"bucket_cap_mb_list": [cfg.first_bucket_mb, bucket_cap_mb(cfg.bucket_cap_mb)]}
        self.module = DistributedDataParallel(
            model, device_ids=device_ids, process_group=process_group, **caps, **no_buffer_sync,
        )
        self.names = {p: n for n, p in model.named_parameters()}
        self.class_of = tc.from_config(cfg).assign(model.named_parameters())
        self._records: list[BucketRecord] = []  # the last synchronized step's, drained by `step_records`
        self._timing: list[tuple[BucketRecord, list]] = []  # with a hook: (record, [ready, launch, complete] stamps)
        self._backward_t: Stamp | None = None
        self.device = next(model.parameters()).device
        self._layout: list[dict] | None = None  # built-in all-reduce: DDP's buckets, from its logging data
        self._layout_final = False
        self._inflight = None  # the previous bucket's future, for serialize_buckets
        # The output's gradient is among the first computed: its hook marks the start of the backward.
        self._forward_hook = self.module.register_forward_hook(self._mark_backward_start)
        self.hook = hooks.resolve(cfg.hook)  # None: DDP's built-in all-reduce
        if self.hook is not None and not self.hook.one_collective:
            self.serialize_buckets = True
        self._registered = self.comm_hook()  # (state, hook) or None
        if self._registered is not None:
            state, fn = self._registered
            self.module.register_comm_hook(state, self._timed(fn))

    @classmethod
    def schedule(cls, sync, model, world, accum_steps=1, ranks_per_node=None) -> Schedule:
        """Bucketed's buckets, as DDP's rebuilt reducer lays them out from the same two knobs, each all-reduced as
        its last gradient is ready; through a comm hook, what the hook sends: a compress hook its bucket cast to
        16 bits (and the cast on the computing thread), the per_class hook each class's part of a bucket on that
        class's group in its wire dtype. A hook whose collectives torch decides at run time has none."""
        # DDP reads neither the split nor the hierarchical plan (`sync_keys`): a profile's classes may still set them
        sync = dataclasses.replace(sync, hierarchical=False, classes={
            c: dataclasses.replace(s, tied_split=False) for c, s in sync.classes.items()})
        plain = Bucketed.schedule(sync, model, world, accum_steps, ranks_per_node)
        plain = dataclasses.replace(plain, collectives=tuple(  # DDP waits for them inside backward()
            dataclasses.replace(c, waits=IN_BACKWARD) for c in plain.collectives))
        hook = hooks.resolve(sync.hook)
        if hook is None or hook.wire == "fp32" and not hook.per_class:
            return dataclasses.replace(plain, strategy=cls.name)
        colls, host = [], []
        if hook.per_class:
            classes = tc.from_config(sync)
            class_of = classes.assign(model.named_parameters())
            sizes = {n: p.numel() for n, p in model.named_parameters()}
            for c, b in zip(plain.collectives, plain.buckets):
                for name in dict.fromkeys(class_of[n] for n in b.names):  # the hook's spans, by class
                    wire = classes.setting(name).wire_dtype
                    numel = sum(sizes[n] for n in b.names if class_of[n] == name)
                    colls.append(dataclasses.replace(c, nbytes=numel * tc.WIRE_DTYPES[wire].itemsize, dtype=wire,
                                                     exact=wire == "fp32", group=name))
        elif hook.wire in ("bf16", "fp16") and hook.one_collective:
            for c, b in zip(plain.collectives, plain.buckets):
                colls.append(dataclasses.replace(c, nbytes=b.numel * 2, dtype=hook.wire, exact=False))
                host.append(HostWork("cast", b.nbytes, "backward"))  # to 16 bits and back: the hook's copies
        else:
            raise UserError(f"sync.hook '{hook.label}': what it sends is decided inside torch's hook as it runs "
                            "(no schedule to predict)")
        return dataclasses.replace(plain, strategy=cls.name, collectives=tuple(colls), host=tuple(host),
                                   class_groups=hook.per_class, label=f"+{hook.label}")

    def comm_hook(self):
        """(state, hook) to register on DDP, or None for DDP's built-in all-reduce. Builds the hook's state (and
        the per-class groups): called once."""
        if self.hook is None:
            return None
        return hooks.build_state(self.hook, self.model, self.cfg, self.process_group), self.hook.fn

    def wire_dtype(self) -> str:
        return "fp32" if self.hook is None else self.hook.wire

    def _bucket_wire(self, classes: set[str]) -> str:
        """What a bucket of `classes` travels as: with the per-class hook its classes' wire dtype (or mixed)."""
        if self.hook is not None and self.hook.per_class:
            wires = {self._registered[0].settings[c].wire_dtype for c in classes}
            return wires.pop() if len(wires) == 1 else "mixed"
        return self.wire_dtype()

    def _mark_backward_start(self, module, inputs, out):
        if torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda grad: setattr(self, "_backward_t", stamp(self.device)))

    def _timed(self, hook):
        """Wrap a comm hook so that each bucket leaves a record (the hook itself runs unchanged)."""

        def timed(state, bucket):  # no annotations: DDP checks them, and they would be strings here
            t = stamp(self.device)
            if self.serialize_buckets and self._inflight is not None:
                self._inflight.wait()
            t_launch = stamp(self.device)
            names = [self.names[p] for p in bucket.parameters()]
            classes = {self.class_of[n] for n in names}
            buffer = bucket.buffer()  # (numel,) the flat bucket DDP copied the gradients into
            rec = BucketRecord(bucket.index(), next(iter(classes)) if len(classes) == 1 else "mixed",
                               dtype=str(buffer.dtype)[6:], wire_dtype=self._bucket_wire(classes),
                               tensors=len(names), numel=buffer.numel(),
                               nbytes=buffer.numel() * buffer.element_size())
            stamps = [t, t_launch, None]
            self._timing.append((rec, stamps))

            def done(fut):
                stamps[2] = stamp(self.device)  # on CUDA: on the stream synchronized with the collective
                return fut.value()

            fut = hook(state, bucket)
            if self.serialize_buckets:
                self._inflight = fut
            return fut.then(done)

        return timed

    def close(self) -> None:
        """DDP's reducer (its buckets, its hooks on the parameters' gradient accumulators) goes with the DDP module:
        the forward hook, which holds this handle, is removed and the module dropped, so that nothing else keeps it
        (a past step's autograd graph may still hold the hook's closure, and with it this handle)."""
        self._forward_hook.remove()
        self.module = None

    def no_sync(self):
        return self.module.no_sync()

    def wait(self) -> None:
        # DDP has already waited inside backward; what is left is turning the timestamps into a record.
        if self._registered is None:
            self._records = self._size_records()
            return
        t0 = self._backward_t

        def ms(t):
            return record_ms(t0, t)

        for rec, (ready, launch, complete) in self._timing:
            rec.ready_ms, rec.launch_ms, rec.complete_ms = ms(ready), ms(launch), ms(complete)
        self._records = sorted((rec for rec, _ in self._timing), key=lambda r: r.bucket)
        self._timing = []

    def _size_records(self) -> list[BucketRecord]:
        """Built-in all-reduce: the bucket layout from DDP's logging data, once DDP has rebuilt its buckets in the
        order of the first backward (logged from step 3 on; before that: its initial layout, sizes only)."""
        if self._layout is None or not self._layout_final:
            data = self.module._get_ddp_logging_data()
            sizes = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes", "")
            members = data.get("rebuilt_per_bucket_param_indices")
            self._layout_final = members is not None
            names = [n for n, p in self.model.named_parameters() if p.requires_grad]  # DDP's parameter indices
            self._layout = []
            for i, nbytes in enumerate(int(v) for v in str(sizes).split(",") if v.strip()):
                entry = {"bytes": nbytes, "tensors": None, "class": "mixed"}
                if members is not None:
                    idx = [int(v) for v in str(members).split(",")[i].split()]
                    classes = {self.class_of[names[j]] for j in idx}
                    entry.update(tensors=len(idx), **{"class": classes.pop() if len(classes) == 1 else "mixed"})
                self._layout.append(entry)
        return [BucketRecord(i, e["class"], dtype="float32", wire_dtype="fp32", tensors=e["tensors"],
                             numel=e["bytes"] // 4, nbytes=e["bytes"]) for i, e in enumerate(self._layout)]

    def step_records(self) -> list[BucketRecord]:
        records, self._records = self._records, []
        return records

    def stats(self):
        return {**super().stats(), "bucket_cap_mb": self.cfg.bucket_cap_mb,
                "first_bucket_mb": self.cfg.first_bucket_mb, "hook": self.cfg.hook}
