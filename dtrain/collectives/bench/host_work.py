"""`--host-work`: what the host work a strategy adds on the computing thread costs on this machine, as its schedule
names it (`dtrain.collectives.schedule.HostWork`):

- `fsdp2_unit` and `fsdp2_unit_resharded`: what FSDP2 adds to one unit's forward and backward beyond the same module
  unwrapped, with its parameters kept from forward to backward, or freed after forward and gathered again for
  backward: its hooks, its copies into and out of its flat buffers, the swaps between its sharded and gathered
  parameters; per tensor of the unit. Timed on a group of this rank alone, where its all-gathers and
  reduce-scatters move nothing over the network (the collectives are timed apart);
- `cast`: a flat fp32 buffer cast to bf16 and back (a compress hook's compression and decompression);
- `dtensor_step`: what an AdamW step over DTensors sharded on the group costs beyond the same step over their plain
  local shards (FSDP2's optimizer: every tensor operation goes through DTensor's dispatch), per tensor.

Each is timed at the sweep's sizes (the median of its repetitions, averaged over the ranks) and written as rows of
path "host_work" (`work`: which; `size`: the bytes one operation reads, one tensor's for the per-tensor kinds). The cost
model fits each per operation (µs + µs per byte, `FittedModel.host_work_us`), and the step-time predictor charges a
schedule's host work with it.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from dtrain.collectives.bench.measure import Row
from dtrain.collectives.strategies.fsdp2 import fsdp2_api

HOST_WORK = ("cast", "dtensor_step", "fsdp2_unit", "fsdp2_unit_resharded")
REPEATS = 7
TENSORS = 8  # tensors per FSDP2 unit (a few weight matrices and vectors) and per optimizer step


def _median_us(fn, repeats: int = REPEATS) -> float:
    fn()  # warm-up: allocations, dispatch caches
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def _cast_us(nbytes: int) -> float:
    grad = torch.randn(max(1, nbytes // 4))
    return _median_us(lambda: grad.copy_(grad.to(torch.bfloat16)))


def _extra_per_tensor_us(fn, baseline) -> float:
    """What `fn` takes beyond `baseline` (the same work without the wrapping that `fn` adds), per tensor of the
    TENSORS both work on: 0 or more."""
    return max(0.0, _median_us(fn) - _median_us(baseline)) / TENSORS


def _dtensor_step_us(nbytes: int, group) -> float:
    """Per tensor: an AdamW step over TENSORS DTensors sharded on dim 0 over `group`, less the same step over their
    local shards."""
    from torch.distributed.tensor import Shard  # DTensor (its import costs about 0.8 s): only when asked

    api = fsdp2_api()
    mesh = api.DeviceMesh.from_group(group, "cpu")
    rows = max(dist.get_world_size(group), nbytes // 4 // TENSORS // 64)
    whole = [torch.randn(rows, 64) for _ in range(TENSORS)]
    sharded = [torch.nn.Parameter(api.distribute_tensor(t, mesh, [Shard(0)])) for t in whole]
    local = [torch.nn.Parameter(p.to_local().clone()) for p in sharded]
    for p in sharded + local:
        p.grad = torch.full_like(p, 1e-3)  # not randn_like: DTensor's random ops warn on a CPU mesh
    return _extra_per_tensor_us(torch.optim.AdamW(sharded, lr=1e-4).step, torch.optim.AdamW(local, lr=1e-4).step)


def _fsdp2_unit_us(nbytes: int, alone, reshard: bool) -> float:
    """Per tensor: a unit of 4 Linear(d, d) layers (TENSORS tensors, `nbytes` in all) on 8 rows, so that its compute
    is small beside FSDP2's work: one forward and backward under `fully_shard` on the one-rank group `alone`, less
    the same on the plain module."""
    api = fsdp2_api()
    d = max(1, int((nbytes / 4 / 4) ** 0.5))
    plain, wrapped = (torch.nn.Sequential(*(torch.nn.Linear(d, d) for _ in range(4))) for _ in range(2))
    api.fully_shard(wrapped, mesh=api.DeviceMesh.from_group(alone, "cpu"), reshard_after_forward=reshard)
    x = torch.randn(8, d)

    def step(module):
        module(x).sum().backward()
        module.zero_grad(set_to_none=True)

    return _extra_per_tensor_us(lambda: step(wrapped), lambda: step(plain))


def measure_host_work(sizes: list[int], group, nranks: int, device, emit) -> list[Row]:
    """One row per kind of host work and size: its median time (µs), mean over ranks (`group`: None, the world)."""
    group = group if group is not None else dist.group.WORLD
    alone = dist.new_group([dist.get_rank()], use_local_synchronization=True)  # FSDP2's units with no network
    emit(f"# host work on the computing thread ({', '.join(HOST_WORK)}): median of {REPEATS} each, per operation")
    emit(f"#  {'work':>20}  {'size (B)':>10}  {'time (us)':>10}")
    measure = {"cast": _cast_us, "dtensor_step": lambda n: _dtensor_step_us(n, group),
               "fsdp2_unit": lambda n: _fsdp2_unit_us(n, alone, False),
               "fsdp2_unit_resharded": lambda n: _fsdp2_unit_us(n, alone, True)}
    rows = []
    for work in HOST_WORK:
        for nbytes in sizes:
            us = measure[work](nbytes)
            size = nbytes if work == "cast" else nbytes // TENSORS  # the others per tensor, each of nbytes / TENSORS
            mean = torch.tensor([us], dtype=torch.float64)
            dist.all_reduce(mean, group=group)
            us = float(mean) / nranks
            rows.append(Row("host_work", size, 1, "float", "none", round(us, 3), 0.0, 0.0, None,
                            median_us=round(us, 3), work=work))
            emit(f"#  {work:>20}  {size:>10}  {us:10.1f}", flush=True)
    emit("#")
    return rows
