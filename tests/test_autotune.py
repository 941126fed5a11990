"""`sync.strategy: auto` (dtrain.engine.autotune): candidates, predictions, the paired dropping rule, and a 2-rank job that
tunes itself, equals an untuned run of its winner and resumes without searching again."""

import json

import pytest
import torch

from dtrain.collectives.costmodel.fit import FittedModel, Regime
from dtrain.common.errors import UserError
from dtrain.common.rundir import TUNING_COLUMNS
from conftest import NO_EVAL, REPO, checkpoint_diff, records, torchrun, train_ranks
from dtrain.collectives.auto import predict
from dtrain.collectives.auto.race import Entrant
from dtrain.collectives.auto.space import DEFAULT_SPACE, NCCL_SPACE
from dtrain.engine import autotune
from dtrain.engine import config as config_mod
from dtrain.engine.model import Transformer

SMOKE = str(REPO / "dtrain" / "profiles" / "smoke.yaml")


def auto_cfg(*overrides):
    return config_mod.load(SMOKE, ["sync.strategy=auto", *overrides])


def test_the_default_space_builds_and_only_lossless_candidates_are_searched_by_default(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)  # one rank, one node: no hierarchical plan
    flat = [n for n, k in DEFAULT_SPACE.items() if not k.get("hierarchical") and n not in NCCL_SPACE]
    cands = autotune.candidates(auto_cfg("train.amp=bf16"))
    assert [c.name for c in cands] == [n for n in flat if n != "fsdp2-bf16"]  # lossy: bf16 params
    assert all(c.lossless for c in cands)
    assert {predict.family(c.cfg.sync) for c in cands} >= {"ddp", "bucketed+split", "sharded+split+rows",
                                                             "sharded+split+bf16", "fsdp2"}
    # bf16 exchanges are exact only under bf16 autocast: without it they are not in the space
    fp32 = autotune.candidates(auto_cfg("train.amp=fp32"))
    assert [c.name for c in fp32] == [n for n in flat if "gather_dtype" not in DEFAULT_SPACE[n]]
    lossy = autotune.candidates(auto_cfg("train.amp=bf16", "sync.tune.lossy=true"))
    assert [c.name for c in lossy if not c.lossless] == ["fsdp2-bf16"]
    split = next(c for c in cands if c.name == "bucketed-0.5-split")
    assert split.cfg.sync.strategy == "bucketed" and split.cfg.sync.classes["embedding"].tied_split
    assert split.cfg.sync.bucket_cap_mb == 0.5

    # 2 nodes x 2 ranks (torchrun's LOCAL_WORLD_SIZE): the hierarchical plan joins, a family of its own
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(autotune.ddist, "world_size", lambda: 4)
    nodes = autotune.candidates(auto_cfg("train.amp=fp32"))
    hierarchical = [c for c in nodes if c.cfg.sync.hierarchical]
    assert [c.name for c in hierarchical] == ["bucketed-2-hierarchical", "bucketed-8-hierarchical"]
    assert {predict.family(c.cfg.sync) for c in hierarchical} == {"bucketed+hierarchical"}
    monkeypatch.setattr(autotune.ddist, "world_size", lambda: 2)  # one node of 2 ranks: out again
    assert not any(c.cfg.sync.hierarchical for c in autotune.candidates(auto_cfg("train.amp=fp32")))

    # on NCCL with a class's own communicator settings (per_group or tuner), per-class NCCL choices join, a family
    # of their own; in global mode (one choice for the job) they do not
    monkeypatch.setattr(autotune.ddist, "choose_backend", lambda dist_cfg: "nccl")
    per_group = autotune.candidates(auto_cfg("train.amp=fp32", "collectives.mode=per_group"))
    nccl = [c for c in per_group if c.name in NCCL_SPACE]
    assert [c.name for c in nccl] == list(NCCL_SPACE) and nccl[0].cfg.sync.classes["projection"].protocol == "LL"
    assert {predict.family(c.cfg.sync) for c in nccl} == {"per_class+nccl"}
    assert not any(c.name in NCCL_SPACE for c in autotune.candidates(auto_cfg("train.amp=fp32")))

    space = "{fp32: {strategy: per_class}, bf16: {strategy: per_class, classes.embedding.wire_dtype: bf16}}"
    assert [c.name for c in autotune.candidates(auto_cfg(f"sync.tune.candidates={space}"))] == ["fp32"]
    both = autotune.candidates(auto_cfg(f"sync.tune.candidates={space}", "sync.tune.lossy=true"))
    assert [(c.name, c.lossless) for c in both] == [("fp32", True), ("bf16", False)]


