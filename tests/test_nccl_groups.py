"""dtrain.collectives.nccl, the process-group side: the environment each class's group is created under (a fake group
factory records it at creation and at the barrier), its restoration, the identical-settings check, the job
environment of global and tuner modes, and gloo, where everything is recorded as requested, not applied."""

import json
import os
from pathlib import Path

import pytest
import torch.distributed as dist

from dtrain.collectives import dist as ddist
from dtrain.collectives import config, nccl
from dtrain.common.errors import UserError

WATCHED = ("NCCL_PROTO", "NCCL_ALGO", "DTRAIN_TUNER_CLASS", "DTRAIN_TUNER_RULES", "NCCL_TUNER_PLUGIN")


class FakeGroups:
    """Records, for every group, the watched variables when it is created and when its barrier runs."""

    def __init__(self, digests=None, bound=True, fail_barrier=False):
        self.events, self.digests, self.bound, self.fail_barrier = [], digests, bound, fail_barrier

    def _env(self):
        return {k: os.environ[k] for k in WATCHED if k in os.environ}

    def new_group(self, ranks, options, desc):
        self.events.append(("new_group", desc, self._env(), dict(options)))
        return desc

    def barrier(self, pg):
        self.events.append(("barrier", pg, self._env()))
        if self.fail_barrier:
            raise RuntimeError("NCCL error during communicator init")

    def gather(self, obj):
        return self.digests or [obj, obj]

    def device_bound(self):
        return self.bound


@pytest.fixture(autouse=True)
def clean_env():
    saved = dict(os.environ)
    nccl.reset()
    yield
    nccl.reset()
    for k in set(os.environ) - set(saved):
        del os.environ[k]
    os.environ.update(saved)


def cfg_of(collectives, classes=None):
    return config.from_dict({"collectives": collectives, "sync": {"strategy": "per_class", "classes": classes or {}}})


CLASSES = {"projection": {"protocol": "LL", "algorithm": "Ring"},
           "embedding": {"protocol": "Simple", "algorithm": "Ring", "max_ctas": 16}}
PER_GROUP = cfg_of({"mode": "per_group"}, CLASSES)


def test_per_group_sets_each_class_variables_only_around_its_creation():
    fake = FakeGroups()
    os.environ.pop("NCCL_PROTO", None)
    os.environ["NCCL_ALGO"] = "Tree"  # the user's own: in force outside the groups, restored after each
    record = nccl.apply_global(*PER_GROUP, backend="nccl", version=(2, 26, 5), factory=fake)
    assert record["applied"] and record["job_env"] == {}
    assert any("NCCL_ALGO=Tree in the environment applies to every class" in w for w in record["warnings"])
    for name in ("projection", "embedding", "ffn"):
        nccl.class_group(name, None, None)
        assert os.environ.get("NCCL_PROTO") is None and os.environ["NCCL_ALGO"] == "Tree"
    assert fake.events == [
        ("new_group", "dtrain:projection", {"NCCL_PROTO": "allreduce:LL", "NCCL_ALGO": "allreduce:Ring"}, {}),
        ("barrier", "dtrain:projection", {"NCCL_PROTO": "allreduce:LL", "NCCL_ALGO": "allreduce:Ring"}),
        ("new_group", "dtrain:embedding", {"NCCL_PROTO": "allreduce:Simple", "NCCL_ALGO": "allreduce:Ring"},
         {"max_ctas": 16}),
        ("barrier", "dtrain:embedding", {"NCCL_PROTO": "allreduce:Simple", "NCCL_ALGO": "allreduce:Ring"}),
        ("new_group", "dtrain:ffn", {"NCCL_ALGO": "Tree"}, {}),  # nothing requested: the environment as it is
        ("barrier", "dtrain:ffn", {"NCCL_ALGO": "Tree"}),
    ]
    groups = nccl.run_record()["groups"]
    assert [(g["class"], g["applied"], g["env"]) for g in groups][:2] == [
        ("projection", True, {"NCCL_PROTO": "allreduce:LL", "NCCL_ALGO": "allreduce:Ring"}),
        ("embedding", True, {"NCCL_PROTO": "allreduce:Simple", "NCCL_ALGO": "allreduce:Ring"})]


