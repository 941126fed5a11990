"""Fault injection for tests and demonstrations (`--fault`, off by default): what a real cluster does to a job.

    crash@step=S,rank=R     rank R exits hard at the start of step S (first attempt only, so a restart recovers)
    hang@step=S,rank=R      rank R stops participating at step S (its peers must time out, not hang)
    nan@step=S,rank=R       rank R's gradient of one parameter is NaN at step S (before synchronization)
    slow@rank=R,ms=M        rank R sleeps M ms in every step (a straggler); with from=S, from step S on (one that
                            turns slow during the run)
"""

from __future__ import annotations

import os
import re
import sys
import time
from dataclasses import dataclass

import torch

from dtrain.common.errors import UserError

_KINDS = {"crash": {"step", "rank"}, "hang": {"step", "rank"}, "nan": {"step", "rank"}, "slow": {"rank", "ms"}}
_OPTIONAL = {"slow": {"from"}}


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int | None = None
    ms: int | None = None
    start: int = 1  # slow: the first step it sleeps in (`from`)


def parse(spec: str) -> Fault:
    """`kind@key=value,key=value` → Fault; anything else is a one-line error naming the part at fault."""
    m = re.fullmatch(r"(\w+)@(.*)", spec.strip())
    if not m or m.group(1) not in _KINDS:
        raise UserError(f"--fault '{spec}': expected one of {', '.join(k + '@...' for k in _KINDS)}")
    kind, fields = m.group(1), {}
    for part in filter(None, m.group(2).split(",")):
        key, sep, value = part.partition("=")
        if not sep or not value.isdigit():
            raise UserError(f"--fault '{spec}': '{part}' must be key=<non-negative integer>")
        if key in fields:
            raise UserError(f"--fault '{spec}': '{key}' is given twice")
        fields[key] = int(value)
    optional = _OPTIONAL.get(kind, set())
    if not _KINDS[kind] <= set(fields) <= _KINDS[kind] | optional:
        takes = ", ".join(sorted(_KINDS[kind])) + (f" (and optionally {', '.join(sorted(optional))})" if optional else "")
        raise UserError(f"--fault '{spec}': {kind} takes exactly {takes}")
    if "from" in fields:
        fields["start"] = fields.pop("from")
    if kind != "slow" and fields["step"] < 1:
        raise UserError(f"--fault '{spec}': step counts from 1")
    return Fault(kind, **fields)


class FaultInjector:
    """Called by the trainer at fixed points of each step; does nothing for faults aimed at other ranks/steps."""

    def __init__(self, faults: list[Fault], rank: int):
        self.faults = [f for f in faults if f.rank == rank]
        self.first_attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0

    def _at(self, kind: str, step: int) -> bool:
        return any(f.kind == kind and f.step == step for f in self.faults)

    def step_start(self, step: int) -> None:
        """`step` is the step about to run (1-based)."""
        if self.first_attempt and self._at("crash", step):
            print(f"[fault] crash at step {step}", file=sys.stderr, flush=True)
            os._exit(17)  # no cleanup, no flush of anything else: like a killed process
        if self._at("hang", step):
            print(f"[fault] hang at step {step}", file=sys.stderr, flush=True)
            while True:
                time.sleep(3600)
        for f in self.faults:
            if f.kind == "slow" and step >= f.start:
                time.sleep(f.ms / 1000)

    def poison(self, step: int, model: torch.nn.Module):
        """A handle whose removal undoes it: makes one parameter's gradient NaN at `step`, before any sync hook."""
        if not self._at("nan", step):
            return None
        name, param = next(iter(model.named_parameters()))
        print(f"[fault] NaN gradient for {name} at step {step}", file=sys.stderr, flush=True)
        return param.register_hook(lambda g: torch.full_like(g, float("nan")))
