"""`python -m dtrain.engine.train --dry-run --topology T`: the run's plan (tokens per step, steps, checkpoints, the MODELED
all-reduce of the gradient) and the simulator's command, which prints the same plan with its modeled step time. And the
README's form, `python -m dtrain.train --profile profiles/<name>.yaml` from any folder, with the precision
`train.amp` resolves to on this machine."""

import re
import shlex
import subprocess
import sys

import pytest
import torch
from conftest import in_process

import dtrain.train
from dtrain.analysis.simulate import flop_timeline, predict
from dtrain.analysis.simulate.__main__ import main as simulate_main
from dtrain.collectives import costmodel as cm
from dtrain.engine import config as config_mod
from dtrain.engine import runplan
from dtrain.engine import train as engine_train
from dtrain.engine.host_cpu import bf16_native


def dry_run(*args):
    """`python -m dtrain.engine.train --dry-run ARGS`, its `main` run in this process (a dry run changes nothing of
    the process; the command itself, from another folder, is run by the README's test below)."""
    return in_process(engine_train.main, "--dry-run", *args)


def test_plan_of_the_wmt14_base_profile_on_two_nodes():
    r = dry_run("--profile", "dtrain/profiles/wmt14-en-de-base.yaml", "--topology", "h100x8-ib:2",
                "--set", "train.accum_steps=2")
    assert r.returncode == 0, r.stderr
    assert "d_model: 512" in r.stdout  # the resolved config is still printed first
    assert "tokens per step: at most 102,400 per side = data.max_tokens 3,200 x train.accum_steps 2 x 16" in r.stdout
    assert "steps: 100,000 (warm-up 4,000)" in r.stdout
    assert "corpus 4,500,000 training pairs" in r.stdout
    assert "checkpoints: every 1,000 steps (100 in all, the last 5 kept, the last 5 averaged" in r.stdout
    cfg = config_mod.load("dtrain/profiles/wmt14-en-de-base.yaml")
    nbytes = runplan.parameters(cfg) * 4
    ms = cm.NcclModel(cm.topology("h100x8-ib:2")).allreduce_ms(nbytes)
    assert f"one all-reduce of the whole fp32 gradient {ms:.2f} ms" in r.stdout
    assert ("python -m dtrain.analysis.simulate --plan --profile dtrain/profiles/wmt14-en-de-base.yaml --set train.accum_steps=2 "
            "--topology h100x8-ib:2") in r.stdout


def test_without_topology_the_plan_is_for_this_launch():
    r = dry_run("--profile", "dtrain/profiles/wmt14-en-de-big.yaml")
    assert r.returncode == 0, r.stderr
    assert "tokens per step: at most 3,200 per side" in r.stdout and "1 rank(s) of this launch" in r.stdout
    assert "300 in all, the last 20 kept" in r.stdout and "MODELED" not in r.stdout


@pytest.mark.parametrize("args,expected", [
    (["--dry-run", "--topology", "h100x8-ib:1"], "topology 'h100x8-ib:1': give the node count (>= 2)"),
    (["--topology", "h100x8"], "--topology is read by --dry-run only"),
])
def test_bad_topology_is_one_line_and_prints_nothing(args, expected):
    r = in_process(engine_train.main, "--profile", "dtrain/profiles/wmt14-en-de-base.yaml", *args)
    assert r.returncode == 2 and r.stdout == ""
    assert expected in r.stderr and r.stderr.strip().count("\n") == 0


def test_simulator_plan_is_the_predicted_step_of_the_profiles_strategy():
    profile, topology = "dtrain/profiles/wmt14-en-de-big.yaml", "h100x8"
    command = shlex.split(runplan.simulator_command(profile, [], topology))
    assert command[:3] == ["python", "-m", "dtrain.analysis.simulate"]
    r = in_process(simulate_main, *command[3:])
    assert r.returncode == 0, r.stderr
    out = r.stdout
    cfg = config_mod.load(profile)
    topo = cm.topology(topology)
    ref, curve, calib, _ = flop_timeline(cfg, topo)
    step = predict(cfg, ref, curve, cm.NcclModel(topo), calib, "ddp").step_ms
    assert f"MODELED step {step:.1f} ms" in out
    m = re.search(r"the whole run ([\d.]+) h", out)
    assert m and float(m.group(1)) == pytest.approx(step * 300_000 / 3.6e6, abs=0.05)
    assert out.splitlines()[0] == "# MODELED (no measurement)"


def test_simulator_plan_needs_a_profile():
    r = in_process(simulate_main, "--plan", "--topology", "h100x8")
    assert r.returncode == 2 and "--plan takes --profile and --topology" in r.stderr and r.stdout == ""


def test_dtrain_train_is_the_engine_s_entry_point():
    assert dtrain.train.main is engine_train.main  # one implementation: `python -m dtrain.train` and `dtrain train`


def test_nccl_settings_on_gloo_are_named_inactive_and_none_requested_is_silent():
    none = {"default": {"protocol": None, "algorithm": None}, "classes": {"ffn": {"protocol": None, "algorithm": None}}}
    ll128 = {"default": {"protocol": "LL128", "algorithm": None},
             "classes": {"ffn": {"protocol": "LL128", "algorithm": "ring"}}}

    def record(requested, applied=False):
        return {"applied": applied, "backend": "nccl" if applied else "gloo", "requested": requested}

    assert engine_train.nccl_inactive(record(ll128)) == (
        "dtrain.engine.train: NCCL settings inactive on backend gloo: algorithm ring, protocol LL128 recorded in run.json "
        "(nccl: requested, not applied)")
    assert engine_train.nccl_inactive(record(none)) is None
    assert engine_train.nccl_inactive(record(ll128, applied=True)) is None


@pytest.mark.slow
def test_the_readme_s_form_from_another_folder_finds_the_shipped_profile(tmp_path):
    """`--profile profiles/ll128.yaml` outside the checkout: the shipped one; a file of that path there wins."""
    cmd = [sys.executable, "-m", "dtrain.train", "--profile", "profiles/ll128.yaml", "--dry-run"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "name: base-ll128" in r.stdout and "protocol: LL128" in r.stdout
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / "ll128.yaml").write_text("name: mine\nmodel: {preset: tiny}\n")
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert r.returncode == 0 and "name: mine" in r.stdout, r.stderr


def test_the_dry_run_says_what_amp_auto_picks_here():
    native, reason = bf16_native(torch.device("cpu"))
    r = dry_run("--profile", "multi30k-cpu")
    assert r.returncode == 0, r.stderr
    assert "amp: auto" in r.stdout  # the profile's setting, resolved only on a device
    assert f"# precision here: {'bf16' if native else 'fp32'} (train.amp auto: {reason})" in r.stdout.splitlines()
    # bf16 exchanges need bf16 autocast: where auto picks fp32, one line naming both keys, before any output
    r = dry_run("--profile", "multi30k-cpu", "--set", "sync.strategy=sharded", "--set", "sync.gather_dtype=bf16")
    if native:
        assert r.returncode == 0 and "# precision here: bf16 (train.amp auto: " in r.stdout, r.stderr
    else:
        assert r.returncode == 2 and r.stdout == ""
        assert "'sync.gather_dtype' 'bf16' needs the forward under bf16 autocast" in r.stderr
