"""`powersgd`: DDP with PyTorch's PowerSGD comm hook (low-rank gradient compression with error feedback). Lossy.

Knobs: `sync.powersgd_rank` (the matrix approximation rank), `sync.powersgd_start_iter` (plain all-reduce before it),
and DDP's `sync.bucket_cap_mb` / `sync.first_bucket_mb`.

Checkpointed state (`state_dict`): torch's `PowerSGDState` keys its memory by DDP bucket index, and a bucket index
names different parameters before and after DDP rebuilds its buckets (after the first iteration of every process, so
also right after a resume). The state is therefore saved per parameter name: each rank's error feedback (the part of
its gradient that compression left out, fed into the next step; it differs per rank), the warm-started Q factors (the
same on every rank after their all-reduce), the iteration count and the hook's random generator. The hook below puts
it back under whatever bucket a parameter is in, and moves it again when DDP's layout changes, before torch's hook
reads it. Without warm start or error feedback the corresponding part is simply absent.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

from dtrain.collectives.registry import CLASS_RULE_KEYS, register
from dtrain.collectives.strategies.ddp import DDPSync
from dtrain.common.errors import UserError


class BucketLayout(NamedTuple):
    """Where each parameter's state lies in a bucket's flat memory, as torch's hook lays it out."""

    names: tuple[str, ...]  # the bucket's parameters, in buffer order
    numels: tuple[int, ...]  # their sizes in the (numel,) gradient buffer and error feedback
    q_names: tuple[str, ...]  # the compressed ones, in the order of the Q memory (grouped by matrix shape)
    q_sizes: tuple[int, ...]  # each one's m · rank entries of the Q memory
    p_size: int  # the P memory's length (n · rank summed)


def bucket_layout(bucket, names: dict, state: powerSGD_hook.PowerSGDState) -> BucketLayout:
    """The layout of `bucket` under `state`'s settings, replaying the hook's choices: which tensors it compresses
    (the hook's own `_should_compress` test) and its grouping of their Q factors by matrix shape."""
    params, grads = bucket.parameters(), bucket.gradients()
    by_shape: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
    for p, g in zip(params, grads):
        n, m = g.shape[0], g.numel() // g.shape[0]  # the (n, m) matrix the hook compresses
        rank = min(n, m, state.matrix_approximation_rank)
        if powerSGD_hook._should_compress(n, m, rank, state.min_compression_rate)[0]:
            by_shape.setdefault((n, m), []).append((names[p], m * rank, n * rank))
    compressed = [entry for group in by_shape.values() for entry in group]
    return BucketLayout(tuple(names[p] for p in params), tuple(g.numel() for g in grads),
                        tuple(e[0] for e in compressed), tuple(e[1] for e in compressed),
                        sum(e[2] for e in compressed))


