"""dtrain.collectives.nccl and its command line (`dtrain nccl`, dtrain.collectives.tools), the profile side:
validation, per-class resolution, version guards, the settings each process group gets (what `groups` and
`--dry-run` print), the CSV for NCCL's example tuner plugin, and the command line's exit codes."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dtrain.collectives import config, nccl
from dtrain.collectives import tensor_classes as tc
from dtrain.collectives.tools import gpu_check
from dtrain.collectives.tools.nccl import main
from dtrain.collectives.settings import ClassSettings
from dtrain.common.errors import UserError

REPO = Path(__file__).resolve().parents[1]


def cfg_of(collectives: dict, classes: dict | None = None, strategy: str = "per_class"):
    """The library's sections `(sync, collectives)`: `collectives` as given, per-class settings under
    `sync.classes`."""
    return config.from_dict({"collectives": collectives, "sync": {"strategy": strategy, "classes": classes or {}}})


PER_GROUP = {"projection": {"protocol": "LL", "algorithm": "Ring"},
             "embedding": {"protocol": "Simple", "algorithm": "Ring", "max_ctas": 16}}


@pytest.mark.parametrize("section, classes, key", [
    ({}, {"ffn": {"protocol": "LL"}}, "sync.classes.ffn.protocol"),  # per-class settings in global mode
    ({"mode": "per_group"}, {"ffn": {"algorithm": "PAT"}}, "sync.classes.ffn.algorithm"),
    ({"mode": "per_group"}, {"ffn": {"algorithm": "NVLS", "protocol": "LL128"}}, "sync.classes.ffn.protocol"),
    ({"mode": "per_group"}, {"ffn": {"protocol": "ll"}}, "sync.classes.ffn.protocol"),
    ({"mode": "tuner"}, {"ffn": {"min_ctas": 8, "max_ctas": 4}}, "sync.classes.ffn.min_ctas"),
    ({"mode": "tuner"}, {"ffn": {"max_ctas": 0}}, "sync.classes.ffn.max_ctas"),
    ({"mode": "tuner"}, {"ffn": {"max_ctas": "8"}}, "sync.classes.ffn.max_ctas"),  # the loader's type check
    ({"mode": "tuner"}, {"a,b": {"match": "x*", "protocol": "LL"}}, "sync.classes.a,b"),
    ({"mode": "tuner"}, {"ffn": {"proto": "LL"}}, "sync.classes.ffn.proto"),  # not a key of a class
    ({"mode": "per_group", "classes": {"ffn": {"proto": "LL"}}}, {}, "collectives.classes"),  # the old home
    ({"mode": "pergroup"}, {}, "collectives.mode"),
    ({"default": {"protocol": "LL", "channels": 4}}, {}, "collectives.default.channels"),
    ({"default": {"algorithm": "PAT"}}, {}, "collectives.default.algorithm"),
    ({"default": {"protocol": "LL", "wire_dtype": "bf16"}}, {}, "collectives.default.wire_dtype"),  # a class's key
    ({"backend": "mpi"}, {}, "collectives.backend"),
    ({"timeout_s": 0}, {}, "collectives.timeout_s"),
])
def test_bad_sections_name_their_key(section, classes, key):
    with pytest.raises(UserError, match=f"'{key}'"):
        cfg_of(section, classes)


def test_errors_name_the_profile_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("sync:\n  strategy: per_class\n  classes:\n    ffn: {protocol: LL}\ncollectives:\n"
                   "  classes:\n    ffn: {proto: LL}\n")
    with pytest.raises(UserError, match=r"bad.yaml:7: unknown key 'collectives.classes'"):
        config.load(bad)
    bad.write_text("sync:\n  strategy: per_class\ncollectives:\n  default: {protocol: LL, match: 'ffn*'}\n")
    with pytest.raises(UserError, match=r"bad.yaml:4: 'collectives.default.match' is a class's key, not NCCL's: "
                                        r"collectives.default takes protocol, algorithm, min_ctas, max_ctas$"):
        config.load(bad)
    bad.write_text("sync:\n  strategy: per_class\n  classes:\n    ffn: {protocol: LL}\n")
    with pytest.raises(UserError, match=r"bad.yaml:4: 'sync.classes.ffn.protocol' needs collectives.mode per_group"):
        config.load(bad)


def test_every_shipped_nccl_profile_loads_and_renders():
    for name in ("ll", "ll128", "simple", "tree", "per_group", "tuner"):
        sync, coll = config.load(REPO / "dtrain" / "profiles" / f"{name}.yaml")
        text = nccl.groups_text(sync, coll, backend="nccl")
        assert text.startswith(f"NCCL plan: mode {coll.mode}")


def test_global_mode_sets_one_job_environment_restricted_to_allreduce():
    setup = nccl.build_groups(*config.load(REPO / "dtrain" / "profiles" / "ll128.yaml"), version=(2, 26, 2))
    assert setup.process_env == {"NCCL_PROTO": "allreduce:LL128"}
    assert all(g.env == {} and g.settings.protocol == "LL128" for g in setup.groups)
    assert any("LL128 is forced" in w and "#wrong" in w for w in setup.warnings)
    validated = cfg_of({"default": {"protocol": "LL128"}, "validated": True})
    assert not any("LL128" in w for w in nccl.build_groups(*validated).warnings)
    tree = nccl.build_groups(*config.load(REPO / "dtrain" / "profiles" / "tree.yaml"), version=(2, 30, 1))
    assert tree.process_env == {"NCCL_ALGO": "allreduce:Tree"}


def test_global_ctas_go_to_the_process_wide_variables():
    setup = nccl.build_groups(*cfg_of({"default": {"protocol": "Simple", "min_ctas": 2, "max_ctas": 8}}))
    assert setup.process_env == {"NCCL_PROTO": "allreduce:Simple", "NCCL_MIN_CTAS": "2", "NCCL_MAX_CTAS": "8"}


def test_per_group_gives_each_class_its_variables_and_cta_options():
    setup = nccl.build_groups(*cfg_of({"mode": "per_group"}, PER_GROUP))
    assert setup.process_env == {} and setup.files == {}
    assert setup.group("world").env == {}
    assert setup.group("projection").env == {"NCCL_PROTO": "allreduce:LL", "NCCL_ALGO": "allreduce:Ring"}
    emb = setup.group("embedding")
    assert emb.env == {"NCCL_PROTO": "allreduce:Simple", "NCCL_ALGO": "allreduce:Ring"}
    assert emb.options == {"max_ctas": 16}
    assert setup.group("ffn").env == {} and setup.group("ffn").options == {}
    # Before 2.24 the plain value: a class communicator only runs its all-reduces anyway.
    old = nccl.build_groups(*cfg_of({"mode": "per_group"}, PER_GROUP), version=(2, 23, 4))
    assert old.group("projection").env == {"NCCL_PROTO": "LL", "NCCL_ALGO": "Ring"}


def test_default_fills_what_a_class_leaves_open():
    cfg = cfg_of({"mode": "per_group", "default": {"protocol": "LL128"}},
                 {"projection": {"algorithm": "Ring"}, "embedding": {"protocol": "Simple"}})
    assert nccl.resolve(*cfg, "projection") == ClassSettings(protocol="LL128", algorithm="Ring")
    assert nccl.resolve(*cfg, "embedding") == ClassSettings(protocol="Simple")
    assert nccl.resolve(*cfg, "ffn") == ClassSettings(protocol="LL128")


def test_what_the_strategy_passes_replaces_the_profiles_class_settings():
    cfg = cfg_of({"mode": "per_group", "default": {"algorithm": "Ring"}}, {"ffn": {"protocol": "LL128", "max_ctas": 4}})
    assert nccl.resolve(*cfg, "ffn") == ClassSettings(protocol="LL128", algorithm="Ring", max_ctas=4)
    # What the strategy passes to class_group: a ClassSettings or its .nccl() mapping.
    sync, _ = cfg
    settings = tc.from_config(sync).setting("ffn")
    assert nccl.resolve(*cfg, "ffn", settings) == nccl.resolve(*cfg, "ffn")
    assert nccl.resolve(*cfg, "ffn", settings.nccl()) == nccl.resolve(*cfg, "ffn")
    assert nccl.resolve(*cfg, "ffn", {"protocol": "Simple"}) == ClassSettings(protocol="Simple", algorithm="Ring")
    with pytest.raises(UserError, match="'sync.classes.ffn' sets NCCL choices"):
        nccl.resolve(*cfg_of({"mode": "global"}), "ffn", {"protocol": "LL"})


def test_unknown_class_name_is_an_error():
    with pytest.raises(UserError, match="'sync.classes.embeding.match' is required"):
        cfg_of({"mode": "per_group"}, {"embeding": {"protocol": "LL"}})
    sync, coll = cfg_of({"mode": "per_group"}, {"big_ffn": {"match": "*.w_1.weight", "protocol": "LL"}})
    assert nccl.class_names(sync)[0] == "big_ffn" and nccl.resolve(sync, coll, "big_ffn").protocol == "LL"


def test_tuner_mode_ships_rules_and_names_each_class_at_creation():
    cfg = cfg_of({"mode": "tuner", "default": {"protocol": "Simple"}},
                 {"projection": {"protocol": "LL", "algorithm": "Ring"}, "ffn": {"algorithm": "Tree", "max_ctas": 8}})
    setup = nccl.build_groups(*cfg)
    (path, rules), = setup.files.items()
    assert setup.process_env == {"NCCL_TUNER_PLUGIN": str(nccl.tuner_lib_path()), "DTRAIN_TUNER_RULES": path}
    body = [line for line in rules.splitlines() if not line.startswith("#")]
    assert body == ["embedding,allreduce,0,-1,-1,simple,-1", "norm_bias,allreduce,0,-1,-1,simple,-1",
                    "projection,allreduce,0,-1,ring,ll,-1", "ffn,allreduce,0,-1,tree,simple,8",
                    "other,allreduce,0,-1,-1,simple,-1", "*,allreduce,0,-1,-1,simple,-1"]
    assert setup.group("ffn").env == {"DTRAIN_TUNER_CLASS": "ffn"} and setup.group("ffn").options == {"max_ctas": 8}
    assert setup.group("world").env == {}  # the default group serves no class: the plugin leaves it alone


@pytest.mark.parametrize("section, classes, version, message", [
    ({"mode": "per_group"}, PER_GROUP, (2, 27, 3), "2.27.0-2.27.4 cache NCCL_PROTO/NCCL_ALGO"),
    ({"default": {"algorithm": "Tree"}}, {}, (2, 23, 4), "'collectives.default.algorithm' Tree needs NCCL >= 2.24"),
    ({"mode": "tuner"}, {"ffn": {"protocol": "LL"}}, (2, 21, 5), "tuner needs NCCL >= 2.22"),
])
def test_version_guards_that_refuse(section, classes, version, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        nccl.build_groups(*cfg_of(section, classes), version=version)


def test_version_guards_that_pass_or_warn():
    per_group = cfg_of({"mode": "per_group"}, PER_GROUP)
    assert nccl.build_groups(*per_group, version=(2, 27, 5)).group("projection").env["NCCL_PROTO"]
    tuner = cfg_of({"mode": "tuner"}, PER_GROUP)
    assert nccl.build_groups(*tuner, version=(2, 27, 3)).mode == "tuner"  # the plugin reads no cached variable
    old = nccl.build_groups(*cfg_of({"default": {"protocol": "LL"}}), version=(2, 23, 4))
    assert old.process_env == {"NCCL_PROTO": "LL"}
    assert any("no per-collective syntax" in w for w in old.warnings)
    hw = nccl.build_groups(*cfg_of({"mode": "per_group"}, {"embedding": {"algorithm": "NVLS"}}))
    assert any("NVLS needs NVLink SHARP" in w for w in hw.warnings)
    ddp = nccl.build_groups(*cfg_of({"mode": "per_group"}, strategy="ddp"))  # (ddp refuses class NCCL keys)
    assert any("creates no per-class process groups" in w for w in ddp.warnings)


def test_auto_warns_only_when_no_candidate_has_class_groups():
    def warnings(candidates):
        raw = {"collectives": {"mode": "per_group"},
               "sync": {"strategy": "auto", "tune": {"candidates": candidates}}}
        return [w for w in nccl.build_groups(*config.from_dict(raw)).warnings if "per-class process groups" in w]
    assert warnings({"ddp-25": {"strategy": "ddp", "bucket_cap_mb": 25},
                     "proj-LL": {"strategy": "per_class", "classes.projection.protocol": "LL"}}) == []
    assert warnings({}) == []  # the default space holds per_class
    only_ddp = warnings({"ddp-2": {"strategy": "ddp"}, "ddp-25": {"strategy": "ddp", "bucket_cap_mb": 25}})
    assert len(only_ddp) == 1 and "nor does any candidate of its search" in only_ddp[0]


def test_nonblocking_init_is_refused_for_per_group(monkeypatch):
    monkeypatch.setenv("TORCH_NCCL_USE_COMM_NONBLOCKING", "1")
    with pytest.raises(UserError, match="needs blocking communicator init"):
        nccl.build_groups(*cfg_of({"mode": "per_group"}, PER_GROUP))
    assert nccl.build_groups(*cfg_of({"default": {"protocol": "LL"}})).mode == "global"


def test_parse_log_flag_turns_on_the_debug_log(tmp_path):
    setup = nccl.build_groups(*cfg_of({"mode": "per_group", "parse_log": True}, PER_GROUP), log_dir=tmp_path)
    assert setup.process_env == {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "ENV,TUNING",
                                "NCCL_DEBUG_FILE": str(tmp_path / "nccl.%h.%p.log")}


def test_rendered_groups_name_variables_options_and_files():
    per_group = cfg_of({"mode": "per_group"}, PER_GROUP)
    text = nccl.render_groups(nccl.build_groups(*per_group))
    assert ("  group class embedding: protocol Simple, algorithm Ring, max_ctas 16\n"
            "    env while its communicator is created, restored after its barrier: NCCL_PROTO=allreduce:Simple "
            "NCCL_ALGO=allreduce:Ring\n"
            "    options: ProcessGroupNCCL.Options().config.max_ctas=16\n") in text
    gloo = nccl.render_groups(nccl.build_groups(*per_group), backend="gloo")
    assert "backend gloo: requested, not applied" in gloo.splitlines()[0]


def test_example_plugin_csv_covers_every_size_and_collective_with_explicit_channels():
    cfg = cfg_of({"mode": "tuner"}, {**PER_GROUP, "norm_bias": {"protocol": "LL"}})
    lines = {n: [ln for ln in nccl.example_tuner_csv(*cfg, n, 8, 2, 12, "p").splitlines() if not ln.startswith("#")]
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
    """`dtrain nccl ARGS` in this process: (exit code, stdout, stderr)."""
    try:
        code = main(list(args))
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_groups_and_its_one_line_errors(tmp_path, capsys):
    code, out, _ = run_cli(capsys, "groups", "--profile", "dtrain/profiles/per_group.yaml", "--backend", "nccl")
    assert code == 0 and "NCCL_PROTO=allreduce:LL" in out
    code, out, err = run_cli(capsys, "groups", "--profile", "dtrain/profiles/tree.yaml", "--nccl-version", "2.23.4")
    assert code == 2 and out == ""
    assert err.startswith("dtrain nccl: error: 'collectives.default.algorithm'") and err.count("\n") == 1
    bad = tmp_path / "bad.yaml"
    bad.write_text("collectives:\n  mode: per_group\nsync:\n  classes:\n    ffn: {protocol: LL129}\n")
    code, _, err = run_cli(capsys, "groups", "--profile", str(bad))
    assert code == 2 and "'sync.classes.ffn.protocol'" in err and err.count("\n") == 1
    code, _, _ = run_cli(capsys, "tuner-config", "--profile", "dtrain/profiles/tuner.yaml", "--nproc", "8", "--out",
                         str(tmp_path / "csv"))
    assert code == 0
    assert sorted(p.name for p in (tmp_path / "csv").iterdir()) == sorted(
        f"nccl_tuner.{n}.conf" for n in ("world", "embedding", "norm_bias", "projection", "ffn", "other"))
    assert "(base-tuner: 8 ranks on 1 node(s))" in (tmp_path / "csv" / "nccl_tuner.ffn.conf").read_text()


def test_help_lists_every_verb(capsys):
    code, out, _ = run_cli(capsys, "--help")
    assert code == 0
    for verb in ("groups", "build-tuner", "tuner-config", "tuner-check", "parse-log", "gpu-check"):
        assert f"    {verb}" in out
    assert "    plan" not in out


@pytest.mark.slow
def test_module_entry_point_runs():
    r = subprocess.run([sys.executable, "-m", "dtrain", "nccl", "groups", "--profile", "dtrain/profiles/ll128.yaml"],
                       capture_output=True, text=True, cwd=REPO, env=dict(os.environ))
    assert r.returncode == 0 and "NCCL_PROTO=allreduce:LL128" in r.stdout


def test_gpu_check_profiles_are_valid_and_it_refuses_without_a_gpu(capsys):
    for mode in ("per_group", "tuner"):
        setup = nccl.build_groups(*gpu_check.gpu_check_config(mode), log_dir="out")
        assert setup.group("projection").settings == ClassSettings(protocol="LL", algorithm="Ring")
        assert setup.process_env["NCCL_DEBUG_SUBSYS"] == "ENV,TUNING"
    if not torch.cuda.is_available():
        code, _, err = run_cli(capsys, "gpu-check", "--out", "unused")
        assert code == 2 and "needs a CUDA GPU" in err
