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
from dtrain.common import host_memory
from dtrain.engine import config as config_mod
from dtrain.engine.trainer import Trainer
cfg = config_mod.load("dtrain/profiles/multi30k-cpu.yaml", ["data.max_tokens=1100", "eval.at_end=false", "model.N=1",
                                                        "model.d_model=64", "model.d_ff=128", "model.h=2", sys.argv[1]])
with host_memory.kept_freed_memory(cfg.train.keep_host_memory, "cpu"):  # as dtrain.engine.train sets it
    trainer = Trainer(cfg, sys.argv[2], ddist.init(cfg.collectives)[0], "gloo")
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


# attach's search on one gloo rank, in a process that keeps freed memory: a 64 MiB block freed during the search is
# handed back to the OS, one freed after it is kept.
# What a 64 MiB block freed now hands back to the OS (MiB of resident memory), in the scripts below.
FREED = """
import torch

def rss_mib():
    return int(next(line for line in open("/proc/self/status") if line.startswith("VmRSS")).split()[1]) // 1024

def freed_mib():
    x = torch.ones(16 * 2**20)  # 64 MiB, touched
    held = rss_mib()
    del x
    return held - rss_mib()
"""

SEARCH = FREED + """
import sys
import torch.distributed as dist
from dtrain.collectives import attach
from dtrain.collectives.settings import SyncConfig, TuneConfig
from dtrain.common import host_memory
from dtrain.engine import verify

dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
host_memory.keep_freed_memory()
tune = TuneConfig(candidates={"ddp": {"strategy": "ddp"}, "bucketed": {"strategy": "bucketed"}}, budget_steps=4,
                  warmup_rounds=1, min_rounds=2)
handle = attach(verify.tiny_model(), SyncConfig(strategy="auto", tune=tune))
opt = torch.optim.Adam(handle.optimizer_params(), lr=0.01)
seen = []
for step in range(6):
    seen.append((handle.winner is None, host_memory.allocator_mode(), freed_mib()))
    src, tgt_in, tgt_out = verify.batch(0, step, 0)
    verify.loss_fn(handle.module(src, tgt_in), tgt_out, 1).backward()
    handle.wait()
    opt.step()
    handle.stepped(opt)
    opt.zero_grad(set_to_none=True)
seen.append((handle.winner is None, host_memory.allocator_mode(), freed_mib()))
print(seen)
"""


@pytest.mark.slow
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc parameters")
def test_the_search_maps_large_blocks_and_keeps_freed_memory_after_it(tmp_path):
    r = subprocess.run([sys.executable, "-c", SEARCH, str(tmp_path / "init")], cwd=REPO, capture_output=True,
                       text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    seen = eval(r.stdout.strip().splitlines()[-1])
    searching = [s for s in seen if s[0]]
    after = [s for s in seen if not s[0]]
    assert searching and after, seen
    assert all(mode == "large blocks mapped" and freed >= 60 for _, mode, freed in searching), seen
    assert all(mode == "kept" and freed < 4 for _, mode, freed in after), seen


# Kept memory inside the block, glibc's defaults after it even when the block raises: a 64 MiB block freed after it is
# handed back to the OS again. Nothing is set where the setting does not ask, nor on a CUDA device.
RESTORE = FREED + """
from dtrain.common import host_memory

with host_memory.kept_freed_memory(False, "cpu") as what:
    print("off:", what, host_memory.allocator_mode())
with host_memory.kept_freed_memory(True, "cuda") as what:
    print("cuda:", what, host_memory.allocator_mode())
try:
    with host_memory.kept_freed_memory(True, "cpu") as what:
        print("inside:", what, freed_mib())
        raise RuntimeError("a failed step")
except RuntimeError:
    pass
print("after:", host_memory.allocator_mode(), freed_mib())
"""


@pytest.mark.slow
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc parameters")
def test_kept_memory_is_undone_on_every_way_out_and_never_set_on_cuda():
    r = subprocess.run([sys.executable, "-c", RESTORE], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = dict(line.split(": ", 1) for line in r.stdout.strip().splitlines())
    assert lines["off"] == "returned to the OS (glibc default) glibc default"
    assert lines["cuda"].endswith("not set on a cuda device glibc default")
    kept, freed_inside = lines["inside"].split()
    assert kept == "kept" and int(freed_inside) < 8  # kept in the heap
    mode, freed_after = lines["after"].rsplit(" ", 1)
    assert mode == "glibc default" and int(freed_after) >= 60  # handed back: the defaults are back
