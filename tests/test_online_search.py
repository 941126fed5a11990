"""`attach(model, SyncConfig(strategy="auto"))`: the search inside any training loop, on the one model
(`dtrain.collectives.auto.search.OnlineSearch`)."""

import gc
import threading
import weakref

import pytest
import torch
import torch.distributed as dist
from test_examples import per_class_run, plain_loop  # noqa: F401 - per_class_run: the reference fixture
from test_strategies import one_rank  # noqa: F401 - the one-rank gloo group fixture

from dtrain.collectives import dist as ddist
from dtrain.collectives import attach
from dtrain.collectives.settings import SyncConfig, TuneConfig
from dtrain.collectives.auto.search import OnlineSearch
from dtrain.collectives.auto.space import DEFAULT_SPACE, NCCL_SPACE, candidate_sync
from dtrain.common.errors import UserError
from dtrain.engine import verify

SPACE = {"ddp-2": {"strategy": "ddp", "bucket_cap_mb": 2}, "bucketed-0.5": {"strategy": "bucketed", "bucket_cap_mb": 0.5},
         "split": {"strategy": "bucketed", "bucket_cap_mb": 0.01, "classes.embedding.tied_split": True}}
# sharding candidates too: the optimizer's state moves at every switch to or from one
SHARDED = {**SPACE, "sharded": {"strategy": "sharded", "bucket_cap_mb": 0.01},
           "sharded-split": {"strategy": "sharded", "bucket_cap_mb": 0.01, "classes.embedding.tied_split": True},
           "rows": {"strategy": "sharded", "bucket_cap_mb": 0.01, "classes.embedding.tied_split": True,
                    "shard_tied_split": True}}


def auto(candidates=None, **tune):
    return SyncConfig(strategy="auto", tune=TuneConfig(candidates=candidates or {}, **tune))


def loop_step(handle, opt, step: int, rank: int) -> None:
    """One step of the plain loop: forward through the handle, backward, wait, the optimizer, stepped."""
    src, tgt_in, tgt_out = verify.batch(rank, step, 0)
    verify.loss_fn(handle.module(src, tgt_in), tgt_out, 1).backward()
    handle.wait()
    opt.step()
    handle.stepped(opt)
    opt.zero_grad(set_to_none=True)


def train(handle, model, steps, rank=0):
    """The plain loop's steps with Adam (state to move); returns the optimizer's whole-model state."""
    opt = torch.optim.Adam(handle.optimizer_params(), lr=0.01)
    for step in range(steps):
        loop_step(handle, opt, step, rank)
    handle.wait_params()
    return handle.optimizer_state(opt)


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


def test_fsdp2_and_lossy_candidates_are_refused_by_name(one_rank):
    model = verify.tiny_model()
    with pytest.raises(UserError, match="'sync.tune.candidates.f': fsdp2 replaces the model's parameters"):
        attach(model, auto({"f": {"strategy": "fsdp2"}}))
    with pytest.raises(UserError, match="'sync.tune.candidates.bf16' is lossy"):
        attach(model, auto({"ok": {"strategy": "bucketed"},
                            "bf16": {"strategy": "per_class", "classes.ffn.wire_dtype": "bf16"}}))
    # with sync.tune.lossy the search judges them by the loss, which the loop must pass
    handle = attach(model, auto({"ok": {"strategy": "bucketed"},
                                 "bf16": {"strategy": "per_class", "classes.ffn.wire_dtype": "bf16"}}, lossy=True))
    opt = torch.optim.SGD(handle.optimizer_params(), lr=0.1)
    src, tgt_in, tgt_out = verify.batch(0, 0, 0)
    loss = verify.loss_fn(handle.module(src, tgt_in), tgt_out, 1)
    loss.backward()
    handle.wait()
    opt.step()
    with pytest.raises(UserError, match=r"pass each step's loss to handle.stepped\(optimizer, loss\)"):
        handle.stepped(opt)
    handle.close()


