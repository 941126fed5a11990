"""examples/plain_loop.py: `collectives.attach` in a plain PyTorch loop, no dtrain trainer, on 2 gloo ranks."""

import os
import subprocess
import sys

import pytest

from conftest import REPO


@pytest.mark.slow
def test_plain_loop_keeps_every_rank_equal(tmp_path):
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        str(REPO / "examples" / "plain_loop.py"), "--strategy", "per_class", "--steps", "5"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "per_class: last loss" in r.stdout and "parameters equal on every rank: True" in r.stdout, r.stdout
