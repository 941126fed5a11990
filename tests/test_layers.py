"""The layering contract in pyproject.toml (analysis > engine > collectives > common, under dtrain) holds, and breaks when a lower
layer imports a higher one."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    # import-linter reads the contract from the pyproject.toml in its working directory and imports the packages
    # from there, so a copy of the tree is checked as it stands, not the installed one.
    return subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command; "
                           "lint_imports_command()", "--no-cache"],
                          cwd=root, capture_output=True, text=True, env={"PYTHONPATH": str(root), "PATH": "/usr/bin"})


@pytest.mark.slow
def test_the_layers_hold():
    r = lint_imports(REPO)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 kept, 0 broken" in r.stdout


def lint_with_import(tmp_path: Path, module: str, line: str) -> subprocess.CompletedProcess:
    """`lint_imports` over a copy of the tree whose `module` (a path under dtrain/) ends with the import `line`."""
    shutil.copytree(REPO / "dtrain", tmp_path / "dtrain", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    path = tmp_path / "dtrain" / module
    path.write_text(path.read_text() + f"\n{line}  # noqa: E402,F401\n")
    return lint_imports(tmp_path)


@pytest.mark.slow
def test_an_import_up_the_layers_breaks_the_contract(tmp_path):
    r = lint_with_import(tmp_path, "collectives/sync.py", "from dtrain.engine import model")
    assert r.returncode != 0
    assert "dtrain.collectives is not allowed to import dtrain.engine" in r.stdout
    assert "dtrain.collectives.sync -> dtrain.engine.model" in r.stdout


@pytest.mark.slow
def test_a_circle_inside_the_communication_library_breaks_its_contract(tmp_path):
    """The registry importing a strategy back (as it once imported them all at its bottom) is a circle."""
    r = lint_with_import(tmp_path, "collectives/registry.py", "from dtrain.collectives.strategies import ddp")
    assert r.returncode != 0
    assert "no circle among dtrain.collectives' packages and modules BROKEN" in r.stdout
