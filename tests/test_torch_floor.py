"""The torch floor (pyproject's `torch>=`, `dtrain.common.torch_version.FLOOR`), the gates of the features that need a
later release, and no FutureWarning in any strategy's normal run."""

import ast
import functools
import re

import pytest
import torch

from conftest import REPO, launch_ranks
from dtrain.collectives.strategies import attachable
from dtrain.common import torch_version
from dtrain.common.errors import UserError
from dtrain.common.torch_version import FLOOR, GATED, NORMAL_PATH, release, require_torch


def test_release_reads_major_and_minor_as_numbers():
    assert release("2.13.0+cpu") == (2, 13)
    assert release("2.9.0a0+git1234abc") == release("2.9.0rc1") == release("2.9") == (2, 9)
    assert release("2.10.0.dev20250101") > release("2.9.1")  # 10 > 9, not '1' < '9'
    with pytest.raises(ValueError):
        release("unknown")


@pytest.mark.parametrize("fake", ["2.8.1+cpu", "2.8.0a0+gitabc", "1.13.1"])
def test_a_gate_on_an_older_torch_is_one_line_naming_the_release(monkeypatch, fake):
    monkeypatch.setattr(torch, "__version__", fake)
    with pytest.raises(UserError) as e:
        require_torch("2.9", "sync.fsdp2_collectives")
    assert str(e.value) == f"sync.fsdp2_collectives needs torch >= 2.9 (this is {fake})"
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("fake", ["2.9.0", "2.9.0a0+gitabc", "2.10.0+cpu", "2.13.0+cpu", "3.0.0"])
def test_a_gate_on_that_release_or_a_later_one_passes(monkeypatch, fake):
    monkeypatch.setattr(torch, "__version__", fake)
    require_torch("2.9", "sync.fsdp2_collectives")
    assert torch_version.at_least("2.9")


def pyproject_floor() -> str:
    """The release in pyproject's `torch>=X` dependency."""
    text = (REPO / "pyproject.toml").read_text()
    found = re.findall(r'^\s*"torch\s*>=\s*([0-9][0-9.]*)"', text, re.M)
    assert len(found) == 1, f"expected one torch>= dependency in pyproject.toml, found {found}"
    return found[0]


def test_the_floor_is_the_newest_release_the_normal_paths_need():
    """pyproject's floor is FLOOR; FLOOR is the newest release any API of the normal paths needs (not lower: the normal
    run would fail; not higher: it would refuse a torch that works); each gated feature needs a later release than
    FLOOR (else it belongs to the normal path); and the README says the same."""
    assert pyproject_floor() == FLOOR
    assert release(FLOOR) == max(release(v) for v in NORMAL_PATH.values()), NORMAL_PATH
    later = {f: v for f, v in GATED.items() if release(v) <= release(FLOOR)}
    assert not later, f"gated, yet not later than the floor {FLOOR}: {later}"
    assert f"PyTorch ≥ {FLOOR}" in (REPO / "README.md").read_text()
    assert torch_version.at_least(FLOOR), f"this torch {torch.__version__} is below the floor {FLOOR}"


@functools.cache
def gate_calls() -> tuple[tuple[str, str, str], ...]:
    """(file:line, version, feature) of every `require_torch("version", "feature")` call in dtrain/."""
    calls = []
    for path in sorted((REPO / "dtrain").rglob("*.py")):
        text = path.read_text()
        if "require_torch(" not in text:
            continue
        for node in ast.walk(ast.parse(text, str(path))):
            name = getattr(node, "func", None)
            if isinstance(node, ast.Call) and getattr(name, "id", getattr(name, "attr", None)) == "require_torch":
                where = f"{path.relative_to(REPO)}:{node.lineno}"
                args = [a.value if isinstance(a, ast.Constant) else None for a in node.args]
                assert len(args) == 2 and all(isinstance(a, str) for a in args), \
                    f"{where}: require_torch takes two literal strings (version, feature)"
                calls.append((where, *args))
    return tuple(calls)


def test_every_gate_names_the_release_listed_for_its_feature():
    wrong = [c for c in gate_calls() if GATED.get(c[2]) != c[1]]
    assert not wrong, f"require_torch calls that disagree with torch_version.GATED {GATED}: {wrong}"


def test_every_gated_feature_is_gated_where_it_is_built():
    gated = {feature for _, _, feature in gate_calls()}
    assert set(GATED) <= gated, f"no require_torch call for {sorted(set(GATED) - gated)}"


@pytest.mark.slow
def test_no_strategy_warns_in_its_normal_run():
    """Every attachable strategy, and fsdp2 with its own collectives (async, p2p), 3 steps each in one job on 2 gloo
    ranks (~15 s), FutureWarning and DeprecationWarning errors in every process (each rank checks that the filter
    holds in it: tests/warnings_loop.py)."""
    r = launch_ranks([REPO / "tests" / "warnings_loop.py", "--steps", "3"], timeout=240,
                     env={"PYTHONWARNINGS": "error::FutureWarning,error::DeprecationWarning"})
    ran = re.findall(r"^ran (\S+)$", r.stdout, re.M)
    assert ran == [*attachable(), "fsdp2+async", "fsdp2+p2p"], r.stdout
    assert set(attachable()) >= {"ddp", "per_tensor", "flat", "bucketed", "per_class", "sharded", "fsdp2",
                                 "powersgd", "noop"}
