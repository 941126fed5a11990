"""train.keep_host_memory: freed host memory is kept for the next allocation instead of handed back to the OS, so a
step's large tensors are not faulted in again page by page (dtrain/common/host_memory.py). Each case runs in a process of
its own: the setting is process-wide."""

import platform
import subprocess
import sys

import pytest

from conftest import REPO

from dtrain.common.errors import UserError
from dtrain.engine import config as config_mod

# A few steps of the CPU profile on one rank: the page faults of a typical step after two. Its logits, (tokens, vocab)
# = (1100, 8000) float32, are above glibc's largest mmap threshold (32 MiB), so by default every step maps them anew.
# The layers are made small (d_model 64, one of each) so that the steps take seconds; the logits keep their size.
SCRIPT = """
import resource, sys
from dtrain.collectives import dist as ddist
from dtrain.engine import config as config_mod
from dtrain.engine.trainer import Trainer
cfg = config_mod.load("dtrain/profiles/multi30k-cpu.yaml", ["data.max_tokens=1100", "eval.at_end=false", "model.N=1",
                                                        "model.d_model=64", "model.d_ff=128", "model.h=2", sys.argv[1]])
trainer = Trainer(cfg, sys.argv[2], ddist.init(cfg.dist)[0], "gloo")
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
per_step = []
for step in range(8):
    before = faults()
    trainer.train_step()
    per_step.append(faults() - before)
print(trainer.host_memory, "|", sorted(per_step[2:])[3])  # the median of steps 3-8 (a larger batch grows the heap)
"""


def faults_per_step(tmp_path, keep: bool) -> tuple[str, int]:
    r = subprocess.run([sys.executable, "-c", SCRIPT, f"train.keep_host_memory={str(keep).lower()}",
                        str(tmp_path / str(keep))], cwd=REPO, capture_output=True, text=True, timeout=300,
                       check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    what, faults = r.stdout.strip().splitlines()[-1].split(" | ")
    return what, int(faults)


@pytest.mark.slow
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc parameters")
def test_kept_memory_is_not_faulted_in_again_each_step(tmp_path, multi30k_dir):
    what, default = faults_per_step(tmp_path, keep=False)
    assert what.startswith("returned") and default > 5000  # the logits alone are 8,000+ pages
    what, kept = faults_per_step(tmp_path, keep=True)
    assert what == "kept" and kept < default / 5


def test_the_setting_is_a_checked_bool():
    assert config_mod.load("dtrain/profiles/smoke.yaml").train.keep_host_memory is True
    assert config_mod.load("dtrain/profiles/smoke.yaml", ["train.keep_host_memory=false"]).train.keep_host_memory is False
    with pytest.raises(UserError) as e:
        config_mod.load("dtrain/profiles/smoke.yaml", ["train.keep_host_memory=sometimes"])
    assert "train.keep_host_memory" in str(e.value) and "\n" not in str(e.value)
