"""dtrain.analysis.tune: the candidate space of an auto profile as an interleave matrix, and its one-line errors."""

import pytest
import yaml

from dtrain.analysis import tune
from dtrain.analysis.interleave import load_configs
from conftest import REPO

PROFILE = str(REPO / "dtrain" / "profiles" / "tune-testbed.yaml")


def test_the_space_matrix_interleaves_every_candidate_as_itself(tmp_path):
    out = tmp_path / "space.yaml"
    assert tune.main(["--profile", PROFILE, "--set", "train.threads=1", "--matrix-out", str(out), "--steps", "7"]) == 0
    matrix = yaml.safe_load(out.read_text())
    assert "&" not in out.read_text()  # no YAML anchors
    cells = {name.removeprefix("tune-testbed-"): cfg for name, cfg in load_configs(str(out), [])}
    assert list(cells) == ["ddp-25", "ddp-2", "bucketed-2", "bucketed-0.5-split", "sharded-2", "sharded-0.5",
                           "sharded-8"]
    split = cells["bucketed-0.5-split"]
    assert (split.sync.strategy, split.sync.bucket_cap_mb, split.sync.classes["embedding"].tied_split) == \
        ("bucketed", 0.5, True)
    assert all(c.train.max_steps == 7 and c.train.threads == 1 and c.data.max_tokens == 1024 for c in cells.values())
    assert matrix["launcher"] == "testbed"


@pytest.mark.parametrize("args, words", [
    (["--profile", str(REPO / "dtrain" / "profiles" / "smoke.yaml"), "--out", "x"], "needs auto"),
    (["--profile", PROFILE], "--out is required"),
])
def test_bad_arguments_are_one_line(args, words, capsys):
    with pytest.raises(SystemExit) as e:
        tune.main(args)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and words in err and "\n" not in err, err


def test_the_space_of_a_profile_set_to_auto_on_the_command_line(tmp_path):
    """A profile made `auto` by --set: the matrix leaves sync.strategy to each variant (a sweep refuses it set in two
    places) and keeps the other overrides' types."""
    out = tmp_path / "space.yaml"
    profile = str(REPO / "dtrain" / "profiles" / "multi30k-cpu.yaml")
    assert tune.main(["--profile", profile, "--set", "sync.strategy=auto", "--set", "train.amp=fp32", "--set",
                      "data.max_tokens=1024", "--matrix-out", str(out), "--steps", "7"]) == 0
    matrix = yaml.safe_load(out.read_text())
    assert "sync.strategy" not in matrix["set"] and matrix["set"]["data.max_tokens"] == 1024
    cells = dict(load_configs(str(out), []))
    assert len(cells) > 10 and all(c.data.max_tokens == 1024 and c.train.amp == "fp32" for c in cells.values())
