"""dtrain.analysis.report on a run that tuned its own communication (`sync.strategy: auto`): a recorded smoke run given a
tuning.csv written here by hand (top four candidates measured, the rest pruned by the prediction), its table and
figure, and the one-line errors for a tuning.csv that cannot be read.
"""

import csv
import json
import shutil

import numpy as np
import pandas as pd
import pytest
from matplotlib.colors import to_rgba

from dtrain.analysis import plots
from dtrain.analysis.report import cli as report, tuning as report_tuning
from dtrain.analysis.runs import load_run
from dtrain.common.errors import UserError

from conftest import REPO

RUNS = REPO / "tests" / "data" / "runs" / "smoke"
HEADER = ["candidate", "sync", "lossless", "predicted_ms", "predicted_rank", "measured_ms", "diff_ms", "diff_low",
          "diff_high", "rounds", "steps", "status", "reason"]
ROWS = [  # in the order the tuner wrote them: by predicted rank
    ["bucketed-0.5-split", "strategy=bucketed; bucket_cap_mb=0.5; classes.embedding.tied_split=true", "true",
     "301.5", "1", "298.2", "", "", "", "6", "36", "winner", "faster than every other measured candidate at 95%"],
    ["ddp-25", "strategy=ddp; bucket_cap_mb=25", "true", "318", "2", "305.9", "4.1", "-1.2", "9.8", "6", "36",
     "kept: budget", "not separable from the leader at 95% when the budget ran out: +4.1 ms [-1.2, 9.8]"],
    ["per_class-1", "strategy=per_class; bucket_cap_mb=1", "true", "322.4", "3", "331", "31", "12", "50", "3", "18",
     "dropped: measured", "slower than the leader at 95%: +31 ms [12, 50]"],
    ["bucketed-4", "strategy=bucketed; bucket_cap_mb=4", "true", "325", "4", "329.5", "27.5", "20.1", "35.2", "2",
     "12", "dropped: measured", "slower than the leader at 95%: +27.5 ms [20.1, 35.2]"],
    ["flat", "strategy=flat", "true", "410.3", "5", "", "", "", "", "0", "0", "dropped: predicted",
     "predicted 410 ms, rank 5 of 7; only the top 4 are measured"],
    ["sharded-2", "strategy=sharded; bucket_cap_mb=2", "true", "812", "6", "", "", "", "", "0", "0",
     "dropped: predicted", "predicted 812 ms, rank 6 of 7; only the top 4 are measured"],
    ["powersgd-4", "strategy=powersgd; powersgd_rank=4", "false", "950", "7", "", "", "", "", "0", "0",
     "dropped: predicted", "predicted 950 ms, rank 7 of 7; only the top 4 are measured"],
]
SUMMARY = {"winner": "bucketed-0.5-split", "steps_spent": 138, "rounds": 6, "budget_steps": 150}


def write_csv(path, rows, header=HEADER):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)


def make_sweep(root, rows=ROWS, summary=SUMMARY):
    """A sweep folder: one tuned run (a copied smoke run with tuning.csv and run.json's summary) and one plain run."""
    tuned = root / "smoke-auto"
    shutil.copytree(RUNS / "smoke-bucketed-bucket_cap_mb=1", tuned)
    shutil.copytree(RUNS / "smoke-ddp", root / "smoke-ddp")
    if rows is not None:
        write_csv(tuned / "tuning.csv", rows)
    header = json.loads((tuned / "run.json").read_text())
    (tuned / "run.json").write_text(json.dumps(header | {"tuning": summary}))
    return tuned


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    make_sweep(root)
    out = root / "report"
    sections = {s.key: s for s in report.build([root], out, topology=None, warmup=3)}
    return out, sections


def expected_order():
    """Measured candidates by measured median, then the unmeasured by prediction, computed from ROWS."""
    measured = sorted((r for r in ROWS if r[5]), key=lambda r: float(r[5]))
    return [r[0] for r in measured] + [r[0] for r in sorted((r for r in ROWS if not r[5]), key=lambda r: float(r[3]))]


