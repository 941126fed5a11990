"""collectives.nccl, the profile side: validation, per-class resolution, version guards, the plan each process group
gets (what `--dry-run` prints), the CSV for NCCL's example tuner plugin, and the command line's exit codes."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from collectives import nccl
from dtrain import config
from dtrain.config import NcclSettings
from common.errors import UserError

REPO = Path(__file__).resolve().parents[1]


def cfg_of(collectives: dict, sync: dict | None = None):
    return config.from_dict({"collectives": collectives, "sync": sync or {"strategy": "per_class"}})


PER_GROUP = {"mode": "per_group", "classes": {"projection": {"proto": "LL", "algo": "Ring"},
                                              "embedding": {"proto": "Simple", "algo": "Ring", "max_ctas": 16}}}


@pytest.mark.parametrize("section, key", [
    ({"classes": {"ffn": {"proto": "LL"}}}, "collectives.classes"),  # per-class settings in global mode
    ({"mode": "per_group", "classes": {"ffn": {"algo": "PAT"}}}, "collectives.classes.ffn.algo"),
    ({"mode": "per_group", "classes": {"ffn": {"algo": "NVLS", "proto": "LL128"}}}, "collectives.classes.ffn.proto"),
    ({"mode": "per_group", "classes": {"ffn": {"proto": "ll"}}}, "collectives.classes.ffn.proto"),
    ({"mode": "tuner", "classes": {"ffn": {"min_ctas": 8, "max_ctas": 4}}}, "collectives.classes.ffn.min_ctas"),
    ({"mode": "tuner", "classes": {"a,b": {"proto": "LL"}}}, "collectives.classes.a,b"),
    ({"mode": "pergroup"}, "collectives.mode"),
    ({"default": {"proto": "LL", "channels": 4}}, "collectives.default.channels"),
])
def test_bad_sections_name_their_key(section, key):
    with pytest.raises(UserError, match=f"'{key}'"):
        cfg_of(section)


def test_every_shipped_nccl_profile_loads_and_renders():
    for name in ("ll", "ll128", "simple", "tree", "per_group", "tuner"):
        cfg = config.load(REPO / "profiles" / f"{name}.yaml")
        text = nccl.plan_text(cfg, backend="nccl")
        assert text.startswith(f"NCCL plan: mode {cfg.collectives.mode}")


def test_global_mode_sets_one_job_environment_restricted_to_allreduce():
    plan = nccl.build_plan(config.load(REPO / "profiles" / "ll128.yaml"), version=(2, 26, 2))
    assert plan.process_env == {"NCCL_PROTO": "allreduce:LL128"}
    assert all(g.env == {} and g.settings.proto == "LL128" for g in plan.groups)
    assert any("LL128 is forced" in w and "#wrong" in w for w in plan.warnings)
    validated = cfg_of({"default": {"proto": "LL128"}, "validated": True})
    assert not any("LL128" in w for w in nccl.build_plan(validated).warnings)
    tree = nccl.build_plan(config.load(REPO / "profiles" / "tree.yaml"), version=(2, 30, 1))
    assert tree.process_env == {"NCCL_ALGO": "allreduce:Tree"}


def test_global_ctas_go_to_the_process_wide_variables():
    plan = nccl.build_plan(cfg_of({"default": {"proto": "Simple", "min_ctas": 2, "max_ctas": 8}}))
    assert plan.process_env == {"NCCL_PROTO": "allreduce:Simple", "NCCL_MIN_CTAS": "2", "NCCL_MAX_CTAS": "8"}


def test_per_group_plan_gives_each_class_its_variables_and_cta_options():
    plan = nccl.build_plan(cfg_of(PER_GROUP))
    assert plan.process_env == {} and plan.files == {}
    assert plan.group("world").env == {}
    assert plan.group("projection").env == {"NCCL_PROTO": "allreduce:LL", "NCCL_ALGO": "allreduce:Ring"}
    emb = plan.group("embedding")
    assert emb.env == {"NCCL_PROTO": "allreduce:Simple", "NCCL_ALGO": "allreduce:Ring"}
    assert emb.options == {"max_ctas": 16}
    assert plan.group("ffn").env == {} and plan.group("ffn").options == {}
    # Before 2.24 the plain value: a class communicator only runs its all-reduces anyway.
    old = nccl.build_plan(cfg_of(PER_GROUP), version=(2, 23, 4))
    assert old.group("projection").env == {"NCCL_PROTO": "LL", "NCCL_ALGO": "Ring"}


def test_default_fills_what_a_class_leaves_open():
    cfg = cfg_of({"mode": "per_group", "default": {"proto": "LL128"},
                  "classes": {"projection": {"algo": "Ring"}, "embedding": {"proto": "Simple"}}})
    assert nccl.resolve(cfg, "projection") == NcclSettings(proto="LL128", algo="Ring")
    assert nccl.resolve(cfg, "embedding") == NcclSettings(proto="Simple")
    assert nccl.resolve(cfg, "ffn") == NcclSettings(proto="LL128")


def test_strategy_settings_merge_and_conflicts_are_errors():
    sync = {"strategy": "per_class", "classes": {"ffn": {"protocol": "LL128", "max_ctas": 4}}}
    cfg = cfg_of({"mode": "per_group", "classes": {"ffn": {"algo": "Ring"}}}, sync)
    assert nccl.resolve(cfg, "ffn") == NcclSettings(proto="LL128", algo="Ring", max_ctas=4)
    # What the strategy passes to class_group: a CollectiveSettings-like object or its .nccl() dict.
    assert nccl.resolve(cfg, "ffn", {"protocol": "LL128"}) == NcclSettings(proto="LL128", algo="Ring")
    clash = cfg_of({"mode": "per_group", "classes": {"ffn": {"proto": "Simple"}}}, sync)
    with pytest.raises(UserError, match=r"'collectives.classes.ffn.proto' \(Simple\) contradicts "
                                        r"'sync.classes.ffn.protocol' \(LL128\)"):
        nccl.build_plan(clash)
    with pytest.raises(UserError, match="'sync.classes.ffn' sets NCCL choices"):
        nccl.build_plan(cfg_of({"mode": "global"}, sync))


def test_unknown_class_name_is_an_error():
    with pytest.raises(UserError, match="'collectives.classes.embeding' names no tensor class"):
        nccl.build_plan(cfg_of({"mode": "per_group", "classes": {"embeding": {"proto": "LL"}}}))


def test_tuner_plan_ships_rules_and_names_each_class_at_creation():
    cfg = cfg_of({"mode": "tuner", "default": {"proto": "Simple"},
                  "classes": {"projection": {"proto": "LL", "algo": "Ring"}, "ffn": {"algo": "Tree", "max_ctas": 8}}})
    plan = nccl.build_plan(cfg)
    (path, rules), = plan.files.items()
    assert plan.process_env == {"NCCL_TUNER_PLUGIN": str(nccl.tuner_lib_path()), "DTRAIN_TUNER_RULES": path}
    body = [line for line in rules.splitlines() if not line.startswith("#")]
    assert body == ["embedding,allreduce,0,-1,-1,simple,-1", "norm_bias,allreduce,0,-1,-1,simple,-1",
                    "projection,allreduce,0,-1,ring,ll,-1", "ffn,allreduce,0,-1,tree,simple,8",
                    "other,allreduce,0,-1,-1,simple,-1", "*,allreduce,0,-1,-1,simple,-1"]
    assert plan.group("ffn").env == {"DTRAIN_TUNER_CLASS": "ffn"} and plan.group("ffn").options == {"max_ctas": 8}
    assert plan.group("world").env == {}  # the default group serves no class: the plugin leaves it alone


@pytest.mark.parametrize("section, version, message", [
    (PER_GROUP, (2, 27, 3), "2.27.0-2.27.4 cache NCCL_PROTO/NCCL_ALGO"),
    ({"default": {"algo": "Tree"}}, (2, 23, 4), "'collectives.default.algo' Tree needs NCCL >= 2.24"),
    ({"mode": "tuner", "classes": {"ffn": {"proto": "LL"}}}, (2, 21, 5), "tuner needs NCCL >= 2.22"),
])
def test_version_guards_that_refuse(section, version, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        nccl.build_plan(cfg_of(section), version=version)


def test_version_guards_that_pass_or_warn():
    assert nccl.build_plan(cfg_of(PER_GROUP), version=(2, 27, 5)).group("projection").env["NCCL_PROTO"]
    tuner = {**PER_GROUP, "mode": "tuner"}
    assert nccl.build_plan(cfg_of(tuner), version=(2, 27, 3)).mode == "tuner"  # the plugin reads no cached variable
    old = nccl.build_plan(cfg_of({"default": {"proto": "LL"}}), version=(2, 23, 4))
    assert old.process_env == {"NCCL_PROTO": "LL"}
    assert any("no per-collective syntax" in w for w in old.warnings)
    hw = nccl.build_plan(cfg_of({"mode": "per_group", "classes": {"embedding": {"algo": "NVLS"}}}))
    assert any("NVLS needs NVLink SHARP" in w for w in hw.warnings)
    ddp = nccl.build_plan(cfg_of(PER_GROUP, {"strategy": "ddp"}))
    assert any("creates no per-class process groups" in w for w in ddp.warnings)


def test_nonblocking_init_is_refused_for_per_group(monkeypatch):
    monkeypatch.setenv("TORCH_NCCL_USE_COMM_NONBLOCKING", "1")
    with pytest.raises(UserError, match="needs blocking communicator init"):
        nccl.build_plan(cfg_of(PER_GROUP))
    assert nccl.build_plan(cfg_of({"default": {"proto": "LL"}})).mode == "global"


def test_parse_log_flag_turns_on_the_debug_log(tmp_path):
    plan = nccl.build_plan(cfg_of({**PER_GROUP, "parse_log": True}), log_dir=tmp_path)
    assert plan.process_env == {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "ENV,TUNING",
                                "NCCL_DEBUG_FILE": str(tmp_path / "nccl.%h.%p.log")}


def test_rendered_plan_names_variables_options_and_files():
    text = nccl.render_plan(nccl.build_plan(cfg_of(PER_GROUP)))
    assert ("  group class embedding: proto Simple, algo Ring, max_ctas 16\n"
            "    env while its communicator is created, restored after its barrier: NCCL_PROTO=allreduce:Simple "
            "NCCL_ALGO=allreduce:Ring\n"
            "    options: ProcessGroupNCCL.Options().config.max_ctas=16\n") in text
    gloo = nccl.render_plan(nccl.build_plan(cfg_of(PER_GROUP)), backend="gloo")
    assert "backend gloo: requested, not applied" in gloo.splitlines()[0]


def test_example_plugin_csv_covers_every_size_and_collective_with_explicit_channels():
    cfg = cfg_of({**PER_GROUP, "mode": "tuner", "classes": {**PER_GROUP["classes"], "norm_bias": {"proto": "LL"}}})
    lines = {n: [ln for ln in nccl.example_tuner_csv(cfg, n, 8, 2, 12).splitlines() if not ln.startswith("#")]
             for n in ("world", "embedding", "projection", "norm_bias")}
    for rows in lines.values():
        fields = [r.split(",") for r in rows]
        assert [f[0] for f in fields] == list(nccl.COLLECTIVES)
        assert all(len(f) == 10 and f[1:3] == ["0", "-1"] and f[6:8] == ["2", "16"] for f in fields)
        assert all(int(f[5]) > 0 for f in fields)  # never -1: the example plugin would run on one channel
    assert lines["embedding"][-1] == "allreduce,0,-1,ring,simple,16,2,16,-1,-1"
    assert lines["projection"][-1] == "allreduce,0,-1,ring,ll,12,2,16,-1,-1"
    assert lines["norm_bias"][-1] == "allreduce,0,-1,ring,ll,12,2,16,-1,-1"  # algorithm left open: ring
    assert lines["world"][-1] == "allreduce,0,-1,ring,simple,12,2,16,-1,-1"


def run_cli(capsys, *args):
    """`python -m collectives.nccl ARGS` in this process: (exit code, stdout, stderr)."""
    try:
        code = nccl.main(list(args))
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_plan_and_its_one_line_errors(tmp_path, capsys):
    code, out, _ = run_cli(capsys, "plan", "--profile", "profiles/per_group.yaml", "--backend", "nccl")
    assert code == 0 and "NCCL_PROTO=allreduce:LL" in out
    code, out, err = run_cli(capsys, "plan", "--profile", "profiles/tree.yaml", "--nccl-version", "2.23.4")
    assert code == 2 and out == ""
    assert err.startswith("collectives.nccl: error: 'collectives.default.algo'") and err.count("\n") == 1
    bad = tmp_path / "bad.yaml"
    bad.write_text("collectives:\n  mode: per_group\n  classes:\n    ffn: {proto: LL129}\n")
    code, _, err = run_cli(capsys, "plan", "--profile", str(bad))
    assert code == 2 and "'collectives.classes.ffn.proto'" in err and err.count("\n") == 1
    code, _, _ = run_cli(capsys, "tuner-config", "--profile", "profiles/tuner.yaml", "--nproc", "8", "--out",
                         str(tmp_path / "csv"))
    assert code == 0
    assert sorted(p.name for p in (tmp_path / "csv").iterdir()) == sorted(
        f"nccl_tuner.{n}.conf" for n in ("world", "embedding", "norm_bias", "projection", "ffn", "other"))


def test_module_entry_point_runs():
    r = subprocess.run([sys.executable, "-m", "collectives.nccl", "plan", "--profile", "profiles/ll128.yaml"],
                       capture_output=True, text=True, cwd=REPO, env=dict(os.environ))
    assert r.returncode == 0 and "NCCL_PROTO=allreduce:LL128" in r.stdout


def test_gpu_check_profiles_are_valid_and_it_refuses_without_a_gpu(capsys):
    for mode in ("per_group", "tuner"):
        plan = nccl.build_plan(nccl._gpu_check_config(mode), log_dir="out")
        assert plan.group("projection").settings == NcclSettings(proto="LL", algo="Ring")
        assert plan.process_env["NCCL_DEBUG_SUBSYS"] == "ENV,TUNING"
    if not torch.cuda.is_available():
        code, _, err = run_cli(capsys, "gpu-check", "--out", "unused")
        assert code == 2 and "needs a CUDA GPU" in err
