"""`attach(model, SyncConfig(strategy="auto"))`: the search inside any training loop, on the one model
(`dtrain.collectives.strategies.auto.OnlineSearch`)."""

import threading

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_examples import per_class_run, plain_loop  # noqa: F401 - per_class_run: the reference fixture
from test_strategies import one_rank  # noqa: F401 - the one-rank gloo group fixture

from dtrain.collectives import attach
from dtrain.collectives.settings import SyncConfig, TuneConfig
from dtrain.collectives.strategies.auto import REPLICATED_SPACE, OnlineSearch, candidate_sync
from dtrain.common.errors import UserError
from dtrain.engine import verify

SPACE = {"ddp-2": {"strategy": "ddp", "bucket_cap_mb": 2}, "bucketed-0.5": {"strategy": "bucketed", "bucket_cap_mb": 0.5},
         "split": {"strategy": "bucketed", "bucket_cap_mb": 0.01, "classes.embedding.tied_split": True}}


def auto(candidates=None, **tune):
    return SyncConfig(strategy="auto", tune=TuneConfig(candidates=candidates or {}, **tune))


def train(handle, model, steps, rank=0):
    """The plain loop's steps: forward through the handle, backward, wait, SGD, stepped."""
    opt = torch.optim.SGD(handle.optimizer_params(), lr=0.1)
    for step in range(steps):
        src, tgt_in, tgt_out = verify.batch(rank, step, 0)
        verify.loss_fn(handle.module(src, tgt_in), tgt_out, 1).backward()
        handle.wait()
        opt.step()
        handle.stepped()
        opt.zero_grad(set_to_none=True)


def test_a_candidate_is_its_keys_over_the_class_rules_and_a_bad_one_is_one_line():
    base = SyncConfig(strategy="auto", classes={"embedding": {"match": "embed.*"}})
    sync = candidate_sync(base, "s", {"strategy": "bucketed", "classes.embedding.tied_split": True})
    assert sync.strategy == "bucketed" and sync.classes["embedding"].match == "embed.*"
    assert sync.classes["embedding"].tied_split
    for keys, words in (({"strategy": "ddp", "bucket_cap": 2}, ["sync.tune.candidates.x", "bucket_cap"]),
                        ({"bucket_cap_mb": 2}, ["sync.tune.candidates.x", "strategy"]),
                        ({"strategy": "ddp", "powersgd_rank": 2}, ["sync.powersgd_rank", "not used by strategy"])):
        with pytest.raises(UserError) as e:
            candidate_sync(base, "x", keys)
        assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


def test_sharding_and_lossy_candidates_are_refused_by_name(one_rank):
    model = verify.tiny_model()
    with pytest.raises(UserError, match="'sync.tune.candidates.s': sharded shards the parameters"):
        attach(model, auto({"s": {"strategy": "sharded"}}))
    with pytest.raises(UserError, match="'sync.tune.candidates.f': fsdp2 shards"):
        attach(model, auto({"f": {"strategy": "fsdp2"}}))
    with pytest.raises(UserError, match="'sync.tune.candidates.bf16' is lossy"):
        attach(model, auto({"ok": {"strategy": "bucketed"},
                            "bf16": {"strategy": "per_class", "classes.ffn.wire_dtype": "bf16"}}))
    with pytest.raises(UserError, match="'sync.tune.lossy'"):
        attach(model, auto(lossy=True))


def test_the_default_space_leaves_out_the_split_where_the_model_has_no_tied_embedding(one_rank):
    plain = attach(torch.nn.Sequential(torch.nn.Linear(4, 4)), auto())
    transformer = attach(verify.tiny_model(), auto())
    no_split = [n for n, k in REPLICATED_SPACE.items() if not k.get("hierarchical")
                and "classes.embedding.tied_split" not in k]
    assert [c.name for c in plain.entrants] == no_split  # one rank, one node: no hierarchical plan either
    assert {c.name for c in transformer.entrants} > set(no_split)
    plain.close()
    transformer.close()


def test_every_search_step_is_a_training_step_and_the_budget_ends_it(one_rank):
    model = verify.tiny_model()
    handle = attach(model, auto(SPACE, budget_steps=9, warmup_rounds=1, min_rounds=2))
    assert isinstance(handle, OnlineSearch) and handle.winner is None
    seen, laid_out = [], []
    forward = handle.module  # the loop may keep this one object: it runs the current candidate
    for step in range(12):
        seen.append(handle.current)
        src, tgt_in, tgt_out = verify.batch(0, step, 0)
        verify.loss_fn(forward(src, tgt_in), tgt_out, 1).backward()
        handle.wait()
        # the planned candidates holding bucket buffers: only the one that ran this step
        laid_out.append([n for n, h in handle.handles.items() if getattr(h, "reducer", None) and h.reducer.buckets])
        handle.stepped()
        model.zero_grad(set_to_none=True)
    assert all(len(names) <= 1 for names in laid_out) and ["bucketed-0.5"] in laid_out, laid_out
    # three rounds of three steps (the budget), then the winner alone
    assert handle.spent == 9 and handle.rounds == 3 and handle.winner in SPACE
    assert sorted(c.steps for c in handle.entrants) == [3, 3, 3]
    for r in range(3):  # each round ran every candidate once
        assert len({id(h) for h in seen[3 * r: 3 * r + 3]}) == 3
    assert all(h is handle.current for h in seen[9:]) and list(handle.handles) == [handle.winner]
    assert all(len(c.times) == 2 for c in handle.entrants)  # the first round was warm-up
    handle.close()


def _two_ranks(rank: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    try:
        threads, groups = threading.active_count(), len(dist.distributed_c10d._world.pg_map)
        searched = verify.tiny_model()
        handle = attach(searched, auto(SPACE, budget_steps=12, warmup_rounds=1, min_rounds=2))
        train(handle, searched, 16, rank)
        winner = handle.winner
        handle.close()
        assert threading.active_count() == threads  # nothing of any candidate left running
        assert len(dist.distributed_c10d._world.pg_map) == groups  # the split's group destroyed
        # The same 16 steps under DDP alone: every candidate is bit for bit DDP's on 2 CPU ranks
        plain = verify.tiny_model()
        ddp = attach(plain, SyncConfig(strategy="ddp"))
        train(ddp, plain, 16, rank)
        for (name, a), b in zip(searched.named_parameters(), plain.parameters()):
            assert torch.equal(a, b), name
        if rank == 0:
            torch.save({"winner": winner}, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_on_two_ranks_the_search_trains_the_run_bit_for_bit_as_ddp_and_leaves_nothing(tmp_path):
    mp.spawn(_two_ranks, args=(str(tmp_path / "init"), str(tmp_path / "out.pt")), nprocs=2, join=True)
    assert torch.load(tmp_path / "out.pt")["winner"] in SPACE


@pytest.mark.slow
def test_auto_in_the_plain_loop_with_no_other_change(tmp_path, per_class_run):
    """examples/plain_loop.py with --strategy auto: the same 20 steps as per_class's run, the same parameters."""
    space = "{ddp-2: {strategy: ddp, bucket_cap_mb: 2}, bucketed-0.5: {strategy: bucketed, bucket_cap_mb: 0.5}}"
    searched, out = plain_loop(tmp_path, "--strategy", "auto", "--candidates", space)
    # 20 steps are 10 rounds of the two: a pick only if the paired rule separated them by then (budget: 60 steps)
    assert ("auto picked " in out and "step minus the pick's" in out) or "auto: still searching after 20" in out, out
    reference, _ = per_class_run
    assert all(torch.equal(searched[n], reference[n]) for n in reference)  # lossless candidates, 2 CPU ranks
