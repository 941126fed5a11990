"""Behaviour pinned: every golden case of tests/golden.py prints exactly what tests/data/golden/ holds."""

import pytest

from golden import GOLDEN, cases, render


@pytest.mark.parametrize("name,module,argv", cases(), ids=[c[0] for c in cases()])
def test_output_unchanged(name, module, argv, monkeypatch):
    monkeypatch.chdir(GOLDEN.parents[2])
    want = (GOLDEN / (name if "." in name else name + ".txt")).read_text()
    assert render(name, module, argv) == want
