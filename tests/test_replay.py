"""dtrain.analysis.replay: a recorded step's collectives replayed on the network (two gloo ranks on loopback), next to
the run's completions and the cost model's replay of the same launches."""

import json
import os
import subprocess
import sys

import pytest

from dtrain.analysis import simulate as sim
from dtrain.analysis.runs import load_run
from dtrain.collectives import costmodel as cm
from conftest import REPO
from test_simulate import _write_run


def _bench(path):
    # A fitted model of 100 us + 1 us per 100 B on the reducer path.
    rows = [{"path": "reducer", "size": s, "time_us": 100.0 + s / 100.0} for s in (8 * 4 ** k for k in range(10))]
    path.write_text(json.dumps(rows))
    return f"local:{path}"


def _replay(*args, nproc=2):
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
                if nproc > 1 else [sys.executable])
    return subprocess.run([*launcher, "-m", "dtrain.analysis.replay", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.slow
def test_two_ranks_replay_a_recorded_step_on_its_class_groups(tmp_path):
    _write_run(tmp_path / "run", strategy="per_class", cap=0.25)
    topology = _bench(tmp_path / "bench.json")
    r = _replay(tmp_path / "run", "--repeats", 2, "--topology", topology, "--json", tmp_path / "replay.json")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    doc = json.loads((tmp_path / "replay.json").read_text())
    recs = sim.reference_step(load_run(tmp_path / "run")).records
    assert doc["schedule"]["class_groups"] and doc["schedule"]["repeats"] == 2 and len(doc["rows"]) == len(recs)
    assert len({rec["class"] for rec in recs}) > 1  # several groups were made and used
    for row, rec in zip(doc["rows"], recs):
        assert (row["class"], row["bytes"], row["launch_ms"]) == (rec["class"], rec["bytes"], rec["launch_ms"])
        assert row["run_complete_ms"] == rec["complete_ms"]
        assert row["network_complete_ms"] >= row["launch_ms"]  # measured: done after its own launch
    # The model's column is the simulator's timeline of the same launches, two lanes per class group, no slowdown.
    model = cm.load_model(topology)
    sizes = [rec["bytes"] for rec in recs]
    tl = sim.play_timeline([rec["launch_ms"] for rec in recs], [model.allreduce_ms(n) for n in sizes], 0.0, True,
                           1.0, 2, [model.allreduce_latency_ms(n) for n in sizes], [rec["class"] for rec in recs])
    assert [row["model_complete_ms"] for row in doc["rows"]] == pytest.approx(tl.end)
    assert doc["last"]["network_ms"] == max(row["network_complete_ms"] for row in doc["rows"])
    assert "# last completion: run" in r.stdout and "the network adds" in r.stdout


@pytest.mark.slow
def test_bad_input_is_one_line(tmp_path):
    _write_run(tmp_path / "run")
    for args, msg in (((tmp_path / "nowhere",), "not a run directory"),
                      ((tmp_path / "run",), "ran with 2 ranks; replay it with as many (this job has 1)"),
                      ((tmp_path / "run", "--repeats", 0), "--repeats must be at least 1"),
                      ((tmp_path / "run", "--topology", "local:/nonexistent.json"), "nonexistent")):
        r = _replay(*args, nproc=1)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.startswith("dtrain.analysis.replay: error: ") and msg in r.stderr and r.stderr.count("\n") == 1
