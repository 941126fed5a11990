"""dtrain.engine.log and dtrain.common.rundir: what a run writes (typed records, JSON on disk as before), and what a resume keeps
of it."""

import json
from types import SimpleNamespace

import pytest

from dtrain.common import rundir
from dtrain.common.errors import UserError
from dtrain.common.jsonl import read_jsonl
from dtrain.common.rundir import BucketRecord, StepRecord, ValRecord
from dtrain.engine.log import RunWriter
from dtrain.engine.trainer import Trainer, samples_file

from conftest import REPO

SMOKE = REPO / "tests" / "data" / "runs" / "smoke"


def step_record(step: int, step_ms: float = 10.0) -> StepRecord:
    return StepRecord(step, 0, loss=7.0, tokens=100, lr=1e-3, grad_norm=1.0, skipped=False, data_ms=0.1,
                      forward_ms=1.0, backward_ms=2.0, comm_exposed_ms=0.5, optimizer_ms=1.0, step_ms=step_ms,
                      time=1.0)


def bucket_record(ready_ms: float) -> BucketRecord:
    return BucketRecord(0, "ffn", dtype="float32", wire_dtype="fp32", tensors=2, numel=16, nbytes=64,
                        ready_ms=ready_ms, launch_ms=ready_ms, complete_ms=ready_ms + 1, wait_start_ms=5.0,
                        wait_ms=0.0)


def test_records_are_written_with_the_keys_and_order_of_the_recorded_runs():
    """The typed records write exactly the JSON objects runs have always held (tests/data/runs: real runs)."""
    steps = read_jsonl(SMOKE / "smoke-bucketed-bucket_cap_mb=1" / rundir.STEPS)
    buckets = read_jsonl(SMOKE / "smoke-bucketed-bucket_cap_mb=1" / rundir.BUCKETS)
    evals = read_jsonl(SMOKE / "smoke-bucketed-bucket_cap_mb=1" / rundir.EVALS)
    assert list(step_record(1).to_json()) == list(steps[0])
    assert list(bucket_record(1.0).to_json(9)) == list(buckets[0])
    val = next(e for e in evals if e["kind"] == "val")
    assert list(ValRecord(1, 5.0, 148.4).to_json()) == list(val)
    rec = step_record(1)
    rec.telemetry.update(gpu_util_pct=50.0, gpu_mem_mib=None)  # sampled GPU figures follow the phase times
    assert list(rec.to_json())[-3:] == ["time", "gpu_util_pct", "gpu_mem_mib"]


def test_other_ranks_write_their_bucket_records_and_truncate_their_own_on_resume(tmp_path):
    (tmp_path / "run").mkdir()  # the trainer makes it before writing
    main, other = RunWriter(tmp_path / "run", True), RunWriter(tmp_path / "run", False, rank=1, rank_records=True)
    for step in (1, 2, 3):
        main.step(step_record(step))
        main.buckets(step, [bucket_record(1.0)])
        rec = step_record(step)
        rec.telemetry.update(cpu_main_ms=7.5, cpu_backend_ms=1.0, cpu_other_ms=0.0, minor_faults=12)
        other.step(rec)
        other.buckets(step, [bucket_record(2.0)])
    other.buckets(4, [])  # nothing to write: no empty lines either
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / rundir.rank_buckets_file(1))] == [1, 2, 3]
    assert read_jsonl(tmp_path / "run" / "buckets.jsonl")[0] == bucket_record(1.0).to_json(1)
    # Rank 1's steps: its step time, CPU by thread and page faults only (the run's loss and phases are rank 0's)
    row = read_jsonl(tmp_path / "run" / rundir.rank_steps_file(1))[0]
    assert set(row) == {"step", "step_ms", "time", "cpu_main_ms", "cpu_backend_ms", "cpu_other_ms",
                        "minor_faults"}
    assert row["step"] == 1 and row["cpu_main_ms"] == 7.5
    # Resuming at step 2: rank 0 keeps its records up to 2 and counts the step to recompute; rank 1 its own.
    assert main.truncate_after(2) == 1
    assert other.truncate_after(2) == 0
    for name in ("steps.jsonl", "buckets.jsonl", rundir.rank_buckets_file(1), rundir.rank_steps_file(1)):
        assert [r["step"] for r in read_jsonl(tmp_path / "run" / name)] == [1, 2], name
    # A rank that never wrote records has nothing to truncate.
    assert RunWriter(tmp_path / "run", False, rank=2).truncate_after(1) == 0
    assert not (tmp_path / "run" / rundir.rank_buckets_file(2)).exists()
    assert json.loads((tmp_path / "run" / rundir.rank_buckets_file(1)).read_text().splitlines()[0])["ready_ms"] == 2.0


