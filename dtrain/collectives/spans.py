"""Labelled communication spans: the reducer wraps each bucket's collective in `comm_span(...)` so that a
torch.profiler trace (`dtrain.engine.profiler`) shows every all-reduce from launch to completion, named with its bucket
index, tensor class, bytes and wire dtype. Outside a profiled window `comm_span` costs one flag check.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch
from torch.autograd.profiler import record_function

SPAN_PREFIX = "dtrain::allreduce"




class _Span(AbstractContextManager):
    """A profiler range opened at launch; `until(future)` moves its end to the collective's completion."""

    def __init__(self, name: str):
        self._rf = record_function(name)

    def __enter__(self) -> "_Span":
        self._rf.__enter__()
        return self

    def until(self, fut: torch.futures.Future) -> torch.futures.Future:
        # The range ends in the future's callback, on the backend's thread, when the all-reduce has completed;
        # the returned future completes with the same value once the range is closed.
        return self._rf._call_end_callbacks_on_future(fut)

    def __exit__(self, *exc) -> None:
        self._rf.__exit__(*exc)  # a no-op once `until` has taken over the end


class _NoSpan(AbstractContextManager):
    def __enter__(self) -> "_NoSpan":
        return self

    def until(self, fut):
        return fut

    def __exit__(self, *exc) -> None:
        return None


_NO_SPAN = _NoSpan()


def span_name(bucket: int, tensor_class: str, nbytes: int, wire_dtype: str | None = None) -> str:
    wire = f" wire={wire_dtype}" if wire_dtype else ""
    return f"{SPAN_PREFIX}[bucket={bucket} class={tensor_class} bytes={nbytes}{wire}]"


def comm_span(bucket: int, tensor_class: str, nbytes: int, wire_dtype: str | None = None):
    """Context for launching one bucket's collective; inside a profiled window it records a range named
    `dtrain::allreduce[bucket=3 class=ffn bytes=1048576 wire=bf16]`:

        with comm_span(b.index, b.tensor_class, b.nbytes, b.settings.wire_dtype) as span:
            work = dist.all_reduce(wire, group=group, async_op=True)
            fut = span.until(work.get_future())   # the range ends when the all-reduce completes
    """
    if not torch.autograd._profiler_enabled():
        return _NO_SPAN
    return _Span(span_name(bucket, tensor_class, nbytes, wire_dtype))