def test_settings_passed_by_the_strategy_are_applied():
    fake = FakeGroups()
    nccl.apply_global(*cfg_of({"mode": "per_group"}), backend="nccl", version=(2, 30, 1), factory=fake)
    nccl.class_group("ffn", {"protocol": "LL128", "algorithm": "Ring", "min_ctas": 2}, [0, 1])
    assert fake.events[0] == ("new_group", "dtrain:ffn", {"NCCL_PROTO": "allreduce:LL128",
                                                          "NCCL_ALGO": "allreduce:Ring"}, {"min_ctas": 2})


def test_variables_are_restored_when_creation_fails():
    fake = FakeGroups(fail_barrier=True)
    nccl.apply_global(*PER_GROUP, backend="nccl", version=(2, 26, 5), factory=fake)
    with pytest.raises(RuntimeError):
        nccl.class_group("projection")
    assert "NCCL_PROTO" not in os.environ and "NCCL_ALGO" not in os.environ


def test_ranks_with_different_settings_are_refused():
    nccl.apply_global(*PER_GROUP, backend="nccl", version=(2, 26, 5), factory=FakeGroups(["a", "b"]))
    with pytest.raises(UserError, match="every rank must load the same profile"):
        nccl.class_group("projection")


def test_nonblocking_init_set_after_apply_is_refused_at_creation():
    nccl.apply_global(*PER_GROUP, backend="nccl", version=(2, 26, 5), factory=FakeGroups())
    os.environ["TORCH_NCCL_USE_COMM_NONBLOCKING"] = "1"
    with pytest.raises(UserError, match="unset TORCH_NCCL_USE_COMM_NONBLOCKING"):
        nccl.class_group("projection")


def test_unbound_device_is_recorded():
    nccl.apply_global(*PER_GROUP, backend="nccl", version=(2, 26, 5), factory=FakeGroups(bound=False))
    nccl.class_group("projection")
    assert any("no device bound at init" in w for w in nccl.run_record()["warnings"])


def test_global_mode_sets_the_job_environment_once():
    fake = FakeGroups()
    record = nccl.apply_global(*config.load("dtrain/profiles/ll128.yaml"), backend="nccl", version=(2, 26, 5),
                               factory=fake)
    assert os.environ["NCCL_PROTO"] == "allreduce:LL128" and record["job_env"] == {"NCCL_PROTO": "allreduce:LL128"}
    nccl.class_group("embedding")
    assert fake.events == [("new_group", "dtrain:embedding", {"NCCL_PROTO": "allreduce:LL128"}, {})]
    assert nccl.run_record()["groups"][0]["applied"] == "job environment"


def test_tuner_mode_builds_the_plugin_writes_rules_and_names_the_class():
    fake = FakeGroups()
    cfg = cfg_of({"mode": "tuner"}, CLASSES)
    record = nccl.apply_global(*cfg, backend="nccl", version=(2, 27, 3), factory=fake)
    lib, rules = os.environ["NCCL_TUNER_PLUGIN"], os.environ["DTRAIN_TUNER_RULES"]
    assert os.path.exists(lib) and open(rules).read() == nccl.tuner_rules(*cfg)
    assert record["files"] == [rules]
    nccl.class_group("projection")
    nccl.class_group("embedding")
    assert "DTRAIN_TUNER_CLASS" not in os.environ
    created = [(e[1], e[2]["DTRAIN_TUNER_CLASS"], e[3]) for e in fake.events if e[0] == "new_group"]
    assert created == [("dtrain:projection", "projection", {}), ("dtrain:embedding", "embedding", {"max_ctas": 16})]


