"""Process-group set-up under torchrun (or a single process without it), backend choice, rank helpers, and ranks
spawned on one machine (`spawn`)."""

from __future__ import annotations

import datetime
import gc
import multiprocessing
import os
import pickle
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing

from dtrain.collectives.settings import CollectivesConfig
from dtrain.common.errors import UserError

# One tensor per rank in, one tensor out: torch 2.13 names these `all_gather_single` and `reduce_scatter_single` and
# deprecates the older `all_gather_into_tensor` and `reduce_scatter_tensor` (a FutureWarning on every call); the
# releases before it have only the older names. Same arguments, `async_op` included.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def env_rank() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from torchrun's environment; (0, 0, 1) outside torchrun."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def choose_backend(cfg: CollectivesConfig) -> str:
    if cfg.backend != "auto":
        return cfg.backend
    return "nccl" if torch.cuda.is_available() else "gloo"


def device_for(cfg: CollectivesConfig) -> torch.device:
    """This rank's device under `cfg`: its GPU (torchrun's LOCAL_RANK) where the backend is NCCL, else the CPU."""
    return torch.device("cuda", env_rank()[1]) if choose_backend(cfg) == "nccl" else torch.device("cpu")


def init(cfg: CollectivesConfig) -> tuple[torch.device, str]:
    """Join the job's default process group; returns this rank's device and the backend.

    With NCCL the device is bound at init (`device_id`), so later `new_group` calls create their communicators
    eagerly; the per-class NCCL settings of `collectives` depend on that.
    """
    rank, _, world = env_rank()
    backend = choose_backend(cfg)
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    device = device_for(cfg)
    if backend == "nccl":
        torch.cuda.set_device(device)
    if dist.is_initialized():
        return device, backend
    kwargs = {"device_id": device} if backend == "nccl" else {}
    if "MASTER_ADDR" in os.environ:
        store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world, timeout=timeout))
        # A restarted attempt (torchrun --max-restarts) can be handed the previous attempt's store, keys and all:
        # a rank would then read its peer's stale gloo address before the peer rewrote it and fail to connect
        # (a race that restarts under torchrun do lose). A per-attempt prefix keeps the attempts apart.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"dtrain/attempt-{attempt}", store)
        dist.init_process_group(backend, store=store, timeout=timeout, rank=rank, world_size=world, **kwargs)
    else:  # a plain `python -m dtrain.engine.train`: a one-rank group, so the same code path runs
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout, **kwargs)
    return device, backend


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def local_world_size() -> int | None:
    """The ranks of this rank's node as torchrun started them (its LOCAL_WORLD_SIZE); None outside torchrun."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    return int(local) if local else None


def is_main() -> bool:
    return rank() == 0


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def all_reduce_sum(values: list[float], device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t.tolist()


def broadcast_object(obj, src: int = 0):
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def main_decides(fn):
    """`fn()` on rank 0 only, its result given to every rank; if it fails, every rank raises its message as a
    UserError, so all ranks exit alike instead of the others waiting for rank 0 at the next collective."""
    result, problem = None, None
    if is_main():
        try:
            result = fn()
        except Exception as e:
            problem = str(e)
    result, problem = broadcast_object((result, problem))
    if problem is not None:
        raise UserError(problem)
    return result


def cleanup() -> None:
    """Destroy every process group while the interpreter is fully alive.

    A process group lives as long as something references it: DDP's reducer, a strategy's handle, a module's hooks.
    Such objects often sit in reference cycles, which only the garbage collector frees; left to the interpreter's
    finalization, a gloo group is destroyed there, its worker threads still holding work whose tensors need the GIL,
    and the process aborts after its work is done ("terminate called without an active exception": the atexit
    approach in pytorch/pytorch#179291 describes the same). So the caller drops its references to models and
    handles first, and the cycles are collected here before the groups are destroyed."""
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def end_rank() -> NoReturn:
    """End a spawned rank's process once its work is done and written: `cleanup()`, then exit at once, without the
    interpreter's finalization.

    A synchronous gloo collective returns as soon as its result is ready; the backend's worker thread then releases
    the work, and with it the tensors, which needs the GIL. If the interpreter has begun finalizing by then, the
    thread is ended inside that release and the process aborts ("terminate called without an active exception"),
    after its results were written: pytorch/pytorch#190489. A rank that exits within a few milliseconds of its last
    collective (a spawned check, a test) meets it now and then. Output is flushed first; nothing else is left to run
    in such a process."""
    cleanup()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# What every rank of a spawned check imports: torch, its distributed package, and sympy with torch.fx's symbolic
# shapes, which torch._dynamo imports (DDP's constructor and torch's optimizers import torch._dynamo).
# torch._dynamo itself is imported in each rank, as a new interpreter does: imported in the server, a stock DDP loop
# forked from it deadlocks now and then at its end. There DDP's reducer, freed with the GIL held, holds the last
# reference to the gloo group, whose destructor joins a worker thread that waits for the GIL to free its last work
# (the class of deadlock in pytorch/pytorch#56297).
SPAWN_PRELOAD = ("torch", "torch.distributed", "torch.fx.experimental.symbolic_shapes")


def spawn(fn: Callable, args: tuple = (), nprocs: int = 2, join: bool = True):
    """`fn(rank, *args)` in `nprocs` processes of this machine, joined, an error in one raised here: as
    `torch.multiprocessing.spawn`, but each process is forked from a server that imported SPAWN_PRELOAD once
    (multiprocessing's forkserver, started by the first call and kept), so a rank starts in a fraction of a second
    instead of seconds of imports in a new interpreter. `join=False`: returns torch's ProcessContext at once, for a
    caller that waits for its `processes` itself.

    Each rank runs with this process's environment, working directory and import path at the call (a forked server
    keeps its own: Python 3.11's forkserver does not pass the path on). What torch reads from the environment when it
    is imported, it read in the server, at the first call."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(SPAWN_PRELOAD))
    # Pickled here, unpickled in the rank after its import path is set: `fn` may live in a module only this
    # process's path finds (a test's file).
    call = pickle.dumps((fn, tuple(args)))
    return torch.multiprocessing.start_processes(_as_caller, args=(call, dict(os.environ), os.getcwd(), list(sys.path)),
                                                 nprocs=nprocs, join=join, start_method="forkserver")


def _as_caller(rank: int, call: bytes, env: dict[str, str], cwd: str, path: list[str]) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path[:] = path
    fn, args = pickle.loads(call)
    fn(rank, *args)


@contextmanager
def rank_process() -> Iterator[None]:
    """The body of a spawned rank (`spawn`, `torch.multiprocessing.spawn`), after it joined the process group: on
    success the process ends there (`end_rank`); on an error the groups are destroyed and the error goes on to spawn,
    which reports it."""
    try:
        yield
    except BaseException:
        cleanup()
        raise
    end_rank()
