import errno
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO

from dtrain.common.errors import JobFailure
from dtrain.engine import checkpoint


def _state(v, step=None):
    return {"step": int(v) if step is None else step, "model": {"w": torch.full((3,), float(v))}}


def test_save_prunes_and_latest_is_newest(tmp_path):
    for step in (10, 20, 30, 40):
        checkpoint.save(tmp_path, step, _state(step), keep=2)
    names = [p.name for p in checkpoint.list_checkpoints(tmp_path)]
    assert names == ["step-0000030.pt", "step-0000040.pt"]
    assert checkpoint.latest(tmp_path).name == "step-0000040.pt"
    assert not list((tmp_path / "checkpoints").glob(".*tmp"))


def test_truncated_checkpoint_is_skipped_with_warning(tmp_path):
    checkpoint.save(tmp_path, 10, _state(10), keep=3)
    path = checkpoint.save(tmp_path, 20, _state(20), keep=3)
    path.write_bytes(path.read_bytes()[:100])  # killed mid-write, or disk corruption
    with pytest.warns(UserWarning, match="checksum mismatch"):
        assert checkpoint.latest(tmp_path).name == "step-0000010.pt"


def test_checkpoint_without_checksum_is_incomplete(tmp_path):
    checkpoint.save(tmp_path, 10, _state(10), keep=3)
    path = checkpoint.save(tmp_path, 20, _state(20), keep=3)
    path.with_name(path.name + ".sha256").unlink()
    with pytest.warns(UserWarning, match="no checksum file"):
        assert checkpoint.latest(tmp_path).name == "step-0000010.pt"


def test_average_is_elementwise_mean(tmp_path):
    paths = [checkpoint.save(tmp_path, s, _state(s), keep=5) for s in (1, 2, 6)]
    assert torch.allclose(checkpoint.average(paths)["w"], torch.full((3,), 3.0))


def test_diff_and_inspect_cli(tmp_path, capsys):
    a = checkpoint.save(tmp_path / "a", 5, _state(1, step=5), keep=1)
    checkpoint.save(tmp_path / "b", 5, _state(1.5, step=5), keep=1)
    checkpoint.main(["diff", str(tmp_path / "a"), str(tmp_path / "b")])
    assert "max |A - B| over parameters: 0.5" in capsys.readouterr().out
    checkpoint.main(["inspect", str(a)])
    out = capsys.readouterr().out
    assert "step        5" in out and "checksum    ok" in out


def test_inspect_reports_a_truncated_checkpoint(tmp_path, capsys):
    path = checkpoint.save(tmp_path, 5, _state(1, step=5), keep=1)
    path.write_bytes(path.read_bytes()[:50])
    assert checkpoint.main(["inspect", str(path)]) == 1
    out = capsys.readouterr().out
    assert "checksum    checksum mismatch" in out and "contents    unreadable" in out


def test_missing_checkpoint_is_a_user_error(tmp_path):
    with pytest.raises(SystemExit) as e:
        checkpoint.main(["inspect", str(tmp_path / "x.pt")])
    assert e.value.code == 2


# ---------------------------------------------------------------------------------------------------------------
# A write that fails (a full disk) leaves the previous checkpoint the latest complete one


def _enospc():
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _assert_only_step_10_remains(run):
    """Nothing of the failed write is left, and step 10 is still complete and the one `latest` (and --resume) takes."""
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-0000010.pt", "step-0000010.pt.sha256"]
    assert checkpoint.latest(run).name == "step-0000010.pt"
    assert checkpoint.load(checkpoint.latest(run))["step"] == 10


def test_failed_data_write_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    checkpoint.save(tmp_path, 10, _state(10), keep=3)
    real_save = torch.save

    def save_until_the_disk_fills(obj, f):  # as torch.save reports it: a RuntimeError raised over the OSError
        real_save(obj, f)
        try:
            raise _enospc()
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc] unexpected pos 704 vs 598")

    monkeypatch.setattr(checkpoint.torch, "save", save_until_the_disk_fills)
    with pytest.raises(JobFailure, match=r"step-0000020.pt: checkpoint not written \(no space left on device\)") as e:
        checkpoint.save(tmp_path, 20, _state(20), keep=3)
    assert "\n" not in str(e.value)
    _assert_only_step_10_remains(tmp_path)


