"""A run checkpointed on 2 ranks resumes on 3 and on 1: the epoch's global batch order does not depend on the world
size, the position counts global batches, and the recorded samples show every batch of an epoch taken exactly once
across the change (only the fewer-than-world batches left at an epoch's end are dropped, as without a change)."""

import shutil

import pytest
import torch
from conftest import NO_EVAL, records, train_ranks

from dtrain.engine import config
from dtrain.engine.data import TokenBatcher
from dtrain.engine.startup import load_corpus

pytestmark = pytest.mark.slow

# 600 pairs make 14 batches an epoch: the change comes 10 batches into epoch 0, and the run crosses several epochs.
LIMIT, BEFORE, AFTER = 600, 5, 24
ARGS = ("--set", f"data.train_limit={LIMIT}", "--set", "train.record_samples=true", "--set", "train.ckpt_every=5",
        *NO_EVAL)


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("world") / "two"
    train_ranks("--run-dir", str(run), "--set", f"train.max_steps={BEFORE}", *ARGS)
    return run


@pytest.fixture(scope="module")
def straight_losses(tmp_path_factory):
    """The same run on 2 ranks without a change, for the loss curve."""
    run = tmp_path_factory.mktemp("world") / "straight"
    train_ranks("--run-dir", str(run), "--set", f"train.max_steps={AFTER}", *ARGS)
    return losses(run)


@pytest.fixture(scope="module")
def epoch_batches():
    cfg = config.load("dtrain/profiles/smoke.yaml", [f"data.train_limit={LIMIT}"])
    batcher = TokenBatcher(load_corpus(cfg).train.lengths(), cfg.data.max_tokens, cfg.seed)
    return batcher.epoch_batches


def resumed(two_rank_run, tmp_path, world: int):
    run = tmp_path / f"on{world}"
    shutil.copytree(two_rank_run, run)
    r = train_ranks("--run-dir", str(run), "--resume", "--set", f"train.max_steps={AFTER}", *ARGS, nproc=world)
    assert f"at step {BEFORE}" in r.stdout and f"written by 2 ranks, the data re-sharded over {world}" in r.stdout, \
        r.stdout
    return run


def check_each_batch_once(run, epoch_batches, world_after: int):
    """Per epoch, the batches the ranks trained on, in global order (step, then rank), are the epoch's batches from
    the first on, each once; an epoch that ended left fewer batches than the ranks that went on to the next."""
    taken = {}  # epoch -> {(step, rank): pair indices}
    for rank in range(max(2, world_after)):
        for rec in records(run / f"samples.rank{rank}.jsonl"):
            assert (rec["step"], rank) not in taken.setdefault(rec["epoch"], {})
            taken[rec["epoch"]][(rec["step"], rank)] = rec["pairs"]
    steps = {s for e in taken.values() for s, _ in e}
    assert steps == set(range(1, AFTER + 1))
    assert len(taken) >= 3, sorted(taken)  # the run crossed epochs before and after the change
    for epoch, by_position in sorted(taken.items()):
        order = [by_position[k] for k in sorted(by_position)]
        expected = epoch_batches(epoch)
        assert order == expected[: len(order)], epoch
        pairs = [i for batch in order for i in batch]
        assert len(pairs) == len(set(pairs))  # no pair twice in an epoch
        if epoch < max(taken):
            next_step = min(s for s, _ in taken[epoch + 1])
            world = world_after if next_step > BEFORE else 2
            assert len(expected) - len(order) < world, (epoch, len(expected), len(order))
    return taken


def losses(run):
    steps = records(run / "steps.jsonl")
    assert [s["step"] for s in steps] == list(range(1, AFTER + 1))
    return [s["loss"] for s in steps]


@pytest.mark.parametrize("world", [3, 1])
def test_resume_on_another_world_size(two_rank_run, straight_losses, epoch_batches, tmp_path, world):
    run = resumed(two_rank_run, tmp_path, world)
    taken = check_each_batch_once(run, epoch_batches, world)
    # Each step after the change takes `world` batches: the epoch of the change has them dealt to the new ranks.
    assert {r for s, r in taken[0] if s > BEFORE} == set(range(world))  # the change came mid-epoch
    loss = losses(run)
    assert loss[:BEFORE] == straight_losses[:BEFORE]

    def mean(values, start, end):  # steps start..end, 1-based
        return sum(values[start - 1 : end]) / (end - start + 1)

    spans = [(BEFORE - 2, BEFORE), (BEFORE + 1, BEFORE + 5), (AFTER - 4, AFTER)]
    print(f"\n2 -> {world} ranks, mean loss of steps " + ", ".join(
        f"{a}-{b}: {mean(loss, a, b):.3f} (2 ranks throughout: {mean(straight_losses, a, b):.3f})" for a, b in spans))
    # The loss after the change continues the 2-rank curve (rank 0's loss: the batches differ, so not exactly)
    # rather than jumping back up, and keeps falling.
    for a, b in spans[1:]:
        assert abs(mean(loss, a, b) - mean(straight_losses, a, b)) < 0.25, (loss, straight_losses)
    assert mean(loss, *spans[2]) < mean(loss, *spans[1]) < mean(loss, *spans[0])


def test_a_sharded_checkpoint_resumes_under_ddp_on_three_ranks_and_back(tmp_path):
    """sharded on 2 ranks for 5 steps, resumed under ddp on 3 to step 7, and that resumed under sharded on 2 to step
    9: the world size changes both ways, each resume reads the whole-model checkpoint (the optimizer state gathered
    whole, then cut into 2 ranks' shards again), and Adam's state goes on from where it stopped: its step count is 9
    for every parameter at the end. (The exact round trip of a whole state through 3 ranks' shards:
    tests/test_fsdp2.py.)"""
    run = tmp_path / "run"
    train_ranks("--run-dir", str(run), "--set", "sync.strategy=sharded", "--set", f"train.max_steps={BEFORE}", *ARGS)
    for strategy, before, world, steps in (("ddp", 2, 3, BEFORE + 2), ("sharded", 3, 2, BEFORE + 4)):
        r = train_ranks("--run-dir", str(run), "--resume", "--set", f"sync.strategy={strategy}",
                        "--set", f"train.max_steps={steps}", *ARGS, nproc=world)
        assert f"at step {steps - 2}" in r.stdout, r.stdout
        assert f"written by {before} ranks, the data re-sharded over {world}" in r.stdout, r.stdout
    steps = records(run / "steps.jsonl")
    assert [s["step"] for s in steps] == list(range(1, BEFORE + 5)) and all(s["grad_norm"] > 0 for s in steps)
    optimizer = torch.load(run / "checkpoints" / f"step-{BEFORE + 4:07d}.pt", weights_only=True)["optimizer"]
    assert len(optimizer["state"]) == len(optimizer["param_groups"][0]["params"])
    assert {int(s["step"]) for s in optimizer["state"].values()} == {BEFORE + 4}
