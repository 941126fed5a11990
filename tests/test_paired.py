"""dtrain.analysis.paired: interleaved jobs compared step by step against a baseline and the run without communication."""

import json

import pytest

from dtrain.analysis import paired
from dtrain.common import rundir
from dtrain.common.errors import UserError

# per configuration: (step ms over the step's shared drift, CPU ms of the training, backend and other threads)
CONFIGS = {"noop": (500.0, (400.0, 0.0, 0.0)), "ddp-2": (650.0, (420.0, 30.0, 0.0)),
           "sharded-8": (590.0, (415.0, 20.0, 10.0))}


def write_job(root, seed, steps=20, rank1=False):
    """An interleaved job's folder: each configuration's run, every step slowed by the same drift."""
    for name, (ms, cpu) in CONFIGS.items():
        run = root / f"multi30k-cpu-{name}"
        run.mkdir(parents=True)
        rows = []
        for s in range(1, steps + 1):
            drift = 40.0 * ((s * 7 + seed) % 5)  # the machine's speed, shared by the configurations of a step
            rows.append({"step": s, "step_ms": ms + drift, "forward_ms": 100.0, "backward_ms": 200.0,
                         "comm_exposed_ms": 0.0, "optimizer_ms": 20.0, "cpu_main_ms": cpu[0] + drift,
                         "cpu_backend_ms": cpu[1], "cpu_other_ms": cpu[2], "minor_faults": 3})
        (run / rundir.STEPS).write_text("".join(json.dumps(r) + "\n" for r in rows))
        if rank1:
            (run / rundir.rank_steps_file(1)).write_text(
                "".join(json.dumps({"step": r["step"], "step_ms": r["step_ms"] + 5}) + "\n" for r in rows))
    return root


def test_paired_against_the_baseline_and_noop(tmp_path):
    jobs = [str(write_job(tmp_path / f"job{i}", seed=i)) for i in (1, 2)]
    configs = paired.load_jobs(jobs)
    assert set(configs) == {"noop", "ddp-2", "sharded-8"}  # the profile's name, shared by all, left out
    assert len(configs["noop"].steps) == 2 * (20 - 3)  # steady: the first max(3, 10%) steps left out
    rows = {r.name: r for r in paired.compare(configs, "ddp-2", "noop", cpu=True)}
    sh = rows["sharded-8"]
    assert sh.paired_ms == (-60.0, -60.0, -60.0)  # the drift cancels step by step
    assert sh.of_paired_overhead == pytest.approx(60 / 150)
    assert sh.overhead_removed == pytest.approx((rows["ddp-2"].median_ms - sh.median_ms)
                                                / (rows["ddp-2"].median_ms - rows["noop"].median_ms))
    assert rows["ddp-2"].vs_baseline == 1.0 and rows["ddp-2"].paired_ms is None
    assert sh.cpu_over_noop_ms["cpu_ms"][0] == pytest.approx(45.0)  # 15 + 20 + 10
    assert sh.cpu_over_noop_ms["cpu_backend_ms"][0] == pytest.approx(20.0)
    assert sh.cpu_over_noop_ms["off_cpu_ms"][0] == pytest.approx(90.0 - 45.0)
    assert sh.minor_faults == 3


def test_rank_records_and_the_command_line(tmp_path, capsys):
    jobs = [str(write_job(tmp_path / f"job{i}", seed=i, rank1=True)) for i in (1, 2)]
    rank1 = paired.load_jobs(jobs, rank=1, warmup=5)
    assert min(s for _, s in rank1["noop"].steps) == 6 and rank1["noop"].median() > 500
    assert paired.main(jobs + ["--baseline", "ddp-2", "--cpu", "--warmup", "5"]) == 0
    out = capsys.readouterr().out
    assert "sharded-8" in out and "-60.0 (-60.0 .. -60.0)" in out and "off CPU" in out
    assert paired.main(jobs + ["--noop", "none", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["noop"] is None and all(r["overhead_removed"] is None for r in doc["rows"])


def test_bad_input_is_one_line(tmp_path, capsys):
    job = str(write_job(tmp_path / "job1", seed=1))
    with pytest.raises(UserError, match=r"--baseline ddp-25: no such configuration \(there are: ddp-2, noop, "):
        paired.compare(paired.load_jobs([job]), "ddp-25", "noop")
    with pytest.raises(UserError, match="no steps.rank1.jsonl .*train.record_ranks"):
        paired.load_jobs([job], rank=1)
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as e:
        paired.main([str(tmp_path / "empty")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no runs there" in err
