import subprocess
import sys

import pytest
import torch
import yaml

from dtrain.collectives import config as comm_config
from dtrain.collectives import strategies
from dtrain.collectives.strategies import available
from dtrain.common.errors import UserError
from dtrain.engine import config

from conftest import REPO

PROFILES = sorted((REPO / "dtrain" / "profiles").glob("*.yaml"))


@pytest.mark.parametrize("profile", PROFILES, ids=[p.name for p in PROFILES])
def test_shipped_profiles_validate(profile):
    config.load(profile)


def _load(tmp_path, text, overrides=()):
    p = tmp_path / "p.yaml"
    p.write_text(text)
    return config.load(p, list(overrides))


def test_preset_fills_fields_and_explicit_values_win(tmp_path):
    cfg = _load(tmp_path, "model: {preset: big, dropout: 0.1}\n")
    assert (cfg.model.d_model, cfg.model.h, cfg.model.dropout) == (1024, 16, 0.1)


@pytest.mark.parametrize("text,expected", [
    ("model:\n  d_modle: 512\n", r"p.yaml:2: unknown key 'model.d_modle'"),
    ("train:\n  max_steps: ten\n", r"p.yaml:2: 'train.max_steps' must be int, got 'ten'"),
    ("train:\n  record_ranks: maybe\n", r"p.yaml:2: 'train.record_ranks' must be bool, got 'maybe'"),
    ("model:\n  d_model: 100\n  h: 8\n", r"'model.h' must divide model.d_model"),
    ("data:\n  max_tokens: -5\n", r"'data.max_tokens' must be positive"),
    ("sync:\n  strategy: magic\n", r"unknown strategy 'magic'"),
    ("model: [1, 2\n", r"p.yaml:\d+: malformed YAML"),
    ("optim:\n  betas: [0.9]\n", r"'optim.betas' must be a list of 2 values"),
    ("train:\n  average_last: 9\n  keep_ckpts: 3\n", r"'train.average_last' cannot exceed train.keep_ckpts"),
    ("a: 1\na: 2\n", r"duplicate key 'a'"),
    ("sync:\n  strategy: sharded\n  gather_dtype: fp8\n", r"p.yaml:3: 'sync.gather_dtype' must be bf16 or null"),
    ("sync:\n  strategy: sharded\n  gather_dtype: bf16\n",
     r"p.yaml:3: 'sync.gather_dtype' 'bf16' needs the forward under that autocast \(train.amp: bf16\)"),
    ("train:\n  amp: fp16\n", r"p.yaml:2: 'train.amp' must be one of auto, fp32, bf16, got 'fp16'"),
])
def test_bad_profiles_name_the_key(tmp_path, text, expected):
    with pytest.raises(UserError, match=expected):
        _load(tmp_path, text)


def test_set_overrides_parse_values(tmp_path):
    cfg = _load(tmp_path, "train: {max_steps: 5}\n", ["train.max_steps=7", "optim.clip_norm=1e-1", "eval.at_end=false"])
    assert cfg.train.max_steps == 7 and cfg.optim.clip_norm == 0.1 and cfg.eval.at_end is False
    with pytest.raises(UserError, match=r"unknown key 'train.max_stpes'; did you mean 'train.max_steps'\? \(known: "):
        _load(tmp_path, "{}\n", ["train.max_stpes=3"])


CPU = torch.device("cpu")


def native_here(monkeypatch, native: bool, capability: str = "AVX2"):
    """This process's CPU, as `resolve_amp` sees it: with bf16 instructions or without."""
    reason = (f"CPU capability {capability} with avx512_bf16: bf16 native" if native else
              f"CPU capability {capability} without bf16 instructions (avx512_bf16, amx_bf16): bf16 emulated")
    monkeypatch.setattr(config, "bf16_native", lambda device: (native, reason))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    config._say_once.cache_clear()
    return reason


