"""Tensor classes: the default rules on dtrain's Transformer, first match wins, size bounds, the catch-all, the
profile's `sync.classes` (typed `ClassSettings`: errors name the file, line and dotted key), and
`python -m dtrain.engine.describe`."""

import subprocess
import sys

import pytest
import torch
from conftest import REPO

from dtrain.collectives import tensor_classes as tc
from dtrain.collectives.settings import ClassSettings, SyncConfig
from dtrain.common.errors import UserError
from dtrain.engine import config as config_mod
from dtrain.engine import describe as classes_cli
from dtrain.engine.model import Transformer


def meta_model(norm="post"):
    with torch.device("meta"):
        return Transformer(vocab=100, N=2, d_model=32, d_ff=64, h=4, norm=norm)


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_default_classes_give_every_parameter_exactly_the_designed_class(norm):
    named = list(meta_model(norm).named_parameters())
    assigned = tc.TensorClasses().assign(named)
    assert set(assigned) == {n for n, _ in named}
    for name, c in assigned.items():
        if name == "embed.weight":
            want = "embedding"
        elif name.endswith(".bias") or "norm" in name:
            want = "norm_bias"
        elif any(f".{w}.weight" in name for w in ("W_Q", "W_K", "W_V", "W_O")):
            want = "projection"
        elif ".feed_forward." in name:
            want = "ffn"
        else:
            want = "other"
        assert c == want, name
    assert "other" not in assigned.values()  # this model needs no catch-all, others may
    if norm == "pre":
        assert assigned["encoder_norm.weight"] == "norm_bias"


def test_first_match_wins_and_size_bounds():
    rules = (tc.ClassRule("small_ffn", ("*.feed_forward.*",), max_numel=100),
             tc.ClassRule("ffn", ("*.feed_forward.*",)),
             tc.ClassRule("rest", ("*",)))
    classes = tc.TensorClasses(rules)
    assert classes.classify("encoder.0.feed_forward.w_1.bias", 64) == "small_ffn"
    assert classes.classify("encoder.0.feed_forward.w_1.weight", 2048) == "ffn"
    assert classes.classify("embed.weight", 10) == "rest"
    bounded = tc.ClassRule("mid", ("*",), min_numel=10, max_numel=20)
    assert [bounded.matches("x", n) for n in (9, 10, 20, 21)] == [False, True, True, False]


def test_a_catch_all_is_required_last_and_only_last():
    with pytest.raises(UserError, match="last rule must be a catch-all"):
        tc.TensorClasses((tc.ClassRule("ffn", ("*.feed_forward.*",)),))
    with pytest.raises(UserError, match="before the last rule"):
        tc.TensorClasses((tc.ClassRule("all", ("*",)), tc.ClassRule("rest", ("*",))))
    with pytest.raises(UserError, match="duplicate"):
        tc.TensorClasses((tc.ClassRule("a", ("x",)), tc.ClassRule("a", ("*",))))
    # A bounded "*" is no catch-all: it may come first.
    tc.TensorClasses((tc.ClassRule("tiny", ("*",), max_numel=10), tc.ClassRule("rest", ("*",))))


def test_profile_classes_settings_and_rule_order():
    sync = SyncConfig(strategy="per_class", bucket_cap_mb=4.0, classes={
        "ffn": ClassSettings(wire_dtype="bf16", bucket_cap_mb=1),  # settings only: keeps its rule and place
        "big_ffn": ClassSettings(match=["*.w_1.weight"], min_numel=1000, wire_dtype="fp16"),  # a new rule: first
    })
    classes = tc.from_config(sync)
    assert [r.name for r in classes.rules] == ["big_ffn", "embedding", "norm_bias", "projection", "ffn", "other"]
    assert classes.setting("ffn") == ClassSettings(wire_dtype="bf16", bucket_cap_mb=1)
    assert classes.setting("projection").bucket_cap_mb == 4.0  # sync.bucket_cap_mb is every class's default
    assert classes.setting("big_ffn").torch_wire_dtype == torch.float16
    assigned = classes.assign(meta_model().named_parameters())
    assert assigned["encoder.0.feed_forward.w_1.weight"] == "big_ffn"  # 64 x 32 = 2048 >= 1000
    assert assigned["encoder.0.feed_forward.w_2.weight"] == "ffn"
    assert tc.from_config(SyncConfig()).setting("ffn").bucket_cap_mb == tc.DEFAULT_BUCKET_CAP_MB