def test_a_switch_to_a_sharding_candidate_needs_the_loops_one_group_optimizer(one_rank):
    model = verify.tiny_model()
    handle = attach(model, auto({"a": {"strategy": "bucketed"}, "b": {"strategy": "sharded"}}))
    two = torch.optim.SGD([{"params": handle.optimizer_params()[:1]}, {"params": handle.optimizer_params()[1:]}])
    with pytest.raises(UserError, match=r"must update handle.optimizer_groups\(\)"):
        handle.stepped(two)
    with pytest.raises(UserError, match=r"pass the loop's optimizer to handle.stepped\(optimizer\)"):
        src, tgt_in, tgt_out = verify.batch(0, 0, 0)
        verify.loss_fn(handle.module(src, tgt_in), tgt_out, 1).backward()
        handle.wait()
        handle.stepped()
    handle.close()


def test_the_default_space_leaves_out_the_split_where_the_model_has_no_tied_embedding(one_rank):
    plain = attach(torch.nn.Sequential(torch.nn.Linear(4, 4)), auto())
    transformer = attach(verify.tiny_model(), auto())
    no_split = [n for n, k in DEFAULT_SPACE.items() if not k.get("hierarchical") and k["strategy"] != "fsdp2"
                and "classes.embedding.tied_split" not in k and n not in NCCL_SPACE]
    assert [c.name for c in plain.entrants] == no_split  # one rank, one node, gloo: no hierarchical plan nor NCCL
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


def test_a_dropped_ddp_candidate_frees_its_reducer(one_rank):
    # DDP's buckets live in its C++ reducer, which goes only with the DDP module: after the search the loser's
    # module is gone, the winner's alive
    model = verify.tiny_model()
    handle = attach(model, auto({"ddp-2": SPACE["ddp-2"], "ddp-25": {"strategy": "ddp", "bucket_cap_mb": 25}},
                                budget_steps=6, warmup_rounds=1, min_rounds=2))
    opt, modules = torch.optim.SGD(handle.optimizer_params(), lr=0.01), {}
    for step in range(8):
        for name, h in handle.handles.items():
            modules.setdefault(name, weakref.ref(h.module))
        loop_step(handle, opt, step, 0)
    gc.collect()
    assert handle.winner is not None and set(modules) == {"ddp-2", "ddp-25"}
    assert {name: ref() is not None for name, ref in modules.items()} == {
        name: name == handle.winner for name in modules}
    handle.close()


def _optimizer(params, world: int):
    """Adam on 2 ranks (bit for bit, whatever it amplifies); SGD with momentum on 3, where sums in another order
    differ by rounding, which Adam blows up where a gradient is zero but for rounding (its update is ~lr whatever
    the gradient's size). Both have state that the switches move."""
    return torch.optim.Adam(params, lr=0.01) if world == 2 else torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _sequence_run(names: list[str], world: int, rank: int):
    """The reference: an untuned run that trains step i under a freshly attached `names[i]`, the optimizer's state
    moved through the whole-model form at each change (as a checkpoint would carry it)."""
    model = verify.tiny_model()
    handle, opt, current = None, None, None
    for step, name in enumerate(names):
        if name != current:
            state = None
            if handle is not None:
                handle.wait_params()
                state = handle.optimizer_state(opt)
                handle.close()
            handle = attach(model, candidate_sync(SyncConfig(), name, SHARDED[name]))
            opt = _optimizer(handle.optimizer_params(), world)
            if state is not None:
                handle.load_optimizer_state(opt, state)
            current = name
        loop_step(handle, opt, step, rank)
    handle.wait_params()
    return model, handle.optimizer_state(opt)


