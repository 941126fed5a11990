"""dtrain.analysis.sweep: matrix checks (one-line errors naming the key, exit 2), run names and overrides, the resume
decision, error lines from a failed launch, and a real sweep with one impossible run: recorded, the others go on, and
a second sweep skips what finished."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dtrain.analysis import sweep
from dtrain.analysis.runs import finished
from dtrain.common import rundir
from dtrain.common.errors import UserError
from dtrain.engine import checkpoint
from dtrain.engine import config as config_mod

from conftest import REPO

RUNS = REPO / "tests" / "data" / "runs" / "smoke"


def write_matrix(tmp_path, **body) -> Path:
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump({"profiles": [str(REPO / "dtrain" / "profiles" / "smoke.yaml")], **body}, sort_keys=False))
    return path


@pytest.mark.parametrize("body, msg", [
    ({"strategy": ["ddp"]}, "unknown key 'strategy'; did you mean 'strategies'? (known: "),
    ({"nproc": "2"}, "'nproc' must be int, got '2'"),
    ({"bench": ["-b", "8"]}, "'bench' must be str"),
    ({"strategies": ["ddp", "nope"]}, "unknown strategy 'nope'"),
    ({"knobs": {"sync.bucket_cap": [1]}}, "'knobs.sync.bucket_cap' unknown key 'sync.bucket_cap'; did you mean 'sync.bucket_cap_mb'?"),
    ({"knobs": {"sync": [1]}}, "'knobs.sync' 'sync' is a section"),
    ({"knobs": {"train.max_steps": 3}}, "'knobs.train.max_steps' must be a non-empty list"),
    ({"only": {"sync.bucket_cap_mb": ["ddp"]}}, "'only.sync.bucket_cap_mb' names a knob"),
    ({"variants": {"a b": {"train.max_steps": 1}}}, "'variants.a b' must be named"),
    ({"variants": {"v": {"sync.strategy": "ddp"}}, "strategies": ["flat"]}, "conflicts with 'strategies'"),
    ({"set": {"train.max_step": 1}}, "'set.train.max_step' unknown key 'train.max_step'; did you mean 'train.max_steps'?"),
    ({"launcher": "slurm"}, "'launcher' must be one of torchrun, testbed"),
    ({"nodes": 2}, "'nodes' needs 'launcher: testbed'"),
    ({"nproc": 0}, "'nproc' must be a positive integer"),
])
def test_bad_matrix_is_one_line_naming_the_key(tmp_path, capsys, body, msg):
    with pytest.raises(SystemExit) as e:
        sweep.main(["--matrix", str(write_matrix(tmp_path, **body)), "--dry-run"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and msg in err and err.count("\n") == 1 and err.startswith("dtrain.analysis.sweep: error: ")


def test_missing_profiles_and_files(tmp_path):
    (tmp_path / "empty.yaml").write_text("name: x\n")
    with pytest.raises(UserError, match="'profiles' is required"):
        sweep.load_matrix(tmp_path / "empty.yaml")
    with pytest.raises(UserError, match="matrix not found"):
        sweep.load_matrix(tmp_path / "nope.yaml")
    with pytest.raises(UserError, match="'profiles' names 'p.yaml', which is neither a file nor a shipped profile"):
        sweep.load_matrix(write_matrix(tmp_path, profiles=["p.yaml"]))
    assert sweep.load_matrix(write_matrix(tmp_path, profiles=["smoke"])).profiles == ["smoke"]  # a shipped one


def test_class_keys_are_checked_below_any_class_name():
    assert sweep.check_key("sync.classes.embedding.wire_dtype") is None
    assert sweep.check_key("sync.classes.my_class") is None  # a whole entry
    assert sweep.check_key("sync.classes.ffn.protocol") is None
    assert sweep.check_key("collectives.default.protocol") is None
    assert "did you mean 'collectives.default.protocol'?" in sweep.check_key("collectives.default.proto")
    assert "is a value" in sweep.check_key("train.max_steps.x")
    assert "unknown key 'sync.classes.ffn.proto'; did you mean 'sync.classes.ffn.protocol'?" in \
        sweep.check_key("sync.classes.ffn.proto")


def test_matrix_errors_name_the_line(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text(f"profiles: [{REPO / 'dtrain' / 'profiles' / 'smoke.yaml'}]\nknobs:\n  sync.bucket_cap_mb: [1]\n"
                    f"variants:\n  v:\n    train.max_stpes: 3\n")
    with pytest.raises(UserError, match=r"m.yaml:6: 'variants.v.train.max_stpes' unknown key 'train.max_stpes'; did you mean 'train.max_steps'"):
        sweep.load_matrix(path)
    path.write_text("profiles: x.yaml\nlaunchr: testbed\n")
    with pytest.raises(UserError, match=r"m.yaml:2: unknown key 'launchr'"):
        sweep.load_matrix(path)
    path.write_text("- profiles\n")
    with pytest.raises(UserError, match=r"m.yaml: a matrix must be a mapping"):
        sweep.load_matrix(path)


def test_shipped_matrices_load_and_every_run_s_profile_loads(monkeypatch):
    monkeypatch.chdir(REPO)
    for path in sorted((REPO / "dtrain" / "profiles" / "sweeps").glob("*.yaml")):
        m = sweep.load_matrix(path)
        for job in sweep.expand(m):
            config_mod.load(job.profile, job.overrides)  # a knob its strategy ignores would be refused


def test_runs_are_named_from_their_settings_and_only_limits_a_knob(tmp_path):
    m = sweep.load_matrix(write_matrix(
        tmp_path, strategies=["flat", "bucketed"], knobs={"sync.bucket_cap_mb": [0.5, 4], "train.accum_steps": [1]},
        only={"sync.bucket_cap_mb": ["bucketed"]}, set={"train.max_steps": 3, "train.max_minutes": None}))
    jobs = sweep.expand(m)
    assert [j.name for j in jobs] == ["smoke-flat-accum_steps=1", "smoke-bucketed-bucket_cap_mb=0.5-accum_steps=1",
                                      "smoke-bucketed-bucket_cap_mb=4-accum_steps=1"]
    assert jobs[1].overrides == ["train.max_steps=3", "train.max_minutes=null", "sync.strategy=bucketed",
                                 "sync.bucket_cap_mb=0.5", "train.accum_steps=1"]
    cmd = sweep.train_command(m, jobs[1], tmp_path / jobs[1].name, resume=True)
    assert cmd[1:4] == ["-m", "torch.distributed.run", "--standalone"] and "--resume" in cmd
    assert cmd[cmd.index("--run-dir") + 1] == str(tmp_path / jobs[1].name)


def test_variants_and_ambiguous_knob_names(tmp_path):
    m = sweep.load_matrix(write_matrix(
        tmp_path, knobs={"sync.classes.ffn.wire_dtype": ["bf16"], "sync.classes.embedding.wire_dtype": ["fp32"]},
        variants={"psgd": {"sync.strategy": "powersgd", "sync.classes": {"ffn": {"wire_dtype": "bf16"}}}}))
    (job,) = sweep.expand(m)
    assert job.name == "smoke-psgd-ffn.wire_dtype=bf16-embedding.wire_dtype=fp32"
    assert 'sync.classes={"ffn": {"wire_dtype": "bf16"}}' in job.overrides and job.strategy == "powersgd"


def test_testbed_launcher(tmp_path):
    m = sweep.load_matrix(write_matrix(tmp_path, launcher="testbed", nproc=1))
    cmd = sweep.train_command(m, sweep.expand(m)[0], tmp_path / "r", resume=False)
    assert cmd[1:3] == ["-m", "dtrain.analysis.testbed"] and cmd[cmd.index("--nodes") + 1] == "2"
    assert cmd[cmd.index("--") + 1:][:2] == ["-m", "dtrain.engine.train"]


def test_last_error_line():
    torchrun_stderr = ("smoke:  45%|####5     | 9/20 [00:03<00:04]\r"
                       "dtrain.engine.train: error: dtrain/profiles/smoke.yaml (with --set): 'sync.bucket_cap_mb' must be positive\n"
                       "E1130 12:00:00.000 torch/distributed/elastic/multiprocessing/api.py:900] failed (exitcode: 2)\n"
                       "Traceback (most recent call last):\n  ...\n"
                       "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
                       "============================================================\n"
                       "dtrain.engine.train FAILED\n------------------------------------------------------------\n")
    assert sweep.last_error_line(torchrun_stderr).startswith("dtrain.engine.train: error: dtrain/profiles/smoke.yaml")
    assert sweep.last_error_line("Killed\n=====\n") == "Killed"


def test_finished_is_read_from_the_records(tmp_path):
    runs = sorted(p for p in RUNS.iterdir() if p.is_dir())
    assert runs and all(finished(p) for p in runs)
    run = tmp_path / "run"
    shutil.copytree(runs[0], run)
    evals = (run / "eval.jsonl").read_text().splitlines()
    (run / "eval.jsonl").write_text("\n".join(e for e in evals if '"bleu"' not in e) + "\n")
    assert not finished(run)  # the BLEU record was due and is missing
    (run / rundir.STEPS).write_text("\n".join((run / rundir.STEPS).read_text().splitlines()[:-1]) + "\n")
    assert not finished(run)  # fewer steps than train.max_steps
    assert not finished(tmp_path / "nothing")


@pytest.mark.slow
def test_sweep_records_a_failed_run_goes_on_and_resumes(tmp_path, capsys):
    # Two runs: one fine, one whose override the trainer refuses at start-up (exit 2, a one-line error).
    matrix = write_matrix(tmp_path, name="t", nproc=1, strategies=["bucketed"],
                          knobs={"sync.bucket_cap_mb": [1, -1]},
                          set={"train.max_steps": 2, "train.val_every": 0, "train.ckpt_every": 2, "train.log_every": 1,
                               "train.average_last": 1, "eval.at_end": False, "data.train_limit": 300,
                               "model.N": 1})
    out = tmp_path / "out"
    assert sweep.main(["--matrix", str(matrix), "--out", str(out)]) == 1
    report = capsys.readouterr().out
    good, bad = out / "smoke-bucketed-bucket_cap_mb=1", out / "smoke-bucketed-bucket_cap_mb=-1"
    assert finished(good) and not finished(bad)
    failed = json.loads((bad / rundir.LAUNCH).read_text())
    assert failed["exit_code"] == 1  # torchrun's code for a failed worker; the worker's message is the error
    assert failed["error"].startswith("dtrain.engine.train: error:") and "'sync.bucket_cap_mb' must be positive" in \
        failed["error"] and "1 failed" in report
    ok = json.loads((good / rundir.LAUNCH).read_text())
    assert ok["exit_code"] == 0 and ok["finished"] and ok["knobs"] == {"sync.bucket_cap_mb": 1}
    log = [json.loads(line) for line in (out / "sweep.jsonl").read_text().splitlines()]
    assert [(r["name"], r["finished"]) for r in log] == [(good.name, True), (bad.name, False)]

    # Again: the finished run is skipped (not relaunched), the failed one is tried again and fails again.
    steps_before = (good / rundir.STEPS).stat().st_mtime_ns
    assert sweep.main(["--matrix", str(matrix), "--out", str(out)]) == 1
    assert "1 skipped as already finished" in capsys.readouterr().out
    assert (good / rundir.STEPS).stat().st_mtime_ns == steps_before
    log = [json.loads(line) for line in (out / "sweep.jsonl").read_text().splitlines()]
    assert [r["name"] for r in log] == [good.name, bad.name, bad.name]


def test_next_attempt(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(next(p for p in RUNS.iterdir() if p.is_dir()), run)
    assert sweep.next_attempt(run) == "skip"
    (run / "eval.jsonl").unlink()  # interrupted before its last validation ...
    assert sweep.next_attempt(run) == "fresh"  # ... and no checkpoint to continue from
    checkpoint.save(run, 2, {"step": 2}, keep=1)
    assert sweep.next_attempt(run) == "resume"
    assert sweep.next_attempt(tmp_path / "never-started") == "fresh"


@pytest.mark.slow
def test_output_into_a_closed_pipe_ends_quietly(tmp_path):
    """`... --dry-run | head -1`: the reader is gone before the listing is written; no traceback, exit 1."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    proc = subprocess.run([sys.executable, "-m", "dtrain.analysis.sweep", "--matrix", str(write_matrix(tmp_path)),
                           "--dry-run"], stdout=write_end, stderr=subprocess.PIPE, text=True, cwd=REPO)
    os.close(write_end)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr


def test_shuffle_reorders_the_runs_by_seed(tmp_path, capsys):
    path = write_matrix(tmp_path, strategies=["bucketed"], knobs={"sync.bucket_cap_mb": [0.5, 1, 2, 4, 8, 16]})

    def order(*extra):
        sweep.main(["--matrix", str(path), "--dry-run", "--out", str(tmp_path / "o"), *extra])
        return [ln.split()[0] for ln in capsys.readouterr().out.splitlines() if ln.startswith("smoke-")]

    plain, one, again, other = order(), order("--shuffle", "1"), order("--shuffle", "1"), order("--shuffle", "2")
    assert sorted(one) == sorted(plain) and len(plain) == 6
    assert one == again and one != plain and other != one


def test_an_output_path_in_the_way_is_a_one_line_error(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    for out, msg in ((tmp_path / "afile", "a file is in the way"), (tmp_path / "afile" / "sub", "cannot make")):
        with pytest.raises(SystemExit) as e:
            sweep.main(["--matrix", str(write_matrix(tmp_path)), "--out", str(out)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and msg in err and err.count("\n") == 1, err
    assert (tmp_path / "afile").read_text() == "x"
