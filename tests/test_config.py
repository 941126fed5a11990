import subprocess
import sys

import pytest

from dtrain import config
from common.errors import UserError

from conftest import REPO

PROFILES = sorted((REPO / "profiles").glob("*.yaml"))


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
])
def test_bad_profiles_name_the_key(tmp_path, text, expected):
    with pytest.raises(UserError, match=expected):
        _load(tmp_path, text)


def test_set_overrides_parse_values(tmp_path):
    cfg = _load(tmp_path, "train: {max_steps: 5}\n", ["train.max_steps=7", "optim.clip_norm=1e-1", "eval.at_end=false"])
    assert cfg.train.max_steps == 7 and cfg.optim.clip_norm == 0.1 and cfg.eval.at_end is False
    with pytest.raises(UserError, match="unknown key 'train.max_stpes'"):
        _load(tmp_path, "{}\n", ["train.max_stpes=3"])


def test_cli_bad_profile_is_one_line_exit_2(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("model:\n  h: 0\n")
    r = subprocess.run([sys.executable, "-m", "dtrain.train", "--profile", str(p), "--dry-run"],
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "'model.h' must be positive" in r.stderr
    assert "Traceback" not in r.stderr


def test_cli_dry_run_prints_resolved_config():
    r = subprocess.run([sys.executable, "-m", "dtrain.train", "--profile", "profiles/base.yaml", "--dry-run"],
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
    # analysis.sweep names runs like this (letters, digits and _ . + - =); profiles use the same characters.
    for name in ("multi30k-cpu-bucketed-bucket_cap_mb=2", "base-per_group", "smoke-x+y-lr_factor=0.5"):
        assert _load(tmp_path, f"name: {name}\n").name == name
