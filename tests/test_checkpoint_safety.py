"""A checkpoint is data, never code: a crafted file is refused by every reader before it can run anything, while a
real training state (tensors, optimizer and scheduler state, RNG states, data position, config) still loads."""

import random
import re
import subprocess
import sys

import pytest
import torch
from conftest import REPO

from dtrain.common.errors import UserError
from dtrain.engine import checkpoint, config
from dtrain.engine.evaluate import load_model_for_eval
from dtrain.engine.trainer import rng_state


class _WritesMarker:
    """Pickles as a call of exec: unpickling it (weights_only=False) writes `marker`, as an attacker's file would."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('code ran')",)


def _crafted_run(tmp_path, name="run"):
    """A run directory whose latest checkpoint has a valid checksum and every training key, one of them the payload."""
    run, marker = tmp_path / name, tmp_path / f"{name}-marker"
    state = {"model": {"w": torch.zeros(2)}, **{k: 0 for k in checkpoint.TRAINING_KEYS}, "step": _WritesMarker(marker)}
    path = checkpoint.save(run, 10, state, keep=1)
    assert checkpoint.latest(run) == path  # complete as far as the checksum can tell
    return run, path, marker


def test_the_crafted_checkpoint_would_run_code(tmp_path):
    # The payload is live: the old weights_only=False load writes the marker. The tests below rely on that.
    _, path, marker = _crafted_run(tmp_path)
    torch.load(path, weights_only=False)
    assert marker.read_text() == "code ran"


def test_resume_load_refuses_a_crafted_checkpoint(tmp_path):
    _, path, marker = _crafted_run(tmp_path)
    refused = rf"^{re.escape(str(path))}: refused: .*\(it names exec\); loading it could run code"
    with pytest.raises(UserError, match=refused) as e:
        checkpoint.load(path, keys=checkpoint.TRAINING_KEYS)
    assert "\n" not in str(e.value)
    assert not marker.exists()


def test_evaluate_refuses_a_crafted_checkpoint(tmp_path):
    run, path, marker = _crafted_run(tmp_path)
    cfg = config.load(str(REPO / "dtrain/profiles/smoke.yaml"))
    with pytest.raises(UserError, match=rf"^{re.escape(str(path))}: refused"):
        load_model_for_eval(run, "latest", 100, cfg)
    averaged = run / "averaged.pt"  # evaluate's default model
    torch.save({"model": {"w": torch.zeros(2)}, "averaged": _WritesMarker(marker)}, averaged)
    with pytest.raises(UserError, match=rf"^{re.escape(str(averaged))}: refused"):
        load_model_for_eval(run, "averaged", 100, cfg)
    assert not marker.exists()


@pytest.mark.slow
def test_inspect_and_diff_refuse_a_crafted_checkpoint(tmp_path):
    run, path, marker = _crafted_run(tmp_path)
    cli = [sys.executable, "-m", "dtrain.engine.checkpoint"]
    r = subprocess.run([*cli, "inspect", str(path)], capture_output=True, text=True, cwd=REPO, check=False)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "checksum    ok" in r.stdout
    assert "contents    unreadable: refused: holds more than tensors and plain data (it names exec)" in r.stdout
    r = subprocess.run([*cli, "diff", str(run), str(path)], capture_output=True, text=True, cwd=REPO, check=False)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0 and "step-0000010.pt: refused" in r.stderr, r.stderr
    assert not marker.exists()


@pytest.mark.slow
def test_resume_refuses_a_crafted_checkpoint(tmp_path):
    run, path, marker = _crafted_run(tmp_path)
    (run / "steps.jsonl").write_text('{"step": 10}\n')
    before = path.read_bytes()
    r = subprocess.run([sys.executable, "-m", "dtrain.engine.train", "--profile", "dtrain/profiles/smoke.yaml", "--run-dir",
                        str(run), "--resume", "--set", "eval.at_end=false"],
                       capture_output=True, text=True, cwd=REPO, check=False, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and f"{path}: refused" in errors[0], r.stderr[-3000:]
    assert not marker.exists()
    assert path.read_bytes() == before


def _training_state():
    """What Trainer.state holds, built from the same parts: Adam and LambdaLR after a step, the RNG states, config."""
    cfg = config.load(str(REPO / "dtrain/profiles/smoke.yaml"))
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters(), lr=1.0, betas=cfg.optim.betas, eps=cfg.optim.eps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (s + 1))
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    scheduler.step()
    random.seed(5)
    return {"step": 7, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(), "data": {"epoch": 1, "step": 3}, "rng": [rng_state(), rng_state()],
            "model_hash": cfg.model_hash(), "config_hash": cfg.config_hash(), "world_size": 2,
            "config": cfg.to_dict()}


def test_a_training_state_loads_without_extra_globals(tmp_path):
    state = _training_state()
    loaded = checkpoint.load(checkpoint.save(tmp_path, 7, state, keep=1), keys=checkpoint.TRAINING_KEYS)
    assert loaded["rng"][1]["python"] == random.getstate()  # the tuple random.setstate takes back
    assert torch.equal(loaded["rng"][0]["torch"], state["rng"][0]["torch"])
    assert loaded["config"] == state["config"] and loaded["data"] == state["data"]
    assert loaded["scheduler"] == state["scheduler"]
    assert loaded["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    assert all(torch.equal(loaded["optimizer"]["state"][0][k], v) for k, v in state["optimizer"]["state"][0].items())
    # What Trainer.resume does with it: the optimizer and the Python RNG take the loaded state back.
    model = torch.nn.Linear(4, 3)
    torch.optim.Adam(model.parameters(), lr=1.0).load_state_dict(loaded["optimizer"])
    random.setstate(loaded["rng"][1]["python"])


def test_averaging_reads_checkpoints_and_its_own_output(tmp_path):
    states = [_training_state() for _ in range(3)]
    for i, s in enumerate(states):
        s["model"] = {k: torch.full_like(v, float(i)) for k, v in s["model"].items()}
    paths = [checkpoint.save(tmp_path, 10 * (i + 1), s, keep=3) for i, s in enumerate(states)]
    avg = checkpoint.average(paths)
    assert all(torch.equal(v, torch.ones_like(v)) for v in avg.values())
    # The averaged model as the trainer writes it and evaluate reads it back.
    back = checkpoint.load(checkpoint.save_averaged(tmp_path, avg, paths))
    assert back["averaged"] == [p.name for p in paths] and back["model"].keys() == avg.keys()
