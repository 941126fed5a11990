"""The training loop's progress on rank 0: tqdm's bar in a terminal; elsewhere (a batch job's log file, a pipe) one
plain line per `train.log_every` steps, since a bar redrawn into a file only piles up copies of itself:

    smoke step 10/40 loss 6.078 lr 1.2e-04 step_ms 154 tok/s 13,305 elapsed 00:05 eta 00:20

(under `train.max_minutes` without the total and the ETA: the step count is open). The other long commands' progress
is `dtrain.common.progress.Bar`; both read whether stderr is a terminal from `plain_output`.
"""

from __future__ import annotations

import sys
import time

from tqdm import tqdm

from dtrain.common.progress import format_interval, plain_output


class Progress:
    """`enabled`: this rank shows progress (rank 0). `total` None: no known last step. Whether stderr is a terminal
    is read once, here."""

    def __init__(self, desc: str, total: int | None, initial: int, enabled: bool):
        self.desc, self.total, self.initial = desc, total, initial
        self.plain = enabled and plain_output()
        self.t0 = time.monotonic()
        self.bar = tqdm(total=total, initial=initial, disable=not enabled or self.plain, desc=desc, unit="step",
                        dynamic_ncols=True, mininterval=1.0)

    def update(self, n: int = 1) -> None:
        self.bar.update(n)

    def write(self, message: str) -> None:
        """A message between the bar's redraws (on stdout, from whichever rank calls it)."""
        self.bar.write(message)

    def log(self, step: int, loss: float, lr: float, step_ms: float, tokens_per_s: float) -> None:
        """The end of a log interval: its loss and throughput over all ranks, the last step's lr and time."""
        if self.bar.disable and not self.plain:
            return
        if not self.plain:
            self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:,.0f}", step_ms=f"{step_ms:.0f}")
            return
        elapsed = time.monotonic() - self.t0
        line = f"{self.desc} step {step}" + (f"/{self.total}" if self.total else "")
        line += (f" loss {loss:.3f} lr {lr:.1e} step_ms {step_ms:.0f} tok/s {tokens_per_s:,.0f} "
                 f"elapsed {format_interval(elapsed)}")
        if self.total and step > self.initial:  # the rate of this process's steps so far
            line += f" eta {format_interval(elapsed / (step - self.initial) * (self.total - step))}"
        print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        self.bar.close()
