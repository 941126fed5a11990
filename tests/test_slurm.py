"""scripts/slurm/train.sbatch under a real Slurm: a one-node cluster (munged, slurmctld, slurmd) on this machine.

Needs Debian's slurm-wlm and munge (.ci/run installs them). Skipped where their programs are absent, except under CI
(`CI=true`, as CI services set it), where a missing Slurm is a failure: the jobs must have run.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from conftest import NO_EVAL, REPO, records

pytestmark = pytest.mark.slow

PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "sinfo", "scontrol", "squeue", "scancel")
MISSING = [p for p in PROGRAMS if shutil.which(p) is None]
UNDER_CI = os.environ.get("CI", "").lower() == "true"


@pytest.fixture(autouse=True, scope="module")
def slurm_programs():
    """Every test here needs Slurm: without it, a skip, or under CI a failure naming what is missing."""
    if MISSING:
        message = f"Slurm not installed (no {', '.join(MISSING)}; apt-get install slurm-wlm munge)"
        if UNDER_CI:
            pytest.fail(message)
        pytest.skip(message)


SCRIPT = REPO / "scripts" / "slurm" / "train.sbatch"
STEPS = 10


def smoke_args(steps: int) -> list[str]:
    """dtrain/profiles/smoke.yaml, short and without the final decoding: these jobs are about the launch
    (test_train_smoke covers the training), with a checkpoint every 5 steps to resume from."""
    return ["dtrain/profiles/smoke.yaml", "--set", f"train.max_steps={steps}", "--set", "train.ckpt_every=5", *NO_EVAL]


def job_env(slurm, run: Path) -> dict:
    """2 processes on the one node; a free rendezvous port, as the default one may be taken on a shared machine."""
    return {**slurm.env, "NPROC_PER_NODE": "2", "RUN_DIR": str(run), "PYTHON": shutil.which("python") or "python",
            "OMP_NUM_THREADS": "1", "RDZV_PORT": str(free_port())}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_line() -> str:
    """This host as slurmd sees it (`slurmd -C`): its name, real CPU layout and memory."""
    out = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True, timeout=30).stdout
    return next(line for line in out.splitlines() if line.startswith("NodeName="))


def slurm_conf(root: Path, node: str, ctld_port: int, slurmd_port: int) -> str:
    name = node.split()[0].split("=", 1)[1]
    return "\n".join([
        "ClusterName=dtraintest",
        f"SlurmctldHost={name}(127.0.0.1)",
        f"SlurmctldPort={ctld_port}",
        f"SlurmdPort={slurmd_port}",
        "SlurmUser=root",
        "SlurmdUser=root",
        f"AuthInfo=socket={root}/munge.socket,cred_expire=10",  # also how long a requeued job waits to start
        f"StateSaveLocation={root}/ctld",
        f"SlurmdSpoolDir={root}/slurmd",
        f"SlurmctldPidFile={root}/slurmctld.pid",
        f"SlurmdPidFile={root}/slurmd.pid",
        f"SlurmctldLogFile={root}/slurmctld.log",
        f"SlurmdLogFile={root}/slurmd.log",
        "ProctrackType=proctrack/linuxproc",  # no cgroups: works in containers
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "SwitchType=switch/none",
        "MpiDefault=none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "SchedulerParameters=sched_interval=1,bf_interval=1",  # start a requeued job as soon as it may start
        "ReturnToService=2",
        "SlurmdTimeout=60",
        "InactiveLimit=0",
        "KillWait=10",
        "MinJobAge=600",  # keep finished jobs in scontrol for the assertions
        f"{node} NodeAddr=127.0.0.1 State=UNKNOWN",
        f"PartitionName=test Nodes={name} Default=YES MaxTime=INFINITE State=UP",
        "",
    ])


class LocalSlurm:
    """munged, slurmctld and slurmd as children of this process (foreground mode), everything under `root`."""

    def __init__(self, root: Path):
        self.root = root
        self.procs: list[subprocess.Popen] = []
        self.env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}

    def start(self) -> None:
        root = self.root
        for d in ("ctld", "slurmd"):
            (root / d).mkdir()
        key = root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self._spawn("munged", ["munged", "--foreground", "--force", f"--key-file={key}",
                               f"--socket={root}/munge.socket", f"--pid-file={root}/munged.pid",
                               f"--log-file={root}/munged.log", f"--seed-file={root}/munged.seed"])
        self._until(lambda: (root / "munge.socket").exists(), 30, "munged did not create its socket")
        (root / "slurm.conf").write_text(slurm_conf(root, node_line(), free_port(), free_port()))
        conf = str(root / "slurm.conf")
        self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", conf])
        self._spawn("slurmd", ["slurmd", "-D", "-f", conf])
        self._until(self._node_idle, 90, "the node never became idle")

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(self.root / f"{name}.out", "w")
        self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                           start_new_session=True))
        log.close()

    def _node_idle(self) -> bool:
        r = self.run(["sinfo", "--noheader", "--format=%T"], check=False)
        return r.returncode == 0 and r.stdout.strip() == "idle"

    def _until(self, ok, timeout_s: float, what: str) -> None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{', '.join(dead)} exited early\n{self.logs()}")
            if ok():
                return
            time.sleep(0.5)
        raise RuntimeError(f"{what} within {timeout_s} s\n{self.logs()}")

    def run(self, cmd: list[str], check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        r = subprocess.run(cmd, capture_output=True, text=True, env=self.env, cwd=REPO, timeout=timeout)
        if check:
            assert r.returncode == 0, f"{cmd}: {r.stdout}{r.stderr}"
        return r

    def job(self, job_id: str) -> dict:
        """`scontrol show job` as a dict of its Key=Value fields."""
        out = self.run(["scontrol", "--oneliner", "show", "job", job_id]).stdout
        return dict(f.split("=", 1) for f in out.split() if "=" in f)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.root.glob("*.log")))

    def stop(self) -> None:
        """Cancel what is left, then stop the daemons: SIGTERM, SIGKILL after a grace period."""
        try:
            if all(p.poll() is None for p in self.procs):
                self.run(["scancel", "--full", "--user=root"], check=False)
                end = time.monotonic() + 30
                while time.monotonic() < end and self.run(["squeue", "--noheader"], check=False).stdout.strip():
                    time.sleep(0.5)
        except subprocess.TimeoutExpired:
            pass  # the daemons are stopped below all the same
        for p in reversed(self.procs):  # slurmd, slurmctld, munged
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait(timeout=10)


FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


def wait_for(ok, timeout_s: float, what) -> None:
    end = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < end, what()
        time.sleep(0.2)


def read(path: Path) -> str:
    return path.read_text() if path.exists() else "(no job output)"


def our_processes(root: Path) -> list[str]:
    """Processes of this cluster still alive: the daemons (their command line names a file under `root`) and
    whatever they started (slurmstepd, the job's processes: they inherit SLURM_CONF)."""
    conf = f"SLURM_CONF={root / 'slurm.conf'}".encode()
    left = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            args = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if str(root) in args or conf in env:
            left.append(f"{proc.name} {args}")
    return left


def kill_left_over(root: Path) -> list[str]:
    """SIGKILL whatever of this cluster outlived stop(); returns what it found."""
    left = our_processes(root)
    for line in left:
        try:
            os.kill(int(line.split()[0]), signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    root = tmp_path_factory.mktemp("slurm")
    cluster = LocalSlurm(root)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        left = kill_left_over(root)  # never leave anything running, but say so: stop() should have ended it
        assert not left, f"processes left behind by stop(), killed: {left}"


def test_sbatch_trains_smoke_on_two_processes(slurm, tmp_path):
    run = tmp_path / "run"
    out = tmp_path / "job.out"
    cmd = ["sbatch", "--parsable", f"--output={out}", "--cpus-per-task=2", "--time=10", str(SCRIPT),
           *smoke_args(STEPS)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=job_env(slurm, run), cwd=REPO, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    job_id = r.stdout.strip().split(";")[0]
    # Polled here, not by `sbatch --wait`: the interval between its polls grows to tens of seconds (Slurm's
    # src/sbatch/sbatch.c, _job_wait), most of it waited out after a job this short has ended.
    wait_for(lambda: slurm.job(job_id)["JobState"] in FINAL, 600, lambda: f"never finished\n{read(out)}")
    job, log = slurm.job(job_id), read(out)
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", \
        f"{job}\n{log[:3000]}\n...\n{log[-3000:]}\n{slurm.logs()}"
    assert f"rendezvous {job['NodeList']}:" in log and "1 node(s) x 2 process(es)" in log, log
    assert "(resuming)" not in log, log  # a first attempt starts a new run
    assert f"done: steps={STEPS}" in log, log[-4000:]

    header = json.loads((run / "run.json").read_text())
    assert header["world_size"] == 2 and header["backend"] == "gloo"
    assert [s["step"] for s in records(run / "steps.jsonl")] == list(range(1, STEPS + 1))
    ckpts = sorted(p.name for p in (run / "checkpoints").glob("step-*.pt"))
    assert ckpts == ["step-0000005.pt", f"step-{STEPS:07d}.pt"], ckpts
    for c in ckpts:
        assert (run / "checkpoints" / (c + ".sha256")).is_file(), c


def test_usr1_requeues_and_the_next_attempt_resumes(slurm, tmp_path):
    """The time-limit warning (--signal=B:USR1@120), sent by hand: the job requeues itself, the second attempt
    resumes from the latest checkpoint and finishes the run."""
    steps, run, out = 15, tmp_path / "run", tmp_path / "job.out"
    cmd = ["sbatch", "--parsable", "--open-mode=append", f"--output={out}", "--cpus-per-task=2", "--time=10",
           str(SCRIPT), *smoke_args(steps),
           "--fault", "slow@rank=0,ms=200"]  # slower steps: the run must not end before the signal requeues it
    # --open-mode=append: the second attempt must not overwrite the first one's output
    r = subprocess.run(cmd, capture_output=True, text=True, env=job_env(slurm, run), cwd=REPO, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    job_id = r.stdout.strip().split(";")[0]

    def steps_done() -> int:
        f = run / "steps.jsonl"
        return len(f.read_text().splitlines()) if f.exists() else 0

    wait_for(lambda: steps_done() >= 7, 300, lambda: f"step 7 never came\n{read(out)}")  # after the step-5 checkpoint
    slurm.run(["scancel", "--batch", "--signal=USR1", job_id])
    wait_for(lambda: slurm.job(job_id)["JobState"] in FINAL, 400, lambda: f"never finished\n{read(out)}")
    job, log = slurm.job(job_id), read(out)
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0" and job["Restarts"] == "1", (job, log)
    assert f"USR1 (time limit near): requeueing job {job_id}" in log and "(resuming)" in log, log
    assert "resumed from" in log and f"done: steps={steps}" in log, log
    # the records past the resumed checkpoint were dropped and written again: every step exactly once
    assert [s["step"] for s in records(run / "steps.jsonl")] == list(range(1, steps + 1))


def test_bad_profile_fails_the_job(slurm, tmp_path):
    out = tmp_path / "job.out"
    r = subprocess.run(["sbatch", "--wait", "--parsable", f"--output={out}", str(SCRIPT), "dtrain/profiles/nope.yaml"],
                       capture_output=True, text=True, env=slurm.env, cwd=REPO, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "profile 'dtrain/profiles/nope.yaml' not found" in out.read_text()
    assert slurm.job(r.stdout.strip().split(";")[0])["ExitCode"] == "2:0"