def test_a_tuned_run_gets_a_figure_and_a_table_the_others_none(built):
    out, sections = built
    tuning = [k for k in sections if k.startswith("tuning_")]
    assert tuning == ["tuning_auto", "tuning_auto_candidates"]  # the ddp run tuned nothing: no section
    fig, table = sections["tuning_auto"], sections["tuning_auto_candidates"]
    assert fig.figure is not None and table.display is not None
    for ext in ("png", "svg"):
        assert (out / f"tuning_auto.{ext}").stat().st_size > 0
    assert (out / "tuning_auto.png").read_bytes()[:4] == b"\x89PNG"
    assert not (out / "tuning_auto_candidates.png").exists()
    md, page = (out / "report.md").read_text(), (out / "report.html").read_text()
    assert fig.title in md and "](tuning_auto.png)" in md and '<img src="tuning_auto.svg"' in page
    assert table.title in md and "tuning_auto_candidates.csv" in page


def test_the_table_holds_every_candidate_as_written(built):
    out, sections = built
    read = pd.read_csv(out / "tuning_auto_candidates.csv", keep_default_na=False)
    assert list(read.columns) == HEADER
    by_name = read.set_index("candidate")
    for row in ROWS:
        got = by_name.loc[row[0]]
        assert got["sync"] == row[1] and got["status"] == row[11] and got["reason"] == row[12]
        assert str(got["lossless"]) == ("True" if row[2] == "true" else "False")
        assert float(got["predicted_ms"]) == float(row[3]) and int(got["rounds"]) == int(row[9])
        assert (got["measured_ms"] == "") == (row[5] == "")

    shown = sections["tuning_auto_candidates"].display
    assert list(shown["candidate"]) == expected_order()
    assert "predicted ms (MODELED)" in shown.columns and "measured ms" in shown.columns
    rows = shown.set_index("candidate")
    assert rows.loc["bucketed-0.5-split", "Δ vs winner ms [95%]"] == "(winner)"
    assert rows.loc["per_class-1", "Δ vs winner ms [95%]"] == "+31 [+12, +50]"
    assert rows.loc["ddp-25", "Δ vs winner ms [95%]"] == "+4.1 [-1.2, +9.8]"
    assert rows.loc["sharded-2", "Δ vs winner ms [95%]"] == "" and rows.loc["sharded-2", "measured ms"] == ""
    assert rows.loc["sharded-2", "predicted ms (MODELED)"] == "812"
    assert rows.loc["powersgd-4", "lossless"] == "no" and rows.loc["flat", "lossless"] == "yes"

    md = (out / "report.md").read_text()
    section = md.split(sections["tuning_auto_candidates"].title)[1]
    assert "| candidate | sync | lossless | predicted ms (MODELED) |" in section
    assert "| per_class-1 | strategy=per_class; bucket_cap_mb=1 | yes | 322 | 3 | 331 | +31 [+12, +50] | 3 | 18 |" \
        in section


def test_captions_say_what_is_modeled_and_what_measured(built):
    _, sections = built
    host = json.loads((RUNS / "smoke-ddp" / "run.json").read_text())["host"]
    for s in (sections["tuning_auto"], sections["tuning_auto_candidates"]):
        assert "MODELED" in s.caption and "measured" in s.caption and host in s.caption
        assert "138 steps of its budget of 150 in 6 measured rounds" in s.caption
    fig = sections["tuning_auto"].caption
    assert "x:" in fig and "y:" in fig and "(ms" in fig and "winner bucketed-0.5-split" in fig
    assert "3 candidate(s) pruned by the prediction" in fig


