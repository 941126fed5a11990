"""dtrain.analysis.interleave: every configuration of a matrix trained in one job, step by step in turn, on the same
batches; each leaves an ordinary run directory."""

import os
import subprocess
import sys

import pytest

from dtrain.analysis import interleave
from dtrain.analysis.runs import load_run
from dtrain.common.errors import UserError
from dtrain.engine import trainer as trainer_mod

from conftest import REPO, records

SET = "set: {train.max_steps: 4, eval.at_end: false, train.average_last: 1, train.ckpt_every: 100, train.val_every: 0}"


def run_job(matrix, out, *extra):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "dtrain.analysis.interleave", "--matrix", str(matrix), "--out", str(out), *extra]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.slow
def test_an_interleaved_job_trains_every_configuration_in_turn_on_the_same_batches(tmp_path):
    matrix = tmp_path / "m.yaml"
    matrix.write_text(f"name: il\nprofiles: [dtrain/profiles/smoke.yaml]\nstrategies: [ddp, bucketed, per_class]\n{SET}\n")
    r = run_job(matrix, tmp_path / "out", "--seed", "3", "--set", "train.record_ranks=true")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    runs = {p.name: p for p in (tmp_path / "out").iterdir()}
    assert sorted(runs) == ["smoke-bucketed", "smoke-ddp", "smoke-per_class"]
    steps = {name: records(p / "steps.jsonl") for name, p in runs.items()}
    assert all([s["step"] for s in rows] == [1, 2, 3, 4] for rows in steps.values())
    # The same seed: the same batches at every step, whatever the strategy.
    assert len({tuple(s["tokens"] for s in rows) for rows in steps.values()}) == 1
    # In turn: every configuration's step i is recorded before any configuration's step i + 1.
    for i in range(3):
        assert max(rows[i]["time"] for rows in steps.values()) <= min(rows[i + 1]["time"] for rows in steps.values())
    # Ordinary run directories: the simulator reads them, bucket records and all.
    run = load_run(runs["smoke-per_class"])
    assert run.strategy == "per_class" and set(run.buckets) == {1, 2, 3, 4}
    # train.record_ranks: rank 1's records beside rank 0's, the same buckets, on its own clock.
    assert set(run.rank_buckets) == {1} and set(run.rank_buckets[1]) == {1, 2, 3, 4}
    assert [r["bytes"] for r in run.rank_buckets[1][4]] == [r["bytes"] for r in run.buckets[4]]
    # ... and rank 1's step times and CPU by thread (not its loss: rank 0's records hold the run's)
    rank1 = records(runs["smoke-ddp"] / "steps.rank1.jsonl")
    assert [r["step"] for r in rank1] == [1, 2, 3, 4] and rank1[-1]["cpu_main_ms"] > 0 and "loss" not in rank1[0]
    # The job ends with its comparison against stock DDP (dtrain.analysis.paired), one row a configuration.
    table = r.stdout[r.stdout.index("configuration "):]
    assert "vs ddp" in table and all(any(ln.startswith(n + " ") for ln in table.splitlines())
                                      for n in ("ddp", "bucketed", "per_class"))
    # A second job into the same folder is refused in one line, and the first one's records are intact. One plain
    # process (a one-rank job) is enough for the refusal: a second 2-rank torchrun would cost seconds for nothing.
    again = subprocess.run([sys.executable, "-m", "dtrain.analysis.interleave", "--matrix", str(matrix), "--out",
                            str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True, timeout=300,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert again.returncode != 0 and "not empty; an interleaved job starts in a new folder" in again.stderr
    assert records(runs["smoke-ddp"] / "steps.jsonl") == steps["smoke-ddp"]


def test_configurations_that_cannot_share_a_job_are_refused(tmp_path):
    matrix = tmp_path / "m.yaml"
    matrix.write_text("profiles: [dtrain/profiles/smoke.yaml]\nstrategies: [bucketed]\n"
                      f"knobs: {{data.max_tokens: [256, 512]}}\n{SET}\n")
    with pytest.raises(UserError, match="differ in data"):
        interleave.load_configs(str(matrix), [])
    with pytest.raises(UserError, match="parse_log"):
        interleave.load_configs(str(matrix), ["data.max_tokens=256", "collectives.parse_log=true"])


def test_only_keeps_the_named_cells_and_names_an_unknown_one(tmp_path):
    matrix = tmp_path / "m.yaml"
    matrix.write_text("profiles: [dtrain/profiles/smoke.yaml]\nvariants:\n  noop: {sync.strategy: noop}\n"
                      "  b2: {sync.strategy: bucketed, sync.bucket_cap_mb: 2}\n"
                      f"  b8: {{sync.strategy: bucketed, sync.bucket_cap_mb: 8}}\n{SET}\n")
    assert [n for n, _ in interleave.load_configs(str(matrix), [])] == ["smoke-noop", "smoke-b2", "smoke-b8"]
    cells = interleave.load_configs(str(matrix), [], only="b8, smoke-noop")  # a variant and a run name
    assert [n for n, _ in cells] == ["smoke-noop", "smoke-b8"]
    assert cells[1][1].sync.bucket_cap_mb == 8
    with pytest.raises(UserError, match=r"no cell named 'b4' in .*\(variants: noop, b2, b8\)"):
        interleave.load_configs(str(matrix), [], only="b2,b4")
    with pytest.raises(UserError, match="no cell named"):
        interleave.load_configs(str(matrix), [], only=",")


def test_each_turn_starts_with_the_ranks_aligned(monkeypatch):
    """A configuration's step in turn (interleave, the tuner's race) first waits for every rank, outside the step."""
    calls = []
    monkeypatch.setattr(trainer_mod.ddist, "barrier", lambda: calls.append("barrier"))

    class Stub:
        phase = ""

        def _guarded(self, fn, *args):
            return fn(*args)

        def recorded_step(self):
            calls.append("step")
            return "record"

    assert trainer_mod.Trainer.turn_step(Stub()) == "record"
    assert calls == ["barrier", "step"]