def _relative(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """max |a - b| over all the tensors, over max |b|: one scale for all (a tensor's own would divide by ~0 where
    its gradient is zero in exact arithmetic, as for the key projection's bias under softmax, and only rounding
    is left)."""
    return (max((x - y).abs().max().item() for x, y in zip(a, b)) / max(y.abs().max().item() for y in b))


def _ranks(rank: int, world: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    with ddist.rank_process():
        threads, groups = threading.active_count(), len(dist.distributed_c10d._world.pg_map)
        searched = verify.tiny_model()
        handle = attach(searched, auto(SHARDED, budget_steps=40, warmup_rounds=1, min_rounds=2))
        opt = _optimizer(handle.optimizer_params(), world)
        names = []
        for step in range(40):
            names.append(handle._name(handle.current))
            loop_step(handle, opt, step, rank)
        handle.wait_params()
        searched_state = handle.optimizer_state(opt)
        winner, spent, entrants = handle.winner, handle.spent, handle.entrants
        timing, moves = handle.timing_steps, handle.switch_steps
        handle.close()
        assert threading.active_count() == threads  # nothing of any candidate left running
        assert len(dist.distributed_c10d._world.pg_map) == groups  # every candidate's groups destroyed
        steps = spent - timing - moves
        assert winner is not None and names[steps:] == [winner] * (40 - steps)
        # every search step, the probe's and lead-ins included, a training step; the probe's network timing and the
        # optimizer state's moves count as the steps their time would have held
        assert sum(c.steps for c in entrants) + timing + moves == spent and timing >= 1
        assert spent <= 40  # the budget, the moves included (the last, to the winner, too)
        switched = sum(a != b for a, b in zip(names, names[1:]))
        reference, reference_state = _sequence_run(names, world, rank)
        worst = _relative([p.detach() for p in searched.parameters()], list(reference.parameters()))
        keys = [(i, k) for i, b in reference_state["state"].items() for k in ("exp_avg", "exp_avg_sq",
                                                                             "momentum_buffer") if k in b]
        moments = _relative([searched_state["state"][i][k] for i, k in keys],
                            [reference_state["state"][i][k] for i, k in keys])
        if world == 2:  # every candidate is bit for bit DDP's on 2 CPU ranks
            ddp = verify.tiny_model()
            train(attach(ddp, SyncConfig(strategy="ddp")), ddp, 40, rank)
            for (name, a), b in zip(searched.named_parameters(), ddp.parameters()):
                assert torch.equal(a, b), name
        if rank == 0:
            torch.save({"winner": winner, "worst": worst, "moments": moments, "switched": switched,
                        "sequence": names, "spent": (spent, timing, moves)}, out)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_the_search_with_sharding_candidates_trains_the_run_as_its_sequence_of_configurations(tmp_path, world):
    """Every search step trains the run: the parameters and Adam's state after the search equal an untuned run of
    the same sequence of configurations, each attached afresh where it starts (2 CPU ranks: bit for bit, and DDP's;
    3: within 1e-6 relative), and no thread or process group of any candidate outlives it."""
    ddist.spawn(_ranks, (world, str(tmp_path / "init"), str(tmp_path / "out.pt")), world)
    out = torch.load(tmp_path / "out.pt")
    assert out["winner"] in SHARDED and out["switched"] >= 10, out["sequence"]
    limit = 0.0 if world == 2 else 1e-6
    assert out["worst"] <= limit and out["moments"] <= limit, out


@pytest.mark.slow
def test_auto_in_the_plain_loop_with_no_other_change(tmp_path, per_class_run):
    """examples/plain_loop.py with --strategy auto: the same 20 steps as per_class's run, the same parameters."""
    space = "{ddp-2: {strategy: ddp, bucket_cap_mb: 2}, bucketed-0.5: {strategy: bucketed, bucket_cap_mb: 0.5}}"
    searched, out = plain_loop(tmp_path, "--strategy", "auto", "--candidates", space)
    # 20 steps are 10 rounds of the two: a pick only if the paired rule separated them by then (budget: 60 steps)
    assert ("auto picked " in out and "step minus the pick's" in out) or "auto: still searching after 20" in out, out
    reference, _ = per_class_run
    assert all(torch.equal(searched[n], reference[n]) for n in reference)  # lossless candidates, 2 CPU ranks