@pytest.mark.parametrize("native,amp", [(True, "bf16"), (False, "fp32")])
def test_amp_auto_is_bf16_where_native_and_fp32_elsewhere(tmp_path, monkeypatch, capsys, native, amp):
    cfg = _load(tmp_path, "train: {amp: auto}\n")
    assert cfg.train.amp == "auto"  # the profile keeps the setting; the trainer resolves it on its device
    reason = native_here(monkeypatch, native)
    resolved, record = config.resolve_amp(cfg, CPU)
    assert resolved.train.amp == amp and resolved.model == cfg.model  # what config.yaml records: the precision run
    assert record == {"amp": amp, "amp_setting": "auto", "amp_reason": reason}
    config.resolve_amp(cfg, CPU)
    config.resolve_amp(cfg, CPU, main=False)
    # what it picked, once, from rank 0; never the emulated path, so nothing to warn of
    assert capsys.readouterr().err == f"dtrain.engine.config: train.amp auto: {amp} here ({reason})\n"


def test_an_explicit_precision_is_kept_and_emulated_bf16_warns_once_with_its_cost(tmp_path, monkeypatch, capsys):
    reason = native_here(monkeypatch, False)
    fp32 = _load(tmp_path, "train: {amp: fp32}\n")
    assert config.resolve_amp(fp32, CPU) == (fp32, {"amp": "fp32", "amp_setting": "fp32",
                                                     "amp_reason": f"set in the profile; {reason}"})
    bf16 = _load(tmp_path, "train: {amp: bf16}\n")
    for _ in range(3):  # an interleaved job: one trainer per configuration, one warning
        resolved, record = config.resolve_amp(bf16, CPU)
        assert resolved.train.amp == "bf16" and record["amp"] == "bf16"
    config.resolve_amp(bf16, CPU, main=False)
    err = capsys.readouterr().err.splitlines()
    assert err == ["dtrain.engine.config: warning: 'train.amp' bf16: bf16 autocast on a CPU without bf16 instructions "
                   "(AVX2) is emulated: about 20x slower per step than fp32 (measured: 18,100 ms vs 880 ms a step, "
                   "multi30k-cpu, 2 ranks, 1,024 tokens); train.amp: auto picks fp32 here"]
    native_here(monkeypatch, True, "AVX512")
    config.resolve_amp(bf16, CPU)
    assert capsys.readouterr().err == ""  # native: nothing to warn of
    native_here(monkeypatch, False)
    config.resolve_amp(bf16, CPU, main=False)
    assert capsys.readouterr().err == ""  # only rank 0 warns


def test_auto_with_bf16_exchanges_needs_bf16_and_says_which_keys(tmp_path, monkeypatch):
    cfg = _load(tmp_path, "train: {amp: auto}\nsync: {strategy: sharded, gather_dtype: bf16}\n")  # accepted here
    native_here(monkeypatch, True)
    assert config.resolve_amp(cfg, CPU)[0].train.amp == "bf16"
    native_here(monkeypatch, False)
    with pytest.raises(UserError, match=r"^'sync.gather_dtype' 'bf16' needs the forward under bf16 autocast, but "
                                        r"'train.amp' auto picks fp32 here \(CPU capability AVX2 without bf16 "
                                        r".*\); set train.amp: bf16, or sync.gather_dtype: fp32$"):
        config.resolve_amp(cfg, CPU)


def test_the_cpu_profile_trains_in_auto_and_the_default_stays_fp32():
    assert config.load(REPO / "dtrain" / "profiles" / "multi30k-cpu.yaml").train.amp == "auto"
    assert config.RunConfig().train.amp == "fp32"


