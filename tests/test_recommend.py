"""dtrain.analysis.recommend (`python -m dtrain.analysis.recommend --profile ... --topology ...`): per-class bucket caps and NCCL
choices for a profile's model, modeled, and the profile with them merged in."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dtrain.analysis import recommend as rec_mod
from dtrain.collectives import costmodel as cm
from dtrain.common.errors import UserError
from dtrain.engine import config as config_mod

H100 = cm.NcclModel(cm.topology("h100x8"))  # 12 channels x 30 GB/s, NVLink, one node of 8


def test_recommend_for_the_base_model_writes_a_valid_profile(tmp_path, capsys):
    out = tmp_path / "rec.yaml"
    rec_mod.main(["--profile", "dtrain/profiles/base.yaml", "--topology", "h100x8-ib:2", "--out", str(out), "--json"])
    rec = json.loads(capsys.readouterr().out)
    assert rec["modeled"] is True
    assert {r["class"] for r in rec["classes"]} == {"embedding", "projection", "ffn", "norm_bias"}
    # The recommendation never models worse than the per_class plan it starts from.
    assert rec["recommended"]["exposed_ms"] <= rec["per_class_profile_caps_default"]["exposed_ms"] + 1e-9
    cfg = config_mod.load(out)
    assert cfg.sync.strategy == "per_class"
    assert {c: v.bucket_cap_mb for c, v in cfg.sync.classes.items()} == {r["class"]: r["cap_mb"]
                                                                             for r in rec["classes"]}


def test_recommend_forces_a_protocol_only_where_measurements_beat_nccls_pick():
    cfg = config_mod.load("dtrain/profiles/base.yaml")
    # Measured (synthetic): Simple beats LL and LL128 at every size, where the analytic model picks LL for the
    # small norm/bias bucket and Simple for the 72 MiB embedding.
    fit = cm.FittedModel({"Ring/LL": [cm.Regime(math.inf, 15.0, 60.0)],
                          "Ring/LL128": [cm.Regime(math.inf, 40.0, 150.0)],
                          "Ring/Simple": [cm.Regime(math.inf, 10.0, 400.0)]}, ranks=8, name="fit")
    rec = rec_mod.recommend(cfg, H100, fit)
    by_class = {r["class"]: r for r in rec["classes"]}
    assert by_class["norm_bias"]["recommended"] == {"algo": "Ring", "proto": "Simple"}
    assert by_class["embedding"]["recommended"] is None  # NCCL already picks Simple there
    assert rec["overlay"]["sync"]["classes"]["norm_bias"] == {"bucket_cap_mb": by_class["norm_bias"]["cap_mb"],
                                                               "protocol": "Simple", "algorithm": "Ring"}
    assert rec["overlay"]["collectives"] == {"mode": "per_group"}
    assert rec["recommended"]["comm_ms"] < rec["recommended_caps_default"]["comm_ms"]
    # Merged into the profile, the forced choice is the class's own NCCL setting on its own communicator.
    text = rec_mod.overlay_yaml("dtrain/profiles/base.yaml", rec, ["--profile", "dtrain/profiles/base.yaml"])
    assert text.splitlines()[1].startswith("# From dtrain/profiles/base.yaml, with per-class bucket caps and NCCL choices")
    merged = config_mod.from_dict(yaml.safe_load(text), "rec.yaml")
    assert merged.collectives.mode == "per_group" and merged.sync.strategy == "per_class"
    assert (merged.sync.classes["norm_bias"].protocol, merged.sync.classes["norm_bias"].algorithm) == ("Simple", "Ring")
    # Under the analytic model alone NCCL's own pick is never beaten: nothing is forced.
    plain = rec_mod.recommend(cfg, H100)
    assert all(r["recommended"] is None for r in plain["classes"]) and "collectives" not in plain["overlay"]


def test_a_fitted_model_without_a_run_is_a_user_error():
    cfg = config_mod.load("dtrain/profiles/base.yaml")
    fit = cm.FittedModel({"measured": [cm.Regime(math.inf, 100.0, 1.0)]}, ranks=2)
    with pytest.raises(UserError, match="needs --run"):
        rec_mod.recommend(cfg, fit)


@pytest.mark.parametrize("argv,msg", [
    (["--profile", "dtrain/profiles/base.yaml", "--topology", "h100x8", "--out", "/nonexistent/dir/rec.yaml"],
     "does not exist"),
    (["--profile", "dtrain/profiles/base.yaml", "--topology", "nope"], "unknown topology 'nope'"),
    (["--profile", "dtrain/profiles/base.yaml"], "--topology"),
])
def test_bad_command_lines_are_one_line_errors(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        rec_mod.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("dtrain.analysis.recommend: error: ") \
        and msg in err, err


@pytest.mark.slow
def test_the_command_runs_as_a_module_and_only_there():
    repo = Path(__file__).parent.parent
    r = subprocess.run([sys.executable, "-m", "dtrain.analysis.recommend", "--help"], capture_output=True, text=True,
                       cwd=repo)
    assert r.returncode == 0 and "--profile" in r.stdout and "--fit" in r.stdout
    r = subprocess.run([sys.executable, "-m", "dtrain.collectives.costmodel", "recommend", "--profile", "dtrain/profiles/base.yaml",
                        "--topology", "h100x8"], capture_output=True, text=True, cwd=repo)
    assert r.returncode == 2 and "unknown command 'recommend'" in r.stderr
