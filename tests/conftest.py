"""Shared fixtures: the Multi30k directory (from $DTRAIN_DATA_DIR, as in CI) and a tiny model; and the rule that
keeps `-m "not slow"` fast."""

import contextlib
import io
import multiprocessing.connection
import multiprocessing.process
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

import pytest
import torch
from filelock import FileLock  # torch's own dependency

import rank_main
from dtrain.collectives import dist as ddist
from dtrain.common.jsonl import read_jsonl
from dtrain.engine import checkpoint

REPO = Path(__file__).resolve().parents[1]


def _starts_python(args) -> bool:
    argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
    return any(os.path.basename(str(a)).startswith(("python", "torchrun")) or str(a) == sys.executable
               for a in argv[:8])


@pytest.fixture(autouse=True)
def processes_only_in_slow_tests(request, monkeypatch):
    """The `slow` mark is what `-m "not slow"` leaves out, so a test without it may not start Python processes
    (ranks, torchrun, the tools as commands): each costs seconds of torch's start-up. Such a test fails here at once,
    naming the mark it needs. Other programs (git, ip, tc) are fine."""
    if request.node.get_closest_marker("slow"):
        return
    test = request.node.nodeid
    popen_init = subprocess.Popen.__init__

    def popen(self, args, *a, **kw):
        if _starts_python(args):
            raise RuntimeError(f"{test} starts a Python process: mark it @pytest.mark.slow")
        popen_init(self, args, *a, **kw)

    def start(self):
        raise RuntimeError(f"{test} starts a process ({self.name}): mark it @pytest.mark.slow")

    monkeypatch.setattr(subprocess.Popen, "__init__", popen)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", start)


# The test files that take longest, longest first (`--durations`, on 2 cores, with bf16 emulated or not). The workers
# take whole files (`--dist loadfile`) in collection order (`--no-loadscope-reorder`, pyproject.toml), so these start
# first and the short files fill in at the end: xdist's own order (most tests first) started the long few-test files
# last, one worker running the last of them while the other sat idle. The files not named follow, those with more
# slow tests first. Only the order changes, never what runs.
LONGEST_FIRST = ("test_sharded.py", "test_compile.py", "test_fsdp2.py", "test_reliability.py", "test_slurm.py",
                 "test_resume_world.py", "test_examples.py", "test_wrap.py", "test_testbed.py", "test_strategies.py",
                 "test_online_search.py", "test_interleave.py", "test_train_smoke.py", "test_preemption.py",
                 "test_hierarchy.py", "test_dry_run.py", "test_host_memory.py", "test_replay.py", "test_compare.py",
                 "test_wheel.py")


def pytest_collection_modifyitems(config, items):
    first, slow = {}, {}
    for i, item in enumerate(items):
        name = item.path.name
        first.setdefault(name, i)
        slow[name] = slow.get(name, 0) + bool(item.get_closest_marker("slow"))

    def file_order(item):
        name = item.path.name
        if name in LONGEST_FIRST:
            return (LONGEST_FIRST.index(name), 0, 0)
        return (len(LONGEST_FIRST), -slow[name], first[name])

    items.sort(key=file_order)  # stable: each file's tests keep their order


@pytest.fixture(scope="session")
def multi30k_dir() -> Path:
    root = os.environ.get("DTRAIN_DATA_DIR")
    if not root or not (Path(root) / "multi30k").is_dir():
        pytest.fail("DTRAIN_DATA_DIR must point at a folder holding multi30k/ (see README: Data)")
    return Path(root) / "multi30k"


@pytest.fixture
def tiny_model():
    from dtrain.engine.model import Transformer

    torch.manual_seed(0)
    model = Transformer(vocab=50, N=2, d_model=32, d_ff=64, h=4, dropout=0.0)
    model.eval()
    return model


def torchrun(*args, nproc=2, check=True, extra=(), timeout=300):
    """`torchrun --standalone` of dtrain.engine.train on dtrain/profiles/smoke.yaml (a free port, so runs never
    collide): for the tests of torchrun's agent (`extra`: its options; the others use `train_ranks`)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *extra,
           "-m", "dtrain.engine.train", "--profile", "dtrain/profiles/smoke.yaml", *args]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    if check:
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return r


def train_ranks(*args, nproc=2, check=True, timeout=300):
    """dtrain.engine.train on dtrain/profiles/smoke.yaml on `nproc` local ranks (`launch_ranks`). Returns a
    CompletedProcess: the ranks' output in rank order, the first failed rank's status (or 0). The tests of the agent
    itself (signals, restarts, elastic nodes) start `torch.distributed.run`."""
    return launch_ranks(["-m", "dtrain.engine.train", "--profile", "dtrain/profiles/smoke.yaml", *args], nproc=nproc,
                        check=check, timeout=timeout)


def launch_ranks(args, nproc=2, check=True, timeout=300, cwd=REPO, env=None):
    """`python ARGS` (a module or a script) on `nproc` local ranks, started as torchrun starts its workers (RANK,
    WORLD_SIZE, LOCAL_RANK, a rendezvous on a free port) but without its agent, whose own start-up (torch imported
    once more, a rendezvous) costs seconds of each test. Where a rank fails the others are stopped, as the agent does.
    Returns a CompletedProcess: the ranks' output in rank order, the first failed rank's status (or 0); `check`
    asserts status 0; `env`: variables added to this process's.

    Each rank is forked from the server that `dist.spawn` keeps, torch imported there once, and runs ARGS as
    `python` would (tests/rank_main.py). With `env` given, or interpreter options in ARGS, each rank is a new
    interpreter instead: what Python and torch read from the environment at start-up (PYTHONWARNINGS, the CPU's
    capabilities) is then this call's."""
    args = [str(a) for a in args]
    new_interpreters = env or (args[0].startswith("-") and args[0] != "-m")
    port = free_port()
    if new_interpreters:
        codes, outputs = _interpreters(args, nproc, timeout, cwd, port, env or {})
    else:
        codes, outputs = _forked(args, nproc, timeout, cwd, port)
    failed = next((c for c in codes if c != 0), 0)
    r = subprocess.CompletedProcess([sys.executable, *args], failed, "".join(o[0] for o in outputs),
                                    "".join(o[1] for o in outputs))
    if check:
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return r


