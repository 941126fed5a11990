"""Measured costs: latency + bytes/bandwidth fitted per size regime to measurements, and the model made of them.

A regime is a line t = lat + bytes / (1000 · bw) over a contiguous range of sizes; a fit splits the size axis into
as few regimes as explain the measurements, least squares on relative error. A `FittedModel` holds the regimes per
collective measured (all-reduce, reduce-scatter, all-gather: each its own fit, over nccl-tests' size of that
collective) and per label (per code path, or per NCCL algorithm/protocol when the log said what ran) and, from the
project's benchmark, the CPU time one all-reduce costs the process and the computation it takes from a backward it
overlaps.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from dtrain.collectives.costmodel.base import COLLECTIVES, Choice, CollectiveCost, check_coll, timed_choice
from dtrain.collectives.costmodel.measurements import Measurement, MeasurementSet
from dtrain.common.errors import UserError


@dataclass(frozen=True)
class Regime:
    """t = lat_us + bytes / (1000 · bw) for sizes up to `max_bytes` (inclusive); bw in GB/s (inf: flat)."""

    max_bytes: float
    lat_us: float
    bw: float

    def time_us(self, nbytes: float) -> float:
        return self.lat_us + (0.0 if math.isinf(self.bw) else nbytes / (1000.0 * self.bw))


def regime_dict(r: Regime) -> dict:
    """A regime as JSON: infinities as null, rounded as printed and saved."""
    return {"max_bytes": None if math.isinf(r.max_bytes) else round(r.max_bytes),
            "lat_us": round(r.lat_us, 4), "bw_GBps": None if math.isinf(r.bw) else round(r.bw, 6)}


# ---- fitting ------------------------------------------------------------------------------------------------------

def _fit_line(pts) -> tuple[float, float, float]:
    """Least squares of t ≈ a + b·x on relative error (weights v/t² for points (x, t, v)), a >= 0, b >= 0; x in
    MB. Returns (a, b, weighted SSE). Closed form from the weighted sums, so the regime search stays cheap."""
    sw = swx = swxx = swt = swxt = swtt = 0.0
    for x, t, v in pts:
        w = v / (t * t)
        sw += w; swx += w * x; swxx += w * x * x; swt += w * t; swxt += w * x * t; swtt += w * t * t  # noqa: E702
    det = sw * swxx - swx * swx
    a = b = None
    if det > 1e-12 * sw * swxx:
        a, b = (swxx * swt - swx * swxt) / det, (sw * swxt - swx * swt) / det
    if a is None or a < 0 or b < 0:  # constrained: the better of latency-only and bandwidth-only
        cands = [(swt / sw, 0.0)]
        if swxx > 0:
            cands.append((0.0, swxt / swxx))
        a, b = min(cands, key=lambda ab: _sse(ab, sw, swx, swxx, swt, swxt, swtt))
    return a, b, _sse((a, b), sw, swx, swxx, swt, swxt, swtt)


def _sse(ab, sw, swx, swxx, swt, swxt, swtt) -> float:
    a, b = ab
    return max(0.0, swtt + a * a * sw + b * b * swxx + 2 * a * b * swx - 2 * a * swt - 2 * b * swxt)


MONOTONE = 0.9  # a regime may start at most 10 % below where the previous one ends (a bigger message is not faster)
# Fit weights: a size's relative spread (interquartile range / median) is taken as at least MIN_SPREAD (no median
# is known better than to 1 %) and at most MAX_SPREAD. On a shared CPU the operations of a small all-reduce can be
# bimodal (most near the median, a quarter or more far above it), so their interquartile range can be several times
# the median and says more about that second mode than about how well the median is known; uncapped, the small
# sizes would weigh next to nothing and a fit could leave them far from every median.
MIN_SPREAD, MAX_SPREAD = 0.01, 0.5


def _weights(spreads: list[float | None] | None, n: int) -> list[float]:
    """1/spread² per point (spread held within MIN_SPREAD..MAX_SPREAD), scaled to mean 1 so that the RMS of the
    weighted residuals stays a relative error; all 1 unless every point has a spread."""
    if spreads is None or len(spreads) != n or any(s is None for s in spreads):
        return [1.0] * n
    raw = [1.0 / min(max(s, MIN_SPREAD), MAX_SPREAD) ** 2 for s in spreads]
    return [w * len(raw) / sum(raw) for w in raw]


def _best_splits(pts, cost: dict, max_regimes: int) -> dict[int, tuple[float, list[tuple[int, int]]]]:
    """{regime count: (summed SSE, segments)} of the best contiguous split of the sorted points into that many
    segments, each segment one of `cost`'s (start, end) with its fitted line. A dynamic programme over (count,
    last segment): the last segment is kept so that the next one can be refused where it would model a bigger
    message as markedly faster than a smaller one at their boundary (MONOTONE)."""
    n = len(pts)

    def boundary(i: int) -> float:  # MB: where a regime ending before point i hands over to the next
        return math.sqrt(max(pts[i - 1][0], 1e-9) * pts[i][0])

    def at(seg: tuple[int, int], x: float) -> float:
        a, b, _ = cost[seg]
        return a + b * x

    ending: dict[tuple[int, int], list[tuple[float, list[tuple[int, int]]]]] = {}  # (count, end) -> solutions
    for (i, j), (_, _, sse) in cost.items():
        if i == 0:
            ending.setdefault((1, j), []).append((sse, [(0, j)]))
    for k in range(2, max_regimes + 1):
        for (i, j), (_, _, sse) in sorted(cost.items()):
            x = boundary(i) if i > 0 else 0.0
            options = [(c + sse, segs + [(i, j)]) for c, segs in ending.get((k - 1, i), [])
                       if at((i, j), x) >= MONOTONE * at(segs[-1], x)]
            if options:
                ending.setdefault((k, j), []).append(min(options, key=lambda o: o[0]))
    return {k: min(ending[k, n], key=lambda o: o[0]) for k in range(1, max_regimes + 1) if (k, n) in ending}


def fit_regimes(sizes: list[float], times: list[float], max_regimes: int = 4, tol: float = 0.02,
                spreads: list[float | None] | None = None) -> list[Regime]:
    """Split the size axis into at most `max_regimes` contiguous regimes, each fitted with latency + bandwidth.
    Each split minimizes the summed squared relative error; the count is the fewest regimes whose RMS relative
    error is within `tol` (or within 1.5x of the best count's, if no count reaches `tol`), so that a regime is
    added to explain a change of slope, not noise.

    `spreads`: each size's measured relative spread (interquartile range / median; None where unknown). Where
    every size has one, each point weighs 1/spread² (the spread held within MIN_SPREAD..MAX_SPREAD): on a shared
    CPU a small all-reduce scatters far more than a large one, and unweighted the noisy small sizes would drag
    the large sizes' bandwidth."""
    if len(sizes) != len(times) or not sizes:
        raise UserError("fit: need as many times as sizes, and at least one")
    if any(t <= 0 for t in times) or any(s < 0 for s in sizes):
        raise UserError("fit: times must be positive and sizes non-negative")
    weights = _weights(spreads, len(sizes))
    order = sorted(range(len(sizes)), key=lambda i: sizes[i])
    pts = [(sizes[i] / 1e6, times[i], weights[i]) for i in order]
    n = len(pts)
    # Boundaries only between distinct sizes, so repeated measurements of one size stay in one regime.
    cuts = [0] + [i for i in range(1, n) if pts[i][0] != pts[i - 1][0]] + [n]
    min_pts = 3 if n >= 6 else 2
    cost = {}
    for ia, i in enumerate(cuts):
        for j in cuts[ia + 1:]:
            if j - i >= min_pts and len({x for x, _, _ in pts[i:j]}) >= 2:
                cost[i, j] = _fit_line(pts[i:j])
    if not cost:
        a, b, _ = _fit_line(pts)
        return [Regime(math.inf, a, 1000.0 / b if b > 0 else math.inf)]
    best = _best_splits(pts, cost, max_regimes)
    rms = {k: math.sqrt(cost_k / n) for k, (cost_k, _) in best.items()}
    good_enough = max(tol, 1.5 * min(rms.values()))
    k = min(k for k, e in rms.items() if e <= good_enough)
    regimes = []
    segs = best[k][1]
    for idx, (i, j) in enumerate(segs):
        a, b, _ = cost[i, j]
        # A regime reaches up to the geometric middle of the gap to the next measured size.
        upper = math.inf if idx == len(segs) - 1 else math.sqrt(max(pts[j - 1][0], 1e-9) * pts[j][0]) * 1e6
        regimes.append(Regime(upper, a, 1000.0 / b if b > 0 else math.inf))
    return regimes


def fit_per_op(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(µs per operation, µs per byte) from (size, µs) per all-reduce (CPU time, or computation lost): the
    per-operation cost is the median over sizes up to 64 KiB (where the data costs nothing), the per-byte cost the
    median of the excess per byte from 1 MiB up (the reduction and copies); robust to the odd slow size."""
    small = [v for n, v in points if n <= 64 << 10]
    per_op = max(0.0, statistics.median(small) if small else min(v for _, v in points))
    large = [(v - per_op) / n for n, v in points if n >= 1 << 20]
    return per_op, max(0.0, statistics.median(large)) if large else 0.0


def _label_matches(label: str, algo: str | None, proto: str | None) -> bool:
    a, _, p = label.partition("/")
    if not p:  # an unlabelled fit ("measured", or a bench path): whatever NCCL or gloo ran
        return True
    return (algo is None or a in ("*", algo)) and (proto is None or p in ("*", proto))


# ---- the model ----------------------------------------------------------------------------------------------------

class FittedModel(CollectiveCost):
    """Measured costs: regimes per collective and label ("measured", or "Ring/LL128" ... when the log says what NCCL
    ran). This is the `fit:` model for gloo, and a calibrated model wherever a benchmark exists.

    `fits` (label -> regimes) are `coll`'s, the collective the model is named by (all-reduce where measured);
    `other_colls` (collective -> label -> regimes) those of the other collectives measured with it. Each collective
    is costed by its own fit and its bandwidths by its own bus factor; asked for one it was not fitted on, the model
    says so."""

    kind = "fitted"

    def __init__(self, fits: dict[str, list[Regime]], coll: str = "allreduce", ranks: int | None = None,
                 name: str = "local", source: str = "", cpu: dict[str, tuple[float, float]] | None = None,
                 host: dict[str, tuple[float, float]] | None = None,
                 link_efficiency: dict[int, float] | None = None,
                 other_colls: dict[str, dict[str, list[Regime]]] | None = None,
                 host_work: dict[str, tuple[float, float]] | None = None):
        self.fits, self.coll, self.ranks, self.name, self.source = fits, coll, ranks, name, source
        self.other_colls = {c: f for c, f in (other_colls or {}).items() if c != coll}
        self.cpu = cpu or {}  # label -> (µs per operation, µs per byte): the process's CPU time, where measured
        self.host = host or {}  # label -> (µs per operation, µs per byte): computation lost per overlapped one
        self.together = dict(sorted((link_efficiency or {}).items()))  # k groups -> their share of the link
        self.work = host_work or {}  # kind of host work -> (µs per operation, µs per byte), where measured

    @classmethod
    def from_measurements(cls, ms: MeasurementSet, name: str = "local", max_regimes: int = 4) -> "FittedModel":
        """A fit per collective and label. The CPU time and the computation lost are the all-reduce's (the
        benchmark's reducer path), where measured."""
        groups: dict[str, dict[str, list[Measurement]]] = {}  # collective -> label -> rows
        for m in ms.rows:
            groups.setdefault(ms.coll_of(m), {}).setdefault(m.label, []).append(m)
        fits = {coll: {lab: fit_regimes([m.size for m in rows], [m.typical_us for m in rows], max_regimes,
                                        spreads=[m.spread for m in rows])
                       for lab, rows in sorted(by_label.items())}
                for coll, by_label in groups.items()}
        reduced = groups.get("allreduce", {})
        cpu = {lab: fit_per_op([(m.size, m.cpu_us) for m in rows]) for lab, rows in sorted(reduced.items())
               if all(m.cpu_us is not None for m in rows)}
        host = {lab: fit_per_op(pts) for lab, rows in sorted(reduced.items())
                if (pts := [(m.size, m.host_us) for m in rows if m.host_us is not None])}
        work = {what: fit_per_op(points) for what, points in sorted((ms.host_work or {}).items())}
        return cls(fits.get(ms.coll, {}), ms.coll, ms.ranks, name, ms.source, cpu, host, ms.link_efficiency,
                   {c: fits[c] for c in ms.colls if c != ms.coll}, work)

    @property
    def colls(self) -> list[str]:
        """The collectives fitted: `coll`, then the others."""
        return [self.coll, *self.other_colls]

    def fits_of(self, coll: str) -> dict[str, list[Regime]]:
        """The fits (label -> regimes) of `coll`; a one-line error where the model was not fitted on it."""
        check_coll(coll)
        if coll == self.coll:
            return self.fits
        if coll not in self.other_colls:
            raise UserError(f"model '{self.name}' was fitted on {', '.join(self.colls)}, not {coll}")
        return self.other_colls[coll]

    @staticmethod
    def _per_op(table: dict[str, tuple[float, float]], nbytes: float) -> float | None:
        # The reducer's path when there is one: what the planned strategies run.
        label = "reducer" if "reducer" in table else next(iter(table), None)
        if label is None:
            return None
        per_op, per_byte = table[label]
        return per_op + per_byte * nbytes

    def cpu_us(self, nbytes: float) -> float | None:
        """CPU time one all-reduce of `nbytes` costs the process (all threads), from the benchmark; None where it
        was not measured."""
        return self._per_op(self.cpu, nbytes)

    def host_us(self, nbytes: float) -> float | None:
        """How much longer a computation takes per all-reduce of `nbytes` launched during it (the benchmark's
        --overlap, CPU); None where it was not measured."""
        return self._per_op(self.host, nbytes)

    def host_work_us(self, what: str, nbytes: float, count: int = 1) -> float | None:
        """What `count` operations of host work `what` over `nbytes` in all take on the computing thread (the
        benchmark's --host-work: `dtrain.collectives.bench.host_work`); None where it was not measured."""
        if what not in self.work:
            return None
        per_op, per_byte = self.work[what]
        return per_op * count + per_byte * nbytes

    def link_efficiency(self, k: int) -> float:
        """The share of the link's rate that `k` process groups transferring at once get together (the benchmark's
        --groups): interpolated between the measured counts, the largest's beyond it; 1 where not measured, and at
        most 1.

        Where the ranks outnumber the cores, one group beside computation is starved of CPU rather than of link, and
        the benchmark measures several groups reaching more together than one (on the 4-rank testbed on 2 vCPUs,
        2 groups 1.9 times one group's rate). Training did not show it: `per_class`, one group per class, measured
        no faster than one group there, so a share above one group's is not played."""
        if not self.together or k <= 1:
            return 1.0
        ks = list(self.together)
        if k >= ks[-1]:
            return min(1.0, self.together[ks[-1]])
        hi = next(i for i, m in enumerate(ks) if m >= k)
        k0, k1 = ks[hi - 1], ks[hi]
        e0, e1 = self.together[k0], self.together[k1]
        return min(1.0, e0 + (e1 - e0) * (k - k0) / (k1 - k0))

    def _regime(self, label: str, nbytes: float, coll: str | None = None) -> Regime:
        return next(r for r in self.fits_of(coll or self.coll)[label] if nbytes <= r.max_bytes)

    def label_time_us(self, label: str, nbytes: float, coll: str | None = None) -> float:
        """The time of `label`'s fit of `coll` (default: the model's `coll`) at `nbytes`."""
        return self._regime(label, nbytes, coll).time_us(nbytes)

    def _label(self, nbytes: float, coll: str, algo: str | None, proto: str | None) -> str:
        """The fit that costs this call: with labelled fits, (algo, proto) selects one, else the fastest of them
        (NCCL-like); the bench's reducer path when there is one, which is what the planned strategies run."""
        fits = self.fits_of(coll)
        labels = [lab for lab in fits if _label_matches(lab, algo, proto)]
        if "reducer" in labels:
            return "reducer"
        if not labels:
            raise UserError(f"model '{self.name}' has no fit for {algo or 'any'}/{proto or 'any'} "
                            f"(fitted: {', '.join(fits)})")
        return min(labels, key=lambda lab: self.label_time_us(lab, nbytes, coll))

    def time_us(self, nbytes: float, coll: str = "allreduce", algo: str | None = None, proto: str | None = None
                ) -> float:
        return self.label_time_us(self._label(nbytes, coll, algo, proto), nbytes, coll)

    def latency_us(self, nbytes: float, coll: str = "allreduce", algo: str | None = None, proto: str | None = None
                   ) -> float:
        """The part of `time_us` that does not grow with the bytes: the latency of the size's regime."""
        return self._regime(self._label(nbytes, coll, algo, proto), nbytes, coll).lat_us

    def allreduce_latency_ms(self, nbytes: float) -> float:
        """The fit's latency term (ms): the part of `allreduce_ms` that does not share the link."""
        return self.latency_us(nbytes, "allreduce") / 1000.0

    def choices(self, nbytes: int, coll: str = "allreduce") -> list[Choice]:
        """One choice per label of `coll`'s fit, its busbw by `coll`'s bus factor."""
        out = []
        for lab in self.fits_of(coll):
            algo, _, proto = lab.partition("/")
            r = self._regime(lab, nbytes, coll)
            out.append(timed_choice(algo, proto, nbytes, r.lat_us, r.bw, coll, self.ranks))
        return out

    def pick(self, nbytes: int, coll: str = "allreduce") -> Choice:
        return min(self.choices(nbytes, coll), key=lambda c: c.time_us)

    def header(self) -> list[str]:
        lines = [f"MODELED from a fit to measurements ({self.source or 'fit'}): latency + bytes/bandwidth per size "
                 f"regime; {', '.join(self.colls)}, {self.ranks or '?'} ranks"]
        if self.cpu_us(0) is not None:
            lines.append(f"CPU time per all-reduce (benchmark, all threads): {self.cpu_us(0):.0f} us + "
                         f"{(self.cpu_us(1 << 20) - self.cpu_us(0)):.0f} us per MiB")
        if self.host_us(0) is not None:
            lines.append(f"computation lost per all-reduce launched during it (benchmark --overlap): "
                         f"{self.host_us(0):.0f} us + {(self.host_us(1 << 20) - self.host_us(0)):.0f} us per MiB")
        if self.together:
            lines.append("the link's rate that k process groups all-reducing at once reach together, of one group's "
                         "(benchmark --groups): " + ", ".join(f"k={k} {e:.3f}" for k, e in self.together.items()))
        if self.work:
            lines.append("host work on the computing thread (benchmark --host-work): " + ", ".join(
                f"{what} {a:.0f} us + {b * (1 << 20):.0f} us per MiB" for what, (a, b) in self.work.items()))
        return lines

    def to_dict(self) -> dict:
        return {"kind": "fitted", "name": self.name, "coll": self.coll, "ranks": self.ranks, "source": self.source,
                "fits": {lab: [regime_dict(r) for r in regs] for lab, regs in self.fits.items()},
                "cpu": {lab: {"per_op_us": round(a, 4), "per_byte_us": b} for lab, (a, b) in self.cpu.items()},
                "host": {lab: {"per_op_us": round(a, 4), "per_byte_us": b} for lab, (a, b) in self.host.items()},
                **({"link_efficiency": {str(k): e for k, e in self.together.items()}} if self.together else {}),
                **({"host_work": {w: {"per_op_us": round(a, 4), "per_byte_us": b} for w, (a, b) in self.work.items()}}
                   if self.work else {}),
                **({"other_colls": {c: {lab: [regime_dict(r) for r in regs] for lab, regs in fits.items()}
                                    for c, fits in self.other_colls.items()}} if self.other_colls else {})}

    @classmethod
    def from_dict(cls, d: dict, where: str = "") -> "FittedModel":
        def regimes(fits: dict) -> dict[str, list[Regime]]:
            return {lab: [Regime(math.inf if r["max_bytes"] is None else float(r["max_bytes"]), float(r["lat_us"]),
                                 math.inf if r["bw_GBps"] is None else float(r["bw_GBps"])) for r in regs]
                    for lab, regs in fits.items()}

        try:
            fits = regimes(d["fits"])
            others = {c: regimes(f) for c, f in (d.get("other_colls") or {}).items()}
            unknown = [c for c in others if c not in COLLECTIVES]
            if unknown:
                raise UserError(f"{where}: not a fitted cost model (unknown collective '{unknown[0]}')")
            cpu, host, work = ({lab: (float(c["per_op_us"]), float(c["per_byte_us"]))
                                for lab, c in (d.get(k) or {}).items()} for k in ("cpu", "host", "host_work"))
            together = {int(k): float(e) for k, e in (d.get("link_efficiency") or {}).items()}
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise UserError(f"{where}: not a fitted cost model ({e})") from e
        return cls(fits, d.get("coll", "allreduce"), d.get("ranks"), d.get("name", "local"), d.get("source", where),
                   cpu, host, together, others, work)
