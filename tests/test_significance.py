"""dtrain.analysis.significance on small synthetic runs: the recorded smoke runs given a synthetic corpus (data.dir) and
translations of its validation split of known quality, scored with sacreBLEU's paired bootstrap test."""

import random
import shutil

import pytest

from dtrain.analysis import significance
from dtrain.analysis.runs import load_runs

from conftest import REPO

SMOKE = REPO / "tests" / "data" / "runs" / "smoke"
WORDS = ("a man woman dog child is are riding walking sitting on in the with red blue green street park beach "
         "water ball bike two three people playing running").split()
SENTENCES = 300


def sentence(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 12)))


def write_corpus(directory, seed=0):
    """The six Multi30k files with synthetic sentences, each target sentence twice in a row (so that two systems can
    be wrong on different sentences and still score the same); returns the validation references (German side)."""
    rng = random.Random(seed)
    directory.mkdir(parents=True)
    refs = {}
    for stem in ("train", "val", "test_2016_flickr"):
        lines = [s for s in (sentence(rng) for _ in range(SENTENCES // 2)) for _ in (0, 1)]
        (directory / f"{stem}.en").write_text("\n".join(sentence(rng) for _ in lines) + "\n")
        (directory / f"{stem}.de").write_text("\n".join(lines) + "\n")
        refs[stem] = lines
    return refs["val"]


def degrade(refs, share, seed):
    """The references with `share` of the sentences replaced by random ones: lower share, higher BLEU."""
    rng = random.Random(seed)
    return [sentence(rng) if rng.random() < share else r for r in refs]


def half_wrong(refs, first: bool, seed):
    """Of each pair of equal references, one translated by a random sentence: the first or the second of the pair.
    The two choices give the same corpus BLEU with different translations."""
    rng = random.Random(seed)
    out = list(refs)
    for i in range(0, len(refs), 2):
        out[i if first else i + 1] = sentence(rng)
    return out


def make_run(sweep, name, source, corpus, hyps, seed=None):
    run = sweep / name
    shutil.copytree(SMOKE / source, run)
    cfg = run / "config.yaml"
    text = cfg.read_text().replace("  dir: null\n", f"  dir: {corpus}\n", 1)
    if seed is not None:
        text = text.replace("seed: 1\n", f"seed: {seed}\n", 1)
    cfg.write_text(text)
    if hyps is not None:
        (run / "hyps.val.txt").write_text("\n".join(hyps) + "\n")
    return run


@pytest.fixture
def sweep(tmp_path):
    """ddp: half the sentences wrong; flat: a tenth wrong (clearly better); bucketed: ddp's translations exactly;
    per_class: as many sentences as ddp wrong in the same way, but other ones (as good)."""
    corpus = tmp_path / "corpus"
    refs = write_corpus(corpus)
    base = half_wrong(refs, True, seed=1)
    out = tmp_path / "sweep"
    make_run(out, "smoke-ddp", "smoke-ddp", corpus, base)
    make_run(out, "smoke-flat", "smoke-flat", corpus, degrade(refs, 0.1, seed=2))
    make_run(out, "smoke-bucketed", "smoke-bucketed-bucket_cap_mb=1", corpus, base)
    make_run(out, "smoke-per_class", "smoke-per_class-bucket_cap_mb=1", corpus, half_wrong(refs, False, seed=1))
    make_run(out, "smoke-noop", "smoke-noop", corpus, None)  # never scored: left out, not an error
    return out, refs


def rows(analysis):
    return {r["run"]: r for _, r in analysis.paired.iterrows()}


def test_better_is_significant_identical_and_equal_are_not(sweep):
    out, refs = sweep
    a = significance.analyse(load_runs([out]))
    assert a.split == "val" and a.baseline.run.path.name == "smoke-ddp"  # the ddp run by default
    r = rows(a)
    assert set(r) == {"smoke-ddp", "smoke-flat", "smoke-bucketed", "smoke-per_class"}
    assert r["smoke-ddp"]["significant"] is None and r["smoke-ddp"]["baseline"] == "smoke-ddp"
    better = r["smoke-flat"]
    assert better["delta"] > 10 and better["p_value"] < 0.01 and better["significant"]
    assert better["low"] < better["mean"] < better["high"] and better["low"] > r["smoke-ddp"]["high"]
    same = r["smoke-bucketed"]
    assert same["bleu"] == r["smoke-ddp"]["bleu"] and same["p_value"] == 1.0 and not same["significant"]
    equal = r["smoke-per_class"]
    assert equal["bleu"] == pytest.approx(r["smoke-ddp"]["bleu"]) and equal["p_value"] > 0.2
    assert not equal["significant"]
    # the intervals of the equal systems overlap
    assert equal["low"] < r["smoke-ddp"]["high"] and r["smoke-ddp"]["low"] < equal["high"]
    # the score is sacreBLEU's corpus BLEU of the file against the references
    hyps = (out / "smoke-flat" / "hyps.val.txt").read_text().splitlines()
    assert better["bleu"] == pytest.approx(significance.bleu_metric().corpus_score(hyps, [refs]).score)
    assert len(a.seeds) == 0 and "one seed" in a.caption() and "bs:1000" in a.signature


def test_the_bootstrap_seed_makes_it_reproducible(sweep):
    out, _ = sweep
    runs = load_runs([out])
    one, two = significance.analyse(runs, seed=3), significance.analyse(runs, seed=3)
    other = significance.analyse(runs, seed=4)
    assert one.paired.equals(two.paired)
    assert not one.paired["ci"].equals(other.paired["ci"])
    assert (one.paired["bleu"] == other.paired["bleu"]).all()  # the score itself is not resampled


def test_named_baseline(sweep):
    out, _ = sweep
    a = significance.analyse(load_runs([out]), baseline="smoke-flat")
    r = rows(a)
    assert r["smoke-flat"]["significant"] is None and r["smoke-ddp"]["delta"] < -10 and r["smoke-ddp"]["significant"]
    with pytest.raises(significance.UserError, match="--baseline nope: no such scored run"):
        significance.analyse(load_runs([out]), baseline="nope")


def test_seeds_pair_with_the_baseline_of_the_same_seed(tmp_path):
    corpus = tmp_path / "corpus"
    refs = write_corpus(corpus)
    out = tmp_path / "sweep"
    for seed in (1, 2, 3):
        base = degrade(refs, 0.5, seed=seed)
        make_run(out, f"smoke-ddp-seed={seed}", "smoke-ddp", corpus, base, seed)
        # seeds 1 and 2 clearly better; seed 3 the same translations as ddp's seed 3
        flat = degrade(refs, 0.1, seed=10 + seed) if seed < 3 else base
        make_run(out, f"smoke-flat-seed={seed}", "smoke-flat", corpus, flat, seed)
    a = significance.analyse(load_runs([out]))
    r = rows(a)
    for seed in (1, 2, 3):
        assert r[f"smoke-flat-seed={seed}"]["baseline"] == f"smoke-ddp-seed={seed}"
        assert r[f"smoke-ddp-seed={seed}"]["significant"] is None
    s = {row["configuration"]: row for _, row in a.seeds.iterrows()}
    assert set(s) == {"smoke-ddp", "smoke-flat"} and s["smoke-flat"]["seeds"] == "1,2,3"
    flat = [r[f"smoke-flat-seed={k}"]["bleu"] for k in (1, 2, 3)]
    assert s["smoke-flat"]["mean_bleu"] == pytest.approx(sum(flat) / 3)
    assert s["smoke-flat"]["min"] == min(flat) and s["smoke-flat"]["sd"] > 0
    assert s["smoke-flat"]["significant_seeds"] == "2 of 3"
    assert s["smoke-ddp"]["significant_seeds"] == ""


def test_cli_prints_the_table(sweep, capsys):
    out, _ = sweep
    assert significance.main([str(out), "--markdown", "--samples", "200"]) == 0
    text = capsys.readouterr().out
    assert "| run | seed | BLEU | 95% CI |" in text and "200 resamples" in text and "(baseline)" in text
    assert "smoke-noop" not in text.split("\n\n")[0]


def test_one_line_errors(sweep, tmp_path, capsys):
    out, _ = sweep
    bare = make_run(tmp_path / "other", "smoke-bare", "smoke-ddp", out.parent / "corpus", None)
    with pytest.raises(SystemExit) as e:
        significance.main([str(out / "smoke-ddp"), str(bare)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "smoke-bare: no hypotheses for split val" in err

    refs = write_corpus(tmp_path / "corpus2", seed=5)
    elsewhere = make_run(tmp_path / "other", "smoke-elsewhere", "smoke-ddp", tmp_path / "corpus2", refs)
    with pytest.raises(SystemExit) as e:
        significance.main([str(out / "smoke-ddp"), str(elsewhere)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "references" in err and "cannot be compared" in err

    short = make_run(tmp_path / "other", "smoke-short", "smoke-ddp", out.parent / "corpus", refs[:10])
    with pytest.raises(SystemExit) as e:
        significance.main([str(out / "smoke-ddp"), str(short)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "10 hypotheses for the 300 val references" in err

    for bad in (["--split", "train"], ["--seed", "0"]):
        with pytest.raises(SystemExit) as e:
            significance.main([str(out), *bad])
        assert e.value.code == 2 and capsys.readouterr().err.count("\n") == 1