def _forked(args, nproc, timeout, cwd, port):
    """`launch_ranks`' ranks forked from `dist.spawn`'s server: (exit statuses, (stdout, stderr) of each rank). Ranks
    still running at the timeout print their Python stacks into the TimeoutError."""
    with tempfile.TemporaryDirectory() as out:
        ranks = ddist.spawn(rank_main.run, (args, str(cwd), port, nproc, out), nproc, join=False).processes
        deadline = time.monotonic() + timeout
        running = list(ranks)
        while running:
            left = deadline - time.monotonic()
            if left <= 0:
                _stop_with_stacks(ranks, running)
                stacks = "".join(f"rank {r}:\n{rank_main.output(out, r, 'stderr')[-3000:]}" for r in range(nproc))
                raise TimeoutError(f"{' '.join(args)} still ran after {timeout} s; the ranks' stderr:\n{stacks}")
            multiprocessing.connection.wait([p.sentinel for p in running], timeout=left)
            for p in [p for p in running if p.exitcode is not None]:
                running.remove(p)
                if p.exitcode != 0:  # stop the others, as torchrun's agent does
                    for q in running:
                        q.terminate()
        outputs = [tuple(rank_main.output(out, r, name) for name in ("stdout", "stderr")) for r in range(nproc)]
    return [p.exitcode for p in ranks], outputs


def _stop_with_stacks(ranks, running):
    """Ask each rank still `running` for its Python stacks (to its stderr file: rank_main registers
    SIGUSR1), give them a second to write, then kill every rank."""
    for p in running:
        with contextlib.suppress(ProcessLookupError):  # ended since the last wait
            os.kill(p.pid, signal.SIGUSR1)
    time.sleep(1)
    for p in ranks:
        p.kill()


def _interpreters(args, nproc, timeout, cwd, port, env):
    """`launch_ranks`' ranks as new interpreters: (exit statuses, (stdout, stderr) of each rank)."""
    cmd = [sys.executable, *args]
    procs = [subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={
        **os.environ, **env, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": "0"}) for r in range(nproc)]
    with ThreadPoolExecutor(nproc) as pool:  # read every rank's pipes while they run
        futures = {pool.submit(p.communicate, timeout=timeout): p for p in procs}
        pending = set(futures)
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            if any(futures[f].returncode != 0 for f in done):
                for p in procs:
                    if p.poll() is None:
                        p.terminate()
        outputs = [f.result() for f in futures]  # rank order
    return [p.returncode for p in procs], outputs


def free_port() -> int:
    """A TCP port free right now, for a rendezvous started without torchrun's agent."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def records(path):
    return read_jsonl(path)


def cut_back(run: Path, to: Path, step: int) -> Path:
    """A copy of run directory `run` at `to` whose latest checkpoint is `step`'s: what a run stopped there wrote."""
    shutil.copytree(run, to)
    for f in (to / "checkpoints").glob("step-*"):
        if int(f.name.split("-")[1].split(".")[0]) > step:
            f.unlink()
    return to


NO_EVAL = ("--set", "eval.at_end=false", "--set", "train.average_last=1")


@pytest.fixture(scope="session")
def straight_run(tmp_path_factory):
    """30 uninterrupted smoke steps without the final decoding: the reference for resume and restart tests (read or
    copied, never changed). Four files use it, so under xdist it is run once for the whole session, by the first
    worker to ask, in the folder the workers' temporary folders share (that session's own), not once per worker."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        run = tmp_path_factory.mktemp("straight") / "run"
        train_ranks("--run-dir", str(run), "--set", "train.max_steps=30", *NO_EVAL)
        return run
    shared = tmp_path_factory.getbasetemp().parent  # pytest-N: this session's, above each worker's popen-gwK
    run, done = shared / "straight" / "run", shared / "straight" / "done"
    with FileLock(str(shared / "straight.lock")):
        if not done.exists():
            shutil.rmtree(run.parent, ignore_errors=True)  # a worker that failed part-way
            run.parent.mkdir()
            train_ranks("--run-dir", str(run), "--set", "train.max_steps=30", *NO_EVAL)
            done.touch()
    return run


def in_process(main, *argv, cwd=None) -> subprocess.CompletedProcess:
    """A command's `main(argv)` run in this process, as `python -m <its module> argv` would run it: its exit status
    (SystemExit's, else 0), stdout and stderr. For the commands that neither train nor change the process (checks,
    dry runs, one-line errors), without a second interpreter's seconds of importing torch."""
    out, err, code, here = io.StringIO(), io.StringIO(), 0, os.getcwd()
    os.chdir(cwd or REPO)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = main([str(a) for a in argv])
        code = status if isinstance(status, int) else 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        os.chdir(here)
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def checkpoint_diff(a, b) -> str:
    """What `python -m dtrain.engine.checkpoint diff A B` prints (runs or checkpoint files), from its `main` in this process:
    the same code and output without a second interpreter importing torch for every comparison (the command line
    itself is run by tests/test_reliability.py). A one-line error is in what it returns."""
    r = in_process(checkpoint.main, "diff", a, b)
    return r.stdout + r.stderr