def test_failed_checksum_write_removes_the_renamed_file(tmp_path, monkeypatch):
    checkpoint.save(tmp_path, 10, _state(10), keep=1)

    def no_space(path, text):
        raise _enospc()

    monkeypatch.setattr(checkpoint, "replace_atomically", no_space)
    with pytest.raises(JobFailure, match=r"step-0000020.pt: checkpoint not written \(no space left on device\)"):
        checkpoint.save(tmp_path, 20, _state(20), keep=1)
    _assert_only_step_10_remains(tmp_path)  # nor was step 10 pruned for keep=1


def test_failed_write_of_the_averaged_model_keeps_the_previous_one(tmp_path, monkeypatch):
    paths = [checkpoint.save(tmp_path, s, _state(s), keep=2) for s in (10, 20)]
    first = checkpoint.save_averaged(tmp_path, checkpoint.average(paths), paths)
    before = first.read_bytes()

    def no_space(fd):
        raise _enospc()

    monkeypatch.setattr(checkpoint.os, "fsync", no_space)
    with pytest.raises(JobFailure, match=r"averaged.pt: averaged model not written \(no space left on device\)"):
        checkpoint.save_averaged(tmp_path, {"w": torch.zeros(3)}, paths)
    assert first.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["averaged.pt", "checkpoints"]


def test_a_state_that_cannot_be_pickled_is_a_bug_not_a_disk_error(tmp_path):
    with pytest.raises(Exception, match="lambda") as e:
        checkpoint.save(tmp_path, 10, {"model": {"w": torch.zeros(1)}, "bad": lambda: 0}, keep=1)
    assert not isinstance(e.value, JobFailure)
    assert list((tmp_path / "checkpoints").iterdir()) == []


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs, so that a real write runs out of space (needs root; mounted for this test only)."""
    where = tmp_path / "disk"
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(where)], capture_output=True, text=True,
                       check=False)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {(r.stderr or r.stdout).strip() or 'mount failed'}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


def _fill(disk, leave: int) -> Path:
    """Write a file that leaves `leave` bytes free on `disk`."""
    st = os.statvfs(disk)
    filler = disk / "filler"
    filler.write_bytes(b"\0" * (st.f_bavail * st.f_frsize - leave))
    return filler


def test_full_disk_leaves_the_previous_checkpoint(small_disk):
    def state(v):  # 1 MiB of parameters
        return {"step": v, "model": {"w": torch.full((3,), float(v)), "big": torch.zeros(1 << 18)}}

    checkpoint.save(small_disk, 10, state(10), keep=3)
    filler = _fill(small_disk, leave=(1 << 19))
    with pytest.raises(JobFailure) as e:
        checkpoint.save(small_disk, 20, state(20), keep=3)
    assert "\n" not in str(e.value)
    assert re.fullmatch(r".*/checkpoints/step-0000020\.pt: checkpoint not written \(no space left on device\); "
                        r"the earlier checkpoints are untouched", str(e.value)), str(e.value)
    _assert_only_step_10_remains(small_disk)
    filler.unlink()  # with space again, the same step saves: the failure left nothing in its way
    assert checkpoint.save(small_disk, 20, state(20), keep=3) == checkpoint.latest(small_disk)


@pytest.mark.slow
def test_full_disk_during_training_then_resume(small_disk):
    """dtrain.engine.train on a disk that fills before its second checkpoint: one line, exit 3, and the first checkpoint is
    still the one --resume takes."""
    def train(*args):
        return subprocess.run([sys.executable, "-m", "dtrain.engine.train", "--profile", "dtrain/profiles/smoke.yaml", "--run-dir",
                               str(run), "--set", "eval.at_end=false", "--set", "train.average_last=1", *args],
                              capture_output=True, text=True, cwd=REPO, check=False, timeout=300)

    subprocess.run(["mount", "-o", "remount,size=16m", str(small_disk)], check=True)
    run = small_disk / "run"
    r = train("--set", "train.max_steps=10")
    assert r.returncode == 0, r.stderr[-3000:]
    _fill(small_disk, leave=(run / "checkpoints" / "step-0000010.pt").stat().st_size // 2)
    r = train("--resume", "--set", "train.max_steps=20")
    assert r.returncode == 3 and "Traceback" not in r.stderr, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and re.search(r"step-0000020.pt: checkpoint not written \(no space left on device\)",
                                          errors[0]), r.stderr[-3000:]
    assert re.search(r"resumed from .*step-0000010.pt at step 10", r.stdout), r.stdout
    _assert_only_step_10_remains(run)  # what the next --resume would take
