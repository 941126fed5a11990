"""The long commands other than `train` (a sweep, an interleaved job) print plain progress lines where stderr is not a
terminal: a batch job's log holds lines, not a bar's carriage-return redraws (`dtrain.common.progress.Bar`)."""

import contextlib
import os
import subprocess
import sys

import pytest
import yaml

from dtrain.analysis import sweep

from conftest import REPO

SMOKE = str(REPO / "dtrain" / "profiles" / "smoke.yaml")


def test_a_sweep_logs_plain_lines_into_a_file(tmp_path, monkeypatch):
    """The sweep's loop with its runs stubbed (each "takes" 40 s), stderr and stdout real files as under a batch job."""
    matrix = tmp_path / "m.yaml"
    matrix.write_text(yaml.safe_dump({"name": "m", "profiles": [SMOKE], "strategies": ["ddp", "flat", "bucketed"]}))
    m = sweep.load_matrix(str(matrix))
    clock = [0.0]
    monkeypatch.setattr("dtrain.common.progress.time.monotonic", lambda: clock[0])

    def run_job(m, job, out, env):
        clock[0] += 40.0
        return sweep.Outcome(job.name, "failed" if job.name.endswith("flat") else "finished", 0, "boom", 40.0)

    monkeypatch.setattr(sweep, "run_job", run_job)
    err, out = tmp_path / "stderr.log", tmp_path / "stdout.log"
    with open(err, "w") as e, open(out, "w") as o, contextlib.redirect_stderr(e), contextlib.redirect_stdout(o):
        outcomes = sweep.sweep(m, tmp_path / "out", sweep.expand(m))
    assert [x.status for x in outcomes] == ["finished", "failed", "finished"]
    assert b"\r" not in err.read_bytes()  # as written: read_text() would turn a carriage return into a newline
    log = err.read_text()
    assert log.splitlines() == [f"sweep m run {i}/3 done={i - (i > 1)} skipped=0 failed={int(i > 1)} "
                                f"elapsed {i * 40 // 60:02d}:{i * 40 % 60:02d} eta {(3 - i) * 40 // 60:02d}:"
                                f"{(3 - i) * 40 % 60:02d}" for i in (1, 2, 3)]
    assert out.read_text().splitlines() == ["smoke-ddp: finished in 40 s",
                                            "smoke-flat: FAILED (exit 0) after 40 s: boom",
                                            "smoke-bucketed: finished in 40 s"]


@pytest.mark.slow
def test_an_interleaved_job_s_log_has_no_bar_redraws(tmp_path):
    """The job itself, one rank, its stderr a file: what the testbed and Slurm leave as the job's log."""
    matrix = tmp_path / "m.yaml"
    matrix.write_text(yaml.safe_dump({
        "name": "il", "profiles": [SMOKE], "strategies": ["ddp", "bucketed"],
        "set": {"train.max_steps": 3, "eval.at_end": False, "train.average_last": 1, "train.ckpt_every": 100,
                "train.val_every": 0, "data.train_limit": 300, "model.N": 1}}))
    log = tmp_path / "job.err"
    with open(log, "w") as err:
        r = subprocess.run([sys.executable, "-m", "dtrain.analysis.interleave", "--matrix", str(matrix), "--out",
                            str(tmp_path / "out")], cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True,
                           timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    text = log.read_text()
    assert r.returncode == 0, r.stdout[-2000:] + text[-3000:]
    assert b"\r" not in log.read_bytes(), text[-2000:]  # as written: read_text() turns "\r" into a newline
    lines = text.splitlines()
    # each bar's last line, at its end (the job is shorter than a line's interval)
    assert any(line.startswith("building config 2/2 elapsed ") for line in lines), text
    assert any(line.startswith("interleaved x2 step 6/6 ") and " eta 00:00" in line for line in lines), text
    assert "2 configurations x 3 steps, interleaved" in r.stdout
