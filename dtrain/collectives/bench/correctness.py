"""The benchmark's correctness pass, as nccl-tests' `-c 1`: known inputs, one all-reduce, the number of elements
that differ from the expected result (the `#wrong` column).

Each rank's input repeats one period of small integers (1..3; 1..2 for prod), so every partial result is exact in
every dtype and the expected result does not depend on the reduction order; the period is a prime, so a shifted or
misplaced chunk shows as wrong.
"""

from __future__ import annotations

from typing import Callable

import torch

PERIOD = 257  # correctness data repeats with a prime period, so a shifted or misplaced chunk shows as wrong


def pattern(rank: int, op: str, dtype: torch.dtype) -> torch.Tensor:
    """One period of rank `rank`'s input: small integers (1..3; 1..2 for prod), so every partial result is exact
    in every dtype and the expected result does not depend on the reduction order."""
    span = 2 if op == "prod" else 3
    return ((torch.arange(PERIOD) + rank) % span + 1).to(dtype)


def expected_period(nranks: int, op: str, dtype: torch.dtype) -> torch.Tensor:
    parts = torch.stack([pattern(r, op, dtype) for r in range(nranks)])
    if op in ("sum", "avg"):
        out = parts.sum(0, dtype=dtype)
        return out if op == "sum" else (out.double() / nranks).to(dtype)
    if op == "prod":
        return parts.prod(0, dtype=dtype)
    return parts.amax(0) if op == "max" else parts.amin(0)


def fill(t: torch.Tensor, period: torch.Tensor) -> None:
    """Write `period` repeated along the flat tensor `t`, without materialising an index tensor of t's size."""
    q, rem = divmod(t.numel(), PERIOD)
    period = period.to(t.device)
    t[:q * PERIOD].view(q, PERIOD).copy_(period.expand(q, PERIOD))
    t[q * PERIOD:].copy_(period[:rem])


def count_wrong(t: torch.Tensor, expected: torch.Tensor, op: str) -> int:
    q, rem = divmod(t.numel(), PERIOD)
    expected = expected.to(t.device)
    if op == "avg":  # the only op whose result is not exact
        def bad(a, b):
            return ~torch.isclose(a.double(), b.double(), rtol=1e-2, atol=1 if not a.is_floating_point() else 0)
    else:
        def bad(a, b):
            return a != b
    return int(bad(t[:q * PERIOD].view(q, PERIOD), expected).sum()) + int(bad(t[q * PERIOD:], expected[:rem]).sum())


def check(reduce: Callable[[torch.Tensor], torch.Tensor], count: int, dtype: torch.dtype, op: str, rank: int,
          nranks: int, device, expect_op: str | None = None) -> int:
    """The separate correctness pass: known inputs, one all-reduce, the number of wrong elements on this rank.
    `reduce(t)` returns the tensor holding the result; `expect_op` is the op that result should equal (a path
    that averages is checked against "avg" although it was asked to sum)."""
    t = torch.empty(count, dtype=dtype, device=device)
    fill(t, pattern(rank, op, dtype))
    out = reduce(t)
    return count_wrong(out, expected_period(nranks, expect_op or op, dtype), expect_op or op)
