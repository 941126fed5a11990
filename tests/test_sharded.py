"""The sharded strategy: reduce-scatter in backward, each rank updating its shard, all-gather in the next forward.
It must give what DDP gives (the same gradients, the same clipped update, the same checkpoints), and its checkpoints
must resume under any strategy."""

import pytest

from conftest import NO_EVAL, checkpoint_diff, records, torchrun
from common.errors import UserError
from dtrain import config, verify

SHARDED = ("--set", "sync.strategy=sharded", "--set", "sync.bucket_cap_mb=0.05")  # many buckets on the tiny model


@pytest.mark.parametrize("nproc", [2, 3])
def test_sharded_gradients_equal_the_reference(nproc):
    results = verify.run(nproc, ["sharded"], accums=[1, 2], steps=3)
    for accum, by_strategy in results.items():
        r = by_strategy["sharded"]
        assert r["lossless"] and r["max_rel"] <= verify.TOLERANCE, (accum, r)
        if nproc == 2:  # a + b in either order: the all-reduce's sum, bit for bit
            assert r["max_abs"] == 0.0, (accum, r)


def test_sharded_refuses_the_tied_split():
    raw = {"sync": {"strategy": "sharded", "classes": {"embedding": {"tied_split": True}}}}
    with pytest.raises(UserError, match="tied_split.*not used by strategy 'sharded'"):
        config.from_dict(raw, "test")


@pytest.mark.slow
def test_sharded_training_equals_ddp_with_clipping_and_accumulation(tmp_path):
    """10 steps, clipped by the global norm, 2 micro-batches a step: the same parameters and optimizer state as
    stock DDP, bit for bit (2 ranks)."""
    same = ("--set", "train.max_steps=10", "--set", "optim.clip_norm=0.5", "--set", "train.accum_steps=2", *NO_EVAL)
    torchrun("--run-dir", str(tmp_path / "ddp"), "--set", "sync.strategy=ddp", *same)
    torchrun("--run-dir", str(tmp_path / "sharded"), *SHARDED, *same)
    diff = checkpoint_diff(tmp_path / "ddp", tmp_path / "sharded")
    assert "max |A - B| over parameters: 0 " in diff and "optimizer states: identical" in diff, diff
    norms = [[s["grad_norm"] for s in records(tmp_path / r / "steps.jsonl")] for r in ("ddp", "sharded")]
    assert norms[0] == norms[1] and max(norms[0]) > 0.5  # the clip was active


@pytest.mark.slow
def test_clipping_changes_the_update(tmp_path, straight_run):
    """Clipping scales the gradients the optimizer reads (it once scaled nothing: given gradient tensors instead of
    parameters, torch's clip_grads_with_norm_ finds no .grad to scale)."""
    torchrun("--run-dir", str(tmp_path / "clipped"), "--set", "train.max_steps=10", "--set", "optim.clip_norm=0.05",
             *NO_EVAL)
    diff = checkpoint_diff(straight_run / "checkpoints" / "step-0000010.pt", tmp_path / "clipped")
    assert "max |A - B| over parameters: " in diff and "max |A - B| over parameters: 0 " not in diff, diff


@pytest.mark.slow
def test_sharded_checkpoint_resumes_exactly(tmp_path, straight_run):
    """10 sharded steps, resumed by the sharded strategy to 20 == 20 stock DDP steps (the uninterrupted run's step-20
    checkpoint): the checkpoint holds the whole optimizer state, which the shards are cut from again."""
    run = tmp_path / "run"
    torchrun("--run-dir", str(run), *SHARDED, "--set", "train.max_steps=10", *NO_EVAL)
    r = torchrun("--run-dir", str(run), *SHARDED, "--resume", "--set", "train.max_steps=20", *NO_EVAL)
    assert "at step 10" in r.stdout
    diff = checkpoint_diff(straight_run / "checkpoints" / "step-0000020.pt", run)
    assert "max |A - B| over parameters: 0 " in diff and "optimizer states: identical" in diff, diff
