"""Point-to-point exchanges and their completion.

`exchange` posts a rank's sends and receives of one exchange as one batch (`dist.batch_isend_irecv`): on NCCL a
receive and a send between the same two ranks, posted one after the other, wait for each other forever unless they
are grouped (NCCL User Guide, "Point-to-point communication" and "Group Calls": ncclGroupStart/End), while gloo runs
them as they come. `rank_order_sum` adds what an exchange brought in a fixed order, the same on every rank.

gloo's point-to-point work has no future to chain a callback on. `Completions` gives it one: a thread waits for each
batch of work in launch order, then runs the batch's callback (stamping the completion, summing received chunks)
and sets its event, so the sums run while backward computes and the training thread waits only on the event.
"""

from __future__ import annotations

import atexit
import queue
import threading
import weakref
from typing import Callable

import torch
import torch.distributed as dist


def exchange(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]],
             group: dist.ProcessGroup, tag: int) -> list:
    """Post (tensor, global peer rank) sends and receives as one batch; returns their work."""
    ops = [dist.P2POp(dist.irecv, t, peer, group, tag) for t, peer in recvs]
    ops += [dist.P2POp(dist.isend, t, peer, group, tag) for t, peer in sends]
    return dist.batch_isend_irecv(ops) if ops else []


def rank_order_sum(own: torch.Tensor, received: list[torch.Tensor], rank: int) -> torch.Tensor:
    """own + the peers' parts (`received`, in rank order without `rank`) summed in rank order, as a new tensor: on two
    ranks a + b, the all-reduce's sum bit for bit."""
    others = iter(received)
    parts = [own if j == rank else next(others) for j in range(len(received) + 1)]
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    return total


class Completions:
    def __init__(self, name: str):
        self._queue: queue.Queue = queue.Queue()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        # A handle the loop never closed: its thread ends before the interpreter's shutdown stops daemon threads,
        # which aborts the process (std::terminate) if one is then inside a collective's wait.
        ref = weakref.ref(self)
        atexit.register(lambda: ref() is not None and ref().close())

    def put(self, works: list, then: Callable[[], None], done: threading.Event) -> None:
        """When every work in `works` has completed: `then()`, then `done.set()` (also after a failure, which
        `check()` re-raises in the caller's thread)."""
        done.clear()
        self._queue.put((works, then, done))

    def close(self) -> None:
        """Let the thread end once the work already put has completed (its last task holds buffers until then)."""
        if not self._thread.is_alive():
            return
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            task = self._queue.get()
            if task is None:
                return
            works, then, done = task
            try:
                for w in works:
                    w.wait()
                then()
            except BaseException as e:  # noqa: BLE001 - handed to the training thread, which re-raises it
                self._failure = e
            done.set()

    def check(self) -> None:
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure
