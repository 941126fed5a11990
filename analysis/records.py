"""A run's records as pandas frames: the run.json header, the resolved config, steps, buckets and evals.

Sits between what a run writes (`dtrain.log`) and everything that reads it back (`analysis.report`, `analysis.sweep`):
the record schema is read here and nowhere else in the report. Also: whether a run has finished (the sweep's resume
test), the sweep's launch record of a run, and benchmark rows of `collectives.bench` as a frame.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import yaml

from analysis.simulate import CAPPED  # strategies whose buckets follow sync.bucket_cap_mb
from common.jsonl import read_jsonl

# Phase columns of steps.jsonl in the order a step runs them (ms); what is left of step_ms is "other".
PHASES = ("data_ms", "forward_ms", "backward_ms", "comm_exposed_ms", "optimizer_ms")
LAUNCH_FILE = "launch.json"  # written into a run directory by analysis.sweep: how it was launched, and how it ended
DEFAULT_CAP_MB = 25.0  # sync.bucket_cap_mb: null means DDP's 25 MiB, for the planned strategies too


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _yaml(path: Path) -> dict:
    try:
        return yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return {}


def _frame(path: Path) -> pd.DataFrame:
    return pd.DataFrame(read_jsonl(path))


@dataclass
class Run:
    """Everything one run directory holds, loaded once."""

    path: Path
    header: dict  # run.json
    config: dict  # config.yaml (the resolved profile)
    launch: dict  # launch.json, when the sweep launched it
    steps: pd.DataFrame
    buckets: pd.DataFrame
    evals: pd.DataFrame
    label: str = field(default="")

    def __post_init__(self):
        self.label = self.label or self.path.name

    # -- what it was ----------------------------------------------------------------------------------------------

    @property
    def sync(self) -> dict:
        return self.header.get("sync") or {}

    @property
    def strategy(self) -> str:
        return self.sync.get("strategy") or self.config.get("sync", {}).get("strategy") or "?"

    @property
    def communicates(self) -> bool:
        """False only for the no-communication baseline: headroom in timing figures, never a quality result."""
        return self.sync.get("communicates", True) is not False

    @property
    def bucket_cap_mb(self) -> float | None:
        """The cap that shaped the buckets, or None for strategies that have no cap."""
        if self.strategy not in CAPPED:
            return None
        cap = self.config.get("sync", {}).get("bucket_cap_mb")
        return float(cap) if cap is not None else DEFAULT_CAP_MB

    @property
    def series(self) -> str:
        """What a figure's legend calls this configuration: the strategy, and the sweep's variant if any."""
        variant = self.launch.get("variant")
        return f"{self.strategy} {variant}" if variant else self.strategy

    @property
    def machine(self) -> str:
        """Where it ran, from run.json (and the sweep's launch record for the emulated testbed)."""
        h = self.header
        if not h:
            return "unknown machine (no run.json)"
        v = h.get("versions", {})
        where = f"{h.get('host', '?')} ({h.get('cpu', '?')}, {h.get('cpus', '?')} CPUs"
        where += f", {v['gpu']})" if v.get("gpu") else ")"
        ranks = f"{h.get('world_size', '?')} ranks, {h.get('backend', '?')}"
        if self.launch.get("launcher") == "testbed":
            ranks += f" over {self.launch.get('nodes', '?')} emulated nodes"
            if self.launch.get("link"):
                ranks += f" ({self.launch['link']} links)"
        else:
            ranks += " on one host"
        soft = f"torch {v.get('torch', '?')}" + (f", NCCL {v['nccl']}" if v.get("nccl") else "")
        return f"{where}, {ranks}, {soft}"

    # -- what it measured -----------------------------------------------------------------------------------------

    def measured(self, warmup: int) -> pd.DataFrame:
        """Step records after warm-up; a run shorter than that keeps its second half rather than nothing."""
        s = self.steps
        if s.empty:
            return s
        skip = warmup if len(s) > warmup else len(s) // 2
        return s.iloc[skip:]

    @property
    def bleu(self) -> dict | None:
        """The last BLEU record (the score of the final, possibly averaged, model)."""
        if self.evals.empty or "kind" not in self.evals:
            return None
        b = self.evals[self.evals["kind"] == "bleu"]
        return None if b.empty else b.iloc[-1].dropna().to_dict()

    @property
    def val(self) -> pd.DataFrame:
        if self.evals.empty or "kind" not in self.evals:
            return pd.DataFrame(columns=["step", "val_nll"])
        return self.evals[self.evals["kind"] == "val"][["step", "val_nll"]].reset_index(drop=True)


def load_run(path: str | Path) -> Run:
    p = Path(path)
    return Run(p, _json(p / "run.json"), _yaml(p / "config.yaml"), _json(p / LAUNCH_FILE), _frame(p / "steps.jsonl"),
               _frame(p / "buckets.jsonl"), _frame(p / "eval.jsonl"))


def is_run_dir(path: Path) -> bool:
    """A run's folder: records, or at least the sweep's note of a launch (a run that failed before its first step)."""
    return any((path / f).is_file() for f in ("steps.jsonl", "run.json", LAUNCH_FILE))


def find_runs(paths: list[str | Path]) -> list[Path]:
    """Run directories among `paths`: each is a run, or a folder (a sweep's) whose sub-folders are runs."""
    found = []
    for p in map(Path, paths):
        if is_run_dir(p):
            found.append(p)
        elif p.is_dir():
            found += sorted((c for c in p.iterdir() if c.is_dir() and is_run_dir(c)), key=natural_key)
    return list(dict.fromkeys(found))


def natural_key(path: Path) -> list:
    """Numbers in a name compare as numbers: bucket_cap_mb=2 before bucket_cap_mb=32 before ...=128."""
    return [float(part) if i % 2 else part for i, part in enumerate(re.split(r"(\d+(?:\.\d+)?)", path.name))]


def load_runs(paths: list[str | Path]) -> list[Run]:
    return [load_run(p) for p in find_runs(paths)]


def finished(path: str | Path) -> bool:
    """Whether a run's records say it ended normally (the sweep skips those).

    The trainer validates once more after its last step and, when `eval.at_end` holds and the strategy
    communicates, writes a BLEU record after that: so a finished run has a val record at its last step, that step is
    `train.max_steps` unless a wall-clock budget stopped it, and the BLEU record is there when one was due.
    """
    p = Path(path)
    steps, evals, cfg = read_jsonl(p / "steps.jsonl"), read_jsonl(p / "eval.jsonl"), _yaml(p / "config.yaml")
    if not steps or not cfg:
        return False
    last = steps[-1]["step"]
    train = cfg.get("train", {})
    if train.get("max_minutes") is None and last < train.get("max_steps", 0):
        return False
    if not any(e.get("kind") == "val" and e.get("step") == last for e in evals):
        return False
    communicates = (_json(p / "run.json").get("sync") or {}).get("communicates", True) is not False
    if cfg.get("eval", {}).get("at_end", True) and communicates:
        return any(e.get("kind") == "bleu" for e in evals)
    return True


def load_bench(path: str | Path) -> pd.DataFrame:
    """Rows of a `collectives.bench` JSON/CSV (or an nccl-tests log): size (B), time_us, algbw, busbw (GB/s), label
    (the code path, raw or reducer, when both were measured). Rows that failed the correctness pass are left out."""
    from collectives.costmodel import read_measurements

    ms = read_measurements(path)
    df = pd.DataFrame([vars(m) for m in ms.rows])
    df["source"] = str(path)
    df["ranks"] = ms.ranks
    return df
