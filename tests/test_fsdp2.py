"""`fsdp2`: stock FSDP2 behind the seam. Its units, its modeled plan, its whole-model state on any world size, and
training through the trainer as DDP does (gradient equality with the per-tensor reference is checked with every
strategy by tests/test_strategies.py, at 2 and 3 ranks, with and without accumulation)."""

import contextlib
import copy
import json

import pytest
import torch
import torch.distributed as dist
from conftest import NO_EVAL, cut_back, records, train_ranks

from dtrain.collectives import dist as ddist
from dtrain.collectives import attach, fsdp2_collectives, strategies
from dtrain.collectives.settings import SyncConfig
from dtrain.collectives.strategies import unused_keys
from dtrain.collectives.strategies.fsdp2 import unit_of, units
from dtrain.common.errors import UserError
from dtrain.engine import verify


def test_each_layer_is_a_unit_and_the_root_holds_the_tied_embedding():
    model = verify.tiny_model()  # 2 encoder and 2 decoder layers
    assert units(model) == [*model.encoder, *model.decoder]
    assert unit_of("embed.weight") == "" and unit_of("decoder.1.src_attn.W_K.bias") == "decoder.1"
    assert unit_of("w2.bias") == ""  # a digit inside a name is not a numbered module
    # The modeled plan: one bucket per unit, in the order backward completes them, the root's last.
    plan = strategies.schedule_for(SyncConfig(strategy="fsdp2"), model, 2).buckets
    assert [unit_of(b.names[0]) for b in plan] == ["decoder.1", "decoder.0", "encoder.1", "encoder.0", ""]
    assert sum(b.numel for b in plan) == sum(p.numel() for p in model.parameters())
    assert all(unit_of(n) == unit_of(b.names[0]) for b in plan for n in b.names)


def test_reshard_after_forward_is_a_setting_only_fsdp2_reads():
    assert unused_keys(SyncConfig(strategy="fsdp2", reshard_after_forward=False)) == []
    assert [k for k, _ in unused_keys(SyncConfig(strategy="sharded", reshard_after_forward=False))] == [
        "sync.reshard_after_forward"]


def _whole_state():
    """The model and Adam state as one process writes them after 2 steps (every rank computes the same)."""
    model = verify.tiny_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for step in range(2):
        src, tgt_in, tgt_out = verify.batch(0, step, 0)
        verify.loss_fn(model(src, tgt_in), tgt_out, 1).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict(), opt.state_dict()


def _round_trip(strategy: str) -> None:
    """Load a whole state into `strategy` on this rank's group and read it back through the seam: the same
    tensors."""
    model_sd, opt_sd = _whole_state()
    handle = attach(verify.tiny_model(), verify.sync_config(strategy, 0.01, []))
    opt = torch.optim.Adam(handle.optimizer_params(), lr=1e-3)
    handle.load_model_state(copy.deepcopy(model_sd))
    handle.load_optimizer_state(opt, copy.deepcopy(opt_sd))
    handle.wait_params()
    back_model, back_opt = handle.model_state(), handle.optimizer_state(opt)
    assert back_model.keys() == model_sd.keys()
    assert all(torch.equal(back_model[k], v) for k, v in model_sd.items())
    assert back_opt["state"].keys() == opt_sd["state"].keys()
    for i, s in opt_sd["state"].items():
        assert all(torch.equal(back_opt["state"][i][k], v) for k, v in s.items()), (strategy, i)
    # ... and what was loaded trains: one step's parameters are those of the same step from the whole state
    src, tgt_in, tgt_out = verify.batch(0, 5, 0)  # the same batch on every rank: the mean is that gradient
    verify.loss_fn(handle.module(src, tgt_in), tgt_out, 1).backward()
    handle.wait()
    opt.step()
    handle.wait_params()
    one = verify.tiny_model()
    one.load_state_dict(model_sd)
    one_opt = torch.optim.Adam(one.parameters(), lr=1e-3)
    one_opt.load_state_dict(opt_sd)
    verify.loss_fn(one(src, tgt_in), tgt_out, 1).backward()
    # Adam scales a gradient that is zero but for rounding (the keys' biases) up to a full step: left out
    scale = max(p.grad.abs().max().item() for p in one.parameters())
    compared = [n for n, p in one.named_parameters() if p.grad.abs().max().item() >= verify.ZERO * scale]
    one_opt.step()
    stepped = handle.model_state()
    worst = max((stepped[n] - one.state_dict()[n]).abs().max().item() for n in compared)
    assert len(compared) > 0.8 * len(model_sd) and worst < 1e-6, (strategy, worst)
    handle.close()


def _round_trips_on_three_ranks(rank: int, init: str, strategies: list[str]) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=3)
    with ddist.rank_process():
        for strategy in strategies:
            _round_trip(strategy)