@register("powersgd")
class PowerSGDSync(DDPSync):
    serialize_buckets = True  # each bucket's P and Q all-reduces are chained from callbacks (see DDPSync)
    # DDP's bucket knobs, not its `sync.hook`: PowerSGD is the hook
    sync_keys = ("bucket_cap_mb", "first_bucket_mb", "powersgd_rank", "powersgd_start_iter") + CLASS_RULE_KEYS

    @classmethod
    def schedule(cls, sync, model, world, accum_steps=1, ranks_per_node=None):
        raise UserError("powersgd sends low-rank factors whose sizes torch's hook decides bucket by bucket as it "
                        "runs (which tensors it compresses): it has no schedule to predict")

    def __init__(self, model, cfg, process_group=None, param_groups=None):
        super().__init__(model, cfg, process_group, param_groups)

    def comm_hook(self):
        if not hasattr(self, "_powersgd"):
            # Fixed seed: every rank draws the same initial Q (the hook requires it).
            self._powersgd = powerSGD_hook.PowerSGDState(
                process_group=self.process_group if self.process_group is not None else dist.group.WORLD,
                matrix_approximation_rank=self.cfg.powersgd_rank,
                start_powerSGD_iter=self.cfg.powersgd_start_iter, random_seed=0)
            self._layouts: dict[int, BucketLayout] = {}  # bucket index → layout, as the hook last saw it
            # Per-parameter state not yet placed in a bucket: {"error": {name: (numel,)}, "q": {name: (m·rank,)}}
            self._pending: dict[str, dict[str, torch.Tensor]] = {"error": {}, "q": {}}
        return self._powersgd, self._keyed_hook

    def _keyed_hook(self, state, bucket):
        """torch's hook, after putting this bucket's saved or re-laid-out state under its current index."""
        idx, layout = bucket.index(), bucket_layout(bucket, self.names, state)
        moved = any(i != idx and set(other.names) & set(layout.names) for i, other in self._layouts.items())
        if moved or (idx in self._layouts and self._layouts[idx] != layout):  # DDP rebuilt its buckets
            self._pending = self._per_parameter()
            for memory in (state.error_dict, state.p_memory_dict, state.q_memory_dict):
                memory.clear()
            self._layouts.clear()
        self._layouts[idx] = layout
        self._place(idx, layout, bucket.buffer())
        return powerSGD_hook.powerSGD_hook(state, bucket)

    def _place(self, idx: int, layout: BucketLayout, buffer: torch.Tensor) -> None:
        """Move the pending state of the bucket's parameters into the hook's memory, if it holds all of them."""
        pending, state = self._pending, self._powersgd
        like = {"device": buffer.device, "dtype": buffer.dtype}
        if layout.names and all(n in pending["error"] for n in layout.names):
            state.error_dict[idx] = torch.cat([pending["error"].pop(n).reshape(-1).to(**like) for n in layout.names])
        if layout.q_names and all(n in pending["q"] for n in layout.q_names):
            # The P memory's values are overwritten before they are read; it must only exist (else Q is redrawn).
            state.p_memory_dict[idx] = torch.empty(layout.p_size, **like)
            state.q_memory_dict[idx] = torch.cat([pending["q"].pop(n).reshape(-1).to(**like) for n in layout.q_names])

    def _per_parameter(self) -> dict[str, dict[str, torch.Tensor]]:
        """The hook's memory, keyed by parameter name (plus what is still pending)."""
        state = self._powersgd
        out = {"error": dict(self._pending["error"]), "q": dict(self._pending["q"])}
        for idx, layout in self._layouts.items():
            if idx in state.error_dict:
                out["error"].update(zip(layout.names, state.error_dict[idx].split(list(layout.numels))))
            if idx in state.q_memory_dict and idx in state.p_memory_dict:
                out["q"].update(zip(layout.q_names, state.q_memory_dict[idx].split(list(layout.q_sizes))))
        return out

    def state_dict(self) -> dict:
        state = self._powersgd
        memory = self._per_parameter()
        _, keys, pos, has_gauss, gauss = state.rng.get_state()  # numpy's MT19937 state
        return {"iter": state.iter,
                "error": {n: t.detach().to("cpu", copy=True) for n, t in memory["error"].items()},
                "q": {n: t.detach().to("cpu", copy=True) for n, t in memory["q"].items()},
                "rng": {"keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos), "has_gauss": int(has_gauss),
                        "gauss": float(gauss)}}

    def load_state_dict(self, state: dict, own: bool = True) -> None:
        if not state:
            return
        ps = self._powersgd
        ps.iter = int(state["iter"])  # every rank must agree on it: it decides between all-reduce and compression
        rng = state["rng"]
        ps.rng.set_state(("MT19937", rng["keys"].numpy().astype("uint32"), rng["pos"], rng["has_gauss"],
                          rng["gauss"]))
        # Another rank's error feedback is not this rank's: a rank without its own starts from none.
        self._pending = {"error": dict(state["error"]) if own else {}, "q": dict(state["q"])}
        for memory in (ps.error_dict, ps.p_memory_dict, ps.q_memory_dict):
            memory.clear()
        self._layouts.clear()

    def wire_dtype(self) -> str:
        return "powersgd"

    def stats(self):
        return {**super().stats(), "powersgd_rank": self.cfg.powersgd_rank,
                "powersgd_start_iter": self.cfg.powersgd_start_iter}