def test_eval_records_validation_and_bleu(tmp_path):
    w = RunWriter(tmp_path, True)
    w.eval(ValRecord(6, 5.0, 148.4))
    w.eval({"kind": "bleu", "step": 6, "bleu": 1.5, "signature": "nrefs:1"})  # sacreBLEU's fields, as they come
    assert [e["kind"] for e in rundir.read_evals(tmp_path)] == ["val", "bleu"]
    RunWriter(tmp_path, False, rank=1).eval(ValRecord(7, 5.0, 148.4))  # only rank 0 writes the run's records
    assert len(rundir.read_evals(tmp_path)) == 2


def test_a_line_torn_by_a_crash_is_dropped_and_any_other_bad_line_is_named(tmp_path):
    p = tmp_path / "steps.jsonl"
    p.write_text('{"step": 1, "step_ms": 5.0}\n{"step": 2, "step_ms": 5.0}\n{"step": 3, "st')  # crash mid-write
    assert [r["step"] for r in read_jsonl(p)] == [1, 2]
    # A resume keeps the complete records and leaves a well-formed file.
    (tmp_path / "buckets.jsonl").write_text("")
    assert RunWriter(tmp_path, True).truncate_after(5) == 0
    assert p.read_text() == '{"step": 1, "step_ms": 5.0}\n{"step": 2, "step_ms": 5.0}\n'
    # A bad line with records after it is not a torn tail: an error naming the file and line, the file untouched.
    p.write_text('{"step": 1}\n{"step": 2,,}\n{"step": 3}\n')
    with pytest.raises(UserError, match=r"steps.jsonl:2: not a JSON record"):
        read_jsonl(p)
    with pytest.raises(UserError, match=r"steps.jsonl:2: not a JSON record"):
        RunWriter(tmp_path, True).truncate_after(1)
    assert p.read_text() == '{"step": 1}\n{"step": 2,,}\n{"step": 3}\n'
    p.write_text('{"step": 1}\n[1, 2]\n')
    with pytest.raises(UserError, match=r"steps.jsonl:2: not a JSON object"):
        read_jsonl(p)


def test_the_fields_computed_with_must_be_numbers(tmp_path):
    rows = [{"step": 1, "bucket": 0, "bytes": 64, "ready_ms": None}, {"step": 2, "bucket": 0, "bytes": "64"}]
    rundir.check_numbers(rows[:1], tmp_path / "b.jsonl", rundir.BUCKET_NUMBERS, rundir.BUCKET_TIMES)
    with pytest.raises(UserError, match=r"b.jsonl: record 2: bytes must be a number"):
        rundir.check_numbers(rows, tmp_path / "b.jsonl", rundir.BUCKET_NUMBERS, rundir.BUCKET_TIMES)
    (tmp_path / "run.json").write_text("[1]")
    assert rundir.read_json(tmp_path / "run.json") == {}
    with pytest.raises(UserError, match="run.json: not a JSON object"):
        rundir.read_json(tmp_path / "run.json", strict=True)


def test_relocating_a_run_moves_each_file_once_by_the_rank_that_writes_it(tmp_path):
    """The tuner's winner continues in the run's own folder (`Trainer.relocate`), the run directory shared by all
    ranks: rank 0 moves the run's files, each rank its own per-rank files."""
    old, new = tmp_path / "candidate", tmp_path / "run"
    old.mkdir()
    for name in ("steps.jsonl", "buckets.jsonl", rundir.rank_buckets_file(1), rundir.rank_steps_file(1),
                 samples_file(0), samples_file(1)):
        (old / name).write_text(json.dumps({"step": 1, "file": name}) + "\n")
    cfg = SimpleNamespace(train=SimpleNamespace(record_ranks=True))
    for rank in (0, 1):
        Trainer.relocate(SimpleNamespace(run_dir=old, main=rank == 0, rank=rank, cfg=cfg), new)
    for name in ("steps.jsonl", "buckets.jsonl", rundir.rank_buckets_file(1), rundir.rank_steps_file(1),
                 samples_file(0), samples_file(1)):
        assert [r["file"] for r in read_jsonl(new / name)] == [name], name
