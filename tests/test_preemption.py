"""Preemption on 2 gloo ranks: SIGTERM or SIGUSR1 mid-run (to torchrun's agent, or to one worker only) stops every
rank after the same step with a checkpoint and status 75; the resumed run ends bit-identical to an uninterrupted one."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import NO_EVAL, REPO, checkpoint_diff, records, torchrun

from dtrain.trainer import PREEMPTED_EXIT

pytestmark = pytest.mark.slow

STEPS = 30
ARGS = ("--set", f"train.max_steps={STEPS}", "--set", "train.record_samples=true", *NO_EVAL)


def start(run: Path) -> subprocess.Popen:
    """A 2-rank torchrun of the smoke profile with slow steps, so that a signal lands mid-run."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "dtrain.train",
           "--profile", "profiles/smoke.yaml", "--run-dir", str(run), "--fault", "slow@rank=0,ms=200", *ARGS]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def wait_for_step(run: Path, proc: subprocess.Popen, step: int, timeout=240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        f = run / "steps.jsonl"
        if f.exists() and len(f.read_text().splitlines()) >= step:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"step {step} never came")


def worker_pid(agent: int, rank: int) -> int:
    """The pid of torchrun's worker of `rank` (a child of the agent with RANK=<rank> in its environment)."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (d / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if ppid == agent and f"RANK={rank}".encode() in env:
            return int(d.name)
    raise AssertionError(f"no worker of rank {rank} under {agent}")


def stop_and_resume(tmp_path, straight_run, send) -> tuple[str, str]:
    run = tmp_path / "preempted"
    proc = start(run)
    wait_for_step(run, proc, 12)  # past the step-10 checkpoint
    send(proc)
    out, err = proc.communicate(timeout=120)
    m = re.search(r"stopped by (\w+) after step (\d+): checkpoint saved; exiting with status 75", out)
    assert m, out + err[-3000:]
    stopped = int(m.group(2))
    assert 12 <= stopped < STEPS
    # The checkpoint of the step it stopped after, and every rank's last step is that one: they stopped together.
    assert (run / "checkpoints" / f"step-{stopped:07d}.pt.sha256").is_file()
    assert [s["step"] for s in records(run / "steps.jsonl")] == list(range(1, stopped + 1))
    for rank in (0, 1):
        assert records(run / f"samples.rank{rank}.jsonl")[-1]["step"] == stopped
    r = torchrun("--run-dir", str(run), "--resume", *ARGS)
    assert f"at step {stopped} (0 recorded steps" in r.stdout, r.stdout
    assert [s["step"] for s in records(run / "steps.jsonl")] == list(range(1, STEPS + 1))
    diff = checkpoint_diff(straight_run, run)
    assert "max |A - B| over parameters: 0 " in diff and "optimizer states: identical" in diff, diff
    return m.group(1), err


def test_sigterm_to_the_torchrun_agent(tmp_path, straight_run):
    """torchrun forwards the SIGTERM to both workers; its own exit reports the signal."""
    name, _ = stop_and_resume(tmp_path, straight_run, lambda p: p.send_signal(signal.SIGTERM))
    assert name == "SIGTERM"


def test_sigusr1_to_one_worker_stops_both(tmp_path, straight_run):
    """Only rank 1 is signalled; rank 0 learns of it from the per-step all-reduce. torchrun reports both workers'
    exit status 75."""
    name, err = stop_and_resume(tmp_path, straight_run,
                                lambda p: os.kill(worker_pid(p.pid, 1), signal.SIGUSR1))
    assert name == "signal"  # rank 0, which prints, was not the rank signalled
    assert f"exitcode  : {PREEMPTED_EXIT}" in err, err[-3000:]
