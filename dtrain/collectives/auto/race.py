"""The race behind `sync.strategy: auto`: candidates measured on the same training steps, round by round, and
dropped once the paired differences say they are slower.

The search behind `attach` (`dtrain.collectives.auto.search`) runs it inside any training loop, dtrain's trainer's
too (`dtrain.engine.autotune`).
Each round runs every candidate still in the race once, in an order shuffled per round and equal on every rank. A
candidate's time in a round is the mean over the ranks, so every rank decides alike.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from dtrain.common.stats import paired_median


@dataclass
class Entrant:
    name: str
    lossless: bool = True
    times: dict[int, float] = field(default_factory=dict)  # counted round -> step ms (mean over ranks)
    losses: dict[int, float] = field(default_factory=dict)  # counted round -> training loss (mean over ranks)
    steps: int = 0  # training steps it ran, counted or not
    diff: tuple[float, float, float] | None = None  # paired (median, low, high) ms against the winner / leader
    status: str = ""
    reason: str = ""
    predicted_ms: float | None = None  # MODELED (`dtrain.collectives.auto.predict`), where the search pruned
    predicted_rank: int | None = None

    @property
    def measured_ms(self) -> float | None:
        return statistics.median(self.times.values()) if self.times else None


def paired(c: Entrant, ref: Entrant) -> tuple[float, float, float] | None:
    """The median of `c`'s step minus `ref`'s over the rounds both ran, with its ~95% interval (None under two)."""
    rounds = sorted(c.times.keys() & ref.times.keys())
    if len(rounds) < 2:
        return None
    return paired_median([c.times[r] for r in rounds], [ref.times[r] for r in rounds])


def fmt_diff(d) -> str:
    return f"{d[0]:+.1f} ms [{d[1]:+.1f}, {d[2]:+.1f}]"


def blocked_ms(alive: list) -> dict[str, float]:
    """Each measured entrant's median, over the rounds all of them ran, of its step minus that round's median step.
    A round is a block: every entrant ran one step in it, at that minute's machine speed, so a round the machine
    ran slow moves all of them alike and drops out, where a plain median of each one's steps may come from
    different rounds. Each one's plain median where they share no round."""
    measured = [c for c in alive if c.times]
    rounds = sorted(set.intersection(*(set(c.times) for c in measured))) if measured else []
    if not rounds:
        return {c.name: c.measured_ms for c in measured}
    centre = {r: statistics.median(c.times[r] for c in measured) for r in rounds}
    return {c.name: statistics.median(c.times[r] - centre[r] for r in rounds) for c in measured}


def leader(alive: list) -> Entrant:
    """The fastest entrant by `blocked_ms` (the first where nothing was measured)."""
    score = blocked_ms(alive)
    return min(alive, key=lambda c: (c.name not in score, score.get(c.name, 0.0)))


def drop(alive: list, min_rounds: int, loss_tolerance: float) -> list:
    """The entrants that stay: not slower than the leader at ~95% (the interval of the paired median above 0), and
    for a lossy one, a loss within `loss_tolerance` of the best lossless one's; decided after `min_rounds`."""
    if min(len(c.times) for c in alive) < min_rounds:
        return alive
    best = leader(alive)
    lossless = [c for c in alive if c.lossless]
    keep = []
    for c in alive:
        if c is not best:
            c.diff = paired(c, best)
            if c.diff and c.diff[1] > 0:
                c.status = "dropped: measured"
                c.reason = f"slower than the leader {best.name} at 95%: {fmt_diff(c.diff)}"
                continue
        if not c.lossless and lossless and c.losses:
            base = min(statistics.mean(b.losses.values()) for b in lossless)
            rel = statistics.mean(c.losses.values()) / base - 1
            if rel > loss_tolerance:
                c.status = "dropped: measured"
                c.reason = f"lossy and its loss {rel:+.1%} above the best lossless candidate's"
                continue
        keep.append(c)
    return keep


def pick(alive: list, budget_steps: int) -> Entrant:
    """The winner among those left: the `leader` (where nothing was measured, the first); the others are marked as
    kept by the budget, with their paired difference against it."""
    winner = leader(alive)
    for c in alive:
        c.status = "winner" if c is winner else "kept: budget"
        if c is not winner:
            c.diff = paired(c, winner)
            c.reason = (f"not separated from the winner within the budget of {budget_steps} steps"
                        + (f": {fmt_diff(c.diff)}" if c.diff else ""))
    return winner


def summary(stats: dict) -> list[str]:
    """An `attach` search's outcome as printable lines, from its handle's `stats()`: the pick, what it spent of the
    loop's steps, and each candidate's median step and its step minus the pick's, paired."""
    if stats["winner"] is None:
        return [f"auto: still searching after {stats['steps_spent']} steps"]
    lines = [f"auto picked {stats['winner']} after {stats['steps_spent']} of the loop's steps"]
    for name, row in stats["race"].items():
        against = ("the pick" if name == stats["winner"]
                   else fmt_diff(row["vs_winner"]) if row["vs_winner"] else "under two common rounds")
        median = f"{row['median_ms']:7.1f} ms" if row["median_ms"] is not None else "      -   "
        lines.append(f"  {name:28s} {row['status']:18s} median {median}, {row['rounds']:2d} rounds; "
                     f"step minus the pick's: {against}")
    return lines