def test_a_class_given_as_a_mapping_in_code_is_typed_like_the_profiles():
    sync = SyncConfig(strategy="per_class", classes={"ffn": {"wire_dtype": "bf16", "protocol": "LL"}})
    assert sync.classes["ffn"] == ClassSettings(wire_dtype="bf16", protocol="LL")
    with pytest.raises(UserError, match="unknown key 'sync.classes.ffn.wire'"):
        SyncConfig(classes={"ffn": {"wire": "bf16"}})
    with pytest.raises(UserError, match="'sync.classes.ffn.bucket_cap_mb' must be float"):
        SyncConfig(classes={"ffn": {"bucket_cap_mb": "1"}})


def test_profile_classes_are_checked_by_the_loader_with_file_and_line(tmp_path):
    profile = tmp_path / "p.yaml"
    profile.write_text("sync:\n  strategy: per_class\n  classes:\n    big_ffn:\n"
                       "      match: ['*.w_1.weight', '*.w_2.*']\n      wire_dtype: bf16\n")
    cfg = config_mod.load(profile)
    assert cfg.sync.classes["big_ffn"].match == ["*.w_1.weight", "*.w_2.*"]
    assert tc.from_config(cfg.sync).rules[0] == tc.ClassRule("big_ffn", ("*.w_1.weight", "*.w_2.*"))
    profile.write_text("sync:\n  strategy: per_class\n  classes:\n    ffn:\n      wire: bf16\n")
    with pytest.raises(UserError, match=r"p.yaml:5: unknown key 'sync.classes.ffn.wire'"):
        config_mod.load(profile)
    profile.write_text("sync:\n  strategy: per_class\n  classes:\n    ffn:\n      min_numel: many\n")
    with pytest.raises(UserError, match=r"p.yaml:5: 'sync.classes.ffn.min_numel' must be int"):
        config_mod.load(profile)


@pytest.mark.parametrize("override, key", [
    ("sync.classes.ffn.wire_dtype=bf8", "sync.classes.ffn.wire_dtype"),
    ("sync.classes.ffn.wire=bf16", "sync.classes.ffn.wire"),
    ("sync.classes.ffn.bucket_cap_mb=0", "sync.classes.ffn.bucket_cap_mb"),
    ("sync.classes.ffn.protocol=LL256", "sync.classes.ffn.protocol"),
    ("sync.classes.mine.wire_dtype=bf16", "sync.classes.mine.match"),
    ("sync.classes.mine.match=*", "sync.classes.mine.match"),
    ("sync.classes.other.match=x*", "sync.classes.other.match"),
    ("sync.classes.ffn=3", "sync.classes.ffn"),
    ("sync.classes.ffn.min_numel=-1", "sync.classes.ffn.min_numel"),
])
def test_bad_classes_are_user_errors_naming_the_key(override, key):
    with pytest.raises(UserError, match=f"'{key}'"):
        config_mod.load(REPO / "dtrain/profiles/smoke.yaml", [override])


def test_classes_summary_counts_bytes_and_ranges():
    named = list(meta_model().named_parameters())
    rows = {r["class"]: r for r in classes_cli.summary(named, tc.TensorClasses())}
    assert list(rows) == ["embedding", "norm_bias", "projection", "ffn", "other"]
    assert rows["embedding"]["tensors"] == 1 and rows["embedding"]["bytes"] == 100 * 32 * 4
    assert rows["projection"]["tensors"] == 2 * 4 + 2 * 8  # encoder self-attn; decoder self- and src-attn
    assert rows["projection"]["min_numel"] == rows["projection"]["max_numel"] == 32 * 32
    assert rows["ffn"]["tensors"] == 4 * 2 and (rows["ffn"]["min_numel"], rows["ffn"]["max_numel"]) == (2048, 2048)
    assert rows["other"]["tensors"] == 0
    assert sum(r["bytes"] for r in rows.values()) == sum(p.numel() * 4 for _, p in named)


@pytest.mark.slow
def test_classes_cli_prints_the_table_and_fails_in_one_line():
    r = subprocess.run([sys.executable, "-m", "dtrain.engine.describe", "--profile", "dtrain/profiles/smoke.yaml",
                        "--set", "sync.strategy=per_class", "--set", "sync.classes.ffn.wire_dtype=bf16"], cwd=REPO,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lines = {line.split()[0]: line.split() for line in r.stdout.splitlines()[2:]}
    assert lines["embedding"][1] == "1" and lines["ffn"][1] == "8" and "bf16" in lines["ffn"]
    r = subprocess.run([sys.executable, "-m", "dtrain.engine.describe", "--profile", "dtrain/profiles/smoke.yaml",
                        "--set", "sync.strategy=per_class", "--set", "sync.classes.ffn.wire_dtype=int8"], cwd=REPO,
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "sync.classes.ffn.wire_dtype" in r.stderr
