"""Each strategy's schedule (`dtrain.collectives.schedule`): what it sends in a step, decided by the strategy, and
read by the one step-time predictor (`dtrain.collectives.step_time`) for `auto` and the simulator alike."""

from __future__ import annotations

import ast

import pytest
import torch

from dtrain.collectives import schedule, step_time, strategies
from dtrain.collectives.auto import predict as auto_predict
from dtrain.collectives.bench.host_work import measure_host_work
from dtrain.collectives.bench.measure import Row
from dtrain.collectives.bench.output import to_json
from dtrain.collectives.costmodel import FittedModel, fit_regimes, load_model
from dtrain.collectives.timeline import ReadyCurve
from dtrain.common.errors import UserError
from dtrain.engine import config as config_mod
from dtrain.engine import describe, verify
from dtrain.engine.model import Transformer

from conftest import REPO
from test_strategies import one_rank  # noqa: F401 - the one-rank gloo group fixture

SMALL = {"model": {"preset": "small"}, "data": {"vocab_size": 8000}}


def _cfg(sync: dict, **extra):
    return config_mod.from_dict({**SMALL, **extra, "sync": sync}, "test")


@pytest.fixture(scope="module")
def model():
    with torch.device("meta"):
        return Transformer.from_config(_cfg({}).model, 8000)


def _schedule(model, sync: dict, world: int = 2, **extra):
    cfg = _cfg(sync, **extra)
    return strategies.schedule_for(cfg.sync, model, world, cfg.train.accum_steps)


def test_every_bucket_is_sent_once_and_the_exact_mean_is_the_strategys_answer(model):
    """Per strategy: the buckets cover every trainable parameter once; exactness follows what travels (a 16-bit
    wire, FSDP2's bf16 parameters) and not the strategy's name; noop sends nothing and is not exact."""
    total = sum(p.numel() for p in model.parameters() if p.requires_grad)
    for name in ("ddp", "bucketed", "flat", "per_tensor", "per_class", "sharded", "fsdp2"):
        s = _schedule(model, {"strategy": name})
        assert sum(b.numel for b in s.buckets) == total, name
        assert s.exact and s.communicates, name
    assert not _schedule(model, {"strategy": "ddp", "hook": "bf16_compress"}).exact
    assert not _schedule(model, {"strategy": "per_class", "classes": {"ffn": {"wire_dtype": "bf16"}}}).exact
    amp = {"train": {"amp": "bf16"}}
    # sharded narrows only what autocast rounds anyway; FSDP2's mixed precision rounds every parameter
    assert _schedule(model, {"strategy": "sharded", "gather_dtype": "bf16"}, **amp).exact
    assert not _schedule(model, {"strategy": "fsdp2", "gather_dtype": "bf16"}, **amp).exact
    noop = _schedule(model, {"strategy": "noop"})
    assert not noop.collectives and not noop.exact and not noop.communicates
    with pytest.raises(UserError, match="powersgd"):
        _schedule(model, {"strategy": "powersgd"})


def test_a_bucket_with_the_split_is_ready_with_the_projection_only_when_it_holds_nothing_else(model):
    """Small buckets: the split embedding's own bucket goes as its projection part is ready, the others at their last
    gradient. A bucket of the embedding and others waits for the last of the others, not for the embedding's place
    in ready order (its encoder lookup, backward's last gradient): at a cap above the model's size, one bucket;
    read as ready with the projection, the predictor hid its whole all-reduce behind the backward."""
    split = {"classes": {"embedding": {"tied_split": True}}}
    small = _schedule(model, {"strategy": "bucketed", "bucket_cap_mb": 0.5, **split})
    readies = [c.ready for c in small.collectives if c.ready != schedule.LOOKUP]
    assert readies[0] == schedule.PROJECTION and set(readies[1:]) == {schedule.GRADIENT}
    total = sum(p.numel() for p in model.parameters())
    embedding = model.embed.weight.numel()
    one, two = (_schedule(model, {"strategy": "bucketed", "bucket_cap_mb": cap, **split}) for cap in (1000, 25))
    assert len(one.buckets) == 1 and len(two.buckets) == 2
    for s in (one, two):
        first = s.collectives[0]
        assert "embed.weight" in s.buckets[first.bucket].names and len(s.buckets[first.bucket].names) > 1
        assert first.ready == schedule.GRADIENT
        assert first.after <= total - embedding  # placed by its other members
    assert two.collectives[0].after < two.collectives[1].after


def test_a_compress_hook_halves_the_bytes_and_adds_the_casts(model):
    plain = _schedule(model, {"strategy": "ddp"})
    hooked = _schedule(model, {"strategy": "ddp", "hook": "bf16_compress"})
    assert [c.nbytes * 2 for c in hooked.collectives] == [c.nbytes for c in plain.collectives]
    assert {c.dtype for c in hooked.collectives} == {"bf16"} and hooked.label == "+bf16_compress"
    assert sum(w.nbytes for w in hooked.host if w.what == "cast") == sum(b.nbytes for b in plain.buckets)
    assert all(c.waits == schedule.IN_BACKWARD for c in plain.collectives)  # DDP waits inside backward()


