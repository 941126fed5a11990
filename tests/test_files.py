"""dtrain.common.files: output paths checked before the work, files written whole or not at all."""

import os

import pytest

from dtrain.common.errors import UserError
from dtrain.common.files import check_writable, output_dir, write_atomic


def test_output_paths_are_checked_and_named(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(UserError, match=r"--json .*: is a directory"):
        check_writable(tmp_path, "--json")
    with pytest.raises(UserError, match=r"--json .*: the folder .*nowhere does not exist"):
        check_writable(tmp_path / "nowhere" / "x.json", "--json")
    assert check_writable(tmp_path / "x.json", "--json") == tmp_path / "x.json"
    with pytest.raises(UserError, match=r"--out .*afile: a file is in the way"):
        output_dir(tmp_path / "afile", "--out")
    with pytest.raises(UserError, match=r"--out .*afile/sub: cannot make this folder"):
        output_dir(tmp_path / "afile" / "sub", "--out")
    assert output_dir(tmp_path / "new" / "deep", "--out").is_dir()


def test_a_write_replaces_the_file_whole(tmp_path):
    target = tmp_path / "fit.json"
    target.write_text("old")
    write_atomic(target, "new", "--out")
    assert target.read_text() == "new" and os.listdir(tmp_path) == ["fit.json"]  # no temporary file left
    with pytest.raises(UserError, match="--out"):
        write_atomic(tmp_path / "missing" / "fit.json", "new", "--out")
