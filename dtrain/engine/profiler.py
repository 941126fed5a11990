"""torch.profiler over a window of training steps: one Chrome-format trace per rank, viewable in Perfetto.

Sits beside the training loop, which drives it (`StepProfiler.start(step)` before the loop, `.step()` after each
optimizer step, `.stop()` at the end). The reducer labels each bucket's collective (`dtrain.collectives.spans`), so the trace
shows every all-reduce from launch to completion, named with its bucket index, tensor class, bytes and wire dtype.

    DTRAIN_PROFILE=10:3 torchrun --nproc_per_node=2 -m dtrain.engine.train --profile dtrain/profiles/smoke.yaml --run-dir runs/p
    # → runs/p/profile/rank0.steps10-12.json, rank1...; open them at https://ui.perfetto.dev
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from torch.profiler import ProfilerAction, ProfilerActivity, profile

from dtrain.collectives.spans import SPAN_PREFIX
from dtrain.common.errors import UserError

ENV = "DTRAIN_PROFILE"  # "START:COUNT" (COUNT steps from step START) or "FIRST-LAST", steps numbered from 1


def parse_window(spec: str) -> tuple[int, int]:
    """'10:3' or '10-12' → (10, 3): the first profiled step and how many."""
    m = re.fullmatch(r"\s*(\d+)\s*([:-])\s*(\d+)\s*", spec or "")
    if not m:
        raise UserError(f"profile window '{spec}': expected START:COUNT or FIRST-LAST, e.g. 10:3 or 10-12")
    first, sep, other = int(m[1]), m[2], int(m[3])
    count = other if sep == ":" else other - first + 1
    if first < 1 or count < 1:
        raise UserError(f"profile window '{spec}': steps start at 1 and the window needs at least one step")
    return first, count


_SPAN_FIELDS = re.compile(r"bucket=(\d+) class=(\S+) bytes=(\d+)(?: wire=(\w+))?")


def as_async_spans(path: Path) -> int:
    """Rewrite the trace's communication spans as async begin/end pairs with their fields as arguments.

    The profiler writes them as complete events on the launching thread, where they overlap the backward ops and
    each other (bucket i+1 launches before bucket i completes); Perfetto wants complete events on one thread
    strictly nested, and gives overlapping async slices lanes of their own. Returns how many were rewritten."""
    trace = json.loads(path.read_text())
    events, n = [], 0
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or not str(e.get("name", "")).startswith(SPAN_PREFIX):
            events.append(e)
            continue
        m = _SPAN_FIELDS.search(e["name"])
        args = {**e.get("args", {}), "bucket": int(m[1]), "class": m[2], "bytes": int(m[3]), "wire_dtype": m[4]}
        common = {"name": e["name"], "cat": "dtrain_comm", "id": f"0x{n:x}", "pid": e["pid"], "tid": e["tid"]}
        events.append({**common, "ph": "b", "ts": e["ts"], "args": args})
        events.append({**common, "ph": "e", "ts": e["ts"] + e.get("dur", 0)})
        n += 1
    trace["traceEvents"] = events
    path.write_text(json.dumps(trace))
    return n


# ---------------------------------------------------------------------------------------------------------------
# The step window (driven by the trainer)


class StepProfiler:
    """Profiles training steps `first` .. `first + count - 1` (one warm-up step before them) and writes
    `<run_dir>/profile/rank<r>.steps<first>-<last>.json`. Every rank profiles and writes its own trace. Off when
    `window` is None."""

    def __init__(self, window: tuple[int, int] | str | None, run_dir: str | Path, rank: int = 0,
                 record_shapes: bool = True, with_stack: bool = False):
        self.window = parse_window(window) if isinstance(window, str) else window
        self.rank, self.record_shapes, self.with_stack = rank, record_shapes, with_stack
        self.dir = Path(run_dir) / "profile"
        self.path: Path | None = None  # the trace, once written
        self._prof: profile | None = None
        self._start_step = 0

    @classmethod
    def from_env(cls, run_dir: str | Path, rank: int = 0) -> "StepProfiler":
        """The window from $DTRAIN_PROFILE (unset or empty: off)."""
        return cls(os.environ.get(ENV) or None, run_dir, rank)

    @property
    def enabled(self) -> bool:
        return self.window is not None

    @property
    def last(self) -> int:
        return self.window[0] + self.window[1] - 1

    def _action(self, i: int) -> ProfilerAction:
        step = self._start_step + 1 + i  # the trainer step the profiler's i-th step() closes
        first, last = self.window[0], self.last
        if step == first - 1:
            return ProfilerAction.WARMUP
        if first <= step < last:
            return ProfilerAction.RECORD
        if step == last:
            return ProfilerAction.RECORD_AND_SAVE
        return ProfilerAction.NONE

    def _save(self, prof: profile) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"rank{self.rank}.steps{self.window[0]}-{self.last}.json"
        prof.export_chrome_trace(str(path))
        as_async_spans(path)
        self.path = path

    def start(self, step: int = 0) -> "StepProfiler":
        """Before the loop; `step` is the number of steps already done (non-zero after a resume). A window that is
        already behind the run stays off."""
        if self.enabled and self.last <= step:
            self.window = None
        if not self.enabled:
            return self
        self._start_step = step
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self._prof = profile(activities=activities, schedule=self._action, on_trace_ready=self._save,
                             record_shapes=self.record_shapes, with_stack=self.with_stack)
        self._prof.start()
        return self

    def step(self) -> None:
        """After each optimizer step; once the window is written the profiler is shut down."""
        if self._prof is None:
            return
        self._prof.step()
        if self.path is not None:
            self.stop()

    def stop(self) -> None:
        if self._prof is not None:
            prof, self._prof = self._prof, None
            prof.stop()
