"""dtrain.analysis.testbed: agent commands and command-line errors everywhere; up/status/down, shaping and 2-node torchrun
jobs where network namespaces can be made (root and iproute2, as in CI). Every testbed made here is removed by the
fixture. The links and the testbed profile: tests/test_testbed_links.py."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dtrain.analysis.testbed import cli as testbed, disks as testbed_disks, jobs as testbed_jobs
from dtrain.analysis.testbed import links as testbed_links, net as testbed_net
from conftest import REPO
from dtrain.common.errors import UserError
from dtrain.common.paths import cache_root


def _why_not() -> str | None:
    try:
        testbed_net.require_tools()
    except UserError as e:
        return f"testbed {e}"
    return None


needs_netns = pytest.mark.skipif(_why_not() is not None, reason=_why_not() or "")


# ---- everywhere --------------------------------------------------------------------------------------------------

def test_agent_commands_put_rank_0_on_node_0():
    names = testbed_net.Names("dtb")
    cmds = [testbed_jobs.agent_command(names, i, 2, 1, 29600, "rid", ["-m", "dtrain.collectives.bench", "-b", "8"])
            for i in range(2)]
    for i, cmd in enumerate(cmds):
        assert cmd[:4] == ["ip", "netns", "exec", f"dtb-n{i}"]
        assert "--rdzv-backend=c10d" in cmd and "--rdzv-endpoint=10.77.0.1:29600" in cmd
        assert f"--local-addr=10.77.0.{i + 1}" in cmd and f"--rdzv-conf=is_host={int(i == 0)}" in cmd
        assert cmd[-4:] == ["-m", "dtrain.collectives.bench", "-b", "8"]
    assert "--local-ranks-filter=0" in cmds[0] and "--local-ranks-filter=0" not in cmds[1]
    # c10d orders agents by address string: node 0's must sort first at any cluster size.
    addrs = [testbed_net.Names.address(i) for i in range(testbed_net.MAX_NODES)]
    assert min(addrs) == addrs[0]


def test_command_line_errors(capsys, monkeypatch):
    with pytest.raises(SystemExit) as e:
        testbed.main(["--name", "Bad-Name", "status"])
    assert e.value.code == 2 and "bad testbed name" in capsys.readouterr().err
    monkeypatch.setattr(testbed_net.os, "geteuid", lambda: 1000)
    with pytest.raises(SystemExit) as e:
        testbed.main(["status"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "needs root" in err


# ---- with network namespaces -------------------------------------------------------------------------------------

@pytest.fixture
def bed():
    """A testbed name of this test session's own; whatever a test leaves up is removed, pass or fail."""
    names = testbed_net.Names(f"t{os.getpid() % 10**6}")
    testbed_net.down(names)
    yield names
    testbed_net.down(names)
    assert names.existing() == ([], [])


def _host_links() -> list[str]:
    return sorted(line.split()[0] for line in subprocess.run(["ip", "-br", "link"], capture_output=True,
                                                             text=True).stdout.splitlines())


@needs_netns
def test_up_status_down(bed):
    host = _host_links()
    # reno: always allowed in a namespace (the kernel's default tcp_allowed_congestion_control)
    testbed_net.up(bed, [testbed_links.Link(10**8), testbed_links.Link(10**8, congestion_control="reno")])
    rows = testbed_net.status(bed)
    host_cc = Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
    assert [r["tcp"] for r in rows] == [host_cc, "reno"]
    assert [(r["netns"], r["address"], r["state"]) for r in rows] == [
        (f"{bed.prefix}-n0", "10.77.0.1/24", "UP"), (f"{bed.prefix}-n1", "10.77.0.2/24", "UP")]
    assert all(r["egress"].startswith("tbf 100mbit") and r["ingress"].startswith("tbf 100mbit") for r in rows)
    assert _host_links() == host  # nothing in the host's own namespace
    with pytest.raises(UserError, match="already up"):
        testbed_net.up(bed, [testbed_links.Link(10**8)] * 2)
    assert sorted(testbed_net.down(bed)) == sorted([bed.hub, bed.node(0), bed.node(1)])
    assert testbed_net.down(bed) == []  # idempotent
    assert bed.existing() == ([], [])