@pytest.mark.slow
def test_cli_bad_profile_is_one_line_exit_2(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("model:\n  h: 0\n")
    r = subprocess.run([sys.executable, "-m", "dtrain.engine.train", "--profile", str(p), "--dry-run"],
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "'model.h' must be positive" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.slow
def test_cli_dry_run_prints_resolved_config():
    r = subprocess.run([sys.executable, "-m", "dtrain.engine.train", "--profile", "dtrain/profiles/base.yaml", "--dry-run"],
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert "d_model: 512" in r.stdout and "warmup: 4000" in r.stdout


@pytest.mark.parametrize("override,expected", [
    ("sync.bucket_cap_mb=.inf", r"'sync.bucket_cap_mb' must be a finite number, got inf"),
    ("sync.bucket_cap_mb=.nan", r"'sync.bucket_cap_mb' must be a finite number, got nan"),
    ("optim.betas=[0.9, .nan]", r"'optim.betas\[1\]' must be a finite number"),
    ("optim.eps=1e999", r"'optim.eps' must be a finite number"),
    ("name=../../etc", r"'name' must be letters, digits and - _ . = \+ \(a single path component"),
    ("name=a/b", r"'name' must be"),
    ("name=.hidden", r"'name' must be"),
    ("name=", r"'name' must be"),
])
def test_non_finite_floats_and_unsafe_names_are_rejected(tmp_path, override, expected):
    with pytest.raises(UserError, match=expected):
        _load(tmp_path, "{}\n", [override])


def test_run_names_of_profiles_and_sweeps_stay_valid(tmp_path):
    # dtrain.analysis.sweep names runs like this (letters, digits and _ . + - =); profiles use the same characters.
    for name in ("multi30k-cpu-bucketed-bucket_cap_mb=2", "base-per_group", "smoke-x+y-lr_factor=0.5"):
        assert _load(tmp_path, f"name: {name}\n").name == name


# -- a knob the strategy does not read is an error ------------------------------------------------------------


@pytest.mark.parametrize("text,expected", [
    ("sync:\n  strategy: per_class\n  first_bucket_mb: 2\n",
     r"p.yaml:3: 'sync.first_bucket_mb' is not used by strategy 'per_class' \(its keys: sync.bucket_cap_mb, "
     r"sync.classes.<class>.\(match, "),
    ("sync:\n  strategy: bucketed\n  classes:\n    ffn: {wire_dtype: bf16}\n",
     r"p.yaml:4: 'sync.classes.ffn.wire_dtype' is not used by strategy 'bucketed'"),
    ("sync:\n  strategy: per_class\n  hook: bf16_compress\n", r"p.yaml:3: 'sync.hook' is not used by strategy 'per_class'"),
    ("sync:\n  strategy: powersgd\n  hook: allreduce\n", r"'sync.hook' is not used by strategy 'powersgd'"),
    ("sync:\n  strategy: ddp\n  powersgd_rank: 4\n", r"p.yaml:3: 'sync.powersgd_rank' is not used by strategy 'ddp'"),
    ("sync:\n  strategy: flat\n  bucket_cap_mb: 4\n", r"'sync.bucket_cap_mb' is not used by strategy 'flat'"),
    ("sync:\n  strategy: noop\n  classes: {ffn: {min_numel: 10}}\n",
     r"'sync.classes.ffn.min_numel' is not used by strategy 'noop' \(its keys: none\)"),
])
def test_a_knob_the_strategy_does_not_use_is_refused(tmp_path, text, expected):
    with pytest.raises(UserError, match=expected):
        _load(tmp_path, text)


def test_default_values_and_overrides_of_unused_knobs_pass(tmp_path):
    # Only a non-default value counts: a dumped config (every key) and a sweep's shared overrides still load.
    cfg = _load(tmp_path, "sync:\n  strategy: flat\n  bucket_cap_mb: null\n  powersgd_rank: 1\n  hook: null\n"
                          "  classes: {ffn: {wire_dtype: fp32, bucket_cap_mb: null}}\n")
    assert cfg.sync.strategy == "flat"
    with pytest.raises(UserError, match=r"p.yaml \(with --set\):3: 'sync.first_bucket_mb' is not used by strategy "
                                        r"'per_class'"):
        _load(tmp_path, "sync:\n  strategy: bucketed\n  first_bucket_mb: 1\n", ["sync.strategy=per_class"])
    assert _load(tmp_path, "sync: {strategy: per_class}\n", ["sync.strategy=bucketed"]).sync.strategy == "bucketed"


KNOB_VALUES = {"bucket_cap_mb": 2, "first_bucket_mb": 0.5, "last_bucket_mb": 1, "hook": "allreduce", "powersgd_rank": 2,
               "powersgd_start_iter": 3, "classes.match": "*.feed_forward.*", "classes.min_numel": 1,
               "classes.max_numel": 10**9, "classes.wire_dtype": "bf16", "classes.bucket_cap_mb": 1,
               "classes.protocol": "LL", "classes.algorithm": "Ring", "classes.min_ctas": 1, "classes.max_ctas": 8,
               "classes.tied_split": True, "shard_tied_split": True, "gather_dtype": "bf16", "gather_at": "forward",
               "reshard_after_forward": False, "fsdp2_collectives": "p2p", "hierarchical": True, "ranks_per_node": 2,
               "tune": {"budget_steps": 30}}


@pytest.mark.parametrize("strategy", available())
def test_every_strategy_takes_exactly_its_declared_keys(tmp_path, strategy):
    declared = set(strategies.get(strategy).sync_keys)
    assert declared <= set(KNOB_VALUES), declared - set(KNOB_VALUES)
    for key, value in KNOB_VALUES.items():
        sync = {"strategy": strategy}
        if key.startswith("classes."):
            sync["classes"] = {"ffn": {key.split(".", 1)[1]: value}}
        else:
            sync[key] = value
        # NCCL keys of a class need a per-class mode; a bf16 all-gather, the forward under bf16 autocast
        raw = {"sync": sync, "collectives": {"mode": "per_group"}, "train": {"amp": "bf16"}}
        if key in declared:
            config.from_dict(raw)
        else:
            with pytest.raises(UserError, match=f"is not used by strategy '{strategy}'"):
                config.from_dict(raw)


# -- profiles as overlays -----------------------------------------------------------------------------------------


def _files(tmp_path, **texts):
    for name, text in texts.items():
        path = tmp_path / name.replace("__", "/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


BASE = "name: base\nmodel: {preset: tiny}\ntrain:\n  max_steps: 10\n  log_every: 5\noptim:\n  betas: [0.8, 0.9]\n"


def test_an_overlay_merges_mappings_and_wins(tmp_path):
    _files(tmp_path, **{"base.yaml": BASE,
                        "sub__over.yaml": "include: ../base.yaml\nname: over\ntrain: {max_steps: 20}\n"
                                          "optim: {betas: [0.7, 0.95]}\n"})
    cfg = config.load(tmp_path / "sub" / "over.yaml")
    assert (cfg.name, cfg.model.d_model, cfg.train.max_steps, cfg.train.log_every) == ("over", 64, 20, 5)
    assert cfg.optim.betas == (0.7, 0.95)  # a list is replaced, not merged
    assert config.load(tmp_path / "sub" / "over.yaml", ["train.log_every=2"]).train.log_every == 2


def test_includes_in_order_and_nested(tmp_path):
    _files(tmp_path, **{"base.yaml": BASE, "steps.yaml": "include: base.yaml\ntrain: {max_steps: 30}\n",
                        "seed.yaml": "seed: 7\ntrain: {max_steps: 40, log_every: 1}\n",
                        "top.yaml": "include: [steps.yaml, seed.yaml]\ntrain: {log_every: 3}\n"})
    cfg = config.load(tmp_path / "top.yaml")
    assert (cfg.name, cfg.seed, cfg.train.max_steps, cfg.train.log_every) == ("base", 7, 40, 3)


def test_errors_point_at_the_file_that_set_the_key(tmp_path):
    _files(tmp_path, **{"base.yaml": "seed: 1\ntrain:\n  max_steps: ten\n", "a.yaml": "include: base.yaml\n"})
    with pytest.raises(UserError, match=r"base.yaml:3: 'train.max_steps' must be int, got 'ten'"):
        config.load(tmp_path / "a.yaml")
    _files(tmp_path, **{"a.yaml": "include: base.yaml\n\ntrain:\n  max_steps: 5\n  log_evry: 1\n"})
    with pytest.raises(UserError, match=r"a.yaml:5: unknown key 'train.log_evry'"):
        config.load(tmp_path / "a.yaml")
    # the knob from the base, refused for the strategy the overlay picks
    _files(tmp_path, **{"base.yaml": "sync:\n  strategy: bucketed\n  first_bucket_mb: 1\n",
                        "a.yaml": "include: base.yaml\nsync: {strategy: per_class}\n"})
    with pytest.raises(UserError, match=r"base.yaml:3: 'sync.first_bucket_mb' is not used by strategy 'per_class'"):
        config.load(tmp_path / "a.yaml")
    # replaced by the overlay: its lines are the overlay's
    _files(tmp_path, **{"a.yaml": "include: base.yaml\nsync:\n  strategy: per_class\n  first_bucket_mb: 2\n"})
    with pytest.raises(UserError, match=r"a.yaml:4: 'sync.first_bucket_mb' is not used"):
        config.load(tmp_path / "a.yaml")


@pytest.mark.parametrize("files,expected", [
    ({"a.yaml": "include: b.yaml\n", "b.yaml": "include: a.yaml\n"},
     r"b.yaml:1: 'include' makes a cycle: .*a.yaml -> .*b.yaml -> .*a.yaml"),
    ({"a.yaml": "include: a.yaml\n"}, r"a.yaml:1: 'include' makes a cycle"),
    ({"a.yaml": "seed: 1\ninclude: [base.yaml, nope.yaml]\n", "base.yaml": "seed: 2\n"},
     r"a.yaml:2: 'include' names 'nope.yaml', which is not a file"),
    ({"a.yaml": "include: {file: b.yaml}\n"}, r"a.yaml:1: 'include' must be a file name or a list of them"),
    ({"a.yaml": "include: []\n"}, r"a.yaml:1: 'include' must be a file name or a list of them"),
    ({"a.yaml": "train:\n  include: b.yaml\n"}, r"a.yaml:2: unknown key 'train.include'"),
    ({"a.yaml": "include: b.yaml\n", "b.yaml": "seed: [1\n"}, r"b.yaml:\d+: malformed YAML"),
])
def test_bad_includes_are_one_line_errors(tmp_path, files, expected):
    _files(tmp_path, **files)
    with pytest.raises(UserError, match=expected):
        config.load(tmp_path / "a.yaml")


def test_the_library_reads_overlays_too(tmp_path):
    _files(tmp_path, **{"base.yaml": "sync:\n  strategy: bucketed\n  bucket_cap_mb: 4\n",
                        "a.yaml": "include: base.yaml\nsync: {first_bucket_mb: 1}\n"})
    sync, coll = comm_config.load(tmp_path / "a.yaml")
    assert (sync.strategy, sync.bucket_cap_mb, sync.first_bucket_mb) == ("bucketed", 4, 1)
    whole = config.load(tmp_path / "a.yaml")
    assert (sync, coll) == (whole.sync, whole.collectives)


def test_a_recorded_config_of_an_earlier_version_still_loads(tmp_path):
    # Earlier versions recorded per-class NCCL choices under collectives.classes and knobs their strategy ignored.
    old = (REPO / "tests/data/runs/smoke/smoke-ddp/config.yaml").read_text()
    assert "  classes: {}\n  parse_log" in old  # the fixture is as an earlier version wrote it
    raw = yaml.safe_load(old)
    raw["sync"]["strategy"] = "per_class"
    raw["collectives"]["mode"] = "per_group"
    raw["collectives"]["classes"] = {"ffn": {"proto": "LL", "algo": "Ring", "min_ctas": None, "max_ctas": 4}}
    raw["sync"]["hook"] = "bf16_compress"  # per_class never read it
    path = tmp_path / "config.yaml"
    raw["dist"]["timeout_s"] = 42.0  # the backend and its timeout were a section `dist`
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(UserError, match=r"config.yaml:\d+: 'dist' is part of 'collectives' now: write "
                                        "collectives.backend and collectives.timeout_s$"):
        config.load(path)  # as a profile: refused
    dist = raw.pop("dist")
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(UserError, match="unknown key 'collectives.classes'"):
        config.load(path)
    del raw["collectives"]["classes"]
    assert raw["collectives"]["default"]["proto"] is None  # named as NCCL's variables, now as a class's keys
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(UserError, match="unknown key 'collectives.default.(algo|proto)'; did you mean "
                                        "'collectives.default.(algorithm|protocol)'"):
        config.load(path)
    current = {**raw, "collectives": {**raw["collectives"], "default": {"protocol": None, "algorithm": None}}}
    path.write_text(yaml.safe_dump(current))
    with pytest.raises(UserError, match="'sync.hook' is not used by strategy 'per_class'"):
        config.load(path)
    raw["collectives"]["classes"] = {"ffn": {"proto": "LL", "algo": "Ring", "min_ctas": None, "max_ctas": 4}}
    raw["collectives"]["default"]["algo"] = "Tree"
    raw["dist"] = dist
    path.write_text(yaml.safe_dump(raw))
    cfg = config.load_recorded(path)
    assert (cfg.collectives.backend, cfg.collectives.timeout_s) == ("auto", 42.0)
    ffn = cfg.sync.classes["ffn"]
    assert (ffn.protocol, ffn.algorithm, ffn.max_ctas) == ("LL", "Ring", 4)
    assert cfg.collectives.default.algorithm == "Tree"
    assert cfg.sync.hook is None and cfg.collectives.mode == "per_group"
