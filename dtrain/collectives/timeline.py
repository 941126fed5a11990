"""The collectives of one backward played onto a timeline, and the gradient-ready curve they are launched from: the
engine of the one step-time predictor (`dtrain.collectives.step_time`).

Everything here is modeled. Times are ms from the start of the synchronized backward; buckets are in index (launch)
order.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Callable

GLOO_LANES = 2  # collectives one gloo process group runs at once: ProcessGroupGloo's worker threads (default 2)


@dataclass
class Timeline:
    """Per bucket (index order): when it is ready, launched, starts on the stream and completes (ms from the start
    of the synchronized backward)."""

    ready: list[float]
    launch: list[float]
    start: list[float]
    end: list[float]
    backward_ms: float

    @property
    def comm_ms(self) -> float:
        """Time with at least one collective in flight (on one stream: the sum of their durations)."""
        busy, reach = 0.0, -math.inf
        for s, e in sorted(zip(self.start, self.end)):
            if e > reach:
                busy += e - max(s, reach)
                reach = e
        return busy

    @property
    def exposed_ms(self) -> float:
        """Communication still running when backward ends: what `wait()` blocks on."""
        return max(0.0, max(self.end, default=0.0) - self.backward_ms)


def launch_times(ready_ms: list[float], backward_ms: float, overlap: bool = True) -> list[float]:
    """With `overlap` bucket i launches once it is ready and bucket i-1 has launched (every rank launches in index
    order); otherwise all launch when backward ends."""
    out, prev = [], 0.0
    for r in ready_ms:
        prev = max(r, prev) if overlap else max(backward_ms, r)
        out.append(prev)
    return out


def play_timeline(ready_ms: list[float], durations_ms: list[float], backward_ms: float, overlap: bool = True,
                  slowdown: float = 1.0, lanes: int = 1, latency_ms: list[float] | None = None,
                  groups: list | None = None, link_efficiency: Callable[[int], float] | None = None,
                  computing_ms: float | None = None, lockstep: bool = False) -> Timeline:
    """The collectives of one backward played onto a timeline. A launched bucket waits in its process group's queue
    (`groups`, one group if None) until one of the group's `lanes` is free, then runs: first its latency part
    (`latency_ms`, at most its duration; none if None), which does not use the link, then its transfer part, which
    shares the link: equally between the groups transferring at that moment (each group is its own set of
    connections, and TCP shares a link between connections), and equally between the transfers of one group.
    `link_efficiency(k)`: the share of the link's rate that k groups transferring at once get together while
    backward computes (1 for one; measured by `dtrain.collectives.bench --groups` beside computation); after backward the
    whole link.
    Everything runs `slowdown` times slower while backward computes (on CPUs, compute and gloo share the cores):
    until `computing_ms` where given (the last rank's backward end, where ranks sharing cores drift apart), else
    until `backward_ms` (this rank's, from which exposed time counts).
    With one lane and one group this is a single stream: a bucket starts when launched and the previous one is done.
    `lockstep`: a group's transfers share its part of the link in proportion to their sizes instead of equally, so
    that a small one sent beside a large one takes about as long as the large one. gloo's ring collectives of one
    process group share its connections and move one chunk of each bucket per step, in turn (seen in the records of
    4 ranks: buckets completing in pairs, a 1 MB bucket beside an 8 MB one finishing with it).

    lanes=1 is NCCL's model here (one communication stream); gloo runs GLOO_LANES collectives per process group at
    once, which shows in its records as small buckets completing out of index order."""
    n = len(durations_ms)
    launch = launch_times(ready_ms, backward_ms, overlap)
    lat = [min(max(0.0, a), d) for a, d in zip(latency_ms or [0.0] * n, durations_ms)]
    left = [[a, d - a] for a, d in zip(lat, durations_ms)]  # per bucket: [latency, transfer] still to do
    full = [max(d - a, 1e-12) for a, d in zip(lat, durations_ms)]  # each transfer's whole: its weight in lockstep
    group = groups or [None] * n
    start, end = [math.nan] * n, [math.nan] * n
    queues: dict = {}
    running: dict = {}  # group -> indices running now
    now, nxt, eps = 0.0, 0, 1e-9
    busy_until = backward_ms if computing_ms is None else max(backward_ms, computing_ms)
    while True:
        while nxt < n and launch[nxt] <= now + eps:  # launched: queue in the group
            queues.setdefault(group[nxt], []).append(nxt)
            nxt += 1
        for g, q in queues.items():
            on = running.setdefault(g, [])
            while q and len(on) < lanes:
                i = q.pop(0)
                start[i] = now
                on.append(i)
        active = [i for on in running.values() for i in on]
        if not active and nxt == n:
            break
        computing = now < busy_until
        rate = 1.0 / slowdown if computing else 1.0
        # The link's share of each transfer (`share[i]` of the link): equal between the groups transferring (each
        # group is its own connection), and between a group's transfers equal or, in lockstep, by size.
        weight = {i: (full[i] if lockstep else 1.0) for on in running.values() for i in on if left[i][0] <= eps}
        sending = {g: sum(weight[i] for i in on if i in weight) for g, on in running.items()}
        groups_sending = sum(1 for k in sending.values() if k) or 1
        link = link_efficiency(groups_sending) if link_efficiency and groups_sending > 1 and computing else 1.0
        share = {i: link * weight[i] / (groups_sending * sending[g]) for g, on in running.items() for i in on
                 if i in weight}
        horizon = [launch[nxt] - now] if nxt < n else []
        if computing and (slowdown != 1.0 or link != 1.0):  # the rates change when backward ends
            horizon.append(busy_until - now)
        for i in active:
            horizon.append(left[i][0] / rate if i not in share else left[i][1] / (rate * share[i]))
        dt = max(0.0, min(horizon))
        for i in active:
            if i not in share:
                left[i][0] -= dt * rate
            else:
                left[i][1] -= dt * rate * share[i]
        now += dt
        for on in running.values():
            for i in [i for i in on if left[i][0] <= eps and left[i][1] <= eps]:
                end[i] = now
                on.remove(i)
    return Timeline(list(ready_ms), launch, start, end, backward_ms)


def forward_stall(need_ms: list[float], durations_ms: list[float], forward_ms: float) -> float:
    """How much longer a forward takes when it waits for all-gathers (a sharded strategy's updated parameters): all
    launched as it starts and run one after another on the link, in the order it needs them; the forward reaches the
    module that needs gather k after `need_ms[k]` of its own compute (ascending) and waits there until gather k is
    done."""
    link = clock = computed = 0.0
    for need, d in zip(need_ms, durations_ms):
        link += d  # gather k done
        clock = max(clock + (need - computed), link)
        computed = need
    return clock + (forward_ms - computed) - forward_ms


def gather_stall(plan, durations_ms: list[float], forward_ms: float, gathered: list[bool] | None = None) -> float:
    """`forward_stall` of a sharded strategy's all-gathers of `plan` (buckets in ready order, their gathers taking
    `durations_ms`): the forward needs them in the reverse of their ready order (it runs first the layers backward
    computed last), each after compute proportional to the elements before it; the tied embedding's lookups cost
    next to nothing, so its bucket weighs nothing there and is needed at once. `gathered[i]`: bucket i has an
    all-gather (default: every bucket; a replicated bucket has none, `Exchange.gathered`)."""
    order = [i for i in range(len(plan)) if gathered is None or gathered[i]][::-1]
    weight = [0.0 if plan[i].tensor_class == "embedding" else float(plan[i].numel) for i in order]
    total, need, acc = sum(weight) or 1.0, [], 0.0
    for w in weight:
        need.append(forward_ms * acc / total)
        acc += w
    return forward_stall(need, [durations_ms[i] for i in order], forward_ms)


class ReadyCurve:
    """Milliseconds from the start of backward until the first `x` gradient elements (in ready order) are ready:
    piecewise linear through measured points, from (0, 0) to (all elements, end of backward)."""

    def __init__(self, points: list[tuple[float, float]], source: str):
        pts = sorted(points)
        xs, ts, t_max = [], [], 0.0
        for x, t in pts:
            t_max = max(t_max, t)  # gradients never become un-ready: keep the curve monotone
            if xs and x == xs[-1]:
                ts[-1] = t_max
            else:
                xs.append(x)
                ts.append(t_max)
        self.xs, self.ts, self.source = xs, ts, source

    @classmethod
    def uniform(cls, total: int, backward_ms: float) -> ReadyCurve:
        return cls([(0, 0.0), (total, backward_ms)], "uniform over backward (assumed)")

    def at(self, x: float) -> float:
        i = bisect.bisect_left(self.xs, x)
        if i == 0:
            return self.ts[0]
        if i >= len(self.xs):
            return self.ts[-1]
        x0, x1, t0, t1 = self.xs[i - 1], self.xs[i], self.ts[i - 1], self.ts[i]
        return t0 + (t1 - t0) * (x - x0) / (x1 - x0)


def through(buckets, params, early=frozenset()) -> list[int]:
    """Per bucket: elements of all gradients up to and including its last member, in ready order. A bucket is
    ready when that many elements are, whatever else is still open in other classes' buckets. `early`: members
    ready before their place in that order (a split tied embedding, whose projection part is the first gradient
    backward makes): a bucket that also holds others is placed by its last other member."""
    pos = {name: i for i, (name, _) in enumerate(params)}
    prefix, acc = [], 0
    for _, p in params:
        acc += p.numel()
        prefix.append(acc)
    out = []
    for b in buckets:
        placing = [n for n in b.names if n not in early] or b.names
        out.append(prefix[max(pos[n] for n in placing)])
    return out
