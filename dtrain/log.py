"""What a run writes (rank 0, and with train.record_ranks each other rank's bucket records): the resolved config, a
header, JSONL step and eval records.

    <run>/config.yaml      the resolved profile (every default filled in)
    <run>/run.json         header: versions, backend, world size, host, sync strategy facts, parameter count
    <run>/steps.jsonl      one record per optimizer step: loss, tokens, lr, phase times in ms
    <run>/buckets.jsonl    per step and gradient bucket, for strategies that record them: bytes, class, timings
    <run>/buckets.rank<r>.jsonl   the same from rank r > 0 (train.record_ranks), each on its own clock
    <run>/eval.jsonl       validation loss every train.val_every steps; BLEU with its signature at the end
    <run>/checkpoints/     see dtrain.checkpoint
"""

from __future__ import annotations

import json
import os
import platform
import socket
import time
from pathlib import Path

import torch

from dtrain import config as config_mod
from common.errors import UserError
from common.jsonl import read_jsonl


def prepare_run_dir(run_dir: Path, resume: bool) -> None:
    """Create the run directory; refuse to start a fresh run on top of an existing one."""
    if not resume and (run_dir / "steps.jsonl").exists():
        raise UserError(f"{run_dir}: already holds a run; pass --resume to continue it or choose another --run-dir")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise UserError(f"{run_dir}: run directory is not writable ({e.strerror or e})") from None


def versions() -> dict:
    v = {"torch": torch.__version__, "python": platform.python_version()}
    if torch.cuda.is_available():
        v["cuda"] = torch.version.cuda
        v["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        v["gpu"] = torch.cuda.get_device_name()
    return v


class RunWriter:
    """Appends records; on resume, drops step records past the checkpoint so the file matches the model again.
    `enabled`: this rank writes the run's records (rank 0). A rank > 0 with `rank_records` writes only its bucket
    records, to its own file (`rank_file`), in the same run directory."""

    def __init__(self, run_dir: Path, enabled: bool, rank: int = 0, rank_records: bool = False):
        self.run_dir, self.enabled, self.rank = Path(run_dir), enabled, rank
        self.rank_records = rank_records and rank > 0 and not enabled
        if self.rank_records:  # rank 0 made it already where the directory is shared; not where it is not
            self.run_dir.mkdir(parents=True, exist_ok=True)

    def write_header(self, cfg, **facts) -> None:
        if not self.enabled:
            return
        (self.run_dir / "config.yaml").write_text(config_mod.dump(cfg))
        header = {"name": cfg.name, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": socket.gethostname(),
                  "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                  "versions": versions(), **facts}
        (self.run_dir / "run.json").write_text(json.dumps(header, indent=2) + "\n")

    def truncate_after(self, step: int) -> int:
        """Keep only per-step records with step <= `step` (the ones the resumed model has seen); returns how many
        steps past it had been recorded, i.e. the steps the resumed run computes again. A rank > 0 truncates its
        own bucket records, if it wrote any."""
        recomputed = 0
        names = ("steps.jsonl", "buckets.jsonl") if self.enabled else (rank_file(self.rank),) if self.rank else ()
        for name in names:
            path = self.run_dir / name
            if not path.exists():
                continue
            records = read_jsonl(path)  # a line torn by the crash being resumed from is dropped here
            kept = [r for r in records if isinstance(r.get("step"), int) and r["step"] <= step]
            if name == "steps.jsonl":
                recomputed = len(records) - len(kept)
            tmp = path.with_name(f".{name}.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
            os.replace(tmp, path)
        return recomputed

    def _append(self, name: str, records: list[dict], write: bool | None = None) -> None:
        """One open and one write per call, however many records (a step can carry a hundred bucket records)."""
        if (self.enabled if write is None else write) and records:
            with open(self.run_dir / name, "a") as f:
                f.write("".join(json.dumps(r) + "\n" for r in records))

    def step(self, record: dict) -> None:
        self._append("steps.jsonl", [record])

    def buckets(self, step: int, records: list[dict]) -> None:
        """Rank 0: buckets.jsonl; a rank > 0 with `rank_records`: its own file."""
        rows = [{"step": step, **r} for r in records]
        if self.enabled:
            self._append("buckets.jsonl", rows)
        else:
            self._append(rank_file(self.rank), rows, write=self.rank_records)

    def eval(self, record: dict) -> None:
        self._append("eval.jsonl", [record])


def rank_file(rank: int) -> str:
    """Where rank `rank` > 0 writes its bucket records with `train.record_ranks`."""
    return f"buckets.rank{rank}.jsonl"
