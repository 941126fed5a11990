"""dtrain.analysis.simulate: the timeline engine on hand-built timelines, the ready curve, the calibration from one
reference step, and a prediction end to end on a small hand-written run directory."""

import json
import math
import re
import statistics
import shutil

import pytest

from dtrain.analysis import simulate as sim
from dtrain.analysis.plans import meta_model, ready_params, schedule_of, sync_for
from dtrain.analysis.runs import load_run, slowest_rank_records
from dtrain.analysis.simulate.__main__ import main
from dtrain.analysis.simulate.calibration import LOOKUP_GROUP, Calibration, record_groups
from dtrain.collectives import schedule, strategies
from dtrain.collectives.sharded.exchange import exchange_plan
from dtrain.collectives.step_time import exchange_ms, hierarchical_ms, p2p_load
from dtrain.collectives import costmodel as cm
from dtrain.collectives.costmodel import CollectiveCost, played
from dtrain.collectives.timeline import gather_stall
from dtrain.common.errors import UserError
from dtrain.engine import config as config_mod

from conftest import REPO

H200_LOG = REPO / "tests" / "data" / "nccl" / "h200_per_class_2.28.9.log"


def test_timeline_overlaps_buckets_with_backward_on_one_stream():
    # Ready at 1, 2, 3 ms; 2 ms each; backward ends at 3 ms.
    tl = sim.play_timeline([1.0, 2.0, 3.0], [2.0, 2.0, 2.0], backward_ms=3.0, overlap=True)
    assert tl.launch == [1.0, 2.0, 3.0]
    assert tl.start == [1.0, 3.0, 5.0]  # each waits for the stream
    assert tl.end == [3.0, 5.0, 7.0]
    assert tl.exposed_ms == pytest.approx(4.0) and tl.comm_ms == pytest.approx(6.0)


def test_timeline_without_overlap_launches_everything_after_backward():
    tl = sim.play_timeline([1.0, 2.0, 3.0], [2.0, 2.0, 2.0], backward_ms=3.0, overlap=False)
    assert tl.start == [3.0, 5.0, 7.0] and tl.exposed_ms == pytest.approx(6.0)


def test_timeline_launches_in_index_order():
    # Bucket 1 is ready first but every rank launches bucket 0 first.
    tl = sim.play_timeline([3.0, 1.0], [0.5, 0.5], backward_ms=4.0)
    assert tl.launch == [3.0, 3.0] and tl.end == [3.5, 4.0] and tl.exposed_ms == 0.0


def test_two_lanes_overlap_latency_and_share_the_links_bandwidth():
    # Latency only (nothing on the link): two lanes run both at once.
    tl = sim.play_timeline([0.0, 0.0], [2.0, 2.0], 10.0, lanes=2, latency_ms=[2.0, 2.0])
    assert tl.end == pytest.approx([2.0, 2.0]) and tl.comm_ms == pytest.approx(2.0)
    # Transfer only: they share the bandwidth, so both end when one lane alone would have ended the second.
    tl = sim.play_timeline([0.0, 0.0], [2.0, 2.0], 10.0, lanes=2)
    assert tl.end == pytest.approx([4.0, 4.0])
    # A 4 ms transfer from 0; at 1 a small one: 1 ms latency (1-2), then 1 ms of transfer at half the bandwidth
    # (2-4). The large one did 2 ms alone by then and 1 more at half speed: it ends at 5, after the small one,
    # as gloo's records show small buckets completing out of index order.
    tl = sim.play_timeline([0.0, 1.0], [4.0, 2.0], 10.0, lanes=2, latency_ms=[0.0, 1.0])
    assert tl.start == pytest.approx([0.0, 1.0]) and tl.end == pytest.approx([5.0, 4.0])
    # A third collective waits for a free lane (the first to end), then runs alone.
    tl = sim.play_timeline([0.0, 0.0, 0.0], [1.0, 3.0, 1.0], 10.0, lanes=2, latency_ms=[1.0, 3.0, 1.0])
    assert tl.start == pytest.approx([0.0, 0.0, 1.0]) and tl.end == pytest.approx([1.0, 3.0, 2.0])
    # One lane per group: two groups run at once, one group queues.
    tl = sim.play_timeline([0.0, 0.0, 0.0], [1.0, 1.0, 1.0], 10.0, latency_ms=[1.0] * 3, groups=["a", "b", "a"])
    assert tl.end == pytest.approx([1.0, 1.0, 2.0])
    # The link is shared between groups first, then within a group: b's one transfer gets half of it, a's two a
    # quarter each; after b ends at 20, a's two share the whole link (per connection, as the testbed's network
    # replay of per_class's buckets shows: dtrain.analysis.replay).
    tl = sim.play_timeline([0.0, 0.0, 0.0], [10.0, 10.0, 10.0], 100.0, lanes=2, groups=["a", "a", "b"])
    assert tl.end == pytest.approx([30.0, 30.0, 20.0])
    # Two groups transferring at once while backward computes reach 0.8 of the link together (the benchmark's
    # --groups): each 0.4 of it, so a's and b's 10 ms transfers take 25; one group alone is not slowed.
    tl = sim.play_timeline([0.0, 0.0], [10.0, 10.0], 100.0, lanes=2, groups=["a", "b"],
                           link_efficiency=lambda k: 0.8)
    assert tl.end == pytest.approx([25.0, 25.0])
    # Backward ends at 5: 2 ms of each done by then (0.4 x 5), the other 8 at half the link each, 16 ms more.
    tl = sim.play_timeline([0.0, 0.0], [10.0, 10.0], 5.0, lanes=2, groups=["a", "b"], link_efficiency=lambda k: 0.8)
    assert tl.end == pytest.approx([21.0, 21.0])
    tl = sim.play_timeline([0.0, 0.0], [10.0, 10.0], 100.0, lanes=2, groups=["a", "a"],
                           link_efficiency=lambda k: 0.8)
    assert tl.end == pytest.approx([20.0, 20.0])
    # Twice slower while backward computes (until 2): 1 ms of the 3 ms latency done by then, 2 ms after.
    tl = sim.play_timeline([0.0, 0.0], [3.0, 3.0], 2.0, slowdown=2.0, lanes=2, latency_ms=[3.0, 3.0])
    assert tl.end == pytest.approx([4.0, 4.0])


def test_ready_curve_interpolates_and_stays_monotone():
    c = sim.ReadyCurve([(0, 0.0), (100, 10.0), (50, 12.0), (200, 20.0)], "hand")
    # (50, 12) precedes (100, 10): the curve keeps 12 from x = 50 on.
    assert c.at(0) == 0.0 and c.at(25) == pytest.approx(6.0) and c.at(100) == pytest.approx(12.0)
    assert c.at(150) == pytest.approx(16.0) and c.at(1000) == 20.0
    u = sim.ReadyCurve.uniform(1000, 50.0)
    assert u.at(500) == pytest.approx(25.0)


class _Flat(CollectiveCost):
    """A cost model of 1 ms + 1 ms per MB."""

    ranks = 2
    name = "flat"

    def time_us(self, nbytes, coll="allreduce", algo=None, proto=None):
        return 1000.0 + nbytes / 1000.0


def test_calibration_from_one_reference_step():
    # Backward ends at 6 ms (wait() starts). Each collective is 2 ms of work at the benchmark's speed (_Flat).
    # Bucket 0 runs 1 -> 5 inside backward: 2x slower. Bucket 1 starts at 5, does 0.5 ms of work by 6 at that
    # pace, the remaining 1.5 ms at full speed: ends at 7.5.
    recs = [{"bucket": 0, "bytes": 1_000_000, "launch_ms": 1.0, "complete_ms": 5.0, "wait_start_ms": 6.0},
            {"bucket": 1, "bytes": 1_000_000, "launch_ms": 2.0, "complete_ms": 7.5, "wait_start_ms": 6.0}]
    ref = sim.ReferenceStep(1, 0.0, 1.0, 6.0, 1.0, exposed_ms=2.0, step_ms=10.0, records=recs)
    cal = sim.calibrate(ref, _Flat())
    assert cal.slowdown == pytest.approx(2.0, rel=1e-4) and cal.comm_scale == 1.0
    # wait() started at 6 and the last collective ended at 7.5: the other 0.5 ms is wait()'s own work.
    assert cal.post_ms == pytest.approx(0.5)
    tl = sim.play_timeline([1.0, 2.0], [2.0, 2.0], 6.0, slowdown=cal.slowdown)
    assert tl.end == pytest.approx([5.0, 7.5], rel=1e-4)
    # Nothing overlapped backward (flat): the measured/modeled ratio scales the collectives instead.
    flat = [{"bucket": 0, "bytes": 1_000_000, "launch_ms": 6.0, "complete_ms": 10.0, "wait_start_ms": 6.0}]
    cal = sim.calibrate(sim.ReferenceStep(1, 0.0, 1.0, 6.0, 1.0, 4.0, 12.0, records=flat), _Flat())
    assert cal.comm_scale == pytest.approx(2.0) and cal.slowdown == 1.0
    assert sim.calibrate(sim.ReferenceStep(1, 0, 1, 1, 1, 0, 3), _Flat()).comm_scale == 1.0