def test_the_per_class_hook_sends_each_class_on_its_own_group_in_its_wire(model):
    s = _schedule(model, {"strategy": "ddp", "hook": "per_class", "classes": {"ffn": {"wire_dtype": "bf16"}}})
    ffn = [c for c in s.collectives if c.group == "ffn"]
    assert ffn and {c.dtype for c in ffn} == {"bf16"} and not any(c.exact for c in ffn)
    assert all(c.exact for c in s.collectives if c.group != "ffn") and s.class_groups


def test_stock_fsdp2_blocks_and_its_gathers_come_again_in_backward(model):
    """Stock FSDP2: every collective waited for on the computing thread where the device has no streams; with
    reshard_after_forward each unit but the root gathered again in backward; FSDP2's copies as host work."""
    stock = _schedule(model, {"strategy": "fsdp2"})
    units = len(stock.buckets)
    kinds = [(c.kind, c.ready) for c in stock.collectives]
    assert kinds.count(("reduce_scatter", "gradient")) == units and kinds.count(("all_gather", "prefetch")) == units - 1
    assert all(c.blocking for c in stock.collectives) and stock.host
    keep = _schedule(model, {"strategy": "fsdp2", "reshard_after_forward": False, "fsdp2_collectives": "p2p"})
    assert not any(c.blocking or c.ready == "prefetch" for c in keep.collectives)
    assert {c.path for c in keep.collectives} == {"p2p"} and keep.label == "+keep+p2p"
    assert keep.updated == pytest.approx(0.5)


def _basis(total: int) -> step_time.Basis:
    return step_time.Basis(100.0, 30.0, 50.0, 20.0, ReadyCurve.uniform(total, 50.0))


def _net() -> FittedModel:
    sizes = [1 << 16, 1 << 20, 1 << 24]
    return FittedModel({"t": fit_regimes(sizes, [200.0 + n / 100.0 for n in sizes], max_regimes=1)}, "allreduce", 2)


def test_blocking_collectives_add_up_without_streams_and_overlap_with_them(model):
    """The predictor reads only the schedule: the same stock FSDP2 schedule is slower on a device without streams
    (each collective adds to the step) than with them (backward hides some); a sharded strategy saves the optimizer
    work of the parameters it does not own."""
    total = sum(p.numel() for p in model.parameters())
    s = _schedule(model, {"strategy": "fsdp2"})
    serial = step_time.predict(s, _basis(total), _net(), step_time.Calibration(streams=False))
    overlapped = step_time.predict(s, _basis(total), _net(), step_time.Calibration(streams=True))
    assert serial.step_ms > overlapped.step_ms
    assert serial.comm_ms == pytest.approx(overlapped.comm_ms)
    noop = step_time.predict(_schedule(model, {"strategy": "noop"}), _basis(total), _net(), step_time.Calibration())
    assert noop.step_ms == 100.0 and noop.comm_ms == 0.0


def test_auto_predicts_through_the_one_predictor(model, monkeypatch):
    """`auto`'s pruning plays a candidate's schedule with `step_time.predict`, as the simulator does."""
    seen = []
    real = step_time.predict

    def spy(sched, basis, net, calib, *args, **kwargs):
        seen.append((sched.strategy, sched.label, calib.streams))
        return real(sched, basis, net, calib, *args, **kwargs)

    monkeypatch.setattr(step_time, "predict", spy)
    probe = auto_predict.Probe(30.0, 50.0, 20.0, 100.0)
    cfg = _cfg({"strategy": "ddp", "hook": "bf16_compress"})
    ms = auto_predict.predict_ms(cfg.sync, model, probe, _net(), 2, "gloo")
    assert ms is not None and seen == [("ddp", "+bf16_compress", False)]
    assert auto_predict.predict_ms(_cfg({"strategy": "powersgd"}).sync, model, probe, _net(), 2, "gloo") is None


# Modules that read a schedule and must not ask which strategy made it
READERS = ("dtrain/collectives/step_time.py", "dtrain/collectives/auto", "dtrain/analysis/simulate",
           "dtrain/analysis/plans.py", "dtrain/analysis/recommend.py", "dtrain/analysis/replay.py",
           "dtrain/engine/describe.py", "dtrain/engine/runplan.py")


def test_no_reader_of_a_schedule_compares_a_strategys_name():
    """No comparison with a registered strategy's name (`== "fsdp2"`, `in ("sharded", ...)`) in the predictor,
    `auto`, the simulator, the recommender, describe and the dry run: they read the schedule, or a fact the strategy
    declares (`shards`, `switchable`)."""
    names = set(strategies.available())
    bad = []
    for where in READERS:
        path = REPO / where
        for f in ([path] if path.suffix else sorted(path.glob("*.py"))):
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, ast.Compare):
                    for side in [node.left, *node.comparators]:
                        consts = [side] if isinstance(side, ast.Constant) else (
                            list(side.elts) if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [])
                        bad += [f"{f.relative_to(REPO)}:{node.lineno}" for c in consts
                                if isinstance(c, ast.Constant) and c.value in names]
    assert not bad, bad