@pytest.mark.parametrize("space, words", [
    ("{x: {strategy: ddp, bucket_cap: 2}}", ["sync.tune.candidates.x", "bucket_cap"]),
    ("{x: {bucket_cap_mb: 2}}", ["sync.tune.candidates.x", "strategy"]),
    ("{x: {strategy: auto}}", ["sync.tune.candidates.x", "auto"]),
    ("{x: {strategy: ddp, powersgd_rank: 2}}", ["sync.powersgd_rank", "not used by strategy 'ddp'"]),
    ("{../up: {strategy: ddp}}", ["sync.tune.candidates.../up", "one path component"]),
])
def test_a_bad_candidate_is_one_line_naming_it(space, words):
    with pytest.raises(UserError) as e:
        autotune.candidates(auto_cfg(f"sync.tune.candidates={space}"))
    assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


def test_auto_takes_no_other_sync_key():
    with pytest.raises(UserError, match="sync.bucket_cap_mb.*not used by strategy 'auto'"):
        auto_cfg("sync.bucket_cap_mb=2")


def test_the_prediction_charges_the_exposed_tail_on_a_slow_network():
    cfg = config_mod.load(REPO / "dtrain" / "profiles" / "multi30k-cpu.yaml", ["sync.strategy=auto"])  # ~10 MB of gradients
    with torch.device("meta"):
        model = Transformer.from_config(cfg.model, cfg.data.vocab_size)
    probe = predict.Probe(forward_ms=40.0, backward_ms=80.0, optimizer_ms=10.0, step_ms=140.0)
    slow = FittedModel({"x": [Regime(float("inf"), 100.0, 0.01)]}, "allreduce", 2)  # 10 MB/s after 100 µs
    fast = FittedModel({"x": [Regime(float("inf"), 1.0, 100.0)]}, "allreduce", 2)
    pred = {c.name: predict.predict_ms(c.cfg.sync, model, probe, slow, 2, "gloo")
            for c in autotune.candidates(cfg)}
    assert pred["ddp-25"] > pred["ddp-2"] > probe.step_ms  # one big bucket waits for the end of backward
    assert pred["bucketed-0.5"] < pred["bucketed-8"]
    on_fast = predict.predict_ms(autotune.candidates(cfg)[0].cfg.sync, model, probe, fast, 2, "gloo")
    assert probe.step_ms <= on_fast < pred["ddp-2"]
    powersgd = config_mod.load(REPO / "dtrain" / "profiles" / "multi30k-cpu.yaml", ["sync.strategy=powersgd"])
    assert predict.predict_ms(powersgd.sync, model, probe, slow, 2, "gloo") is None
    hierarchical = config_mod.load(REPO / "dtrain" / "profiles" / "multi30k-cpu.yaml",
                                   ["sync.strategy=bucketed", "sync.hierarchical=true"])
    assert predict.predict_ms(hierarchical.sync, model, probe, slow, 4, "gloo") is None  # measured, not predicted


def entrants(cands, predictions):
    """The race's entrants of `cands` with those predictions, and their sync sections by name."""
    return ([Entrant(c.name, c.lossless, predicted_ms=ms) for c, ms in zip(cands, predictions)],
            {c.name: c.cfg.sync for c in cands})


def test_pruning_keeps_the_best_predicted_and_every_unpredicted_candidate():
    cands, syncs = entrants(autotune.candidates(auto_cfg())[:5], (300.0, None, 100.0, 200.0, 400.0))
    racing = predict.prune(cands, syncs, top_k=2)
    assert [c.name for c in racing] == [cands[2].name, cands[3].name, cands[1].name]
    assert [c.predicted_rank for c in cands] == [3, None, 1, 2, 4]
    dropped = [c for c in cands if c.status == "dropped: predicted"]
    assert dropped == [cands[0], cands[4]] and "rank 4 of 4; measured: each family's best" in cands[4].reason


def test_pruning_measures_each_familys_best_first_within_the_slack():
    """A prediction can be 20-25% off: the best predicted member of every family within FAMILY_SLACK is measured,
    even past top_k, before a near copy of a better predicted one; a family beyond the slack only fills a place
    left over."""
    by_name = {c.name: c for c in autotune.candidates(auto_cfg())}
    names = ("bucketed-0.5", "bucketed-2", "bucketed-8", "ddp-2", "ddp-25", "sharded-2")
    predictions = (100.0, 101.0, 102.0, 120.0, 121.0, 140.0)

    def prune(top_k):
        cands, syncs = entrants([by_name[n] for n in names], predictions)
        return [c.name for c in predict.prune(cands, syncs, top_k)], {c.name for c in cands if c.status}

    assert prune(1) == (["bucketed-0.5", "ddp-2"], {"bucketed-2", "bucketed-8", "ddp-25", "sharded-2"})
    assert prune(2) == (["bucketed-0.5", "ddp-2"], {"bucketed-2", "bucketed-8", "ddp-25", "sharded-2"})
    assert prune(3) == (["bucketed-0.5", "bucketed-2", "ddp-2"], {"bucketed-8", "ddp-25", "sharded-2"})


