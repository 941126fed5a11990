"""What a run writes (rank 0, and with train.record_ranks each other rank's bucket records, step times and CPU): the
resolved config, a header, and the JSONL step, bucket and eval records; the files and the records are those of
`dtrain.common.rundir`.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import socket
import time
from pathlib import Path

import torch

import dtrain
from dtrain.common import rundir
from dtrain.common.checkout import git_commit
from dtrain.common.errors import UserError
from dtrain.common.jsonl import append_jsonl, read_jsonl, rewrite_jsonl
from dtrain.common.rundir import BucketRecord, StepRecord, ValRecord
from dtrain.engine import config as config_mod
from dtrain.engine.host_cpu import FIELDS as HOST_CPU_FIELDS


def prepare_run_dir(run_dir: Path, resume: bool) -> None:
    """Create the run directory; refuse to start a fresh run on top of an existing one."""
    if not resume and (run_dir / rundir.STEPS).exists():
        raise UserError(f"{run_dir}: already holds a run; pass --resume to continue it or choose another --run-dir")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise UserError(f"{run_dir}: run directory is not writable ({e.strerror or e})") from None


@functools.cache
def source() -> dict:
    """The git commit of the checkout dtrain was imported from ("dirty": True with changes), {} for an installed
    copy; asked once per process, since the code a process runs does not change under it."""
    return git_commit(Path(dtrain.__file__).parent)


def versions() -> dict:
    """run.json's `versions`: dtrain's (and its commit, where it runs from a git checkout), torch's, Python's; with
    CUDA also the CUDA and NCCL versions and the GPU."""
    v = {"dtrain": dtrain.__version__, **source(), "torch": torch.__version__, "python": platform.python_version()}
    if torch.cuda.is_available():
        v["cuda"] = torch.version.cuda
        v["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        v["gpu"] = torch.cuda.get_device_name()
    return v


def cpu_model() -> dict:
    """The CPU's model name (Linux's /proc/cpuinfo, where there is one) and the instruction set torch's CPU kernels
    use: a CPU without bf16 instructions runs bf16 autocast many times slower than fp32, which changes what a run's
    step is made of."""
    facts = {"cpu_capability": torch.backends.cpu.get_cpu_capability()}
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    if names:
        facts["cpu_model"] = names[0]
    return facts


class RunWriter:
    """Appends records; on resume, drops step records past the checkpoint so the file matches the model again.
    `enabled`: this rank writes the run's records (rank 0). A rank > 0 with `rank_records` writes only its bucket
    records and its step time and CPU time by thread, to files of its own (`rundir.rank_buckets_file`,
    `rundir.rank_steps_file`), in the same run directory."""

    def __init__(self, run_dir: Path, enabled: bool, rank: int = 0, rank_records: bool = False):
        self.run_dir, self.enabled, self.rank = Path(run_dir), enabled, rank
        self.rank_records = rank_records and rank > 0 and not enabled
        if self.rank_records:  # rank 0 made it already where the directory is shared; not where it is not
            self.run_dir.mkdir(parents=True, exist_ok=True)

    def write_header(self, cfg, **facts) -> None:
        if not self.enabled:
            return
        (self.run_dir / rundir.CONFIG).write_text(config_mod.dump(cfg))
        header = {"name": cfg.name, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": socket.gethostname(),
                  "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(), **cpu_model(),
                  "versions": versions(), **facts}
        (self.run_dir / rundir.HEADER).write_text(json.dumps(header, indent=2) + "\n")

    def truncate_after(self, step: int) -> int:
        """Keep only per-step records with step <= `step` (the ones the resumed model has seen); returns how many
        steps past it had been recorded, i.e. the steps the resumed run computes again. A rank > 0 truncates its
        own bucket records, if it wrote any."""
        recomputed = 0
        names = ((rundir.STEPS, rundir.BUCKETS) if self.enabled
                 else (rundir.rank_buckets_file(self.rank), rundir.rank_steps_file(self.rank)) if self.rank else ())
        for name in names:
            path = self.run_dir / name
            if not path.exists():
                continue
            records = read_jsonl(path)  # a line torn by the crash being resumed from is dropped here
            kept = [r for r in records if isinstance(r.get("step"), int) and r["step"] <= step]
            if name == rundir.STEPS:
                recomputed = len(records) - len(kept)
            rewrite_jsonl(path, kept)
        return recomputed

    def step(self, record: StepRecord) -> None:
        """Rank 0: the whole record; a rank > 0 with `rank_records`: its step time, CPU time by thread and host memory."""
        if self.enabled:
            append_jsonl(self.run_dir / rundir.STEPS, [record.to_json()])
        elif self.rank_records:
            row = {"step": record.step, "step_ms": record.step_ms, "time": record.time}
            append_jsonl(self.run_dir / rundir.rank_steps_file(self.rank),
                         [row | {k: v for k, v in record.telemetry.items() if k in HOST_CPU_FIELDS}])

    def buckets(self, step: int, records: list[BucketRecord]) -> None:
        """Rank 0: buckets.jsonl; a rank > 0 with `rank_records`: its own file."""
        rows = [r.to_json(step) for r in records]
        if self.enabled:
            append_jsonl(self.run_dir / rundir.BUCKETS, rows)
        elif self.rank_records:
            append_jsonl(self.run_dir / rundir.rank_buckets_file(self.rank), rows)

    def eval(self, record: ValRecord | dict) -> None:
        """A validation record, or a BLEU score (a dict: its fields are sacreBLEU's, see `dtrain.engine.evaluate`)."""
        if self.enabled:
            append_jsonl(self.run_dir / rundir.EVALS,
                                  [record.to_json() if isinstance(record, ValRecord) else record])
