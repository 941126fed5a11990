"""Host memory kept for the next step instead of handed back to the operating system.

glibc's malloc serves a large allocation (above a threshold that adapts, at most 32 MiB) with its own mmap and
returns it with munmap when it is freed. A CPU training step frees and allocates the same large activations and
gradients every step, so each step faults every page of them in again, and the kernel zeroes each one. Two of
glibc's malloc parameters stop that (the GNU C Library manual, "Malloc Tunable Parameters"): M_MMAP_MAX = 0 serves
every allocation from the heap, and a high M_TRIM_THRESHOLD keeps freed heap memory for the next allocation. The
price is that the process does not shrink after a peak, as a CUDA caching allocator does not either.

The same can be set from outside before a process starts, e.g.
GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647.

Kept memory suits a loop whose steps are alike. `auto`'s search is not: its candidates free and allocate blocks of
other sizes and lifetimes from one step to the next, and a heap that keeps every freed block ends as the union of
their layouts, with holes none of them fills. `map_large_blocks` serves large blocks with their own mmap again, each
handed back when freed, while it lasts: the search's steps fault them in again, every candidate alike, and the heap
stays the size of what is in use. `keep_again` ends it.

All of this is process-wide state, so it is set only where a setting asks for it (the trainer's
`train.keep_host_memory`, on a CPU device) and only inside `kept_freed_memory()`, which puts glibc's defaults back on
every way out, an exception's included.

`heap_mib` reads what the heap holds and what of it is in use (glibc's mallinfo2): where a process frees and
allocates blocks of many sizes, the heap can hold much more than it uses, and the peak resident memory shows the
heap, not the use.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import platform
from contextlib import contextmanager
from typing import Iterator

# mallopt's parameter numbers, from glibc's malloc.h
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
KEEP = 2**31 - 1  # mallopt takes an int: freed heap memory up to 2 GiB above the top is kept
MAPPED_FROM = 128 * 1024  # glibc's own starting mmap threshold (DEFAULT_MMAP_THRESHOLD_MIN), here held fixed
MAPS = 65536  # glibc's default M_MMAP_MAX
TRIM_DEFAULT = 128 * 1024  # glibc's default M_TRIM_THRESHOLD (DEFAULT_TRIM_THRESHOLD)

_mode = "glibc default"  # this process's allocator as set here: "glibc default", "kept" or "large blocks mapped"


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """This process's C library where it is glibc on Linux, else None."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def keep_freed_memory() -> str:
    """Make this process's allocator keep freed memory (glibc on Linux). Returns what was done, for the run's
    record: "kept", or why not."""
    libc = _glibc()
    if libc is None:
        return f"not applied: {platform.system()} {platform.libc_ver()[0] or 'without glibc'}"
    # mallopt returns 1 on success, 0 on error
    if libc.mallopt(M_MMAP_MAX, 0) != 1 or libc.mallopt(M_TRIM_THRESHOLD, KEEP) != 1:
        return "not applied: mallopt refused"
    global _mode
    _mode = "kept"
    return "kept"


def map_large_blocks() -> None:
    """Where this process keeps freed memory (`keep_freed_memory` applied), serve blocks of `MAPPED_FROM` bytes or
    more with their own mmap again, each handed back when freed, until `keep_again()`; elsewhere the allocator is
    left as the process set it."""
    global _mode
    libc = _glibc()
    if _mode == "kept" and libc.mallopt(M_MMAP_THRESHOLD, MAPPED_FROM) == 1 and libc.mallopt(M_MMAP_MAX, MAPS) == 1:
        _mode = "large blocks mapped"


def keep_again() -> None:
    """End `map_large_blocks`: freed memory is kept again (nothing where blocks are not mapped)."""
    if _mode == "large blocks mapped":
        keep_freed_memory()


def restore_defaults() -> None:
    """glibc's default thresholds back (trim and mmap at 128 KiB, 65,536 maps), where this module changed them. glibc
    then holds the mmap threshold fixed rather than adapting it, as it does once any of them is set."""
    global _mode
    libc = _glibc()
    if _mode != "glibc default" and libc is not None:
        libc.mallopt(M_MMAP_MAX, MAPS)
        libc.mallopt(M_MMAP_THRESHOLD, MAPPED_FROM)
        libc.mallopt(M_TRIM_THRESHOLD, TRIM_DEFAULT)
        libc.malloc_trim(0)  # what was kept goes back now
        _mode = "glibc default"


@contextmanager
def kept_freed_memory(wanted: bool, device: str) -> Iterator[str]:
    """Keep freed host memory inside the block where `wanted` and the device is a CPU (a CUDA run's large tensors are
    not the host's); glibc's defaults come back when the block exits, however it exits. Yields what was done, for the
    run's record."""
    if not wanted:
        yield "returned to the OS (glibc default)"
        return
    if device != "cpu":
        yield f"returned to the OS (glibc default): not set on a {device} device"
        return
    try:
        yield keep_freed_memory()
    finally:
        restore_defaults()


def record() -> str:
    """What this process's allocator does now, for a run's record."""
    return {"kept": "kept", "large blocks mapped": "kept (large blocks mapped during a search)"}.get(
        _mode, "returned to the OS (glibc default)")


def allocator_mode() -> str:
    """What this module has set in this process: "glibc default", "kept" or "large blocks mapped"."""
    return _mode


class _MallInfo2(ctypes.Structure):
    """glibc's `struct mallinfo2` (malloc.h, glibc >= 2.33): every field a size_t."""

    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


@functools.cache
def _mallinfo2():
    """glibc's mallinfo2, or None (not glibc, or older than 2.33)."""
    fn = getattr(_glibc(), "mallinfo2", None)
    if fn is not None:
        fn.restype = _MallInfo2
    return fn


def heap_mib() -> dict[str, float]:
    """The allocator's heap now, over all its arenas: `heap_mib`, what it holds from the operating system (its
    arenas and its blocks mapped on their own), and `heap_used_mib`, what of that is allocated. Empty where glibc's
    mallinfo2 is not there."""
    fn = _mallinfo2()
    if fn is None:
        return {}
    m = fn()
    return {"heap_mib": round((m.arena + m.hblkhd) / 2**20, 1),
            "heap_used_mib": round((m.uordblks + m.hblkhd) / 2**20, 1)}