@pytest.mark.slow
def test_an_auto_job_survives_a_crash_equals_its_winner_untuned_and_resumes_without_searching(tmp_path):
    space = "{ddp-25: {strategy: ddp, bucket_cap_mb: 25}, bucketed-1: {strategy: bucketed, bucket_cap_mb: 1}}"
    tune = ("--set", "sync.strategy=auto", "--set", f"sync.tune.candidates={space}", "--set",
            "sync.tune.budget_steps=12", "--set", "sync.tune.warmup_rounds=1", "--set", "sync.tune.min_rounds=3",
            "--set", "sync.tune.probe_steps=2", "--set", "train.val_every=0", *NO_EVAL)
    run = tmp_path / "auto"
    # Rank 1 crashes in the search's third round; torchrun restarts the job, which searches again from step 0.
    r = torchrun("--run-dir", str(run), "--set", "train.max_steps=8", "--set", "train.ckpt_every=8", *tune,
                 "--fault", "crash@step=3,rank=1", extra=("--max-restarts=1",))
    assert "[fault] crash at step 3" in r.stderr and r.stdout.count(" wins after ") == 1
    tuned = json.loads((run / "tuned.json").read_text())
    rows = (run / "tuning.csv").read_text().splitlines()
    assert rows[0].split(",") == list(TUNING_COLUMNS) and len(rows) == 3
    assert f"tuning: {tuned['winner']} wins" in r.stdout
    header = json.loads((run / "run.json").read_text())
    assert header["tuning"]["winner"] == tuned["winner"] and header["tuning"]["steps_spent"] <= 12
    win_rounds = header["tuning"]["rounds"]
    assert [s["step"] for s in records(run / "steps.jsonl")] == list(range(1, 9))  # tuning steps are the run's
    assert config_mod.load(run / "config.yaml").sync.strategy == tuned["sync"]["strategy"]
    assert win_rounds >= 1

    # The same 8 steps of the winner, untuned: the same parameters and optimizer state.
    plain = tmp_path / "plain"
    keys = [f"sync.{k}={v}" for k, v in tuned["sync"].items()]
    train_ranks("--run-dir", str(plain), "--set", "train.max_steps=8", "--set", "train.ckpt_every=8",
                "--set", "train.val_every=0", *NO_EVAL, *[a for k in keys for a in ("--set", k)])
    diff = checkpoint_diff(run / "checkpoints" / "step-0000008.pt", plain / "checkpoints" / "step-0000008.pt")
    assert "max |A - B| over parameters: 0 " in diff and "optimizer states: identical" in diff, diff

    # Resumed: the recorded winner trains on, nothing is searched again.
    csv_before = (run / "tuning.csv").read_text()
    r = train_ranks("--run-dir", str(run), "--resume", "--set", "train.max_steps=10", "--set", "train.ckpt_every=8",
                    *tune)
    assert "tuning:" not in r.stdout and (run / "tuning.csv").read_text() == csv_before
    assert [s["step"] for s in records(run / "steps.jsonl")][-1] == 10


@pytest.mark.slow
def test_a_drifting_step_time_starts_a_new_search_from_a_checkpoint(tmp_path):
    """The search takes steps 1-10 (its budget); steps 11-13 are the baseline window. Rank 0 turns slow from step 15
    (+900 ms a step): the window of steps 14-16 drifts past 200% of it, the run checkpoints step 16 and searches
    again from it on the same model, which the run's last step (24) ends; the records stay one step per line, 1 to
    24. (The margin is wide so that CI's own load, which can slow steps by half, does not start a search first.)"""
    space = "{ddp-25: {strategy: ddp, bucket_cap_mb: 25}, bucketed-1: {strategy: bucketed, bucket_cap_mb: 1}}"
    run = tmp_path / "auto"
    r = train_ranks("--run-dir", str(run), "--set", "train.max_steps=24", "--set", "train.ckpt_every=100",
                    "--set", "sync.strategy=auto", "--set", f"sync.tune.candidates={space}",
                    "--set", "sync.tune.budget_steps=10", "--set", "sync.tune.warmup_rounds=1",
                    "--set", "sync.tune.min_rounds=10",  # nothing dropped: the search spends its budget
                    "--set", "sync.tune.retune_drift=2.0", "--set", "sync.tune.retune_window=3",
                    "--set", "train.val_every=0", *NO_EVAL, "--fault", "slow@rank=0,ms=900,from=15")
    assert "step 16: the median step moved" in r.stdout and r.stdout.count("wins after") == 2, r.stdout[-3000:]
    tuned = json.loads((run / "tuned.json").read_text())
    assert tuned["search"] == 1 and tuned["from_step"] == 16
    assert (run / "tuning.0.csv").exists() and (run / "tuning.csv").exists()
    assert [s["step"] for s in records(run / "steps.jsonl")] == list(range(1, 25))
    assert (run / "checkpoints" / "step-0000016.pt").exists()