def test_describe_and_the_dry_run_print_the_schedule(capsys):
    profile = str(REPO / "dtrain" / "profiles" / "smoke.yaml")
    describe.main(["--profile", profile, "--set", "sync.strategy=sharded", "--world", "4"])
    out = capsys.readouterr().out
    assert "# schedule of sharded on 4 ranks" in out and "reduce_scatter" in out and "all_gather" in out
    describe.main(["--profile", profile, "--set", "sync.strategy=powersgd"])
    assert "schedule of powersgd: none before it runs" in capsys.readouterr().out


@pytest.mark.parametrize("gather_at,pending_after_step", [("step", False), ("forward", True)])
def test_sharded_starts_its_all_gathers_where_gather_at_says(one_rank, gather_at, pending_after_step):
    """`sync.gather_at`: the updated shards' all-gathers start as the optimizer step ends (`stepped`), or wait for
    the next forward to start; the schedule says which."""
    sync = _cfg({"strategy": "sharded", "bucket_cap_mb": 0.05, "gather_at": gather_at}).sync
    model = verify.tiny_model()
    handle = strategies.attach(model, sync)
    optimizer = torch.optim.SGD(handle.optimizer_params(), lr=0.1)
    src, tgt_in, tgt_out = verify.batch(0, 0, 0)
    verify.loss_fn(handle.module(src, tgt_in), tgt_out, 1).backward()
    handle.wait()
    optimizer.step()
    handle.stepped(optimizer)
    assert handle.reducer.gather_pending is pending_after_step
    handle.module(src, tgt_in)  # the next forward: every gather started, and waited for by the modules
    assert not handle.reducer.gather_pending
    readies = {c.ready for c in strategies.schedule_for(sync, model, 2).collectives if c.kind == "all_gather"}
    assert readies == {schedule.STEP if gather_at == "step" else schedule.FORWARD_START}
    handle.close()


def test_gather_at_is_checked_and_read_by_sharded_only():
    with pytest.raises(UserError, match="sync.gather_at.*must be one of step, forward, got 'later'"):
        _cfg({"strategy": "sharded", "gather_at": "later"})
    with pytest.raises(UserError, match="sync.gather_at.*is not used by strategy 'bucketed'"):
        _cfg({"strategy": "bucketed", "gather_at": "forward"})


def test_host_work_is_timed_by_the_benchmark_and_charged_by_the_predictor(one_rank, model, tmp_path):
    """`--host-work` rows fit per operation; the predictor charges a schedule's host work with them (FSDP2's work per
    unit and its DTensor optimizer, a compress hook's casts), less the basis's own, and names what it could not
    price."""
    rows = measure_host_work([1 << 16, 1 << 20, 1 << 21], None, 1, torch.device("cpu"), lambda *a, **k: None)
    assert {r.work for r in rows} == {"cast", "dtensor_step", "fsdp2_unit", "fsdp2_unit_resharded"}
    assert all(r.time_us > 0 for r in rows if r.work == "cast")  # FSDP2's and DTensor's extra: 0 or more
    bench = _net_rows() + rows
    (tmp_path / "bench.json").write_text(to_json(bench))
    fit = load_model(f"fit:{tmp_path / 'bench.json'}")
    assert fit.host_work_us("cast", 1 << 20) > fit.host_work_us("cast", 1 << 16) > 0
    total = sum(p.numel() for p in model.parameters())
    fsdp2 = _schedule(model, {"strategy": "fsdp2", "fsdp2_collectives": "p2p"})
    charged = step_time.predict(fsdp2, _basis(total), fit, step_time.Calibration())
    bare = step_time.predict(fsdp2, _basis(total), _net(), step_time.Calibration())
    assert charged.unpriced == () and set(bare.unpriced) == {"fsdp2_unit", "fsdp2_unit_resharded", "dtensor_step"}
    work, _ = step_time.host_work_ms(fsdp2, fit)
    assert work > 0 and charged.step_ms > bare.step_ms
    # a basis whose own strategy did the same work already holds it
    own = step_time.Basis(**{**vars(_basis(total)), "host_work_ms": work})
    assert step_time.predict(fsdp2, own, fit, step_time.Calibration()).step_ms == pytest.approx(
        charged.step_ms - work)


def _net_rows():
    return [Row("reducer", n, n // 4, "float", "sum", 200.0 + n / 100.0, 0.0, 0.0, 0, median_us=200.0 + n / 100.0,
                coll="all_reduce") for n in (1 << 16, 1 << 20, 1 << 24)]
