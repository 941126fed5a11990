import pytest
import torch

from dtrain import checkpoint


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
