"""Shipped profiles are found by name from any folder; the cache is where XDG says."""

import pytest

from dtrain.common.errors import UserError
from dtrain.common.paths import PROFILES, cache_root, resolve_profile, shipped_profiles
from dtrain.engine import config as config_mod


def test_a_shipped_profile_by_name_from_any_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_profile("smoke") == PROFILES / "smoke.yaml"
    assert resolve_profile("smoke.yaml") == PROFILES / "smoke.yaml"
    assert resolve_profile("sweeps/smoke") == PROFILES / "sweeps" / "smoke.yaml"
    assert resolve_profile("dtrain/profiles/smoke.yaml") == PROFILES / "smoke.yaml"
    assert resolve_profile("profiles/smoke.yaml") == PROFILES / "smoke.yaml"  # as older run records name it
    assert config_mod.load("smoke").name == config_mod.load(PROFILES / "smoke.yaml").name
    assert {"smoke", "base", "sweeps/smoke", "testbed/1gbit"} <= set(shipped_profiles())


def test_a_file_of_that_name_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smoke").write_text("name: mine\n")
    assert resolve_profile("smoke").resolve() == tmp_path / "smoke"


def test_an_unknown_name_suggests_the_nearest(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=r"^smok: profile not found: neither a file nor one shipped with dtrain "
                                        r"\(base, .*smoke.*, sweeps/\.\.\., testbed/\.\.\.\); did you mean 'smoke'\?$"):
        resolve_profile("smok")
    with pytest.raises(UserError, match=r"matrix not found.*did you mean 'sweeps/smoke'\?$"):
        resolve_profile("sweeps/smoek.yaml", "matrix")
    with pytest.raises(UserError, match=r"zzzz: profile not found: [^;]*$"):  # nothing near: no suggestion
        resolve_profile("zzzz")


def test_the_cache_follows_xdg(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_root() == tmp_path / "dtrain"
    assert cache_root("~/elsewhere") != tmp_path / "dtrain"
