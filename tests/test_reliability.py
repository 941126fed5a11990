"""Faults on 2 gloo ranks: crash and restart, a hung peer, NaN gradients, corrupt checkpoints, bad input."""

import math
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import (NO_EVAL, REPO, checkpoint_diff, cut_back, free_port, in_process, records, torchrun,
                      train_ranks)
from dtrain.engine import evaluate
from dtrain.engine import train as engine_train
from dtrain.engine.faults import Fault, parse


def test_fault_specs_parse_and_reject():
    assert parse("crash@step=7,rank=1") == Fault("crash", rank=1, step=7)
    assert parse("slow@rank=0,ms=50") == Fault("slow", rank=0, ms=50)
    for bad in ("boom@step=1,rank=0", "crash@step=1", "hang@step=x,rank=0", "nan@step=0,rank=0",
                "crash@step=1,rank=0,rank=1"):
        with pytest.raises(Exception, match="--fault"):
            parse(bad)


@pytest.mark.slow
def test_crash_and_restart_matches_uninterrupted_run(tmp_path, straight_run):
    """Rank 1 dies at step 13; torchrun restarts both from the step-10 checkpoint, and step 20 is the uninterrupted
    run's step 20 (the schedule and the data order depend on the step, not on train.max_steps)."""
    run = tmp_path / "crashed"
    r = torchrun("--run-dir", str(run), "--fault", "crash@step=13,rank=1", "--set", "train.max_steps=20", *NO_EVAL,
                 extra=["--max-restarts=1"])
    assert "[fault] crash at step 13" in r.stderr
    assert re.search(r"resumed from .*step-0000010.pt at step 10 \(2 recorded steps", r.stdout), r.stdout
    assert "recomputed=2" in r.stdout
    assert [s["step"] for s in records(run / "steps.jsonl")] == list(range(1, 21))
    diff = checkpoint_diff(straight_run / "checkpoints" / "step-0000020.pt", run)
    assert "max |A - B| over parameters: 0 " in diff and "optimizer states: identical" in diff, diff


@pytest.mark.slow
def test_hung_peer_fails_within_the_timeout(tmp_path):
    """Rank 1 stops taking part at step 5: rank 0's all-reduce gives up after collectives.timeout_s, with one line
    naming the phase. The two ranks get torchrun's environment but not its agent, which would then wait out its own
    grace period (30 s, torch.distributed.elastic's shutdown) for the hung rank: its SIGTERM handler only asks for a
    stop."""
    timeout, port = 6, free_port()
    cmd = [sys.executable, "-m", "dtrain.engine.train", "--profile", "dtrain/profiles/smoke.yaml",
           "--run-dir", str(tmp_path / "hang"), "--fault", "hang@step=5,rank=1",
           "--set", f"collectives.timeout_s={timeout}", *NO_EVAL]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "WORLD_SIZE": "2"}
    rank1 = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             env={**env, "RANK": "1", "LOCAL_RANK": "1"})
    try:
        r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120,
                           env={**env, "RANK": "0", "LOCAL_RANK": "0"})
    finally:
        rank1.kill()  # hung for good, as intended
        rank1.wait()
    assert r.returncode != 0
    m = re.search(r"rank 0: (.*) at step 5 failed after ([\d.]+) s \(collectives.timeout_s = 6\)", r.stderr)
    assert m, r.stderr[-3000:]
    assert "all-reduce" in m.group(1)
    assert float(m.group(2)) <= timeout + 3


@pytest.mark.slow
def test_nan_gradient_skips_the_step_on_every_rank(tmp_path):
    """One run: a NaN on rank 0 at step 5 is skipped and training goes on; NaNs on rank 1 at steps 8 and 9 are two in a
    row, one more than train.max_bad_steps allows, and stop the run at step 9."""
    run = tmp_path / "nan"
    r = train_ranks("--run-dir", str(run), "--fault", "nan@step=5,rank=0", "--fault", "nan@step=8,rank=1",
                    "--fault", "nan@step=9,rank=1", "--set", "train.max_bad_steps=1", *NO_EVAL, check=False)
    assert r.returncode != 0
    assert "stopping at step 9: 2 consecutive steps with non-finite gradients (train.max_bad_steps = 1)" in r.stderr, \
        r.stderr[-3000:]
    steps = records(run / "steps.jsonl")
    assert [s["step"] for s in steps] == list(range(1, 10))
    assert [s["step"] for s in steps if s["skipped"]] == [5, 8, 9]
    assert all(math.isfinite(s["grad_norm"]) for s in steps[5:7])  # steps 6 and 7: finite again after step 5


