"""Order statistics for step times: distribution-free, since step times on a shared machine have long tails."""

from __future__ import annotations

import math
import statistics


def median_ci(values: list[float], z: float = 1.96) -> tuple[float, float]:
    """A distribution-free ~95% confidence interval of the median: the order statistics n/2 ± z·√n/2."""
    v = sorted(values)
    n = len(v)
    half = z * math.sqrt(n) / 2
    return v[max(0, math.floor(n / 2 - half))], v[min(n - 1, math.ceil(n / 2 + half) - 1)]


def paired_median(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """Median of the differences a[i] - b[i] of paired samples (the same step or round) and its ~95% interval; a
    drift of the machine's speed shared by both samples of a pair cancels in the difference."""
    diffs = [x - y for x, y in zip(a, b)]
    return (statistics.median(diffs), *median_ci(diffs))