@needs_netns
@pytest.mark.parametrize("exc", [UserError("boom"), KeyboardInterrupt()])
def test_up_leaves_nothing_behind_on_failure(bed, monkeypatch, exc):
    calls = []
    real_sh = testbed_net.sh

    def failing_sh(*args):
        calls.append(args)
        if len(calls) == 20:  # half-way through node 1 of 3
            raise exc
        return real_sh(*args)

    monkeypatch.setattr(testbed_net, "sh", failing_sh)
    with pytest.raises(type(exc)):
        testbed_net.up(bed, [testbed_links.Link(10**9)] * 3)
    assert bed.existing() == ([], [])


@pytest.mark.slow
@needs_netns
def test_shaping_limits_throughput(bed):
    testbed_net.up(bed, [testbed_links.Link(40 * 10**6)] * 2)  # 40 Mbit/s = 5 MB/s
    bps = testbed_net.probe(bed, 0, 1, seconds=1.0)
    assert 2.5e6 < bps < 5.5e6


@pytest.mark.slow
@needs_netns
def test_the_link_inside_a_node_is_shaped_apart(bed):
    # node 0: unshaped between nodes, 40 Mbit/s between its own ranks (loopback); node 1: both unshaped
    testbed_net.up(bed, [testbed_links.Link(None, intra_rate=40 * 10**6), testbed_links.Link(None)])
    assert [r["intra"].split(" burst")[0] for r in testbed_net.status(bed)] == ["tbf 40mbit", "unshaped"]
    assert 2.5e6 < testbed_net.probe(bed, 0, 0, seconds=1.0) < 5.5e6  # a stream inside node 0
    assert testbed_net.probe(bed, 0, 1, seconds=1.0) > 50e6  # node 0 to node 1: not through node 0's loopback


RANK_SCRIPT = """
import json, os, socket, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.connect((os.environ["MASTER_ADDR"], 9))  # no packet sent: only asks which local address routes there
t = torch.full((1000,), float(rank + 1))
dist.all_reduce(t)
info = dict(rank=rank, addr=s.getsockname()[0], master=os.environ["MASTER_ADDR"],
            ifname=os.environ["GLOO_SOCKET_IFNAME"], sum=t[0].item(), world=dist.get_world_size(),
            cpus=sorted(os.sched_getaffinity(0)))
open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w").write(json.dumps(info))
print(f"hello from rank {rank}", flush=True)
mode = sys.argv[2] if len(sys.argv) > 2 else "ok"
if mode == "fail" and rank == 1:
    sys.exit(3)
if mode in ("fail", "hang"):
    time.sleep(600)  # rank 0 (fail) or both (hang): only the testbed's cleanup ends this
dist.destroy_process_group()
"""


def _testbed_run(bed, tmp_path, mode, *options):
    script = tmp_path / "job.py"
    script.write_text(RANK_SCRIPT)
    return [sys.executable, "-m", "dtrain.analysis.testbed", "--name", bed.prefix, "run", "--nodes", "2", *options,
            "--log-dir", str(tmp_path / "logs"), "--", str(script), str(tmp_path), mode]


def _no_processes_left(bed):
    for i in range(2):
        out = subprocess.run(["ip", "netns", "pids", bed.node(i)], capture_output=True, text=True).stdout
        assert out.split() == [], f"processes left in {bed.node(i)}"