def test_the_figure_draws_predictions_medians_and_paired_intervals(built):
    _, sections = built
    s = sections["tuning_auto"]
    t, ax = s.table, s.figure.axes[0]
    order = expected_order()
    assert list(t["candidate"]) == order
    rows = {r[0]: r for r in ROWS}
    art = {a.get_gid(): a for a in [*ax.collections, *ax.patches, *ax.get_lines()] if a.get_gid()}
    at = plots.TUNING_ROW
    # predictions: every candidate, in its row (row 0 on top)
    np.testing.assert_allclose(art["predicted"].get_offsets(),
                               [(float(rows[c][3]), i + at["predicted"]) for i, c in enumerate(order)])
    measured = [(float(rows[c][5]), i + at["measured"]) for i, c in enumerate(order) if rows[c][5]]
    np.testing.assert_allclose(art["measured"].get_offsets(), measured)
    # the paired interval sits around the winner's median plus the difference, not the candidate's own median
    winner = float(rows["bucketed-0.5-split"][5])
    want = [[(winner + float(rows[c][7]), i + at["paired"]), (winner + float(rows[c][8]), i + at["paired"])]
            for i, c in enumerate(order) if rows[c][6]]
    np.testing.assert_allclose(np.array(art["paired"].get_segments()), want)
    np.testing.assert_allclose(art["paired_median"].get_offsets(),
                               [(winner + float(rows[c][6]), i + at["paired"]) for i, c in enumerate(order)
                                if rows[c][6]])
    assert art["reference_ms"].get_xdata()[0] == winner and art["reference"].get_label() == "winner"
    band = art["reference"].get_path().transformed(art["reference"].get_patch_transform()).vertices[:, 1]
    assert band.min() < order.index("bucketed-0.5-split") < band.max()
    labels = {lab.get_text(): lab for lab in ax.get_yticklabels()}
    assert labels["bucketed-0.5-split"].get_fontweight() == "bold"
    for c in order:  # pruned by the prediction: grey names, prediction only
        grey = rows[c][11] == "dropped: predicted"
        assert (to_rgba(labels[c].get_color()) == to_rgba("tab:gray")) == grey, c
    assert ax.get_ylim()[0] > ax.get_ylim()[1]  # the first row on top


def errors_of(tmp_path, capsys, rows, header=HEADER, summary=SUMMARY):
    """Run the report's command line on a sweep whose tuned run has this tuning.csv: (exit code, stderr)."""
    root = tmp_path / "sweep"
    tuned = make_sweep(root, rows=None, summary=summary)
    write_csv(tuned / "tuning.csv", rows, header)
    with pytest.raises(SystemExit) as e:
        report.main([str(root), "--out", str(tmp_path / "out"), "--topology", "none"])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "out" / "report.md").exists()  # stopped before writing anything
    return e.value.code, err


def changed(column, value, row=2):
    rows = [list(r) for r in ROWS]
    rows[row][HEADER.index(column)] = value
    return rows


@pytest.mark.parametrize("rows, header, where", [
    (changed("predicted_ms", "fast"), HEADER, "line 4, column predicted_ms: 'fast' is not a number"),
    (changed("measured_ms", "nan"), HEADER, "line 4, column measured_ms"),
    (changed("lossless", "maybe"), HEADER, "line 4, column lossless"),
    (changed("status", "dropped"), HEADER, "line 4, column status: 'dropped' is not one of"),
    (changed("rounds", "-1"), HEADER, "line 4, column rounds"),
    (changed("predicted_rank", "0"), HEADER, "line 4, column predicted_rank"),
    (changed("sync", "strategy bucketed"), HEADER, "line 4, column sync: 'strategy bucketed' is not key=value"),
    (changed("diff_low", ""), HEADER, "line 4, column diff_low"),
    (changed("diff_low", "60"), HEADER, "line 4, column diff_low: 60 is above diff_high 50"),
    (changed("status", "winner"), HEADER, "column status: 2 rows are the winner (bucketed-0.5-split, per_class-1)"),
    (changed("predicted_rank", "1.5"), HEADER, "line 4, column predicted_rank: '1.5' is not a whole number"),
    (changed("candidate", "ddp-25"), HEADER, "column candidate: ddp-25 listed more than once"),
    ([r[:-3] + r[-2:] for r in ROWS], [h for h in HEADER if h != "steps"], "no column steps"),
    ([ROWS[0], ROWS[1][:-1]], HEADER, "line 3, column reason: no cell"),
    ([ROWS[0], ROWS[1] + ["x"]], HEADER, "line 3: 1 cell(s) beyond the header's 13 columns"),
])
def test_a_malformed_tuning_csv_is_one_line_naming_the_file_and_column(tmp_path, capsys, rows, header, where):
    code, err = errors_of(tmp_path, capsys, rows, header)
    assert code == 2 and "smoke-auto/tuning.csv" in err and where in err, err