@pytest.mark.slow
def test_corrupt_latest_checkpoint_falls_back_to_previous(tmp_path, straight_run):
    run = tmp_path / "corrupt"
    shutil.copytree(straight_run, run)  # 30 steps, checkpoints at 10, 20 and 30
    latest = run / "checkpoints" / "step-0000030.pt"
    latest.write_bytes(latest.read_bytes()[: latest.stat().st_size // 2])  # truncated on disk
    r = train_ranks("--run-dir", str(run), "--resume", "--set", "train.max_steps=30", *NO_EVAL)
    assert "skipping checkpoint" in r.stderr and "checksum mismatch" in r.stderr
    assert "at step 20" in r.stdout
    assert [s["step"] for s in records(run / "steps.jsonl")] == list(range(1, 31))


def run_train(*args, env=None):
    """Single-process dtrain.engine.train (no torchrun): bad-input cases fail before any training."""
    return subprocess.run([sys.executable, "-m", "dtrain.engine.train", *args], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, **(env or {})}, timeout=120)


def assert_one_line_error(r, pattern):
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    lines = [line for line in r.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1 and re.search(pattern, lines[0]), r.stderr[-2000:]


def test_bad_fault_spec_is_one_line_error():
    # refused before the process changes (signal handlers, process group): its `main` run in this process
    r = in_process(engine_train.main, "--profile", "dtrain/profiles/smoke.yaml", "--fault", "crash@rank=1")
    assert_one_line_error(r, r"--fault 'crash@rank=1': crash takes exactly rank, step")


@pytest.mark.slow
def test_unwritable_run_dir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert_one_line_error(run_train("--profile", "dtrain/profiles/smoke.yaml", "--run-dir", str(blocker / "run")),
                          r"run directory is not writable")


@pytest.mark.slow
def test_missing_corpus_without_network(tmp_path):
    # No data anywhere; the download points at a closed local port, so it fails at once like an offline machine.
    r = run_train("--profile", "dtrain/profiles/smoke.yaml", "--run-dir", str(tmp_path / "r"),
                  "--set", f"data.cache_dir={tmp_path / 'cache'}",
                  env={"DTRAIN_DATA_DIR": "", "https_proxy": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9"})
    assert_one_line_error(r, r"Multi30k not found .* download of .* failed")


@pytest.mark.slow
def test_resume_with_a_different_model_shape(tmp_path, straight_run):
    run = tmp_path / "shape"
    shutil.copytree(straight_run, run)
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    r = run_train("--profile", "dtrain/profiles/smoke.yaml", "--run-dir", str(run), "--resume",
                  "--set", "model.d_model=128", *NO_EVAL)
    assert_one_line_error(r, r"checkpoint is of a different model shape")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before


def _run_with_foreign_checkpoint(tmp_path):
    """A run directory whose only checkpoint has a matching checksum but holds a list, not a training state."""
    from dtrain.engine import checkpoint

    run = tmp_path / "foreign"
    path = checkpoint.save(run, 10, [1, 2], keep=5)  # torch.save of any object, checksum file and all
    (run / "steps.jsonl").write_text('{"step": 10}\n')
    return run, path


@pytest.mark.slow
def test_checkpoint_of_wrong_contents_is_a_one_line_error(tmp_path):
    import torch

    from dtrain.engine import checkpoint, config
    from dtrain.common.errors import UserError
    from dtrain.engine.evaluate import load_model_for_eval

    run, path = _run_with_foreign_checkpoint(tmp_path)
    cli = [sys.executable, "-m", "dtrain.engine.checkpoint"]
    r = subprocess.run([*cli, "diff", str(run), str(path)], capture_output=True, text=True, cwd=REPO)
    assert_one_line_error(r, r"step-0000010.pt: not a dtrain checkpoint \(holds a list, not a dict\)")
    r = subprocess.run([*cli, "inspect", str(path)], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "checksum    ok" in r.stdout and "contents    unreadable: not a dtrain checkpoint" in r.stdout
    with pytest.raises(UserError, match=r"step-0000010.pt: not a dtrain checkpoint"):
        load_model_for_eval(run, "latest", 100, config.load("dtrain/profiles/smoke.yaml"))
    # A dict is not enough: resuming needs the whole training state, evaluating a "model" of tensors.
    partial = checkpoint.save(tmp_path / "partial", 5, {"model": {"w": torch.zeros(2)}}, keep=1)
    with pytest.raises(UserError, match=r"no 'step', 'optimizer', 'scheduler', 'data', 'rng', 'model_hash'"):
        checkpoint.load(partial, keys=checkpoint.TRAINING_KEYS)
    for i, model in enumerate(([1], {}, {"w": 1})):  # `diff` and `inspect` would index or sum over these
        bad_model = checkpoint.save(tmp_path / f"bad-model-{i}", 5, {"model": model}, keep=1)
        with pytest.raises(UserError, match=r"'model' is not a mapping of parameter names to tensors"):
            checkpoint.load(bad_model)


@pytest.mark.slow
def test_resume_from_a_checkpoint_of_wrong_contents(tmp_path):
    run, path = _run_with_foreign_checkpoint(tmp_path)
    before = {p.name: p.read_bytes() for p in (run / "checkpoints").iterdir()}
    r = run_train("--profile", "dtrain/profiles/smoke.yaml", "--run-dir", str(run), "--resume", *NO_EVAL)
    assert_one_line_error(r, r"step-0000010.pt: not a dtrain checkpoint \(holds a list, not a dict\)")
    assert {p.name: p.read_bytes() for p in (run / "checkpoints").iterdir()} == before  # nothing lost
    assert (run / "steps.jsonl").read_text() == '{"step": 10}\n'


def test_evaluate_rejects_a_beam_below_one(tmp_path):
    for beam in ("-3", "0"):
        r = in_process(evaluate.main, "--run", tmp_path, "--beam", beam, "--split", "val")
        assert_one_line_error(r, rf"--beam must be at least 1 \(1 = greedy\), got {beam}$")


@pytest.mark.slow
def test_resume_of_a_run_dir_that_does_not_exist(tmp_path):
    missing = tmp_path / "no-such-run"
    r = run_train("--profile", "dtrain/profiles/smoke.yaml", "--run-dir", str(missing), "--resume", *NO_EVAL)
    assert_one_line_error(r, r"no-such-run: nothing to resume there \(no such directory\)")
    assert not missing.exists()


@pytest.mark.slow
def test_powersgd_resume_continues_exactly(tmp_path):
    """PowerSGD's error feedback (per rank) and warm-started Q factors are checkpointed by parameter name: 10 steps,
    stop, resume to 20 == 20 steps straight, bit for bit, although the resumed DDP starts with its initial bucket
    layout and rebuilds it after the first step."""
    import torch

    # A checkpoint every 5 steps, all kept: the split run is a copy of the straight one cut back to its step-10
    # checkpoint, which is what 10 steps of its own would have written.
    powersgd = ("--set", "sync.strategy=powersgd", "--set", "train.ckpt_every=5", "--set", "train.keep_ckpts=6",
                *NO_EVAL)
    straight = tmp_path / "straight"
    train_ranks("--run-dir", str(straight), "--set", "train.max_steps=20", *powersgd)
    split = cut_back(straight, tmp_path / "split", 10)
    state = torch.load(split / "checkpoints" / "step-0000010.pt", weights_only=True)
    ranks = state["sync"]
    assert len(ranks) == 2 and all(r["iter"] == 10 for r in ranks)
    names = set(state["model"])
    assert ranks[0]["error"].keys() == ranks[1]["error"].keys() and set(ranks[0]["error"]) <= names
    assert any(not torch.equal(ranks[0]["error"][n], ranks[1]["error"][n]) for n in ranks[0]["error"])  # per rank
    assert ranks[0]["q"] and all(torch.equal(ranks[0]["q"][n], ranks[1]["q"][n]) for n in ranks[0]["q"])
    r = train_ranks("--run-dir", str(split), "--resume", "--set", "train.max_steps=20", *powersgd)
    assert "at step 10" in r.stdout
    diff = checkpoint_diff(straight, split)
    assert "max |A - B| over parameters: 0 " in diff and "optimizer states: identical" in diff, diff
