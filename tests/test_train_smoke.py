"""End to end: 2-rank torchrun runs of dtrain/profiles/smoke.yaml (about 15 s each here), and the README's first
command, `torchrun --nproc_per_node=2 -m dtrain.train --profile profiles/ll128.yaml`, made small."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import dtrain
from dtrain.analysis.runs import load_run

from conftest import REPO, records, train_ranks

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("smoke") / "run"
    r = train_ranks("--run-dir", str(run), "--set", "train.tensorboard=true")
    return run, r


def test_smoke_run_writes_the_run_directory(smoke_run):
    run, r = smoke_run
    assert "done: steps=40" in r.stdout
    for name in ("config.yaml", "run.json", "steps.jsonl", "eval.jsonl", "bpe.model", "averaged.pt", "hyps.val.txt"):
        assert (run / name).is_file(), name
    header = json.loads((run / "run.json").read_text())
    assert header["world_size"] == 2 and header["backend"] == "gloo" and header["sync"]["strategy"] == "ddp"
    assert header["ranks_per_node"] == 2 and load_run(run).ranks_per_node == 2  # one node (LOCAL_WORLD_SIZE)
    assert header["host_memory"] == "kept"  # train.keep_host_memory, on by default (glibc here)
    assert header["amp"] == "fp32" and header["amp_setting"] == "fp32"  # the default: the same numbers everywhere
    assert header["amp_reason"].startswith(("set in the profile; CPU capability ", "set in the profile; CPU with "))
    steps = records(run / "steps.jsonl")
    assert [s["step"] for s in steps] == list(range(1, 41))
    for key in ("loss", "tokens", "lr", "data_ms", "forward_ms", "backward_ms", "comm_exposed_ms", "optimizer_ms"):
        assert key in steps[0]
    # The step's CPU time by thread: the training thread computed, and DDP's all-reduces ran on gloo's threads.
    assert all(s["cpu_main_ms"] > 0 for s in steps[1:]) and sum(s["cpu_backend_ms"] for s in steps) > 0
    evals = records(run / "eval.jsonl")
    assert [e["kind"] for e in evals] == ["val", "val", "bleu"]
    assert evals[-1]["signature"].startswith("nrefs:1|case:mixed") and evals[-1]["sentences"] == 1014
    assert len(list((run / "checkpoints").glob("step-*.pt"))) == 3  # keep_ckpts


def test_smoke_run_writes_tensorboard_events_and_plain_progress(smoke_run):
    """train.tensorboard on 2 ranks: rank 0's events hold the records of steps.jsonl and eval.jsonl, BLEU included;
    stderr, a pipe here, holds one plain line per log interval and no bar."""
    run, r = smoke_run
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert {"train/loss", "train/lr", "train/step_ms", "train/comm_exposed_ms", "train/tokens_per_s", "val/nll",
            "val/bleu"} <= set(events.Tags()["scalars"])
    steps = records(run / "steps.jsonl")
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [
        (s["step"], float(np.float32(s["loss"]))) for s in steps]  # TensorBoard keeps float32
    evals = records(run / "eval.jsonl")
    assert [e.step for e in events.Scalars("val/nll")] == [e["step"] for e in evals if e["kind"] == "val"]
    bleu = evals[-1]
    assert [(e.step, e.value) for e in events.Scalars("val/bleu")] == [(40, float(np.float32(bleu["bleu"])))]
    assert [e.step for e in events.Scalars("train/tokens_per_s")] == list(range(5, 41, 5))
    lines = [line for line in r.stderr.splitlines() if line.startswith("smoke step")]
    assert [line.split()[2] for line in lines] == [f"{s}/40" for s in range(5, 41, 5)], r.stderr[-2000:]
    assert "\r" not in r.stderr  # no bar redraws
    assert "decoding val (rank 0): 507 sentences" in r.stderr and "decoding val (rank 0): done in" in r.stderr
    versions = json.loads((run / "run.json").read_text())["versions"]
    assert versions["dtrain"] == dtrain.__version__


def test_smoke_loss_decreases(smoke_run):
    run, _ = smoke_run
    steps = records(run / "steps.jsonl")
    first = sum(s["loss"] for s in steps[:5]) / 5
    last = sum(s["loss"] for s in steps[-5:]) / 5
    assert last < first - 0.5, (first, last)


def test_fresh_run_refuses_existing_run_dir(smoke_run):
    run, _ = smoke_run
    before = (run / "steps.jsonl").read_bytes()
    r = train_ranks("--run-dir", str(run), check=False)
    assert r.returncode != 0 and "already holds a run" in r.stderr
    assert (run / "steps.jsonl").read_bytes() == before


def test_evaluate_cli_scores_a_saved_run(smoke_run):
    run, _ = smoke_run
    r = subprocess.run([sys.executable, "-m", "dtrain.engine.evaluate", "--run", str(run), "--split", "val", "--beam", "1"],
                       capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("BLEU ") and "beam 1, model averaged" in r.stdout and "nrefs:1" in r.stdout
    last = records(run / "eval.jsonl")[-1]
    assert last["kind"] == "bleu" and last["beam"] == 1 and last["sentences"] == 1014


def test_the_readme_s_ll128_command_trains_on_cpu_ranks_with_its_nccl_setting_inactive(tmp_path):
    """The command as the README gives it, from a folder outside the checkout, the model and data made smoke-sized
    (the profile's own base model takes seconds a step here): gloo ranks, LL128 recorded and said to be inactive."""
    size = ["model.preset=tiny", "data.vocab_size=1000", "data.train_limit=2000", "data.max_tokens=1200",
            "train.max_steps=2", "train.val_every=0", "train.average_last=1", "eval.at_end=false", "train.amp=auto"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "dtrain.train",
           "--profile", "profiles/ll128.yaml", "--run-dir", "run", *[a for kv in size for a in ("--set", kv)]]
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    out, err = r.stdout.decode(), r.stderr.decode()  # bytes as written: text=True would turn "\r" into "\n"
    assert r.returncode == 0, out[-2000:] + err[-3000:]
    assert "done: steps=2" in out and "\r" not in err  # plain progress lines, no bar redraws
    inactive = [line for line in err.splitlines() if "NCCL settings inactive" in line]
    assert inactive == ["dtrain.engine.train: NCCL settings inactive on backend gloo: protocol LL128 recorded in "
                        "run.json (nccl: requested, not applied)"]  # rank 0 alone
    header = json.loads((tmp_path / "run" / "run.json").read_text())
    assert header["name"] == "base-ll128" and header["backend"] == "gloo"
    assert header["nccl"]["applied"] is False and header["nccl"]["status"] == "requested, not applied (backend gloo)"
    assert header["nccl"]["requested"]["default"]["protocol"] == "LL128"
    assert header["amp_setting"] == "auto" and header["amp"] in ("bf16", "fp32") and header["amp_reason"]