def test_run_json_naming_another_winner_is_an_error(tmp_path, capsys):
    code, err = errors_of(tmp_path, capsys, ROWS, summary=SUMMARY | {"winner": "ddp-25"})
    assert code == 2 and "run.json: tuning.winner is 'ddp-25'" in err and "tuning.csv" in err


def test_an_empty_tuning_csv_is_an_error(tmp_path):
    path = tmp_path / "tuning.csv"
    path.write_text("")
    with pytest.raises(UserError, match="tuning.csv: empty, no header row"):
        report_tuning.read_tuning(path)


def test_a_tuned_run_without_tuning_csv_gets_a_note(tmp_path):
    make_sweep(tmp_path / "sweep", rows=None)
    sections = {s.key: s for s in report.build([tmp_path / "sweep"], tmp_path / "out", topology=None)}
    s = sections["tuning_auto"]
    assert s.figure is None and s.note.startswith("skipped: no ") and "tuning.csv" in s.note
    assert "tuning_auto_candidates" not in sections
    assert f"*{s.note}*" in (tmp_path / "out" / "report.md").read_text()
    # a header without rows: a note too, not an error
    write_csv(tmp_path / "sweep" / "smoke-auto" / "tuning.csv", [])
    s = report_tuning.sections_of(load_run(tmp_path / "sweep" / "smoke-auto", strict=False))
    assert len(s) == 1 and "lists no candidate" in s[0].note


def test_a_search_cut_short_shows_its_leader_and_what_was_racing(tmp_path):
    # As the tuner leaves the file after a round when the job stops mid-search: no winner, the candidates still
    # racing with an empty status and their differences against that round's leader; one without a prediction.
    rows = [list(r) for r in ROWS]
    rows[0][11:] = ["", ""]  # the leader: least measured median among those racing
    rows[1][11:] = ["", ""]
    rows[3][11] = "dropped: measured"  # against the leader of the round it was dropped in: not drawn
    rows[6][3:5] = ["", ""]  # no prediction made
    tuned = make_sweep(tmp_path / "sweep", rows=rows, summary=None)
    header = json.loads((tuned / "run.json").read_text())
    (tuned / "run.json").write_text(json.dumps({k: v for k, v in header.items() if k != "tuning"}))
    sections = {s.key: s for s in report.build([tmp_path / "sweep"], tmp_path / "out", topology=None)}
    fig, table = sections["tuning_auto"], sections["tuning_auto_candidates"]
    assert "search cut short: no winner" in fig.caption and "bucketed-0.5-split" in fig.caption
    t = fig.table
    assert list(t.loc[t["reference"], "candidate"]) == ["bucketed-0.5-split"]
    drawn = t.dropna(subset=["paired_ms"])
    assert list(drawn["candidate"]) == ["ddp-25"]  # racing; the dropped ones' differences are in the table only
    assert drawn["paired_ms"].iloc[0] == pytest.approx(298.2 + 4.1)
    shown = table.display.set_index("candidate")
    assert shown.loc["bucketed-0.5-split", "Δ vs leader ms [95%]"] == "(leader)"
    assert shown.loc["per_class-1", "Δ vs leader ms [95%]"] == "+31 [+12, +50]"
    assert shown.loc["ddp-25", "status"] == "racing (search cut short)"
    assert shown.loc["powersgd-4", "predicted ms (MODELED)"] == ""
    assert shown.loc["powersgd-4", "predicted rank (MODELED)"] == ""
    ax = fig.figure.axes[0]
    predicted = next(c for c in ax.collections if c.get_gid() == "predicted")
    assert len(predicted.get_offsets()) == len(ROWS) - 1  # none drawn where none was made
    assert next(p for p in ax.patches if p.get_gid() == "reference").get_label() == "leader"
    assert (tmp_path / "out" / "tuning_auto.png").is_file()
