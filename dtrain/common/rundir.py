"""The run directory: its file names, the records a run writes (typed), and reading and writing them.

    <run>/config.yaml      the resolved profile (every default filled in)
    <run>/run.json         header: versions, backend, world size, host, the sync strategy's facts, parameter count,
                           the precision (`amp`, the profile's `amp_setting` and the `amp_reason` for the choice)
    <run>/steps.jsonl      one `StepRecord` per optimizer step: loss, tokens, lr, phase times in ms
    <run>/buckets.jsonl    one `BucketRecord` per step and gradient bucket, for strategies that record them
    <run>/buckets.rank<r>.jsonl   the same from rank r > 0 (`train.record_ranks`), each on its own clock
    <run>/steps.rank<r>.jsonl     rank r > 0's step time and CPU time by thread (`train.record_ranks`)
    <run>/eval.jsonl       a `ValRecord` every `train.val_every` steps; the BLEU score with its signature at the end
    <run>/launch.json      how `dtrain.analysis.sweep` launched the run, and how it ended
    <run>/tuning.csv       `sync.strategy: auto`: one row per candidate of the search (TUNING_COLUMNS)
    <run>/tuned.json       ... the winner and its sync keys, which a resumed run takes

Records are written from the dataclasses below, one JSON object a line, in a fixed key order. They are read back
as the JSON objects themselves (dicts): runs written before a field existed lack it, so a reader relies only on
the fields it checks (`check_numbers`, with the field lists below) and treats the rest as optional.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from dtrain.common.errors import UserError
from dtrain.common.jsonl import read_jsonl

CONFIG = "config.yaml"
HEADER = "run.json"
STEPS = "steps.jsonl"
BUCKETS = "buckets.jsonl"
EVALS = "eval.jsonl"
LAUNCH = "launch.json"
TUNING = "tuning.csv"
TUNED = "tuned.json"
TUNING_COLUMNS = ("candidate", "sync", "lossless", "predicted_ms", "predicted_rank", "measured_ms", "diff_ms",
                  "diff_low", "diff_high", "rounds", "steps", "status", "reason")
TUNING_FINAL = ("winner", "dropped: predicted", "dropped: measured", "kept: budget")  # a candidate's last status


def rank_buckets_file(rank: int) -> str:
    """Where rank `rank` > 0 writes its bucket records with `train.record_ranks`."""
    return f"buckets.rank{rank}.jsonl"


def rank_steps_file(rank: int) -> str:
    """Where rank `rank` > 0 writes its step time and CPU time by thread with `train.record_ranks`."""
    return f"steps.rank{rank}.jsonl"


# ---------------------------------------------------------------------------------------------------------------
# Records


@dataclass
class StepRecord:
    """One optimizer step over `train.accum_steps` micro-batches (times in ms, summed over the micro-batches)."""

    step: int
    epoch: int
    loss: float  # per target token, this rank's micro-batches
    tokens: int  # target tokens of this rank's micro-batches
    lr: float
    grad_norm: float  # of the synchronized gradients
    skipped: bool  # non-finite gradients: the update was not applied
    data_ms: float
    forward_ms: float
    backward_ms: float
    comm_exposed_ms: float  # in `wait()`: communication the optimizer waited for
    optimizer_ms: float
    step_ms: float
    time: float  # Unix time at the end of the step
    # Host CPU time by thread (`dtrain.engine.host_cpu`), then GPU utilization, memory and power (`dtrain.engine.telemetry`),
    # written after the other fields when sampled
    telemetry: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        out = {k: v for k, v in vars(self).items() if k != "telemetry"}
        return out | self.telemetry


@dataclass
class BucketRecord:
    """One gradient bucket of one synchronized step. Times in ms from the start of the backward (None where not
    measured, e.g. DDP's built-in all-reduce); on disk the tensor class is `class` and the size `bytes`."""

    bucket: int  # index: launch order
    tensor_class: str  # `dtrain.collectives.tensor_classes`; "mixed" for a bucket of several classes
    dtype: str  # of the gradients, e.g. "float32"
    wire_dtype: str  # what goes on the wire: fp32, bf16, fp16, powersgd
    tensors: int | None
    numel: int
    nbytes: int  # on the wire
    ready_ms: float | None = None  # all its gradients ready
    launch_ms: float | None = None
    complete_ms: float | None = None
    wait_start_ms: float | None = None  # `wait()` called (the same for every bucket of the step)
    wait_ms: float | None = None  # blocked on this bucket in `wait()`
    # A part of a tensor's communication: "projection" or "lookup" of a split tied embedding (`dtrain.collectives.tied_split`),
    # "reduce_scatter" (backward) or "all_gather" (the next forward) of a sharded bucket (`dtrain.collectives.sharded`).
    part: str | None = None
    # The computing thread's time for the part's own work (a split lookup's: its mask in forward, its rows, adding
    # them), which the model without that part would not spend.
    host_ms: float | None = None

    def to_json(self, step: int) -> dict:
        out = {"step": step, "bucket": self.bucket, "class": self.tensor_class, "dtype": self.dtype,
               "wire_dtype": self.wire_dtype, "tensors": self.tensors, "numel": self.numel, "bytes": self.nbytes,
               "ready_ms": self.ready_ms, "launch_ms": self.launch_ms, "complete_ms": self.complete_ms,
               "wait_start_ms": self.wait_start_ms, "wait_ms": self.wait_ms}
        if self.part is not None:
            out["part"] = self.part
        if self.host_ms is not None:
            out["host_ms"] = self.host_ms
        return out


@dataclass
class ValRecord:
    """Validation loss over the whole val split, summed across ranks (nats per target token)."""

    step: int
    val_nll: float
    val_ppl: float

    def to_json(self) -> dict:
        return {"kind": "val", "step": self.step, "val_nll": self.val_nll, "val_ppl": self.val_ppl}


# What readers compute with: these fields must be numbers (the optional ones numbers or null).
STEP_NUMBERS = ("step", "step_ms", "forward_ms", "backward_ms", "optimizer_ms")
STEP_OPTIONAL_NUMBERS = ("data_ms", "comm_exposed_ms")
BUCKET_NUMBERS = ("step", "bucket", "bytes")
BUCKET_TIMES = ("ready_ms", "launch_ms", "complete_ms", "wait_start_ms")  # null where not measured


def check_numbers(rows: list[dict], path: Path, required: tuple, optional: tuple = ()) -> None:
    """A one-line error naming the file, the record and the fields unless every `required` field of every row is a
    finite number and every `optional` one a finite number or null."""
    def number(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    for k, row in enumerate(rows, 1):
        bad = [f for f in required if not number(row.get(f))]
        bad += [f for f in optional if row.get(f) is not None and not number(row[f])]
        if bad:
            raise UserError(f"{path}: record {k}: {', '.join(bad)} must be a number")


# ---------------------------------------------------------------------------------------------------------------
# Reading


def read_json(path: Path, strict: bool = False) -> dict:
    """A JSON object file ({} if there is none). Unreadable or not an object: {} or, `strict`, a one-line error."""
    path = Path(path)
    if not path.is_file():
        return {}
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError) as e:
        if strict:
            raise UserError(f"{path}: not JSON ({e.__class__.__name__})") from e
        return {}
    if not isinstance(doc, dict):
        if strict:
            raise UserError(f"{path}: not a JSON object")
        return {}
    return doc


def read_config(run_dir: Path) -> dict:
    """config.yaml as written ({} if missing or unreadable); `dtrain.engine.config.load_recorded` is the checked reading."""
    try:
        return yaml.safe_load((Path(run_dir) / CONFIG).read_text()) or {}
    except (OSError, yaml.YAMLError):
        return {}


def read_steps(run_dir: Path, rank: int = 0) -> list[dict]:
    """Rank `rank`'s step records (those with a step time: the trainer writes one in every record)."""
    return [s for s in read_jsonl(Path(run_dir) / (STEPS if rank == 0 else rank_steps_file(rank))) if "step_ms" in s]


def read_buckets(run_dir: Path, rank: int = 0) -> list[dict]:
    """Rank `rank`'s bucket records, in file order."""
    return read_jsonl(Path(run_dir) / (BUCKETS if rank == 0 else rank_buckets_file(rank)))


def read_evals(run_dir: Path) -> list[dict]:
    return read_jsonl(Path(run_dir) / EVALS)
