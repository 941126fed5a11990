"""dtrain.analysis.compare: statistics from hand-written run records, the table and files, CLI errors, one real run."""

import csv
import json

import pytest

from dtrain.analysis import compare

from conftest import REPO


def write_run(path, strategy, step_ms, buckets=((1000, "ffn"), (3000, "mixed")), lossless=True, communicates=True):
    path.mkdir(parents=True)
    (path / "run.json").write_text(json.dumps({"sync": {"strategy": strategy, "lossless": lossless,
                                                        "communicates": communicates}}))
    with open(path / "steps.jsonl", "w") as f, open(path / "buckets.jsonl", "w") as g:
        for i, ms in enumerate(step_ms, 1):
            f.write(json.dumps({"step": i, "step_ms": ms, "backward_ms": ms / 2, "comm_exposed_ms": ms / 10}) + "\n")
            for b, (nbytes, c) in enumerate(buckets):
                g.write(json.dumps({"step": i, "bucket": b, "class": c, "bytes": nbytes}) + "\n")
    return path


def test_summary_skips_warmup_and_pools_rounds(tmp_path):
    a = write_run(tmp_path / "a", "bucketed", [1000, 10, 20, 30, 40])
    b = write_run(tmp_path / "b", "bucketed", [1000, 50, 60, 70, 80])
    s = compare.summarize([a, b], "bucketed", warmup=1)
    assert s.steps == 8 and s.median_ms == 45 and s.p95_ms == pytest.approx(76.5)
    assert s.bytes_per_step == 4000 and s.collectives_per_step == 2 and s.exposed_ms == 4.5
    with pytest.raises(compare.UserError, match="no steps after the 5 warm-up steps"):
        compare.summarize([a], "x", warmup=5)


def test_table_ratios_and_files(tmp_path):
    rows = compare.with_ratios([
        compare.summarize([write_run(tmp_path / "ddp", "ddp", [100] * 4)], "ddp", 1),
        compare.summarize([write_run(tmp_path / "b", "bucketed", [90] * 4)], "bucketed", 1),
        compare.summarize([write_run(tmp_path / "n", "noop", [80] * 4, buckets=(), lossless=False,
                                     communicates=False)], "noop", 1),
        compare.summarize([write_run(tmp_path / "s1", "bucketed", [95] * 4)], "bucketed@1MB", 1, 1.0),
        compare.summarize([write_run(tmp_path / "s4", "bucketed", [85] * 4)], "bucketed@4MB", 1, 4.0),
    ])
    assert [r.ratio_to_ddp for r in rows] == [1.0, 0.9, 0.8, 0.95, 0.85]
    lines = compare.table(rows)
    assert lines[0].split()[:3] == ["strategy", "steps", "median"]
    assert "0.900" in lines[2] and "headroom" in lines[3] and "inside backward" in lines[1]
    compare.write_csv(rows[3:], tmp_path / "sweep.csv")
    got = list(csv.DictReader(open(tmp_path / "sweep.csv")))
    assert [(float(r["bucket_mb"]), float(r["median_ms"])) for r in got] == [(1.0, 95.0), (4.0, 85.0)]
    compare.plot_sweep(rows[3:], rows[:3], tmp_path / "sweep.png", "test")
    assert (tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("argv, msg", [
    (["--strategies", "ddp,nope"], "unknown strategy 'nope'"),
    (["--bucket-mb", "1,x"], "--bucket-mb '1,x'"),
    (["--steps", "3", "--warmup", "5"], "must exceed --warmup"),
    (["--set", "sync.strategy=nope"], "sync.strategy"),
    (["--strategies", "", "--bucket-mb", ""], "nothing to run"),
])
def test_cli_errors_are_one_line(argv, msg, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        compare.main(["--profile", str(REPO / "dtrain/profiles/smoke.yaml"), "--out", str(tmp_path / "o"), *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and msg in err, err


@pytest.mark.slow
def test_compare_runs_strategies_and_a_sweep(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    out = tmp_path / "cmp"
    assert compare.main(["--profile", "dtrain/profiles/smoke.yaml", "--steps", "3", "--warmup", "1", "--strategies", "ddp",
                         "--bucket-mb", "0.1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "ddp" in printed and "bucketed@0.1MB" in printed
    rows = list(csv.DictReader(open(out / "sweep.csv")))
    assert len(rows) == 1 and float(rows[0]["collectives_per_step"]) > 1 and rows[0]["ratio_to_ddp"]
    assert (out / "sweep.png").exists() and (out / "compare.csv").exists()
    # --reuse keeps finished runs: nothing runs again
    assert compare.main(["--profile", "dtrain/profiles/smoke.yaml", "--steps", "3", "--warmup", "1", "--strategies", "ddp",
                         "--out", str(out), "--reuse"]) == 0