@pytest.mark.slow
def test_a_whole_state_goes_in_and_out_of_the_shards_of_three_ranks(tmp_path):
    """A checkpoint's model and optimizer state (written as one process would) loaded under `sharded`, then under
    `fsdp2`, on 3 ranks (one spawn), then read back for the next checkpoint: bit for bit the same. One step after
    the load matches the same step taken by one process from that state."""
    ddist.spawn(_round_trips_on_three_ranks, (str(tmp_path / "init"), ["sharded", "fsdp2"]), 3)


SPLIT_P2P = ("--set", "sync.classes.embedding.tied_split=true", "--set", "sync.fsdp2_collectives=p2p")
CLIPPED = ("--set", "optim.clip_norm=0.5", "--set", "train.accum_steps=2", "--set", "train.ckpt_every=5", *NO_EVAL)


@pytest.fixture(scope="module")
def clipped_ddp(tmp_path_factory):
    """10 clipped steps of stock DDP on 2 ranks, the reference of both cases below."""
    run = tmp_path_factory.mktemp("clipped") / "ddp"
    r = train_ranks("--run-dir", str(run), "--set", "sync.strategy=ddp", "--set", "train.max_steps=10", *CLIPPED)
    assert "FutureWarning" not in r.stderr and "DeprecationWarning" not in r.stderr, r.stderr[-2000:]
    return run


@pytest.mark.slow
@pytest.mark.parametrize("extra", [(), SPLIT_P2P], ids=["stock", "split-p2p"])
def test_fsdp2_trains_as_ddp_and_its_checkpoints_resume_under_ddp_on_three_ranks(tmp_path, clipped_ddp, extra):
    """10 steps clipped by the global norm, 2 micro-batches a step: fsdp2's gradient norms are DDP's to rounding
    (its local gradients are rounded differently: not bit for bit), and the clip was active. Its step-5 checkpoint
    resumes under ddp on 3 ranks. (A whole state going into fsdp2's shards on 3 ranks: the test above.) Stock, and
    with the split tied embedding (whole on every rank, outside FSDP2) and `sharded`'s exchanges in FSDP2's hooks."""
    same = CLIPPED
    runs = {"ddp": clipped_ddp, "fsdp2": tmp_path / "fsdp2"}
    r = train_ranks("--run-dir", str(runs["fsdp2"]), "--set", "sync.strategy=fsdp2", "--set", "train.max_steps=10",
                    *same, *extra)
    assert "FutureWarning" not in r.stderr and "DeprecationWarning" not in r.stderr, r.stderr[-2000:]
    norms = {s: [x["grad_norm"] for x in records(run / "steps.jsonl")] for s, run in runs.items()}
    assert len(norms["fsdp2"]) == 10 and max(norms["ddp"]) > 0.5
    assert all(abs(a - b) <= 1e-4 * b for a, b in zip(norms["fsdp2"], norms["ddp"])), norms
    run = cut_back(runs["fsdp2"], tmp_path / "fsdp2-under-ddp", 5)
    r = train_ranks("--run-dir", str(run), "--resume", "--set", "sync.strategy=ddp", "--set", "train.max_steps=7",
                    *same, nproc=3)
    assert "at step 5" in r.stdout and "re-sharded over 3" in r.stdout, r.stdout
    after = records(run / "steps.jsonl")
    assert [x["step"] for x in after][-2:] == [6, 7] and all(x["grad_norm"] > 0 for x in after[-2:])


def test_fsdp2_collectives_is_a_setting_only_fsdp2_reads():
    assert unused_keys(SyncConfig(strategy="fsdp2", fsdp2_collectives="p2p")) == []
    assert [k for k, _ in unused_keys(SyncConfig(strategy="sharded", fsdp2_collectives="async"))] == [
        "sync.fsdp2_collectives"]


UNWAITED_STEPS = 2  # the first step's all-gathers, issued by `stepped`, are waited for in the second's forward


def _stock_and_unwaited(rank: int, mode: str, reshard: bool, split: bool) -> dict:
    """Stock FSDP2 and FSDP2 with `fsdp2_collectives: mode` (and the split tied embedding) trained side by side from
    the same model on the same batches, UNWAITED_STEPS Adam steps of 2 micro-batches; what the second left in flight."""
    torch.manual_seed(0)
    model = verify.tiny_model()
    handles = {m: attach(copy.deepcopy(model), verify.sync_config("fsdp2", 0.01, [
        f"sync.fsdp2_collectives={m}", f"sync.reshard_after_forward={str(reshard).lower()}",
        *(["sync.classes.embedding.tied_split=true"] if split and m == mode else [])]))
        for m in ("stock", mode)}
    opts = {m: torch.optim.Adam(h.optimizer_params(), lr=1e-2) for m, h in handles.items()}
    seen = {"in_flight_after_backward": [], "gathers_issued_by_stepped": [], "projections": [],
            "embedding_whole": type(dict(handles[mode].model.named_parameters())["embed.weight"]).__name__}
    issued = []
    module, name = fsdp2_collectives, ("all_gather_single" if mode == "async" else "exchange")
    issue = getattr(module, name)

    def counted(*args, **kwargs):
        issued.append(kwargs.get("async_op", True))
        return issue(*args, **kwargs)

    setattr(module, name, counted)
    for step in range(UNWAITED_STEPS):
        for m, h in handles.items():
            for micro in range(2):
                src, tgt_in, tgt_out = verify.batch(rank, step, micro)
                with h.no_sync() if micro == 0 else contextlib.nullcontext():
                    verify.loss_fn(h.module(src, tgt_in), tgt_out, 2).backward()
            if m == mode:
                seen["in_flight_after_backward"].append(len(h.collectives.pending))
                seen["projections"].append(len(h._projections))
            h.wait()
            opts[m].step()
            opts[m].zero_grad(set_to_none=True)
            del issued[:]
            h.stepped(opts[m])
            if m == mode:
                seen["gathers_issued_by_stepped"].append(list(issued))
    setattr(module, name, issue)
    states = {m: (h.wait_params(), h.model_state())[1] for m, h in handles.items()}
    seen["max_diff"] = max((states[mode][k] - v).abs().max().item() for k, v in states["stock"].items())
    # a training forward with gradients left from a step: refused, not added to a reduce-scatter in flight
    src, tgt_in, tgt_out = verify.batch(rank, 9, 0)
    h = handles[mode]
    verify.loss_fn(h.module(src, tgt_in), tgt_out, 1).backward()
    h.wait()
    try:
        h.module(src, tgt_in)
        seen["refused"] = ""
    except UserError as e:
        seen["refused"] = str(e)
    for h in handles.values():
        h.close()
    return seen


