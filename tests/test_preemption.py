"""Preemption on 2 gloo ranks: SIGTERM or SIGUSR1 mid-run (to torchrun's agent, or to one worker only) stops every
rank after the same step with a checkpoint and status 75; the resumed run ends bit-identical to an uninterrupted one.

One run takes both: SIGTERM to the agent stops it, the resumed run is stopped by SIGUSR1 to rank 1, and the run
resumed again ends bit-identical to `straight_run` (three launches instead of two per signal)."""

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import NO_EVAL, REPO, checkpoint_diff, records, train_ranks

from dtrain.engine.trainer import PREEMPTED_EXIT

pytestmark = pytest.mark.slow

STEPS = 30
ARGS = ("--set", f"train.max_steps={STEPS}", "--set", "train.record_samples=true", *NO_EVAL)


def start(run: Path, *resume: str) -> subprocess.Popen:
    """A 2-rank torchrun of the smoke profile with slow steps, so that a signal lands mid-run."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "dtrain.engine.train",
           "--profile", "dtrain/profiles/smoke.yaml", "--run-dir", str(run), "--fault", "slow@rank=0,ms=200", *resume, *ARGS]
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


@dataclass
class Stop:
    """One stop, as the run directory and torchrun's output showed it right after."""
    out: str
    err: str
    name: str  # the signal rank 0 names
    step: int  # the step every rank stopped after
    steps: list  # the steps in steps.jsonl
    last_samples: list  # per rank, the step of its last recorded samples
    checkpointed: bool  # the stop step's checkpoint is complete (its checksum file is there)


def stop(run: Path, proc: subprocess.Popen, after: int, send) -> Stop:
    wait_for_step(run, proc, after)
    send(proc)
    out, err = proc.communicate(timeout=120)
    m = re.search(r"stopped by (\w+) after step (\d+): checkpoint saved; exiting with status 75", out)
    assert m, out + err[-3000:]
    step = int(m.group(2))
    return Stop(out, err, m.group(1), step, [s["step"] for s in records(run / "steps.jsonl")],
                [records(run / f"samples.rank{rank}.jsonl")[-1]["step"] for rank in (0, 1)],
                (run / "checkpoints" / f"step-{step:07d}.pt.sha256").is_file())


@pytest.fixture(scope="module")
def preempted(tmp_path_factory, straight_run):
    """SIGTERM to torchrun's agent past step 12; resumed, SIGUSR1 to rank 1's worker 4 steps later; resumed to the
    end. Returns both stops, the last resume's stdout and the run directory."""
    run = tmp_path_factory.mktemp("preempted") / "run"
    by_term = stop(run, start(run), 12, lambda p: p.send_signal(signal.SIGTERM))  # past the step-10 checkpoint
    by_usr1 = stop(run, start(run, "--resume"), by_term.step + 4,
                   lambda p: os.kill(worker_pid(p.pid, 1), signal.SIGUSR1))
    last = train_ranks("--run-dir", str(run), "--resume", *ARGS)
    return by_term, by_usr1, last.stdout, run


def check_stopped_together(s: Stop, earliest: int) -> None:
    """The checkpoint of the step it stopped after, and every rank's last step is that one: they stopped together."""
    assert earliest <= s.step < STEPS, s.out
    assert s.checkpointed
    assert s.steps == list(range(1, s.step + 1))
    assert s.last_samples == [s.step, s.step]


def test_sigterm_to_the_torchrun_agent(preempted):
    """torchrun forwards the SIGTERM to both workers; its own exit reports the signal."""
    by_term, by_usr1, _, _ = preempted
    assert by_term.name == "SIGTERM"
    check_stopped_together(by_term, 12)
    assert f"at step {by_term.step} (0 recorded steps" in by_usr1.out, by_usr1.out  # the resume took that checkpoint


def test_sigusr1_to_one_worker_stops_both(preempted):
    """Only rank 1 is signalled; rank 0 learns of it from the per-step all-reduce. torchrun reports both workers'
    exit status 75."""
    by_term, by_usr1, last_out, _ = preempted
    assert by_usr1.name == "SIGUSR1"  # rank 0, which prints, was not signalled: it learned the signal's number
    assert f"exitcode  : {PREEMPTED_EXIT}" in by_usr1.err, by_usr1.err[-3000:]
    check_stopped_together(by_usr1, by_term.step + 4)
    assert f"at step {by_usr1.step} (0 recorded steps" in last_out, last_out


def test_resumed_twice_ends_as_the_uninterrupted_run(preempted, straight_run):
    *_, run = preempted
    assert [s["step"] for s in records(run / "steps.jsonl")] == list(range(1, STEPS + 1))
    diff = checkpoint_diff(straight_run, run)
    assert "max |A - B| over parameters: 0 " in diff and "optimizer states: identical" in diff, diff