def test_bad_arguments_are_one_line_errors(tmp_path, capsys):
    for argv in (["--run", str(tmp_path)], ["--run", str(tmp_path), "--topology", "h100x8"],
                 ["--paper", "--topology", "nope"], ["--paper", "--bucket-sizes", "0"],
                 ["--paper", "--bucket-sizes", "nan"], ["--paper", "--bucket-sizes", "inf"],
                 ["--paper", "--strategies", ","], ["--paper", "--warmup", "-1"],
                 ["--run", str(tmp_path), "--median", "--step", "5"], ["--bogus"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("dtrain.analysis.simulate: error:")


# -- end to end on a hand-written run (needs the bucketing plans of dtrain.collectives.plan) ----------------------------


def _write_run(path, strategy="bucketed", cap=0.25, steps=6):
    pytest.importorskip("dtrain.collectives.plan")
    cfg = config_mod.from_dict({"model": {"N": 1, "d_model": 32, "d_ff": 64, "h": 2},
                                "data": {"vocab_size": 1000},
                                "sync": {"strategy": strategy, "bucket_cap_mb": cap}})
    path.mkdir()
    (path / "config.yaml").write_text(config_mod.dump(cfg))
    (path / "run.json").write_text(json.dumps({"world_size": 2, "vocab": 1000}))
    plan = schedule_of(cfg).buckets
    # A hand-built timeline: backward 12 ms on the trainer's clock, of which the last 10 ms run on the reducer's
    # (its clock starts at the first gradient hook, after the loss); buckets ready evenly over those 10 ms, each
    # collective taking exactly what the flat model says, launched when ready, on one stream; wait() adds 0.2 ms.
    params = ready_params(cfg)
    total = sum(p.numel() for _, p in params)
    ready = [10.0 * x / total for x in sim.through(plan, params)]
    dur = [_Flat().time_us(b.nbytes) / 1000 for b in plan]
    tl = sim.play_timeline(ready, dur, 10.0)
    exposed = tl.exposed_ms + 0.2
    with open(path / "steps.jsonl", "w") as f, open(path / "buckets.jsonl", "w") as g:
        for s in range(1, steps + 1):
            f.write(json.dumps({"step": s, "data_ms": 1.0, "forward_ms": 5.0, "backward_ms": 12.0,
                                "comm_exposed_ms": exposed, "optimizer_ms": 2.0,
                                "step_ms": 20.0 + exposed}) + "\n")
            for b, r, ln, st, e in zip(plan, ready, tl.launch, tl.start, tl.end):
                g.write(json.dumps({"step": s, "bucket": b.index, "class": b.tensor_class, "numel": b.numel,
                                    "bytes": b.nbytes, "ready_ms": r, "launch_ms": ln, "complete_ms": e,
                                    "wait_start_ms": 10.0, "wait_ms": 0.0}) + "\n")
    return cfg, exposed


def test_prediction_reproduces_the_reference_run_itself(tmp_path):
    cfg, exposed = _write_run(tmp_path / "run")
    run = load_run(tmp_path / "run")
    ref = sim.reference_step(run)
    curve = sim.ready_curve(run, ref)
    assert curve.source.endswith("re-planned plan")
    cal = sim.calibrate(ref, _Flat())
    assert cal.slowdown == pytest.approx(1.0, rel=1e-3) and cal.post_ms == pytest.approx(0.2, abs=1e-6)
    p = sim.predict(run.cfg, ref, curve, _Flat(), cal, "bucketed", 0.25, run.vocab)
    assert p.exposed_ms == pytest.approx(exposed, rel=1e-6)
    assert p.step_ms == pytest.approx(20.0 + exposed, rel=1e-6)
    # The medians of identical steps are that step.
    med = sim.reference_step(run, median=True)
    assert med.step_ms == pytest.approx(ref.step_ms) and len(med.records) == len(ref.records)
    assert sim.predict(run.cfg, med, sim.ready_curve(run, med), _Flat(), sim.calibrate(med, _Flat()), "bucketed",
                       0.25, run.vocab).exposed_ms == pytest.approx(exposed, rel=1e-6)
    # flat sends everything after backward: all of its communication is exposed.
    f = sim.predict(run.cfg, ref, curve, _Flat(), cal, "flat", None, run.vocab)
    assert f.buckets == 1 and f.exposed_ms == pytest.approx(f.comm_ms + 0.2)
    assert sim.predict(run.cfg, ref, curve, _Flat(), cal, "noop").step_ms == pytest.approx(20.0)
    # The split is in the label only where the strategy takes it and the merged classes ask for it.
    split = {"embedding": {"tied_split": True}}
    assert sim.predict(run.cfg, ref, curve, _Flat(), cal, "sharded", 0.25, run.vocab, classes=split).label == \
        "sharded@0.25M+split"
    assert sim.predict(run.cfg, ref, curve, _Flat(), cal, "ddp", 0.25, run.vocab, classes=split).label == "ddp@0.25M"
    assert p.label == "bucketed@0.25M"


def test_each_bucket_waits_for_the_slowest_rank(tmp_path):
    _write_run(tmp_path / "run", cap=0.02)
    run = load_run(tmp_path / "run")
    own = run.buckets[4]
    assert len(own) >= 3 and run.rank_buckets == {}
    assert slowest_rank_records(run, 4) == (own, None)  # rank 0's alone
    # Rank 1's clock runs 100 ms behind rank 0's (same completions at c - 100); it had bucket 1 ready 3 ms later
    # than rank 0, the others 1 ms earlier.
    theirs = []
    for r in own:
        late = 3.0 if r["bucket"] == 1 else -1.0
        theirs.append({**r, "ready_ms": r["ready_ms"] - 100 + late, "launch_ms": r["launch_ms"] - 100 + late,
                       "complete_ms": r["complete_ms"] - 100})
    run.rank_buckets = {1: {4: theirs}}
    recs, delay = slowest_rank_records(run, 4)
    assert delay == pytest.approx(3.0)
    for mine, r in zip(own, recs):
        shift = 3.0 if r["bucket"] == 1 else 0.0
        assert r["ready_ms"] == pytest.approx(mine["ready_ms"] + shift)
        assert r["launch_ms"] == pytest.approx(mine["launch_ms"] + shift)
    assert own[1]["ready_ms"] == pytest.approx(recs[1]["ready_ms"] - 3.0)  # rank 0's own records untouched
    ref = sim.reference_step(run, 4)
    assert ref.records == recs and "the latest of 2 ranks" in ref.notes[0]


def test_every_step_repeats_the_check_with_each_steady_step_as_reference(tmp_path, capsys):
    _write_run(tmp_path / "a", "bucketed", 0.25, steps=8)
    _write_run(tmp_path / "b", "flat", None, steps=8)
    run = load_run(tmp_path / "a")
    es = sim.every_step([run], _Flat(), [run, load_run(tmp_path / "b")], False, 1, None)
    assert es.steps == len(run.steady_steps()) == 5  # 8 steps, the first 3 warm-up
    # Every step of these runs is the same hand-built timeline, replayed exactly by the flat model.
    assert max(es.max_err) < 1e-6 and es.discordant == [0] * 5 and len(es.separated) == 5
    assert "within 15% for 5" in es.lines()[0]
    with pytest.raises(SystemExit) as e:
        main(["--run", str(tmp_path / "a"), "--topology", "h100x8", "--every-step"])
    assert e.value.code == 2 and "--every-step repeats the check" in capsys.readouterr().err


def test_every_step_pools_windows_of_consecutive_steps(tmp_path, capsys):
    _write_run(tmp_path / "a", "bucketed", 0.25, steps=8)
    _write_run(tmp_path / "b", "flat", None, steps=8)
    run = load_run(tmp_path / "a")
    es = sim.every_step([run], _Flat(), [run, load_run(tmp_path / "b")], False, 1, None, pool=3)
    assert es.steps == 3 and es.pool == 3  # 5 steady steps: windows 4-6, 5-7, 6-8
    assert max(es.max_err) < 1e-6 and "window of 3 steps" in es.lines()[0]
    for args, msg in ((["--pool", "0"], "--pool must be at least 1"), (["--pool", "2"], "--pool applies to")):
        with pytest.raises(SystemExit) as e:
            main(["--run", str(tmp_path / "a"), "--topology", "h100x8", "--measured", str(tmp_path / "b"), *args])
        assert e.value.code == 2 and msg in capsys.readouterr().err
    with pytest.raises(UserError, match="--pool 9 needs that many steady steps"):
        sim.every_step([run], _Flat(), [run], False, 1, None, pool=9)


def test_by_default_each_configuration_gets_its_median_prediction_over_the_steady_steps(tmp_path, capsys):
    """No one step decides: every steady step with bucket records is replayed as the profiled step, and each
    configuration's prediction is the median of its predictions; --step, --typical and --median replay one."""
    _write_run(tmp_path / "a", "bucketed", 0.25, steps=8)
    path = tmp_path / "a" / "steps.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for r, fwd in zip(rows, (5, 5, 5, 3.0, 9.0, 4.0, 8.0, 30.0)):  # steady steps 4-8: forward 3, 9, 4, 8, 30 ms
        r["forward_ms"] = fwd
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = load_run(tmp_path / "a")

    def play(ref, curve, calib):
        return [sim.predict(run.cfg, ref, curve, _Flat(), calib, "flat", None, run.vocab)]

    per_step = sim.each_step(run, _Flat(), False, 1, None, play)
    singles = [rows[0].step_ms for rows in per_step]
    assert len(singles) == 5 and len(set(singles)) == 5  # the forward shifts each step's prediction
    pooled = sim.pooled(per_step)[0]
    assert pooled.step_ms == statistics.median(singles) == singles[3]  # step 7's (forward 8 ms)
    assert per_step[4][0].step_ms - pooled.step_ms == pytest.approx(22.0)  # the 30 ms step moved nothing
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps([{"path": "reducer", "size": 8 * 4 ** k, "time_us": 1000.0 + 8 * 4 ** k / 1000.0}
                                 for k in range(10)]))
    argv = ["--run", str(tmp_path / "a"), "--topology", f"fit:{bench}", "--strategies", "noop", "--json"]
    main(argv)
    doc = json.loads(capsys.readouterr().out)
    assert "median prediction over 5 steady steps with bucket records, each" in doc["notes"][0]
    assert doc["rows"][0]["step_ms"] == pytest.approx(statistics.median(20.0 + f - 5.0 for f in (3, 9, 4, 8, 30)))
    main([*argv, "--step", "8"])
    assert json.loads(capsys.readouterr().out)["rows"][0]["step_ms"] == pytest.approx(45.0)
    # The same configuration's run in a second job, on a machine 40 ms slower every step: pooled with the first.
    shutil.copytree(tmp_path / "a", tmp_path / "a2")
    (tmp_path / "a2" / "steps.jsonl").write_text("".join(
        json.dumps(r | {"forward_ms": r["forward_ms"] + 40.0}) + "\n" for r in rows))
    main([*argv[:2], str(tmp_path / "a2"), *argv[2:]])
    doc = json.loads(capsys.readouterr().out)
    assert "over 10 steady steps with bucket records of 2 runs" in doc["notes"][0]
    assert doc["rows"][0]["step_ms"] == pytest.approx(statistics.median(
        [15.0 + f for f in (3, 9, 4, 8, 30)] + [55.0 + f for f in (3, 9, 4, 8, 30)]))
    _write_run(tmp_path / "b", "flat", None, steps=8)
    for extra, msg in ((["--step", "8", "--typical"], "give one of them"),
                       (["--run", str(tmp_path / "a"), str(tmp_path / "a2"), "--step", "8"], "give one --run"),
                       (["--run", str(tmp_path / "a"), str(tmp_path / "b")], "is not the configuration of")):
        with pytest.raises(SystemExit) as e:
            main([*argv, *extra])
        assert e.value.code == 2 and msg in capsys.readouterr().err


def test_a_split_embedding_is_played_as_the_reducer_runs_it_where_the_profile_recorded_its_rows(tmp_path):
    """From a profiled step with a split tied embedding's records (its projection part and each lookup's rows): the
    ready curve is the other buckets' (the parts are not where the embedding sits in ready order), and a
    configuration with the split launches the embedding's bucket first and each lookup's rows when recorded, so that
    backward ends with the rows' small all-reduce, not the whole matrix's."""
    _, exposed = _write_run(tmp_path / "a", "bucketed", 0.05)  # the 128 kB embedding in a bucket of its own, last
    run = load_run(tmp_path / "a")
    ref = sim.reference_step(run)
    plain_curve = sim.ready_curve(run, ref)
    ref.records = [{"bucket": 99, "class": "embedding", "part": "projection", "numel": 32000, "bytes": 128000,
                    "ready_ms": 0.1, "launch_ms": 0.1, "complete_ms": 1.3, "wait_start_ms": 10.0}, *ref.records,
                   *({"bucket": 100 + i, "class": "embedding", "part": "lookup", "numel": 100, "bytes": 400,
                      "ready_ms": t, "launch_ms": t, "complete_ms": t + 1.0, "wait_start_ms": 10.0}
                     for i, t in enumerate((5.0, 10.0)))]
    curve = sim.ready_curve(run, ref)
    assert (curve.xs, curve.ts) == (plain_curve.xs, plain_curve.ts)
    split = {"embedding": {"tied_split": True}}
    cal = sim.Calibration()
    plain = sim.predict(run.cfg, ref, curve, _Flat(), cal, "bucketed", 0.05, run.vocab)
    with_split = sim.predict(run.cfg, ref, curve, _Flat(), cal, "bucketed", 0.05, run.vocab, classes=split)
    assert with_split.variant == "+split" and plain.variant == ""
    assert plain.exposed_ms == pytest.approx(exposed - 0.2)  # the recorded timeline, without wait()'s 0.2 ms
    # Split: the matrix's bucket goes first, and backward ends with the encoder lookup's 400 bytes alone, launched at
    # 10 ms: 1.0004 ms on the flat model.
    assert with_split.exposed_ms == pytest.approx(1.0004) and plain.exposed_ms > 1.1
    # The split's own work on the computing thread, as its records measured it: a configuration without the split
    # does not do it; one with the split does, as the profiled step did
    for r in ref.records:
        if r.get("part") == "lookup":
            r["host_ms"] = 3.0
    assert ref.split_host_ms == 6.0
    assert sim.predict(run.cfg, ref, curve, _Flat(), cal, "bucketed", 0.05,
                       run.vocab).step_ms == pytest.approx(plain.step_ms - 6.0)
    assert sim.predict(run.cfg, ref, curve, _Flat(), cal, "bucketed", 0.05, run.vocab,
                       classes=split).step_ms == pytest.approx(with_split.step_ms)
    assert sim.predict(run.cfg, ref, curve, _Flat(), cal, "noop").step_ms == pytest.approx(ref.compute_ms - 6.0)
    # No rows recorded: the embedding still goes first, as the reducer re-plans it, and no lookup's rows are played
    # (their bytes are the step's tokens'): backward ends with the last bucket's all-reduce, hidden here
    ref.records = [r for r in ref.records if r.get("part") != "lookup"]
    assert sim.predict(run.cfg, ref, curve, _Flat(), cal, "bucketed", 0.05, run.vocab,
                       classes=split).exposed_ms == pytest.approx(0.0)


def test_measured_runs_line_up_with_predictions(tmp_path, capsys):
    _write_run(tmp_path / "a", "bucketed", 0.25)
    _write_run(tmp_path / "b", "flat", None)
    bench = tmp_path / "bench.csv"
    bench.write_text("path,size,count,type,redop,time_us,algbw,busbw,wrong\n"
                     + "".join(f"out-of-place,{s},{s // 4},float,sum,{1000 + s / 1000},0,0,0\n"
                               for s in (1024, 65536, 1 << 20, 1 << 24)))
    shutil.copytree(tmp_path / "a", tmp_path / "a-repeat")  # a second run of a's profile: taken together with it
    # ... on a machine 20% slower: every compute phase and the step take 1.2x as long.
    steps = [json.loads(line) for line in (tmp_path / "a-repeat" / "steps.jsonl").read_text().splitlines()]
    for st in steps:
        for k in ("forward_ms", "step_ms"):
            if k in st:
                st[k] *= 1.2
    (tmp_path / "a-repeat" / "steps.jsonl").write_text("".join(json.dumps(st) + "\n" for st in steps))
    main(["--run", str(tmp_path / "a"), "--topology", f"local:{bench}", "--strategies", "flat,bucketed",
              "--bucket-sizes", "0.25", "--measured", str(tmp_path / "a"), str(tmp_path / "b"),
              str(tmp_path / "a-repeat"), "--json"])
    doc = json.loads(capsys.readouterr().out)
    measured = [r for r in doc["rows"] if r["measured_step_ms"] is not None]
    assert len(measured) == 2
    a, b = measured
    assert a["run"].startswith("2 runs: ") and "a-repeat" in a["run"] and a["measured_runs"] == 2
    # Two runs: the median of the run medians, the range of run medians as its interval; the slow machine shows as
    # a speed of 1.1 (median of 1.0 and 1.2) and the speed-adjusted figure is the fast run's again.
    assert math.isclose(a["measured_step_ms"], 1.1 * median_step_ms(tmp_path / "a"), rel_tol=1e-6)
    assert a["measured_ci"] == pytest.approx([median_step_ms(tmp_path / "a"), 1.2 * median_step_ms(tmp_path / "a")])
    assert a["speed"] == pytest.approx(1.1) and a["adjusted_ci"] == pytest.approx([median_step_ms(tmp_path / "a")] * 2)
    for r in measured:
        assert math.isclose(r["step_ms"], r["adjusted_step_ms"], rel_tol=0.01)
        lo, hi = r["measured_ci"]
        assert lo <= r["measured_step_ms"] <= hi
    assert b["speed"] == pytest.approx(1.0) and b["adjusted_step_ms"] == pytest.approx(b["measured_step_ms"])
    assert doc["ranking"]["pairs"] == 1 and doc["ranking_adjusted"]["agrees"]
    probe = next(n for n in doc["notes"] if n.startswith("machine-speed probes"))
    opt = sorted(r["measured_optimizer_ms"] for r in measured)
    assert f"measured configurations {opt[0]:.1f}-{opt[-1]:.1f} ms" in probe


def median_step_ms(run_dir):
    """The median steady step time of a run written by `_write_run`."""
    return statistics.median(s["step_ms"] for s in load_run(run_dir).steady_steps())


def test_median_ci_uses_order_statistics():
    assert sim.median_ci([float(v) for v in range(1, 101)]) == (41.0, 60.0)  # n/2 ± 1.96·√100/2 = 50 ± 9.8
    assert sim.median_ci([5.0]) == (5.0, 5.0)


def _row(label, predicted, measured, ci):
    return sim.Prediction(label, None, 1, 0.0, 0.0, predicted, measured_step_ms=measured, measured_ci=ci)


def test_ranking_counts_only_pairs_that_measurement_or_model_can_order():
    a = _row("a", 100.0, 110.0, (105.0, 115.0))
    b = _row("b", 120.0, 106.0, (103.0, 107.0))  # measured faster than a, but inside a's interval: a tie
    c = _row("c", 120.3, 200.0, (190.0, 210.0))  # predicted within 0.5% of b: a tie with b
    rk = sim.ranking([a, b, c])
    assert (rk.pairs, rk.ties, rk.agrees) == (3, 2, True)
    d = _row("d", 90.0, 150.0, (140.0, 160.0))  # predicted fastest, measured slower than a and b beyond noise
    rk = sim.ranking([a, b, c, d])
    assert not rk.agrees and sorted(rk.discordant) == [("a", "d"), ("b", "d")]


def test_paper_projection_runs_and_states_assumptions(capsys):
    pytest.importorskip("dtrain.collectives.plan")
    main(["--paper", "--strategies", "flat,bucketed", "--bucket-sizes", "25"])
    out = capsys.readouterr().out
    assert "MODELED projection" in out and "assumed" in out and "p100x8" in out
    with pytest.raises(UserError):
        sim.predict(config_mod.from_dict({}, "test"), None, None, None, None, "powersgd")


def test_a_profiles_per_class_nccl_choice_is_honoured_by_the_preset():
    pytest.importorskip("dtrain.collectives.plan")
    base = {"model": {"preset": "base"}, "data": {"vocab_size": 37000}, "sync": {"strategy": "per_class"}}
    forced = {**base, "sync": {"strategy": "per_class", "classes": {"ffn": {"algorithm": "Ring", "protocol": "LL"}}},
              "collectives": {"mode": "per_group"}}
    model = cm.NcclModel(cm.topology("h100x8"))
    ref, curve, _ = sim.flop_step(config_mod.from_dict(dict(base)), model.topo, 3200, 3200)
    preds = [sim.predict(config_mod.from_dict(c), ref, curve, model, sim.Calibration(), "per_class")
             for c in (base, forced)]
    # 25 MiB ffn buckets: NCCL picks LL128; forcing LL (capped at 141 GB/s bus) costs more.
    assert preds[1].comm_ms > preds[0].comm_ms
    ffn = [b for b in schedule_of(config_mod.from_dict(dict(base))).buckets if b.tensor_class == "ffn"]
    extra = sum(model.time_us(b.nbytes, algo="Ring", proto="LL") - model.time_us(b.nbytes) for b in ffn) / 1000
    assert preds[1].comm_ms - preds[0].comm_ms == pytest.approx(extra, rel=1e-6)


class _FlatWithHost(_Flat):
    """_Flat, and 0.5 ms of computation lost per all-reduce launched during it, whatever its size."""

    def host_us(self, nbytes):
        return 500.0


def _schedule(cfg, world=2):
    return strategies.schedule_for(cfg.sync, meta_model(cfg), world)


def test_a_replicated_bucket_is_played_whole_from_the_start_of_backward_and_has_no_gather():
    """sharded with tied_split: the embedding's bucket (first, replicated) is all-reduced whole from its projection
    part (the first gradient of backward) and the next forward needs no gather for it; the other buckets are
    reduce-scattered as their gradients are ready and gathered for the next forward."""
    cfg = config_mod.from_dict({"model": {"preset": "small"}, "data": {"vocab_size": 8000},
                                "sync": {"strategy": "sharded", "bucket_cap_mb": 2,
                                         "classes": {"embedding": {"tied_split": True}}}}, "test")
    plain = config_mod.from_dict({"model": {"preset": "small"}, "data": {"vocab_size": 8000},
                                  "sync": {"strategy": "sharded", "bucket_cap_mb": 2}}, "test")
    sch, ref = _schedule(cfg), _schedule(plain)
    plan = list(sch.buckets)
    assert plan[0].tensor_class == "embedding"
    backward = [c for c in sch.collectives if c.ready != schedule.STEP and c.ready != schedule.LOOKUP]
    assert [(c.kind, c.ready) for c in backward] == [("all_reduce", "projection")] + [
        ("reduce_scatter", "gradient")] * (len(plan) - 1)
    gathered = [c.bucket for c in sch.collectives if c.kind == "all_gather"]
    assert gathered == list(range(1, len(plan)))
    assert [c.group for c in sch.collectives if c.ready == schedule.LOOKUP] == [schedule.LOOKUP_GROUP]
    # The forward waits for the first gathered bucket it needs; the plain plan's embedding gather comes first
    # and is the largest, so the split's replicated embedding makes the stall shorter.
    split_stall = gather_stall([plan[i] for i in gathered], [2.0 * plan[i].numel / 1e6 for i in gathered], 100.0)
    plain_stall = gather_stall(list(ref.buckets), [2.0 * b.numel / 1e6 for b in ref.buckets], 100.0)
    assert 0.0 <= split_stall < plain_stall
    assert sch.updated == pytest.approx(1 - 0.5 * sum(b.numel for b in plan[1:]) / sum(b.numel for b in plan))


def test_an_embedding_sharded_by_rows_is_reduce_scattered_from_the_start_of_backward_and_gathered_last():
    """sharded with tied_split and shard_tied_split: the embedding's bucket is ready with the projection's gradient
    (the first of backward), reduce-scattered like the others, its lookups' rows reduce-scattered to their owners,
    and the next forward needs its gather only at the end (its lookups fetch their rows)."""
    cfg = config_mod.from_dict({"model": {"preset": "small"}, "data": {"vocab_size": 8000},
                                "sync": {"strategy": "sharded", "bucket_cap_mb": 2, "shard_tied_split": True,
                                         "classes": {"embedding": {"tied_split": True}}}}, "test")
    sch = _schedule(cfg)
    plan = list(sch.buckets)
    exs = exchange_plan(cfg.sync, meta_model(cfg), plan, 2)
    assert exs[0].row_size == 256 and all(ex.gathered for ex in exs)  # d_model of the small preset
    first = sch.collectives[0]
    assert (first.kind, first.ready, first.path) == ("reduce_scatter", "projection", "p2p")
    assert [c.kind for c in sch.collectives if c.ready == schedule.LOOKUP] == ["reduce_scatter"]
    assert sch.label == "+split+rows" and sch.exact
    # Gathered last, needed at the end of the forward: its gather stalls nothing that the others' do not.
    durations = [2.0 * b.numel / 1e6 for b in plan]
    assert gather_stall(plan, durations, 1000.0) == gather_stall(plan[1:], durations[1:], 1000.0)
    assert sch.updated == pytest.approx(0.5)  # every bucket sharded over 2 ranks


def test_a_narrowed_sharded_plan_moves_its_linear_members_in_bf16(tmp_path):
    """sharded with gather_dtype bf16: a bucket's Linear members travel at 2 bytes an element, its LayerNorm members
    at 4, the replicated embedding whole; the prediction's exchanges shrink with them, and its label says so."""
    raw = {"model": {"preset": "small"}, "data": {"vocab_size": 8000}, "train": {"amp": "bf16"},
           "sync": {"strategy": "sharded", "bucket_cap_mb": 2, "gather_dtype": "bf16",
                    "classes": {"embedding": {"tied_split": True}}}}
    cfg = config_mod.from_dict(raw, "test")
    plan = schedule_of(cfg).buckets
    sizes = [ex.nbytes("all_gather") or ex.bucket.nbytes for ex in exchange_plan(sync_for(cfg), meta_model(cfg), plan, 2)]
    assert sizes[0] == plan[0].nbytes  # the replicated embedding: read by the lookups in fp32
    assert all(b.nbytes / 2 < n < b.nbytes for b, n in zip(plan[1:], sizes[1:]) if "norm" in " ".join(b.names))
    assert sum(sizes[1:]) < 0.51 * sum(b.nbytes for b in plan[1:])  # almost all of the rest is Linear weights
    cfg_run, _ = _write_run(tmp_path / "run", strategy="sharded")
    run = load_run(tmp_path / "run")
    ref = sim.reference_step(run)
    curve, cal = sim.ready_curve(run, ref), sim.calibrate(ref, _Flat())
    narrowed = config_mod.from_dict({**run.cfg.to_dict(), "train": {"amp": "bf16"},
                                     "sync": {"strategy": "sharded", "bucket_cap_mb": 0.25,
                                              "gather_dtype": "bf16"}}, "test")
    fp32 = sim.predict(run.cfg, ref, curve, _Flat(), cal, "sharded", 0.25, run.vocab)
    low = sim.predict(narrowed, ref, curve, _Flat(), cal, "sharded", 0.25, run.vocab)
    assert low.label == "sharded@0.25M+bf16" and fp32.label == "sharded@0.25M"
    assert low.comm_ms < fp32.comm_ms and low.step_ms < fp32.step_ms  # the tiny model: mostly its fp32 embedding


def test_a_collective_costs_backward_pro_rata_to_its_run_before_backward_ends():
    # Backward ends at 10. Runs 0-4 (all of it before: 0.5 ms), 8-12 (half: 0.25), 11-13 (none), queued (none).
    tl = sim.Timeline([0, 0, 0, 0], [0, 0, 0, 0], [0.0, 8.0, 11.0, 12.0], [4.0, 12.0, 13.0, 14.0], 10.0)
    assert sim.host_ms(_FlatWithHost(), [1, 1, 1, 1], tl) == pytest.approx(0.75)
    assert sim.host_ms(_Flat(), [1], tl) is None  # no --overlap measurement: no host cost
    # another rank computes until 14 (ranks sharing the cores): all four runs end by then, 0.5 ms each
    assert sim.host_ms(_FlatWithHost(), [1, 1, 1, 1], tl, computing_ms=14.0) == pytest.approx(2.0)
    assert sim.host_ms(_FlatWithHost(), [1, 1, 1, 1], tl, computing_ms=5.0) == pytest.approx(0.75)  # never earlier


def test_collectives_during_backward_lengthen_it_relative_to_the_reference_step(tmp_path):
    _write_run(tmp_path / "run", cap=0.02)  # small buckets, so that some run during backward
    run = load_run(tmp_path / "run")
    ref = sim.reference_step(run)
    curve = sim.ready_curve(run, ref)
    plain = sim.calibrate(ref, _FlatWithHost())  # a GPU run: no host cost
    cal = sim.calibrate(ref, _FlatWithHost(), host_cost=True)
    # The reference step's own collectives, played again, as the base its backward already holds.
    base = sim.host_ms(_FlatWithHost(), [r["bytes"] for r in ref.records], cal.timeline)
    assert plain.host_base_ms is None and cal.host_base_ms == pytest.approx(base) and base > 0
    own = sim.predict(run.cfg, ref, curve, _FlatWithHost(), cal, "bucketed", 0.02, run.vocab)
    assert own.step_ms == pytest.approx(sim.predict(run.cfg, ref, curve, _Flat(), plain, "bucketed", 0.02,
                                                    run.vocab).step_ms)  # the reference plan: nothing changes
    # per_tensor runs more collectives during backward: its compute grows by their pro-rata cost less the base.
    per_tensor = sim.predict(run.cfg, ref, curve, _FlatWithHost(), cal, "per_tensor", None, run.vocab)
    without = sim.predict(run.cfg, ref, curve, _Flat(), plain, "per_tensor", None, run.vocab)
    plan = schedule_of(run.cfg, "per_tensor").buckets
    tl = sim.play_timeline([curve.at(x) for x in sim.through(plan, ready_params(run.cfg))],
                    [_Flat().time_us(b.nbytes) / 1000 for b in plan], ref.sync_backward_ms)
    extra = sim.host_ms(_FlatWithHost(), [b.nbytes for b in plan], tl) - base
    assert extra > 0 and per_tensor.step_ms == pytest.approx(without.step_ms + extra)
    # flat sends after backward: the reference step's cost comes off, nothing goes on.
    assert sim.predict(run.cfg, ref, curve, _FlatWithHost(), cal, "noop").step_ms == pytest.approx(20.0 - base)


def test_the_benchmarks_cpu_time_and_overlap_cost_are_fitted_per_operation_and_per_byte():
    rows = [cm.Measurement(s, 100.0, label="reducer", cpu_us=600.0 + s * 1e-4, host_us=300.0 + s * 1e-4)
            for s in (8, 1024, 65536)]
    rows += [cm.Measurement(s, 100.0, label="reducer", cpu_us=600.0 + 2e-4 * s) for s in (1 << 24,)]
    rows += [cm.Measurement(1 << 20, 100.0, label="reducer", cpu_us=600.0 + 2e-4 * (1 << 20),
                            host_us=300.0 + 1024 * 1e-4 + 5e-5 * (1 << 20))]
    fm = cm.FittedModel.from_measurements(cm.MeasurementSet(rows, ranks=2))
    assert fm.cpu_us(0) == pytest.approx(600.0 + 1024 * 1e-4)  # the median of the small sizes
    assert fm.cpu_us(1 << 22) == pytest.approx(600.0 + 1024 * 1e-4 + (1 << 22) * 2e-4, rel=1e-3)
    # --overlap measured only up to 1 MiB: its rows alone make the fit
    assert fm.host_us(0) == pytest.approx(300.0 + 1024 * 1e-4)
    assert fm.host_us(1 << 22) == pytest.approx(300.0 + 1024 * 1e-4 + (1 << 22) * 5e-5, rel=1e-6)
    again = cm.FittedModel.from_dict(json.loads(json.dumps(fm.to_dict())))
    assert again.cpu_us(1 << 22) == pytest.approx(fm.cpu_us(1 << 22), rel=1e-6)
    assert again.host_us(1 << 22) == pytest.approx(fm.host_us(1 << 22), rel=1e-6)
    plain = cm.FittedModel.from_measurements(cm.MeasurementSet([cm.Measurement(8, 1.0), cm.Measurement(16, 1.0)]))
    assert plain.cpu_us(8) is None and plain.host_us(8) is None


def test_interleaved_configurations_are_ranked_by_paired_step_differences():
    # Two configurations of one interleaved job: the machine drifts by ±30% from step to step, b is always 5 ms
    # slower. Their medians' intervals overlap (no order from them), the paired differences separate them.
    drift = [100.0 * (1 + 0.3 * math.sin(i)) for i in range(40)]
    a = _row("a", 100.0, 100.0, (80.0, 125.0))
    b = _row("b", 106.0, 105.0, (85.0, 130.0))
    a.samples = {("job1", i): d for i, d in enumerate(drift)}
    b.samples = {("job1", i): d + 5.0 for i, d in enumerate(drift)}
    assert sim.paired(a, b) == (-5.0, -5.0, -5.0)
    rk = sim.ranking([a, b])
    assert (rk.pairs, rk.ties, rk.agrees) == (1, 0, True)
    b.step_ms = 94.0  # predicted faster than a: the paired measurement says otherwise
    assert sim.ranking([a, b]).discordant == [("a", "b")]
    b.samples = {("job2", i): v for (_, i), v in b.samples.items()}  # different jobs: not paired, intervals overlap
    assert sim.paired(a, b) is None and sim.ranking([a, b]).ties == 1


@pytest.mark.parametrize("damage,msg", [
    (lambda p: (p / "steps.jsonl").write_text('{"step": 1,,}\n' + (p / "steps.jsonl").read_text()),
     "steps.jsonl:1: not a JSON record"),
    (lambda p: (p / "run.json").write_text("{not json"), "run.json: not JSON"),
    (lambda p: (p / "steps.jsonl").write_text((p / "steps.jsonl").read_text().replace('"backward_ms"', '"bwd"')),
     "record 1: backward_ms must be a number"),
    (lambda p: (p / "buckets.jsonl").write_text(re.sub(r'"bytes": (\d+)', r'"bytes": "\1"',
                                                       (p / "buckets.jsonl").read_text())),
     "buckets.jsonl: record 1: bytes must be a number"),
])
def test_a_damaged_run_directory_is_a_one_line_error(tmp_path, capsys, damage, msg):
    _write_run(tmp_path / "run")
    damage(tmp_path / "run")
    with pytest.raises(SystemExit) as e:
        main(["--run", str(tmp_path / "run"), "--topology", "h100x8"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and msg in err, err


def test_a_run_without_bucket_records_is_replayed_from_its_steps_alone(tmp_path, capsys):
    _write_run(tmp_path / "run")
    (tmp_path / "run" / "buckets.jsonl").write_text("")
    (tmp_path / "run" / "buckets.rank1.jsonl").write_text("")
    main(["--run", str(tmp_path / "run"), "--topology", "h100x8", "--strategies", "flat"])
    assert "flat" in capsys.readouterr().out


def test_the_default_reference_step_is_the_most_typical_not_just_the_median_step_time(tmp_path):
    _write_run(tmp_path / "run", steps=10)
    path = tmp_path / "run" / "steps.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for r in rows:
        r["step_ms"] += 0.1 * r["step"]  # step 7 has the median step time of the steady steps 4-10 ...
    rows[6].update(forward_ms=1.0, backward_ms=16.0)  # ... but a forward and backward unlike any other's
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = load_run(tmp_path / "run")
    assert statistics.median_low(s["step_ms"] for s in run.steady_steps()) == rows[6]["step_ms"]
    chosen = sim.reference_step(run)
    assert chosen.step in (6, 8) and chosen.forward_ms == 5.0
    assert sim.reference_step(run, step=7).forward_ms == 1.0  # --step still replays the step asked for


def test_two_lanes_only_for_a_gloo_run_costed_by_a_fit(tmp_path):
    fit = tmp_path / "bench.json"
    fit.write_text(json.dumps([{"path": "reducer", "size": 8 * 4 ** k, "time_us": 100.0 + 8 * 4 ** k / 100.0}
                               for k in range(10)]))
    assert sim.default_lanes("gloo", cm.load_model(f"local:{fit}")) == sim.GLOO_LANES
    assert sim.default_lanes("nccl", cm.load_model(f"local:{fit}")) == 1
    for nccl_model in ("h100x8", f"nccl-log:{H200_LOG}"):  # NCCL's models: one stream, whatever ran the profile
        assert sim.default_lanes("gloo", cm.load_model(nccl_model)) == 1


def test_fsdp2_on_a_cpu_device_adds_every_collective_and_with_streams_overlaps_them(tmp_path):
    """fsdp2: one bucket per unit (the layer and the root); a reduce-scatter and an all-gather each cost the latency
    and half the rest of an all-reduce. Without device streams every one adds to the step, the gathers again in
    backward with reshard_after_forward (all but the root's); with streams backward hides some of them, and so it
    does on a CPU device with collectives that do not wait (`sync.fsdp2_collectives`)."""
    _write_run(tmp_path / "run", strategy="sharded")
    run = load_run(tmp_path / "run")
    ref = sim.reference_step(run)
    curve, cal = sim.ready_curve(run, ref), Calibration()  # collectives at the cost model's speed
    plan = schedule_of(run.cfg, "fsdp2").buckets
    assert len(plan) == 3  # encoder.0, decoder.0 and the root: N=1

    def half(nbytes):  # the all-reduce's latency and half the rest, as `sharded`'s exchanges cost
        whole, alpha = _Flat().allreduce_ms(nbytes), _Flat().allreduce_latency_ms(nbytes)
        return alpha + (whole - alpha) / 2

    one_way = sum(half(b.nbytes) for b in plan)
    saving = ref.optimizer_ms * 0.5  # each of 2 ranks updates half of every unit
    for reshard, again in ((False, 0.0), (True, sum(half(b.nbytes) for b in plan[:-1]))):
        cfg = config_mod.from_dict({**run.cfg.to_dict(), "sync": {"strategy": "fsdp2",
                                                                   "reshard_after_forward": reshard}}, "test")
        cal.streams = False
        serial = sim.predict(cfg, ref, curve, _Flat(), cal, "fsdp2", None, run.vocab)
        assert serial.label == ("fsdp2" if reshard else "fsdp2+keep") and serial.buckets == 3
        assert serial.comm_ms == pytest.approx(2 * one_way + again)
        assert serial.step_ms == pytest.approx(ref.compute_ms - saving + 2 * one_way + again)
        cal.streams = True
        overlapped = sim.predict(cfg, ref, curve, _Flat(), cal, "fsdp2", None, run.vocab)
        assert overlapped.comm_ms == pytest.approx(serial.comm_ms) and overlapped.step_ms < serial.step_ms
        # on a CPU device, its collectives issued without waiting (`sync.fsdp2_collectives`) play as with streams
        cal.streams = False
        unwaited = config_mod.from_dict({**cfg.to_dict(), "sync": {**cfg.to_dict()["sync"],
                                                                   "fsdp2_collectives": "async"}}, "test")
        played = sim.predict(unwaited, ref, curve, _Flat(), cal, "fsdp2", None, run.vocab)
        assert played.step_ms == pytest.approx(overlapped.step_ms) and played.comm_ms == pytest.approx(serial.comm_ms)


def test_fsdp2_with_the_split_all_reduces_the_embedding_outside_its_units(tmp_path):
    """fsdp2 with a split tied embedding (`tied_split`: outside FSDP2, whole on every rank): the embedding a bucket of
    its own, first, all-reduced (no reduce-scatter, no all-gather, no saving in the optimizer); the units as without
    the split, less the embedding."""
    _write_run(tmp_path / "run", strategy="sharded")
    run = load_run(tmp_path / "run")
    ref = sim.reference_step(run)
    curve, cal = sim.ready_curve(run, ref), Calibration()
    sync = {"strategy": "fsdp2", "reshard_after_forward": False, "fsdp2_collectives": "p2p"}
    plain = config_mod.from_dict({**run.cfg.to_dict(), "sync": sync}, "test")
    split = config_mod.from_dict({**run.cfg.to_dict(), "sync": {**sync, "classes": {"embedding": {
        "tied_split": True}}}}, "test")
    plan = schedule_of(split, "fsdp2").buckets
    assert list(plan[0].names) == ["embed.weight"] and all("embed.weight" not in b.names for b in plan[1:])
    assert sum(b.numel for b in plan) == sum(b.numel for b in schedule_of(plain, "fsdp2").buckets)

    def half(nbytes):
        whole, alpha = _Flat().allreduce_ms(nbytes), _Flat().allreduce_latency_ms(nbytes)
        return alpha + (whole - alpha) / 2

    p = sim.predict(split, ref, curve, _Flat(), cal, "fsdp2", None, run.vocab)
    assert p.label == "fsdp2+split+keep+p2p"
    assert p.comm_ms == pytest.approx(_Flat().allreduce_ms(plan[0].nbytes) + 2 * sum(half(b.nbytes) for b in plan[1:]))


def test_fsdp2_costs_the_reduce_scatters_and_all_gathers_the_benchmark_measured(tmp_path):
    """A model fitted on reduce-scatter and all-gather too (the benchmark's `--collective`) costs fsdp2's
    collectives by their own fits, not as half an all-reduce: FSDP2 calls torch's reduce_scatter_tensor and
    all_gather_into_tensor, whose cost on gloo is their own; with `sharded`'s exchanges in its hooks, half an
    all-reduce."""
    _write_run(tmp_path / "run", strategy="sharded")
    run = load_run(tmp_path / "run")
    ref = sim.reference_step(run)
    curve, cal = sim.ready_curve(run, ref), Calibration()
    cal.streams = False
    plan = schedule_of(run.cfg, "fsdp2").buckets
    flat = [cm.Regime(math.inf, 50.0, 1.0)]  # 50 µs + 1 GB/s
    fitted = cm.FittedModel({"raw": flat}, "allreduce", 2, other_colls={
        "reducescatter": {"raw": [cm.Regime(math.inf, 200.0, 0.5)]},
        "allgather": {"raw": [cm.Regime(math.inf, 100.0, 0.25)]}})
    cfg = config_mod.from_dict({**run.cfg.to_dict(), "sync": {"strategy": "fsdp2",
                                                               "reshard_after_forward": False}}, "test")
    p = sim.predict(cfg, ref, curve, fitted, cal, "fsdp2", None, run.vocab)
    scatter = sum(0.2 + b.nbytes / 0.5e6 for b in plan)
    gather = sum(0.1 + b.nbytes / 0.25e6 for b in plan)
    assert p.comm_ms == pytest.approx(scatter + gather)
    only_allreduce = cm.FittedModel({"raw": flat}, "allreduce", 2)
    halves = sim.predict(cfg, ref, curve, only_allreduce, cal, "fsdp2", None, run.vocab).comm_ms
    assert halves < p.comm_ms / 3
    # `sharded`'s point-to-point exchanges in FSDP2's hooks: not torch's collectives, half an all-reduce each
    p2p = config_mod.from_dict({**cfg.to_dict(), "sync": {**cfg.to_dict()["sync"], "fsdp2_collectives": "p2p"}},
                               "test")
    assert sim.predict(p2p, ref, curve, fitted, cal, "fsdp2", None, run.vocab).comm_ms == pytest.approx(halves)


class _Flat4(_Flat):
    """_Flat over 4 ranks (2 nodes x 2 ranks)."""

    ranks = 4


def test_the_hierarchical_plan_costs_each_buckets_shard_by_the_load_it_puts_on_a_nodes_link(tmp_path):
    """sync.hierarchical on 2 nodes x 2 ranks: each bucket's shard all-reduce between the nodes costs the flat
    all-reduce of (N-1)/N / ((NR-1)/NR) = 2/3 of its bytes, the reduce-scatter and all-gather inside the node their
    latency each, and the three run one after another on one thread (one bucket at a time)."""
    _write_run(tmp_path / "run", "bucketed", 0.05)
    run = load_run(tmp_path / "run")
    ref = sim.reference_step(run)
    curve, cal = sim.ready_curve(run, ref), Calibration(lanes=2)
    model = _Flat4()
    def allreduce(_, nbytes):
        return model.allreduce_ms(nbytes)

    one = hierarchical_ms(lambda n: allreduce(None, n), model.allreduce_latency_ms, 3_000_000, 2, 4)
    assert one == pytest.approx(2 * model.allreduce_latency_ms(1_500_000) + model.allreduce_ms(2_000_000))
    hier = config_mod.from_dict({**run.cfg.to_dict(), "sync": {"strategy": "bucketed", "bucket_cap_mb": 0.05,
                                                                "hierarchical": True, "ranks_per_node": 2}}, "test")
    flat = sim.predict(run.cfg, ref, curve, model, cal, "bucketed", 0.05, run.vocab)
    tiered = sim.predict(hier, ref, curve, model, cal, "bucketed", 0.05, run.vocab)
    assert tiered.label == "bucketed@0.05M+hier" and flat.label == "bucketed@0.05M"
    plan = schedule_of(hier, world=4).buckets
    sizes = [b.nbytes for b in plan]
    # One lane: the buckets' durations add up wherever they overlap nothing else (after backward, in the end)
    assert tiered.comm_ms == pytest.approx(sum(hierarchical_ms(lambda n: allreduce(None, n), model.allreduce_latency_ms,
                                                               n, 2, 4)
                                               for n in sizes))
    # With the path inside a node modeled (simulate's --intra-topology), its reduce-scatter and all-gather cost what
    # that model says (here half an all-reduce each: it did not measure them itself), not their latency
    inner = _Flat4()
    inner.inside_node = _Flat()
    within = sim.predict(hier, ref, curve, inner, cal, "bucketed", 0.05, run.vocab)
    assert within.comm_ms == pytest.approx(sum(
        hierarchical_ms(lambda n: allreduce(None, n), model.allreduce_latency_ms, n, 2, 4, _Flat().allreduce_ms) for n in sizes))
    assert within.comm_ms > tiered.comm_ms
    # The ranks per node must be known and split the cost model's world
    odd = config_mod.from_dict({**hier.to_dict(), "sync": {**hier.to_dict()["sync"], "ranks_per_node": 3}}, "test")
    with pytest.raises(UserError, match="ranks_per_node"):
        sim.predict(odd, ref, curve, model, cal, "bucketed", 0.05, run.vocab)
    with pytest.raises(UserError, match="ranks_per_node"):
        sim.predict(hier, ref, curve, _Flat(), cal, "bucketed", 0.05, run.vocab)  # a 2-rank model


def test_a_sharded_plans_exchanges_load_a_nodes_link_by_the_ranks_it_holds(tmp_path, capsys):
    """`sharded`'s point-to-point reduce-scatter and all-gather send each rank's 1/W of a bucket to every other rank:
    with R ranks a node, R(W - R)/W of the bucket crosses the node's link, where half a ring all-reduce puts
    (W - 1)/W there. So 4/3 of what the ring's half costs on 2 nodes of 2 ranks, the same with one rank a node (or
    one node). The layout comes from the cost model's user: `--ranks-per-node`, else the profiled run's record
    (run.json's ranks_per_node, torchrun's LOCAL_WORLD_SIZE); the hierarchical plan takes its levels from it too."""
    assert p2p_load(4, None) == 1.0 and p2p_load(4, 1) == 1.0 and p2p_load(4, 4) == 1.0
    assert p2p_load(4, 2) == pytest.approx(4 / 3) and p2p_load(16, 8) == pytest.approx(64 / 15)
    assert exchange_ms(10.0, 2.0, 4 / 3) == pytest.approx(2.0 + 4 / 3 * 4.0)
    _write_run(tmp_path / "run", "sharded", 0.05)
    run = load_run(tmp_path / "run")
    ref = sim.reference_step(run)
    curve, cal = sim.ready_curve(run, ref), Calibration(lanes=2)
    flat, nodes = _Flat4(), _Flat4()
    nodes.ranks_per_node = 2
    one = sim.predict(run.cfg, ref, curve, flat, cal, "sharded", 0.05, run.vocab)
    two = sim.predict(run.cfg, ref, curve, nodes, cal, "sharded", 0.05, run.vocab)
    assert two.comm_ms > one.comm_ms and two.step_ms > one.step_ms
    # the hierarchical plan without 'sync.ranks_per_node': the model's layout
    hier = config_mod.from_dict({**run.cfg.to_dict(), "sync": {"strategy": "bucketed", "bucket_cap_mb": 0.05,
                                                                "hierarchical": True}}, "test")
    assert sim.predict(hier, ref, curve, nodes, cal, "bucketed", 0.05, run.vocab).variant == "+hier"
    with pytest.raises(UserError, match="ranks per node"):
        sim.predict(hier, ref, curve, flat, cal, "bucketed", 0.05, run.vocab)
    # the command line: the layout printed; one that does not divide the fit's ranks, a one-line error
    rows = [{"path": "reducer", "size": 8 * 4 ** k, "time_us": 50.0 + 8 * 4 ** k / 100.0, "world_size": 4}
            for k in range(12)]
    (tmp_path / "fit.json").write_text(json.dumps(rows))
    argv = ["--run", str(tmp_path / "run"), "--topology", f"fit:{tmp_path / 'fit.json'}", "--strategies", "sharded",
            "--bucket-sizes", "0.05"]
    main([*argv, "--ranks-per-node", "2", "--intra-topology", f"fit:{tmp_path / 'fit.json'}"])
    out = capsys.readouterr().out
    assert "# the machine's layout: 2 ranks per node" in out and "# inside a node (the hierarchical plan's" in out
    for bad, why in (("3", "3 ranks per node do not divide the cost model's 4 ranks"), ("0", "at least 1")):
        with pytest.raises(SystemExit) as e:
            main([*argv, "--ranks-per-node", bad])
        assert e.value.code == 2 and why in capsys.readouterr().err


def test_a_split_embeddings_lookups_run_on_their_own_group_beside_the_buckets():
    """The split's lookups' rows go through the split's own process group: in the calibration's replay a lookup
    launched while a long bucket runs starts at once (in launch order, not the record order that puts lookups last)
    and shares the link with it, instead of queueing behind it."""
    recs = [{"bucket": 0, "bytes": 4_000_000, "launch_ms": 1.0, "complete_ms": 5.0, "wait_start_ms": 9.0},
            {"bucket": 1, "bytes": 1_000, "launch_ms": 2.0, "complete_ms": 3.0, "wait_start_ms": 9.0,
             "part": "lookup"}]
    ref = sim.ReferenceStep(1, 0.0, 1.0, 9.0, 1.0, exposed_ms=0.0, step_ms=10.0, records=recs)
    assert record_groups(recs, False) == [None, LOOKUP_GROUP]
    cal = sim.calibrate(ref, _Flat(), lanes=1)
    # On one group with one lane the lookup would wait for bucket 0 (5 ms of work): its replay ends long after 3 ms.
    assert cal.timeline.start[1] == pytest.approx(2.0)
    reordered = sim.ReferenceStep(1, 0.0, 1.0, 9.0, 1.0, 0.0, 10.0, records=list(reversed(recs)))
    assert sim.calibrate(reordered, _Flat(), lanes=1).timeline.start == cal.timeline.start  # record order: no matter


def test_collectives_run_slower_until_the_last_rank_stops_computing():
    """With ranks that share cores, some rank still computes after this one's backward ends: the slowdown lasts
    until `computing_ms`, while exposed time still counts from this rank's backward end."""
    alone = sim.play_timeline([0.0], [4.0], 2.0, slowdown=2.0)
    assert alone.end == pytest.approx([5.0])  # 1 ms of work by 2 ms, 3 ms after
    shared = sim.play_timeline([0.0], [4.0], 2.0, slowdown=2.0, computing_ms=6.0)
    assert shared.end == pytest.approx([7.0]) and shared.exposed_ms == pytest.approx(5.0)  # 3 ms of work by 6


def test_the_reference_step_knows_when_the_first_and_last_ranks_compute(tmp_path):
    """slowest_rank_records also gives when the last rank's backward started and ended on rank 0's clock: the
    reference step's compute window (a gradient ready "at the start of backward" is ready everywhere only then) and
    the ready curve's first point."""
    _write_run(tmp_path / "run", cap=0.02)
    run = load_run(tmp_path / "run")
    own = run.buckets[4]
    # Rank 1's backward starts 4 ms after rank 0's (its clock reads 4 ms less for the same moment), its buckets are
    # ready 2 ms later than rank 0's, and its backward ends 6 ms later (at 16 ms on rank 0's clock).
    run.rank_buckets = {1: {4: [{**r, "ready_ms": r["ready_ms"] - 2.0, "launch_ms": r["launch_ms"] - 2.0,
                                 "complete_ms": r["complete_ms"] - 4.0, "wait_start_ms": 12.0} for r in own]}}
    ref = sim.reference_step(run, 4)
    assert ref.sync_backward_ms == pytest.approx(10.0)
    assert ref.compute_start_ms == pytest.approx(4.0) and ref.compute_end_ms == pytest.approx(16.0)
    assert all(r["ready_ms"] == pytest.approx(m["ready_ms"] + 2.0) for r, m in zip(ref.records, own))
    curve = sim.ready_curve(run, ref)
    assert curve.at(0) == pytest.approx(min(4.0, min(r["ready_ms"] for r in ref.records)))
    alone = _write_run(tmp_path / "alone", cap=0.02) and sim.reference_step(load_run(tmp_path / "alone"), 4)
    assert (alone.compute_start_ms, alone.compute_end_ms) == (0.0, alone.sync_backward_ms)


def test_in_lockstep_a_groups_collectives_share_its_link_by_size():
    """gloo beyond two ranks: two collectives of one group in flight at once advance a chunk each per step, so a
    small one beside a large one ends about with it; shared equally, the small one ends first. Either way the link
    moves the same bytes: the last one ends at the same time."""
    equal = sim.play_timeline([0.0, 0.0], [8.0, 1.0], 0.0, lanes=2)
    by_size = sim.play_timeline([0.0, 0.0], [8.0, 1.0], 0.0, lanes=2, lockstep=True)
    assert equal.end == pytest.approx([9.0, 2.0]) and by_size.end == pytest.approx([9.0, 9.0])
    assert played.lockstep(_Flat4()) and not played.lockstep(_Flat())


def _flat_floor_fit() -> cm.FittedModel:
    """A 4-rank fit as gloo's on oversubscribed CPUs: a flat 6 ms up to 600 kB, then 0.1 GB/s (10 ms per MB)."""
    return cm.FittedModel({"reducer": [cm.Regime(600_000, 6000.0, math.inf), cm.Regime(math.inf, 0.0, 0.1)]},
                          "allreduce", 4)


def test_a_fits_flat_small_size_regime_still_puts_its_bytes_on_the_link():
    """The part of an all-reduce that does not use the link is what is left of its time after its bytes at the
    link's rate (the fit's cost per byte at the largest sizes), not the intercept of its size's regime: a 500 kB
    all-reduce in a flat regime keeps the link busy 5 ms of its 6, a 1 kB one almost none of it."""
    fit = _flat_floor_fit()
    assert played.link_ms(fit, 500_000) == pytest.approx(5.0)
    assert sim.off_link_ms(fit, 500_000) == pytest.approx(1.0)  # the regime's intercept would say all 6
    assert sim.off_link_ms(fit, 1_000) == pytest.approx(5.99)
    assert sim.off_link_ms(fit, 2_000_000) == pytest.approx(0.0)
    assert sim.off_link_ms(fit, 500_000, ms=3.5, share=0.5) == pytest.approx(1.0)  # a reduce-scatter: half the bytes
    assert played.link_ms(_Flat(), 500_000) is None  # not a fit: its own latency term
    assert sim.off_link_ms(_Flat(), 500_000) == pytest.approx(_Flat().allreduce_latency_ms(500_000))
    # In lockstep beside a large one, a 500 kB bucket takes its share of the link: the pair ends 5 ms later
    # than the large one alone (with the intercept as latency it would cost the link nothing).
    sizes = (4_000_000, 500_000)
    dur, lat = [fit.allreduce_ms(n) for n in sizes], [sim.off_link_ms(fit, n) for n in sizes]
    tl = sim.play_timeline([0.0, 0.0], dur, 0.0, lanes=2, latency_ms=lat, lockstep=True)
    assert max(tl.end) == pytest.approx(45.0)


def test_a_fits_flat_regime_past_the_links_rate_does_not_move_bytes_faster_than_the_link():
    """A fit whose flat small-size regime reaches past the size where its bytes alone take longer (flat 6 ms up to
    800 kB, the link 10 ms per MB) is played no faster than the link: a 700 kB all-reduce takes 7 ms, not 6, and
    eight of them back to back on two lanes keep the link busy 56 ms, where the fit as it stands would play them in
    48 (and credit a plan of small buckets for it)."""
    fit = cm.FittedModel({"reducer": [cm.Regime(800_000, 6000.0, math.inf), cm.Regime(math.inf, 0.0, 0.1)]},
                         "allreduce", 4)
    assert fit.allreduce_ms(700_000) == pytest.approx(6.0)
    assert sim.played_ms(fit, 700_000) == pytest.approx(7.0)
    assert sim.played_ms(fit, 1_000) == pytest.approx(6.0)  # above the link's time: the fit's
    assert sim.played_ms(fit, 700_000, ms=9.0) == pytest.approx(9.0)
    assert sim.played_ms(_Flat(), 700_000) == pytest.approx(_Flat().allreduce_ms(700_000))  # not a fit: no link rate
    n = [700_000] * 8

    def last(dur):
        return max(sim.play_timeline([0.0] * 8, dur, 0.0, lanes=2, latency_ms=[sim.off_link_ms(fit, x) for x in n],
                                     lockstep=True).end)

    assert last([fit.allreduce_ms(x) for x in n]) == pytest.approx(48.0)
    assert last([sim.played_ms(fit, x) for x in n]) == pytest.approx(56.0)


def test_the_calibration_plays_the_profiled_steps_small_buckets_on_the_link():
    """Replayed at their recorded launches, a profiled step's buckets in a flat regime share the link as the
    predictions play them: two 500 kB buckets beside each other after backward take 1 ms apart and 10 ms of link
    together, so a run that took 11 ms for them needs no scaling (with the regime's intercept as their latency the
    model would say 6 ms, and scale every collective by 11/6)."""
    recs = [{"bucket": i, "bytes": 500_000, "launch_ms": 1.0, "complete_ms": 12.0, "wait_start_ms": 0.5}
            for i in range(2)]
    ref = sim.ReferenceStep(1, 0.0, 1.0, 0.5, 1.0, exposed_ms=11.5, step_ms=14.0, records=recs)
    cal = sim.calibrate(ref, _flat_floor_fit(), lanes=2)
    assert cal.comm_scale == pytest.approx(1.0) and cal.timeline.end == pytest.approx([12.0, 12.0])


def test_a_split_embeddings_bucket_is_ready_when_the_profiled_step_made_its_projection_part(tmp_path):
    """The projection part is ready when the generator's backward has made it, which the profiled step records
    (`ReferenceStep.split_ready_ms`, the latest rank's), not at the start of backward; without that record, at the
    start of backward as the ready curve has it."""
    _write_run(tmp_path / "a", "bucketed", 0.05)
    run = load_run(tmp_path / "a")
    ref = sim.reference_step(run)
    curve = sim.ready_curve(run, ref)
    assert ref.projection_ready_ms is None and ref.split_ready_ms(curve) == curve.at(0)
    proj = {"bucket": 99, "class": "embedding", "part": "projection", "numel": 32000, "bytes": 128000,
            "launch_ms": 0.1, "complete_ms": 1.3, "wait_start_ms": 10.0}
    lookup = {"bucket": 100, "class": "embedding", "part": "lookup", "numel": 100, "bytes": 400, "ready_ms": 10.0,
              "launch_ms": 10.0, "complete_ms": 11.0, "wait_start_ms": 10.0}
    split = {"embedding": {"tied_split": True}}
    exposed = {}
    for at in (0.1, 9.5):
        ref.records = [{**proj, "ready_ms": at}, *[r for r in ref.records if r.get("part") is None], lookup]
        assert ref.split_ready_ms(curve) == at
        exposed[at] = sim.predict(run.cfg, ref, curve, _Flat(), sim.Calibration(), "bucketed", 0.05, run.vocab,
                                  classes=split).exposed_ms
    # Ready at 9.5 ms, the matrix's 1.128 ms all-reduce ends at 10.628, beside the lookup's rows from 10 ms
    assert exposed[0.1] == pytest.approx(1.0004) and exposed[9.5] > exposed[0.1] + 0.1


def test_also_topology_lists_the_pairs_another_fit_orders_the_other_way(tmp_path, capsys):
    """The same predictions under a second cost model of the machine: the best choice under it, and the pairs it
    orders oppositely. Many small overlapped buckets win on a link with little latency per collective; one
    all-reduce after backward wins where every collective costs a large fixed time."""
    _write_run(tmp_path / "a", "bucketed", 0.25)

    def fit(name: str, latency_us: float) -> str:  # 100 bytes per us
        rows = [{"path": "reducer", "size": 8 * 4 ** k, "time_us": latency_us + 8 * 4 ** k / 100.0}
                for k in range(12)]
        (tmp_path / name).write_text(json.dumps(rows))
        return f"fit:{tmp_path / name}"

    cheap, costly = fit("cheap.json", 5.0), fit("costly.json", 8000.0)
    # uncalibrated: the profiled step's own collectives would scale both fits to its measured completions
    argv = ["--run", str(tmp_path / "a"), "--topology", cheap, "--strategies", "flat,bucketed",
            "--bucket-sizes", "0.01", "--no-calibrate", "--json"]
    main([*argv, "--also-topology", cheap, costly])
    doc = json.loads(capsys.readouterr().out)
    steps = {r["label"]: r["step_ms"] for r in doc["rows"]}
    assert steps["bucketed@0.01M"] < steps["flat"]  # under the cheap fit
    same, other = doc["also_topologies"]
    assert same["order_changes"] == [] and same["best"] == "bucketed@0.01M"
    assert other["order_changes"] == [["bucketed@0.01M", "flat"]] and other["best"] == "flat"
    main(argv[:-1] + ["--also-topology", costly])
    text = capsys.readouterr().out
    assert f"under --also-topology {costly} (MODELED): best lossless choice flat" in text
    assert "(under --topology: bucketed@0.01M)" in text and "1 of 1 pairs" in text
    with pytest.raises(SystemExit) as e:
        main(["--paper", "--also-topology", costly])
    assert e.value.code == 2 and "--also-topology" in capsys.readouterr().err