def test_gloo_records_requested_not_applied_and_sets_nothing():
    before = dict(os.environ)
    fake = FakeGroups()
    record = nccl.apply_global(*config.load("dtrain/profiles/per_group.yaml"), backend="gloo", factory=fake)
    assert dict(os.environ) == before
    assert record["applied"] is False and record["status"] == "requested, not applied (backend gloo)"
    assert record["requested"]["classes"]["embedding"] == {"protocol": "Simple", "algorithm": "Ring", "min_ctas": None,
                                                           "max_ctas": 16}
    nccl.class_group("embedding")
    assert fake.events == [("new_group", "dtrain:embedding", {}, {})]  # no barrier, no variables
    assert nccl.run_record()["groups"] == [{
        "class": "embedding", "ranks": None, "applied": False, "requested": record["requested"]["classes"]["embedding"],
        "env": {"NCCL_PROTO": "allreduce:Simple", "NCCL_ALGO": "allreduce:Ring"}, "options": {"max_ctas": 16},
        "files": {}}]  # what an NCCL run would apply


def _two_rank_gloo(rank, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    with ddist.rank_process():
        cfg = config.load("dtrain/profiles/per_group.yaml")
        nccl.apply_global(*cfg, backend="gloo")
        import torch

        for name in ("projection", "embedding"):
            pg = nccl.class_group(name, None, None)
            t = torch.ones(3) * (rank + 1)
            dist.all_reduce(t, group=pg)
            assert t.tolist() == [3.0, 3.0, 3.0]
        # A file per rank, not a multiprocessing.Manager: its server process is forked from a parent that may run
        # threads by now (other tests' compile workers), which a fork does not survive reliably.
        (Path(out_dir) / f"record-{rank}.json").write_text(json.dumps(nccl.run_record()))


@pytest.mark.slow
def test_two_gloo_ranks_create_the_class_groups_and_record_them(tmp_path):
    ddist.spawn(_two_rank_gloo, (str(tmp_path / "init"), str(tmp_path)), 2)
    records = {rank: json.loads((tmp_path / f"record-{rank}.json").read_text()) for rank in (0, 1)}
    for rank in (0, 1):
        r = records[rank]
        assert r["status"] == "requested, not applied (backend gloo)"
        assert [(g["class"], g["applied"]) for g in r["groups"]] == [("projection", False), ("embedding", False)]
        assert r["groups"][0]["requested"] == {"protocol": "LL", "algorithm": "Ring", "min_ctas": None, "max_ctas": None}


def test_without_a_profile_applied_an_attached_class_group_gets_its_own_choices_on_nccl(monkeypatch):
    # attach from a user's loop: no apply_global, so class_group applies the class's own choices as per_group does
    fake = FakeGroups()
    monkeypatch.setattr(nccl.groups.dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(nccl.groups, "TorchGroups", lambda: fake)
    monkeypatch.setattr(nccl.groups, "nccl_version", lambda: (2, 26, 5))
    os.environ.pop("NCCL_PROTO", None)
    nccl.class_group("embedding", {"protocol": "Simple", "max_ctas": 16}, [0, 1])
    nccl.class_group("ffn", None, [0, 1])  # no choice: a plain group, NCCL decides
    assert "NCCL_PROTO" not in os.environ
    assert fake.events == [("new_group", "dtrain:embedding", {"NCCL_PROTO": "allreduce:Simple"}, {"max_ctas": 16}),
                           ("barrier", "dtrain:embedding", {"NCCL_PROTO": "allreduce:Simple"}),
                           ("new_group", "dtrain:ffn", {}, {})]
    os.environ["TORCH_NCCL_USE_COMM_NONBLOCKING"] = "1"
    with pytest.raises(UserError, match="sync.classes.projection.*unset TORCH_NCCL_USE_COMM_NONBLOCKING"):
        nccl.class_group("projection", {"protocol": "LL"}, [0, 1])
    # gloo: the choices are NCCL's, a plain group
    monkeypatch.setattr(nccl.groups.dist, "get_backend", lambda group=None: "gloo")
    nccl.class_group("projection", {"protocol": "LL"}, [0, 1])
    assert fake.events[-1] == ("new_group", "dtrain:projection", {}, {})