@pytest.mark.slow
@needs_netns
def test_run_all_reduce_across_two_nodes_each_on_its_own_cpus(bed, tmp_path):
    """The job's ranks meet across the nodes' link; with --pin-cpus each node's processes run on its share of the
    CPUs (the runs of the tests below are not pinned)."""
    testbed_net.up(bed, [testbed_links.Link(10**9)] * 2)
    r = subprocess.run(_testbed_run(bed, tmp_path, "ok", "--pin-cpus"), cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "hello from rank 0" in r.stdout and "hello from rank 1" not in r.stdout  # rank 0's output only
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    for i, info in enumerate(ranks):
        assert info["addr"] == f"10.77.0.{i + 1}"  # rank i runs inside node i
        assert info["master"] == "10.77.0.1" and info["ifname"] == testbed_net.IFACE
        assert info["sum"] == 3.0 and info["world"] == 2
        assert info["cpus"] == testbed_jobs.node_cpus(i, 2, sorted(os.sched_getaffinity(0)))
    assert "CPUs node 0: " in r.stderr
    assert "hello from rank 1" in (tmp_path / "logs" / "node1.log").read_text()
    _no_processes_left(bed)


@pytest.mark.slow
@needs_netns
def test_run_returns_the_failure_and_stops_the_rest(bed, tmp_path):
    testbed_net.up(bed, [testbed_links.Link(10**9)] * 2)
    t0 = time.monotonic()
    r = subprocess.run(_testbed_run(bed, tmp_path, "fail"), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert time.monotonic() - t0 < 60  # rank 0, asleep, was stopped rather than waited for
    assert "node 1 exited with" in r.stderr
    _no_processes_left(bed)


@pytest.mark.slow
@needs_netns
def test_ctrl_c_stops_the_job(bed, tmp_path):
    testbed_net.up(bed, [testbed_links.Link(10**9)] * 2)
    p = subprocess.Popen(_testbed_run(bed, tmp_path, "hang"), cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True)
    try:
        deadline = time.monotonic() + 90
        while not all((tmp_path / f"rank{i}.json").exists() for i in range(2)):
            assert time.monotonic() < deadline and p.poll() is None, "the job did not start"
            time.sleep(0.2)
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=90) == 130
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    _no_processes_left(bed)


# ---- private filesystems (run --private-fs) ----------------------------------------------------------------------

def test_private_mounts_give_each_node_its_own_copy_and_cover_tmp_last():
    names = testbed_net.Names("dtb")
    targets = [Path("/work/repo/runs"), Path("/tmp"), Path("/root/.cache/dtrain"),
               Path("/tmp/elsewhere/run"), Path("/work/repo/runs/")]
    mounts = testbed_disks.private_mounts(names.disk(1), targets)
    disk = Path("/tmp/dtb-node1")
    # /tmp/elsewhere/run is private with /tmp; the repeated runs/ once; /tmp, which holds the node's disk, last.
    assert mounts == [(disk / "work/repo/runs", Path("/work/repo/runs")),
                      (disk / "root/.cache/dtrain", Path("/root/.cache/dtrain")),
                      (disk / "tmp", Path("/tmp"))]
    assert testbed_disks.private_mounts(names.disk(2), targets)[0][0] == Path("/tmp/dtb-node2/work/repo/runs")
    with pytest.raises(UserError, match="--private-path /"):
        testbed_disks.private_mounts(names.disk(1), [Path("/")])


def test_private_paths_are_the_run_dirs_the_cache_and_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(sys, "prefix", "/opt/venv")
    monkeypatch.setattr(sys, "executable", "/opt/venv/bin/python")
    monkeypatch.setattr(Path, "cwd", classmethod(lambda cls: cls("/srv/checkout")))
    assert testbed_disks.private_paths(["results"]) == [Path("/srv/checkout/runs"), tmp_path / "xdg" / "dtrain",
                                                 Path("/tmp"), Path("/srv/checkout/results")]
    # A checkout under /tmp (or a virtual environment there) keeps /tmp shared: covered, the nodes could not run.
    monkeypatch.setattr(Path, "cwd", classmethod(lambda cls: tmp_path))
    assert testbed_disks.private_paths() == [tmp_path / "runs", tmp_path / "xdg" / "dtrain"]
    monkeypatch.setattr(Path, "cwd", classmethod(lambda cls: cls("/srv/checkout")))
    monkeypatch.setattr(sys, "executable", "/tmp/venv/bin/python")
    assert Path("/tmp") not in testbed_disks.private_paths()


def test_agent_command_mounts_before_torchrun():
    names = testbed_net.Names("dtb")
    mounts = [(Path("/tmp/dtb-node1/a b"), Path("/a b")), (Path("/tmp/dtb-node1/tmp"),
                                                                           Path("/tmp"))]
    cmd = testbed_jobs.agent_command(names, 1, 2, 1, 29600, "rid", ["-m", "x"], mounts)
    assert cmd[:6] == ["ip", "netns", "exec", "dtb-n1", "sh", "-c"]
    assert cmd[6] == "mount --bind '/tmp/dtb-node1/a b' '/a b' && mount --bind /tmp/dtb-node1/tmp /tmp && exec \"$@\""
    assert cmd[7:10] == ["sh", sys.executable, "-m"] and cmd[10] == "torch.distributed.run" and cmd[-2:] == ["-m", "x"]
    plain = testbed_jobs.agent_command(names, 1, 2, 1, 29600, "rid", ["-m", "x"])
    assert plain[4] == sys.executable  # no mounts: as is


def test_private_path_needs_private_fs(capsys):
    with pytest.raises(SystemExit) as e:
        testbed.main(["run", "--private-path", "/x", "--", "-m", "x"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--private-path needs --private-fs" in err


# Each rank leaves a mark in /tmp, in runs/ and in dtrain's cache, waits for the other, then reports which marks it
# sees: with private filesystems, only its own.
FS_SCRIPT = """
import json, os, sys
from pathlib import Path
import torch.distributed as dist
from dtrain.common.paths import cache_root
dist.init_process_group("gloo")
rank, tag, report = dist.get_rank(), sys.argv[1], Path(sys.argv[2])
places = [Path("/tmp") / tag, Path.cwd() / "runs" / tag, cache_root() / tag]
for p in places:
    p.mkdir(parents=True, exist_ok=True)
    (p / f"rank{rank}").write_text("")
dist.barrier()
seen = {str(p): sorted(f.name for f in p.iterdir()) for p in places}
report.mkdir(parents=True, exist_ok=True)
(report / f"rank{rank}.json").write_text(json.dumps(seen))
dist.barrier()
dist.destroy_process_group()
"""


def _mounts() -> str:
    return open("/proc/self/mountinfo").read()


@pytest.mark.slow
@needs_netns
def test_private_fs_gives_node_1_its_own_run_dirs_cache_and_tmp(bed, tmp_path):
    testbed_net.up(bed, [testbed_links.Link(10**9)] * 2)
    tag = f"private-fs-{bed.prefix}"
    before = _mounts()
    cmd = [sys.executable, "-m", "dtrain.analysis.testbed", "--name", bed.prefix, "run", "--private-fs", "--log-dir",
           str(tmp_path / "logs"), "--", "--no-python", sys.executable, "-c", FS_SCRIPT, tag, str(tmp_path / "seen")]
    try:
        r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        disk = bed.disk(1)
        node1_seen = disk / str(tmp_path / "seen").lstrip("/")  # node 1's /tmp is disk/tmp on the host
        if not (node1_seen / "rank1.json").exists():  # /tmp shared (see below): its report is on the host
            node1_seen = tmp_path / "seen"
        seen = [json.loads((tmp_path / "seen" / "rank0.json").read_text()),
                json.loads((node1_seen / "rank1.json").read_text())]
        places = [f"/tmp/{tag}", str(REPO / "runs" / tag), str(cache_root() / tag)]
        # /tmp stays shared when it holds the checkout or the virtual environment (a CI clone under /tmp)
        private = [p for p in places if any(Path(p).parent == t or t in Path(p).parents
                                            for t in testbed_disks.private_paths())]
        assert str(REPO / "runs" / tag) in private and str(cache_root() / tag) in private
        for p in places:
            if p in private:  # node 0 wrote on the host; node 1 on its own disk
                assert seen[0][p] == ["rank0"] and seen[1][p] == ["rank1"]
                assert sorted(os.listdir(p)) == ["rank0"]
                assert sorted(os.listdir(disk / p.lstrip("/"))) == ["rank1"]
            else:
                assert sorted(os.listdir(p)) == ["rank0", "rank1"]
        assert _mounts() == before  # node 1's mounts never reached the host
    finally:
        for p in (f"/tmp/{tag}", REPO / "runs" / tag, cache_root() / tag):
            shutil.rmtree(p, ignore_errors=True)
    assert str(bed.disk(1)) in testbed_net.down(bed) and not bed.disk(1).exists()


def test_an_elastic_agent_asks_for_a_range_of_nodes():
    names = testbed_net.Names("dtb")
    cmd = testbed_jobs.agent_command(names, 1, 2, 1, 29600, "rid", ["--max-restarts=3", "-m", "x"], min_nodes=1)
    assert "--nnodes=1:2" in cmd and "--nnodes=2" not in cmd and "--rdzv-conf=is_host=0" in cmd
    short = testbed_jobs.agent_command(names, 0, 2, 1, 29600, "rid", ["-m", "x"], min_nodes=1, last_call_s=2)
    assert "--rdzv-conf=is_host=1,last_call_timeout=2" in short
    assert cmd[-3:] == ["--max-restarts=3", "-m", "x"]  # torchrun's own options pass through before the module


@needs_netns
def test_drop_refuses_node_0_and_unknown_nodes(bed):
    testbed_net.up(bed, [testbed_links.Link(10**9)] * 2)
    with pytest.raises(UserError, match="node 0 hosts the rendezvous"):
        testbed_jobs.drop(bed, 0)
    with pytest.raises(UserError, match="no node 5"):
        testbed_jobs.drop(bed, 5)
    assert testbed_jobs.drop(bed, 1) == 0  # nothing runs there


@pytest.mark.slow
@needs_netns
def test_an_elastic_job_goes_on_when_a_node_is_taken_away(bed, tmp_path):
    """2 nodes, private disks, --min-nodes 1: node 1 is dropped mid-run; node 0's agent meets the rendezvous again
    alone, and its worker resumes from the last checkpoint on 1 rank and finishes every step."""
    testbed_net.up(bed, [testbed_links.Link(10**9)] * 2)
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "dtrain.analysis.testbed", "--name", bed.prefix, "run", "--private-fs", "--min-nodes", "1",
           "--last-call", "2", "--log-dir", str(tmp_path / "logs"), "--", "--max-restarts=3", "-m", "dtrain.engine.train",
           "--profile", "dtrain/profiles/smoke.yaml", "--set", "train.max_steps=20", "--set", "train.ckpt_every=5",
           "--set", "eval.at_end=false", "--set", "train.average_last=1", "--fault", "slow@rank=0,ms=250",
           "--run-dir", str(run)]
    job = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and job.poll() is None:
            steps = run / "steps.jsonl"
            if steps.exists() and len(steps.read_text().splitlines()) >= 12:
                break
            time.sleep(0.5)
        assert job.poll() is None, job.communicate()[0][-3000:]  # still running: its node 1 is there to drop
        assert testbed_jobs.drop(bed, 1) >= 1
        out, _ = job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, out[-3000:]
    assert "the data re-sharded over 1" in out and "done: steps=20" in out, out[-3000:]
    assert [json.loads(line)["step"] for line in (run / "steps.jsonl").read_text().splitlines()] == list(range(1, 21))
    header = json.loads((run / "run.json").read_text())
    assert header["world_size"] == 1  # the attempt that finished ran on node 0 alone


def test_node_cpus_divide_the_machine_between_the_nodes():
    assert [testbed_jobs.node_cpus(i, 2, [0, 1]) for i in range(2)] == [[0], [1]]
    assert [testbed_jobs.node_cpus(i, 2, list(range(16))) for i in range(2)] == [list(range(8)), list(range(8, 16))]
    assert [testbed_jobs.node_cpus(i, 3, [0, 1]) for i in range(3)] == [[0], [1], [0]]  # more nodes than CPUs
    assert [testbed_jobs.node_cpus(i, 2, [4, 5, 6]) for i in range(2)] == [[4], [5]]  # of the CPUs allowed


def test_agent_command_pins_before_mounting():
    names = testbed_net.Names("dtb")
    cmd = testbed_jobs.agent_command(names, 1, 2, 1, 29600, "rid", ["-m", "x"], [(Path("/d/t"), Path("/t"))],
                                     cpus=[2, 3])
    assert cmd[:8] == ["ip", "netns", "exec", "dtb-n1", "taskset", "-c", "2,3", "sh"]
