"""Sizes and bandwidths as nccl-tests writes them: one grammar for byte sizes, their short human form, and the
bus-bandwidth factor.

Sizes use binary multiples, as nccl-tests' `-b`/`-e` do: `8`, `64K`, `1M`, `1.5M`, `1G`, `1GiB`, `128MB`, `512B`
(case-insensitive). A list of sizes is a range `min:max[:factor]` (powers of 2 by default) or a comma list.

Bus bandwidth (nccl-tests' doc/PERFORMANCE.md): busbw = algbw x a factor of the collective and the rank count n,
so that it compares with the link's speed whatever n is: 2(n-1)/n for all-reduce (a reduce-scatter then an
all-gather), (n-1)/n for all-gather and reduce-scatter, 1 for broadcast.
"""

from __future__ import annotations

import re

from dtrain.common.errors import UserError

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"\s*(\d+)(\.\d+)?\s*([KMGT]?)(?:i?B)?\s*", re.IGNORECASE)


def parse_size(text) -> int:
    """'8' -> 8, '64K' -> 65536, '1.5M', '1G', '1GiB', '128MB', '512B' -> bytes (binary multiples); a fraction of a
    byte is dropped."""
    m = _SIZE.fullmatch(str(text))
    if not m:
        raise UserError(f"bad size '{text}': expected bytes with an optional K, M, G or T suffix, e.g. 8, 64K, "
                        "256M, 1G")
    whole, frac, unit = m.group(1), m.group(2), _UNITS[m.group(3).upper()]
    # Whole numbers exactly (no float rounding for huge ones); a fraction through float, as "1.5M".
    return int(whole) * unit if frac is None else int(float(whole + frac) * unit)


def parse_sizes(spec: str) -> list[int]:
    """'8:1G' (powers of 2), '1K:1M:4' (factor 4), or a list '1M,4M,16M'."""
    if ":" in spec:
        parts = spec.split(":")
        if len(parts) not in (2, 3):
            raise UserError(f"bad size range '{spec}' (min:max[:factor])")
        lo, hi = parse_size(parts[0]), parse_size(parts[1])
        factor = int(parts[2]) if len(parts) == 3 and parts[2].isdigit() else 2 if len(parts) == 2 else 0
        if lo < 1 or hi < lo or factor < 2:
            raise UserError(f"bad size range '{spec}': need 1 <= min <= max and an integer factor >= 2")
        out, s = [], lo
        while s <= hi:
            out.append(s)
            s *= factor
        return out
    sizes = [parse_size(s) for s in spec.split(",") if s.strip()]
    if not sizes:
        raise UserError(f"bad sizes '{spec}': give min:max[:factor] or a list of sizes")
    return sizes


def human(nbytes: float) -> str:
    """A size in its short binary form: 8B, 64K, 1.5M, 1G (three significant digits where not whole)."""
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale:
            v = nbytes / scale
            return f"{v:.0f}{unit}" if v == int(v) else f"{v:.3g}{unit}"
    return f"{nbytes:.0f}B"


def bus_factor(coll: str, ranks: int) -> float:
    """nccl-tests' busbw / algbw for collective `coll` on `ranks` ranks (see the module docstring)."""
    n = ranks
    factors = {"allreduce": lambda: 2 * (n - 1) / n, "allgather": lambda: (n - 1) / n,
               "reducescatter": lambda: (n - 1) / n, "broadcast": lambda: 1.0}
    if coll not in factors:
        raise UserError(f"no bus bandwidth factor for collective '{coll}' (known: {', '.join(factors)})")
    return factors[coll]()
