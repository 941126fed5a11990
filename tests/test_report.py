"""dtrain.analysis.report (its tables, `report_tables`, and sections, `report_sections`) from small recorded runs
(tests/data/runs/smoke: trimmed records of real 2-rank smoke runs and a loopback benchmark): the files, the series each
figure holds, the captions, and figures skipped when data is missing.
"""

import json
import shutil

import numpy as np
import pandas as pd
import pytest
from matplotlib.colors import to_rgba

from dtrain.analysis import plots
from dtrain.analysis.report import cli as report, sections as report_sections, tables as report_tables
from dtrain.collectives import costmodel as cm
from dtrain.analysis.runs import find_runs, load_run, load_runs

from conftest import REPO

RUNS = REPO / "tests" / "data" / "runs" / "smoke"
KEYS = ["step_vs_bucket", "busbw", "allreduce_size", "breakdown", "timeline", "pareto", "train_loss", "validation"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    sections = report.build([RUNS], out, topology="h100x8", warmup=3)
    return out, {s.key: s for s in sections}


def test_files_and_pages(built):
    out, sections = built
    assert list(sections) == KEYS
    for key, s in sections.items():
        assert s.figure is not None, s.note
        assert (out / f"{key}.png").read_bytes()[:4] == b"\x89PNG"
        assert (out / f"{key}.svg").read_text().lstrip().startswith("<?xml")
        assert len(pd.read_csv(out / f"{key}.csv")) == len(s.table)
    md, page = (out / "report.md").read_text(), (out / "report.html").read_text()
    for s in sections.values():
        assert s.title in md and f"]({s.key}.png)" in md and f'<img src="{s.key}.svg"' in page
    assert "skipped" not in md
    assert len(pd.read_csv(out / "summary.csv")) == len(load_runs([RUNS]))


def test_every_caption_gives_axes_units_and_machine(built):
    _, sections = built
    host = json.loads(next(RUNS.glob("*/run.json")).read_text())["host"]
    for key, s in sections.items():
        assert "x:" in s.caption and "y:" in s.caption, key
        assert any(u in s.caption for u in ("(ms", "(GB/s", "(MiB", "(nats")), key
        assert host in s.caption and "gloo" in s.caption, key  # the benchmark: by the sweep's runs beside it
    assert "MODELED" in sections["busbw"].caption and "bench.json" in sections["busbw"].caption


def test_step_time_vs_bucket_size(built):
    _, sections = built
    s = sections["step_vs_bucket"]
    ax = s.figure.axes[0]
    lines = {ln.get_label(): ln for ln in ax.get_lines() if not ln.get_label().startswith("_")}
    assert {"bucketed", "per_class", "ddp"} <= set(lines)
    for series in ("bucketed", "per_class"):
        rows = s.table[s.table["series"] == series].sort_values("bucket_cap_mb")
        assert list(lines[series].get_xdata()) == [0.05, 1.0]
        np.testing.assert_allclose(lines[series].get_ydata(), rows["median_ms"])
    assert list(lines["ddp"].get_xdata()) == [25.0]  # DDP's default cap
    assert "flat (no bucket cap)" in lines
    headroom = lines[f"noop ({plots.HEADROOM})"]
    assert headroom.get_linestyle() == ":" and s.table.loc[s.table["series"] == "noop", "headroom"].all()
    # every strategy its own colour, horizontal lines included
    colours = [to_rgba(ln.get_color()) for label, ln in lines.items() if not label.startswith("noop")]
    assert len(set(colours)) == len(colours)


def test_uncapped_strategies_get_distinct_colours():
    table = pd.DataFrame({"series": ["bucketed", "flat", "per_tensor", "noop"], "bucket_cap_mb": [1.0, np.nan, np.nan,
                                                                                                  np.nan],
                          "median_ms": [10.0, 12.0, 11.0, 9.0], "p95_ms": [11.0, 13.0, 12.0, 9.5],
                          "headroom": [False, False, False, True]})
    ax = plots.step_vs_bucket(table).axes[0]
    lines = {ln.get_label(): ln for ln in ax.get_lines() if not ln.get_label().startswith("_")}
    assert to_rgba(lines["flat (no bucket cap)"].get_color()) != to_rgba(lines["per_tensor (no bucket cap)"].get_color())


def test_bus_bandwidth_measured_beside_modeled(built):
    _, sections = built
    s = sections["busbw"]
    labels = {ln.get_label() for ln in s.figure.axes[0].get_lines()}
    assert {"measured: raw", "measured: reducer"} <= labels
    assert {f"modeled: h100x8 {p}" for p in ("LL", "LL128", "Simple")} <= labels
    t = s.table
    modeled = t[t["kind"] == "modeled"]
    # At the measured sizes, each protocol's curve is the cost model's fastest algorithm for that protocol.
    assert set(modeled["size"]) == set(t.loc[t["kind"] == "measured", "size"])
    model = cm.NcclModel(cm.topology("h100x8"))
    for _, r in modeled.iterrows():
        proto = r["curve"].split()[-1]
        best = min((c for c in model.choices(r["size"]) if c.proto == proto), key=lambda c: c.time_us)
        assert r["busbw"] == pytest.approx(best.busbw)


def test_allreduce_time_against_size_per_strategy_over_the_model_of_the_same_network(built):
    _, sections = built
    s = sections["allreduce_size"]
    t = s.table
    measured, modeled = t[t["kind"] == "measured"], t[t["kind"] == "modeled"]
    # every recorded bucket with both times, read here from the records themselves
    want = sorted((r.strategy, b["class"], b["bytes"], round(b["complete_ms"] - b["launch_ms"], 6))
                  for r in load_runs([RUNS]) for recs in r.buckets.values() for b in recs
                  if b.get("launch_ms") is not None and b.get("complete_ms") is not None)
    got = sorted(zip(measured["strategy"], measured["class"], measured["bytes"], measured["time_ms"].round(6)))
    assert got == want and {"bucketed", "per_class"} <= set(measured["strategy"])
    axes = {ax.get_title(): ax for ax in s.figure.axes}
    assert set(axes) == set(measured["strategy"])  # one panel per strategy with bucket timings
    assert "ddp" in s.caption  # ... and the ones without are named
    model = cm.load_model(f"fit:{RUNS / 'bench.json'}")  # the benchmark the sweep ran beside its runs
    for strategy, ax in axes.items():
        mine = measured[measured["strategy"] == strategy]
        for c in ax.collections:
            cls = c.get_gid().split(":")[2]
            pts = mine[mine["class"] == cls]
            assert tuple(c.get_facecolor()[0][:3]) == to_rgba(plots.CLASS_COLORS[cls])[:3]
            np.testing.assert_allclose(sorted(map(tuple, c.get_offsets())),
                                       sorted(zip(pts["bytes"], pts["time_ms"])))
        assert sum(len(c.get_offsets()) for c in ax.collections) == len(mine)
        line = next(ln for ln in ax.get_lines() if ln.get_gid() == f"modeled:{strategy}")
        np.testing.assert_allclose(line.get_ydata(), [model.allreduce_ms(x) for x in line.get_xdata()])
        assert min(line.get_xdata()) <= measured["bytes"].min() and max(line.get_xdata()) >= measured["bytes"].max()
    assert len(modeled) == len(axes) * len(set(modeled["bytes"]))
    assert "MODELED" in s.caption and "bench.json" in s.caption and "(ms" in s.caption


def test_allreduce_size_model_follows_the_topology(tmp_path):
    runs = [load_run(RUNS / "smoke-per_class-bucket_cap_mb=1")]
    preset = report_sections.section_allreduce_size(runs, [], "h100x8")  # no benchmark beside: the preset, said so
    assert "not the network these runs measured" in preset.caption
    m = preset.table[preset.table["kind"] == "modeled"]
    model = cm.NcclModel(cm.topology("h100x8"))
    np.testing.assert_allclose(m["time_ms"], [model.allreduce_ms(n) for n in m["bytes"]])
    fitted = report_sections.section_allreduce_size(runs, [], f"fit:{RUNS / 'bench.json'}")  # a fit given: that one
    assert "(--topology)" in fitted.caption
    bare = report_sections.section_allreduce_size(runs, [], None)
    assert (bare.table["kind"] == "measured").all() and "No modeled curve" in bare.caption
    assert not any(ln.get_gid() for ln in bare.figure.axes[0].get_lines())


def test_breakdown_stacks_the_phases_and_marks_headroom(built):
    _, sections = built
    s = sections["breakdown"]
    ax = s.figure.axes[0]
    phases = [c.get_label() for c in ax.containers]
    assert phases == list(plots.PHASE_NAMES.values())
    assert all(len(c) == len(s.table) == len(load_runs([RUNS])) for c in ax.containers)
    total = s.table[list(plots.PHASE_NAMES)].sum(axis=1)
    assert (total >= s.table["step_ms"] - 1e-6).all()  # "other" closes the gap to the mean step
    run = load_runs([RUNS])[0]
    row, steps = report_tables.breakdown_table([run], 3).iloc[0], run.steady_frame(3)
    assert row["forward_ms"] == pytest.approx(steps["forward_ms"].mean())  # means: the stack adds up to the step
    assert row["step_ms"] == pytest.approx(steps["step_ms"].mean())
    noop = list(s.table["label"]).index("noop")
    assert all(c[noop].get_hatch() == "//" for c in ax.containers)
    assert "headroom" in ax.get_xticklabels()[noop].get_text()


def test_timeline_colours_buckets_by_class(built):
    _, sections = built
    s = sections["timeline"]
    assert "per_class" in s.caption  # the per_class run is preferred: its buckets never mix classes
    ax = s.figure.axes[0]
    bars = {p.get_gid(): p for p in ax.patches if (p.get_gid() or "").startswith("bucket:")}
    assert len(bars) == len(s.table) > 3
    for _, r in s.table.iterrows():
        bar = bars[f"bucket:{r['bucket']}"]
        assert bar.get_facecolor() == to_rgba(plots.CLASS_COLORS[r["class"]])
        assert bar.get_x() == pytest.approx(r["launch_ms"])
        assert bar.get_width() == pytest.approx(r["complete_ms"] - r["launch_ms"])
    assert {"embedding", "projection", "ffn", "norm_bias"} <= set(s.table["class"])
    assert any(p.get_gid() == "backward" for p in ax.patches)


def test_pareto_leaves_out_the_baseline(built):
    _, sections = built
    t = sections["pareto"].table
    assert "noop" not in set(t["label"]) and len(t) == len(load_runs([RUNS])) - 1
    assert t["bleu"].notna().all() and t["to_target_s"].notna().all()  # default target: every run reaches it
    assert "noop" in set(sections["breakdown"].table["label"])  # timing figures keep it, as headroom


def test_pareto_front_is_marked(tmp_path):
    # The smoke runs are too short to translate (BLEU 0): give them distinct scores to see the front drawn.
    runs = tmp_path / "runs"
    shutil.copytree(RUNS, runs)
    for i, run in enumerate(sorted(p for p in runs.iterdir() if (p / "eval.jsonl").exists())):
        lines = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
        for e in lines:
            if e["kind"] == "bleu":
                e["bleu"] = float((7 * i) % 5 + i / 10)  # not monotone in the order of the runs
        (run / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    s = report_sections.section_pareto(load_runs([runs]), warmup=3, target=None)
    t = s.table
    for x, front in (("ms_per_ktok", "on_front_step"), ("to_target_s", "on_front_wall")):
        on = t[t[front]]
        for _, p in t.iterrows():  # on the front exactly when nothing is at least as fast and strictly better
            better = (t[x] <= p[x]) & (t["bleu"] > p["bleu"]) | (t[x] < p[x]) & (t["bleu"] >= p["bleu"])
            assert p[front] == (not better.any()), (x, p["label"])
        assert t.loc[t["bleu"].idxmax(), front] and t.loc[t[x].idxmin(), front]
        line = next(ln for ax in s.figure.axes for ln in ax.get_lines() if ln.get_gid() == f"front:{x}")
        np.testing.assert_allclose(line.get_xdata(), on.sort_values(x)[x])
    # one colour per configuration, each named in the figure's legend
    points = [c for c in s.figure.axes[0].collections if str(c.get_gid()).startswith("point:ms_per_ktok:")]
    assert len(points) == len(t) and len({tuple(c.get_facecolor()[0]) for c in points}) == len(t)
    assert set(t["label"]) <= {txt.get_text() for txt in s.figure.legends[0].get_texts()}
    run = next(r for r in load_runs([runs]) if r.communicates and r.bleu is not None)
    (q, _), m = report_tables.quality_table([run], 3, None), run.steady_frame(3)
    assert q["ms_per_ktok"].iloc[0] == pytest.approx((m["step_ms"] / m["tokens"] * 1000).median())
    assert q["tokens_per_step"].iloc[0] == pytest.approx(m["tokens"].mean())


def test_pareto_front_and_time_to_target_by_hand():
    x = pd.Series([1.0, 2.0, 3.0, 2.0])
    y = pd.Series([10.0, 12.0, 11.0, 9.0])
    assert list(report_tables.pareto_front(x, y)) == [True, True, False, False]
    run = load_run(next(p for p in RUNS.iterdir() if (p / "eval.jsonl").exists()))
    first = run.val.iloc[0]
    want = run.step_frame.loc[run.step_frame["step"] <= first["step"], "step_ms"].sum() / 1000
    assert report_tables.time_to_target(run, first["val_nll"]) == pytest.approx(want)
    assert np.isnan(report_tables.time_to_target(run, 0.0))


def test_training_loss_and_validation_curves_hold_one_line_per_run(built):
    out, sections = built
    runs = load_runs([RUNS])
    report._unique_labels(runs)  # the labels the report gives them
    runs = [r for r in runs if r.communicates]  # the baseline is never a quality result
    assert len(runs) == len(load_runs([RUNS])) - 1
    loss, val = sections["train_loss"], sections["validation"]
    lines = {ln.get_gid(): ln for ln in loss.figure.axes[0].get_lines()}
    assert set(lines) == {f"loss:{r.label}" for r in runs}
    for r in runs:  # every step's loss as recorded, in step order: nothing smoothed
        line = lines[f"loss:{r.label}"]
        assert list(line.get_xdata()) == [s["step"] for s in r.steps]
        np.testing.assert_array_equal(line.get_ydata(), [s["loss"] for s in r.steps])
        assert line.get_label() == r.label
    assert len(loss.figure.axes) == 1 and "nothing smoothed" in loss.caption and "rank 0" in loss.caption
    # Validation: one line per run through its validations; BLEU (one final score per run here) is not drawn.
    assert len(val.figure.axes) == 1 and "BLEU is not drawn" in val.caption
    lines = {ln.get_gid(): ln for ln in val.figure.axes[0].get_lines()}
    assert set(lines) == {f"val_nll:{r.label}" for r in runs}
    for r in runs:
        np.testing.assert_array_equal(lines[f"val_nll:{r.label}"].get_xdata(), r.val["step"])
        np.testing.assert_array_equal(lines[f"val_nll:{r.label}"].get_ydata(), r.val["val_nll"])
    # a run drawn alike in both figures; each run its own colour and dash pattern
    styles = {ln.get_label(): (to_rgba(ln.get_color()), str(ln.get_linestyle())) for ln in lines.values()}
    assert styles == {ln.get_label(): (to_rgba(ln.get_color()), str(ln.get_linestyle()))
                      for ln in loss.figure.axes[0].get_lines()}
    assert len(set(styles.values())) == len(runs)
    # written and linked: the SVG holds one line per run (matplotlib writes an artist's gid as its group's id)
    md, page = (out / "report.md").read_text(), (out / "report.html").read_text()
    for key, prefix in (("train_loss", "loss"), ("validation", "val_nll")):
        assert f"]({key}.svg)" in md and f"({key}.csv)" in md and f'<img src="{key}.svg"' in page
        svg = (out / f"{key}.svg").read_text()
        assert svg.count(f'<g id="{prefix}:') == len(runs)
        assert all(f'<g id="{prefix}:{r.label}">' in svg for r in runs)
    assert len(pd.read_csv(out / "train_loss.csv")) == sum(len(r.steps) for r in runs)
    assert set(pd.read_csv(out / "validation.csv")["run"]) == {r.label for r in runs}


def test_bleu_scored_at_several_steps_gets_a_panel(tmp_path):
    runs = tmp_path / "runs"
    for name in ("smoke-ddp", "smoke-flat", "smoke-noop"):
        shutil.copytree(RUNS / name, runs / name)
    with (runs / "smoke-ddp" / "eval.jsonl").open("a") as f:  # two more scores: at step 6, and one with no step
        bleu = next(e for e in map(json.loads, (RUNS / "smoke-ddp" / "eval.jsonl").read_text().splitlines())
                    if e["kind"] == "bleu")
        f.write(json.dumps({**bleu, "step": 6, "bleu": 1.5}) + "\n")
        f.write(json.dumps({k: v for k, v in bleu.items() if k != "step"} | {"bleu": 9.0}) + "\n")
    loaded = load_runs([runs])
    report._unique_labels(loaded)
    s = report_sections.sections_curves(loaded)[1]
    assert s.title == "Validation loss and BLEU against step" and "split val" in s.caption
    val_ax, bleu_ax = s.figure.axes
    lines = {ln.get_gid(): ln for ln in bleu_ax.get_lines()}
    assert set(lines) == {"bleu:ddp", "bleu:flat"}  # flat: its one final score, a single point
    assert list(lines["bleu:ddp"].get_xdata()) == [6, 12]  # step order; the score with no step left out
    assert list(lines["bleu:ddp"].get_ydata()) == [1.5, bleu["bleu"]]
    assert {ln.get_gid() for ln in val_ax.get_lines()} == {"val_nll:ddp", "val_nll:flat"}
    assert report_tables.bleu_points(s.table) == 2


def test_curves_leave_out_non_finite_and_missing_losses(tmp_path):
    run = tmp_path / "runs" / "smoke-ddp"
    shutil.copytree(RUNS / "smoke-ddp", run)
    steps = [json.loads(line) for line in (run / "steps.jsonl").read_text().splitlines()]
    steps[3]["loss"] = float("nan")  # json writes NaN: a non-finite loss is a gap
    del steps[4]["loss"]  # a record without one is left out
    (run / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    t = report_tables.train_loss_table(load_runs([run]))
    assert list(t["step"]) == [s["step"] for i, s in enumerate(steps) if i != 4]
    assert t["loss"].isna().sum() == 1 and np.isnan(t.loc[t["step"] == steps[3]["step"], "loss"]).all()


def test_missing_data_skips_figures_with_a_note(tmp_path):
    run = tmp_path / "runs" / "bare"
    run.mkdir(parents=True)
    src = RUNS / "smoke-noop"
    shutil.copy(src / "run.json", run / "run.json")
    shutil.copy(src / "steps.jsonl", run / "steps.jsonl")  # no buckets, no evals, no config
    sections = {s.key: s for s in report.build([tmp_path / "runs"], tmp_path / "out", topology=None)}
    # the baseline's losses are no result, and it has no validation records: no curves
    for key in ("busbw", "allreduce_size", "timeline", "pareto", "train_loss", "validation"):
        assert sections[key].figure is None and sections[key].note.startswith("skipped: "), key
    assert sections["breakdown"].figure is not None and sections["step_vs_bucket"].figure is not None
    md = (tmp_path / "out" / "report.md").read_text()
    assert md.count("*skipped: ") == 6 and not (tmp_path / "out" / "timeline.png").exists()
    assert not (tmp_path / "out" / "train_loss.svg").exists()


def test_cli(tmp_path, capsys):
    one = RUNS / "smoke-per_class-bucket_cap_mb=0.05"
    assert report.main([str(one), "--out", str(tmp_path / "r"), "--topology", "none", "--warmup", "2"]) == 0
    assert "report: " in capsys.readouterr().out and (tmp_path / "r" / "report.html").exists()
    with pytest.raises(SystemExit) as e:
        report.main([str(tmp_path / "nothing"), "--out", str(tmp_path / "x")])
    assert e.value.code == 2 and "no run directories" in capsys.readouterr().err


def test_labels_drop_a_hyphenated_profile_name(tmp_path):
    for name in ("smoke-ddp", "smoke-bucketed-bucket_cap_mb=1"):
        dst = tmp_path / name.replace("smoke-", "multi30k-cpu-")
        shutil.copytree(RUNS / name, dst)
        cfg = dst / "config.yaml"
        cfg.write_text(cfg.read_text().replace("name: smoke\n", "name: multi30k-cpu\n", 1))
    runs = load_runs([tmp_path])
    report._unique_labels(runs)
    assert sorted(r.label for r in runs) == ["bucketed-bucket_cap_mb=1", "ddp"]


def test_runs_of_a_sweep_load_in_natural_order(tmp_path):
    for name in ("s-bucketed-bucket_cap_mb=32", "s-bucketed-bucket_cap_mb=8", "s-bucketed-bucket_cap_mb=0.5",
                 "s-flat"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "run.json").write_text("{}")
    assert [p.name for p in find_runs([tmp_path])] == ["s-bucketed-bucket_cap_mb=0.5", "s-bucketed-bucket_cap_mb=8",
                                                      "s-bucketed-bucket_cap_mb=32", "s-flat"]


def test_an_output_folder_in_the_way_is_named_before_any_work(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(SystemExit) as e:
        report.main([str(tmp_path), "--out", str(tmp_path / "afile")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--out" in err and "a file is in the way" in err and err.count("\n") == 1


@pytest.mark.slow
def test_runs_with_translations_get_a_bleu_significance_section(tmp_path, capsys):
    from test_significance import degrade, half_wrong, make_run, write_corpus

    refs = write_corpus(tmp_path / "corpus")
    sweep = tmp_path / "sweep"
    make_run(sweep, "smoke-ddp", "smoke-ddp", tmp_path / "corpus", half_wrong(refs, True, seed=1))
    make_run(sweep, "smoke-flat", "smoke-flat", tmp_path / "corpus", degrade(refs, 0.1, seed=2))
    make_run(sweep, "smoke-bucketed", "smoke-bucketed-bucket_cap_mb=1", tmp_path / "corpus",
             half_wrong(refs, True, seed=1))
    make_run(sweep, "smoke-per_class", "smoke-per_class-bucket_cap_mb=1", tmp_path / "corpus", None)
    out = tmp_path / "out"
    assert report.main([str(sweep), "--out", str(out), "--topology", "none", "--baseline", "smoke-bucketed"]) == 0
    assert "bleu_significance written" in " ".join(capsys.readouterr().out.split())
    table = pd.read_csv(out / "bleu_significance.csv").set_index("run")
    assert list(table.index) == ["bucketed", "ddp", "flat"]  # per_class kept no translations: left out
    assert table.loc["flat", "significant"] and not table.loc["ddp", "significant"]
    assert table.loc["ddp", "p_value"] == 1.0 and table.loc["flat", "baseline"] == "bucketed"
    md, page = (out / "report.md").read_text(), (out / "report.html").read_text()
    section = md.split("## BLEU with 95% confidence intervals, paired against a baseline")[1]
    assert "| run | seed | BLEU | 95% CI | baseline | Δ BLEU | p | significant |" in section
    assert "| flat | 1 |" in section and "| yes |" in section and "(baseline)" in section
    assert "split val (300 sentences" in section and "Left out (no hyps.val.txt): per_class" in section
    assert "95% CI" in page and "bleu_significance.csv" in page

    # translations scored against other references: the section says why it is missing, the rest is written
    other = write_corpus(tmp_path / "corpus2", seed=5)
    make_run(sweep, "smoke-elsewhere", "smoke-ddp", tmp_path / "corpus2", other)
    sections = {s.key: s for s in report.build([sweep], tmp_path / "out2", topology=None)}
    s = sections["bleu_significance"]
    assert s.figure is None and s.display is None and "cannot be compared" in s.note
    assert "*skipped: " in (tmp_path / "out2" / "report.md").read_text() and sections["pareto"].figure is not None


def _simulation(path, world, rows):
    path.write_text(json.dumps({"modeled": True, "world": world, "notes": [], "rows": [
        {"label": label, "strategy": label.split("@")[0], "step_ms": modeled, "exposed_ms": exposed,
         "measured_step_ms": measured,
         "measured_exposed_ms": exposed + 5.0, "run": f"2 runs: {label}"} for label, modeled, measured, exposed in rows]
        + [{"label": "per_tensor", "step_ms": 1.0, "exposed_ms": 0.0, "measured_step_ms": None}]}))
    return path


def test_the_scaling_section_sets_measured_beside_modeled_per_shape(tmp_path, capsys):
    """--scaling NxR=FILE per shape (the simulator's JSON): one row per shape and measured configuration, shapes in
    order of ranks then nodes, each configuration a measured and a MODELED line in both panels; a bad spec, a
    missing file or a simulation of another world is a one-line error before any work."""
    s41 = _simulation(tmp_path / "s41.json", 4, [("ddp@2M", 900.0, 1000.0, 0.0)])
    s21 = _simulation(tmp_path / "s21.json", 2, [("ddp@2M", 480.0, 500.0, 0.0), ("noop", 300.0, 300.0, 0.0)])
    s22 = _simulation(tmp_path / "s22.json", 4, [("ddp@2M", 1000.0, 900.0, 0.0)])
    specs = [f"4x1={s41}", f"2x1={s21}", f"2x2={s22}"]
    from dtrain.analysis.report import scaling as report_scaling
    t = report_scaling.scaling_table(specs)
    assert list(t["shape"]) == ["2x1", "2x1", "2x2", "4x1"] and list(t["ranks"]) == [2, 2, 4, 4]
    assert t.loc[t["shape"] == "4x1", "error_pct"].item() == pytest.approx(-10.0)
    # DDP records no exposed time (it waits inside backward): not set beside the model's; noop's is
    assert t.loc[t["configuration"] == "ddp@2M", "measured_exposed_ms"].isna().all()
    assert t.loc[t["configuration"] == "noop", "measured_exposed_ms"].item() == pytest.approx(5.0)
    s = report_scaling.section_scaling(specs)
    gids = {line.get_gid() for ax in s.figure.axes for line in ax.get_lines()}
    assert {"measured:ddp@2M", "modeled:ddp@2M", "measured:noop", "modeled:noop"} <= gids
    assert "MODELED" in s.caption and "max 11.1% (ddp@2M at 2x2)" in s.caption
    assert report.main([str(RUNS), "--out", str(tmp_path / "r"), "--topology", "none", "--warmup", "2",
                        *(a for spec in specs for a in ("--scaling", spec))]) == 0
    assert (tmp_path / "r" / "scaling.csv").is_file() and "Scaling with the job's shape" in (
        tmp_path / "r" / "report.md").read_text()
    capsys.readouterr()
    for bad, msg in (("2by2=x.json", "NODESxRANKS=FILE"), (f"2x2={tmp_path / 'none.json'}", "no such file"),
                     (f"2x2={tmp_path / 's21.json'}", None)):
        with pytest.raises(SystemExit) as e:
            report.main([str(RUNS), "--out", str(tmp_path / "r2"), "--topology", "none", "--scaling", bad])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and (msg or "a simulation of 2 ranks, not 4") in err
