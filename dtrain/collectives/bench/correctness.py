"""The benchmark's correctness pass, as nccl-tests' `-c 1`: known inputs, one collective, the number of elements
of this rank's result that differ from what it should hold (the `#wrong` column).

Each rank's input repeats one period of small integers (1..3; 1..2 for prod), so every partial result is exact in
every dtype and the expected result does not depend on the reduction order; the period is a prime, so a shifted or
misplaced chunk shows as wrong. A reduce-scatter's input starts each rank's share at a phase of its own (share c at
element c of the period), and so does an all-gather's (rank k's input at element k), so that a share landing on the
wrong rank, or in the wrong place of the gathered output, differs from the one expected there.
"""

from __future__ import annotations

from typing import Callable

import torch

from dtrain.collectives.bench.collectives import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER

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


def fill(t: torch.Tensor, period: torch.Tensor, start: int = 0) -> None:
    """Write `period` repeated along the flat tensor `t`, beginning at the period's element `start`, without
    materialising an index tensor of t's size."""
    q, rem = divmod(t.numel(), PERIOD)
    period = period.roll(-start).to(t.device)
    t[:q * PERIOD].view(q, PERIOD).copy_(period.expand(q, PERIOD))
    t[q * PERIOD:].copy_(period[:rem])


def count_wrong(t: torch.Tensor, expected: torch.Tensor, op: str, start: int = 0) -> int:
    """The elements of the flat tensor `t` that differ from `expected` (one period) repeated along it, beginning at
    the period's element `start`."""
    q, rem = divmod(t.numel(), PERIOD)
    expected = expected.roll(-start).to(t.device)
    if op == "avg":  # the only op whose result is not exact
        def bad(a, b):
            return ~torch.isclose(a.double(), b.double(), rtol=1e-2, atol=1 if not a.is_floating_point() else 0)
    else:
        def bad(a, b):
            return a != b
    return int(bad(t[:q * PERIOD].view(q, PERIOD), expected).sum()) + int(bad(t[q * PERIOD:], expected[:rem]).sum())


def check(run: Callable[[torch.Tensor], torch.Tensor], count: int, dtype: torch.dtype, op: str, rank: int,
          nranks: int, device, expect_op: str | None = None, collective: str = ALL_REDUCE.name) -> int:
    """The separate correctness pass: known inputs, one collective, the number of wrong elements on this rank.
    `run(t)` runs it on the input `t` and returns the tensor holding this rank's result; `count` is the table's count
    (elements per rank); `expect_op` is the op that result should equal (a path that averages is checked against
    "avg" although it was asked to sum).

    all_reduce: `count` elements in and out, the reduction of every rank's input. reduce_scatter: `count` x ranks
    in, the reduction of every rank's share `rank` out (`count`). all_gather: `count` in (this rank's pattern, at
    phase `rank`), `count` x ranks out: share k as rank k put it in."""
    expect = expect_op or op
    if collective == ALL_GATHER.name:  # nothing reduced: share k of the output is rank k's input
        t = torch.empty(count, dtype=dtype, device=device)
        fill(t, pattern(rank, "sum", dtype), start=rank)
        shares = run(t).view(nranks, count)
        return sum(count_wrong(s, pattern(k, "sum", dtype), "sum", start=k) for k, s in enumerate(shares))
    if collective == REDUCE_SCATTER.name:  # (ranks, count): share c of every rank's input at phase c
        t = torch.empty(count * nranks, dtype=dtype, device=device)
        for c, share in enumerate(t.view(nranks, count)):
            fill(share, pattern(rank, op, dtype), start=c)
        return count_wrong(run(t), expected_period(nranks, expect, dtype), expect, start=rank)
    t = torch.empty(count, dtype=dtype, device=device)
    fill(t, pattern(rank, op, dtype))
    return count_wrong(run(t), expected_period(nranks, expect, dtype), expect)