UNWAITED = [("async", True, False), ("async", False, False), ("p2p", True, False), ("p2p", False, False),
            ("p2p", False, True)]


def _every_unwaited_case_on_two_ranks(rank: int, init: str, out: str) -> None:
    """Every case of UNWAITED, one after another in one 2-rank group (each case's handles closed before the next):
    one spawn of two interpreters instead of one per case."""
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    with ddist.rank_process():
        seen = {repr(case): _stock_and_unwaited(rank, *case) for case in UNWAITED}
        if rank == 0:
            with open(out, "w") as f:
                json.dump(seen, f)


@pytest.fixture(scope="module")
def unwaited_cases(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("unwaited")
    ddist.spawn(_every_unwaited_case_on_two_ranks, (str(tmp / "init"), str(tmp / "seen.json")), 2)
    return json.loads((tmp / "seen.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("mode,reshard,split", UNWAITED)
def test_unwaited_collectives_train_as_stock_fsdp2_with_them_in_flight(unwaited_cases, mode, reshard, split):
    """On 2 gloo CPU ranks, 2 steps of 2 micro-batches: the same parameters as stock FSDP2, bit for bit (`p2p` sums
    a + b in rank order and halves, as gloo's average does). After each backward every unit's reduce-scatter (4
    layers and the root) is still in flight for `wait()`; after each update `stepped` has issued every unit's
    all-gather without waiting. With the split, the tied embedding stays a plain tensor outside FSDP2, its
    projection part is all-reduced apart, and the parameters are still stock FSDP2's bit for bit: the split adds each
    row as autograd does, and two ranks' mean is exact. A training forward with gradients left over is a one-line
    error."""
    seen = unwaited_cases[repr((mode, reshard, split))]
    assert seen["max_diff"] == 0.0, seen
    units = 4 if split else 5  # the root holds the embedding alone: outside FSDP2 with the split
    assert seen["in_flight_after_backward"] == [units] * UNWAITED_STEPS
    assert seen["gathers_issued_by_stepped"] == [[True] * units] * UNWAITED_STEPS
    assert seen["projections"] == [1 if split else 0] * UNWAITED_STEPS
    assert seen["embedding_whole"] == ("Parameter" if split else "DTensor")
    assert f"'sync.fsdp2_collectives: {mode}' needs the gradients dropped" in seen["refused"]


MODES = ["stock", "async", "p2p"]


@pytest.fixture(scope="module")
def split_checked():
    """nproc -> the results of every mode, from one spawn of `nproc` ranks (not one per mode: interpreters' start-up
    is most of a check's time)."""
    done = {}

    def run(nproc: int) -> dict:
        if nproc not in done:
            done[nproc] = verify.run_cases(nproc, ["fsdp2"], {mode: [
                "sync.classes.embedding.tied_split=true", f"sync.fsdp2_collectives={mode}"] for mode in MODES},
                accums=(1, 2), steps=3)
        return done[nproc]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 3])
@pytest.mark.parametrize("mode", MODES)
def test_fsdp2_with_the_split_matches_the_reference(split_checked, nproc, mode):
    """The tied embedding outside FSDP2 (`ignored_params`), whole on every rank and reduced by the split (its
    projection part all-reduced as backward completes it, its looked-up rows as each lookup's backward ends), with
    FSDP2's own collectives and with each of `fsdp2_collectives`' modes in its hooks: the per-tensor reference's mean
    within verify's tolerance, with and without accumulation."""
    results = split_checked(nproc)[mode]
    for accum, r in results.items():
        assert r["fsdp2"]["lossless"] and r["fsdp2"]["max_rel"] <= verify.TOLERANCE, (accum, r)
