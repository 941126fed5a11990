"""Bucketing plans are pure (meta tensors, no process group) and follow each strategy's rules; the registry."""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from dtrain.collectives import schedule
from dtrain.collectives import strategies
from dtrain.collectives import tensor_classes as tc
from dtrain.collectives.plan import Bucket, BucketingStrategy, pack, ready_order
from dtrain.collectives.settings import ClassSettings, SyncConfig
from dtrain.common.errors import UserError
from dtrain.engine.model import Transformer

MiB = 2**20


@pytest.fixture(scope="module")
def named():
    with torch.device("meta"):  # planning reads numel and dtype only
        model = Transformer(vocab=1000, N=2, d_model=64, d_ff=256, h=4)
    return ready_order(model)


def plan_of(name, named, **sync):
    cfg = SyncConfig(strategy=name, **sync)
    classes = tc.from_config(cfg)
    class_of = classes.assign(named)
    settings = {r.name: classes.setting(r.name) for r in classes.rules}
    return strategies.get(name).from_sync(cfg).plan(named, class_of, settings), class_of


def covers_every_parameter_once(buckets, named):
    names = [n for b in buckets for n in b.names]
    assert sorted(names) == sorted(n for n, _ in named)
    assert [b.index for b in buckets] == list(range(len(buckets)))
    sizes = dict((n, p.numel()) for n, p in named)
    for b in buckets:
        assert b.numel == sum(sizes[n] for n in b.names)
        assert b.nbytes == b.numel * b.settings.torch_wire_dtype.itemsize


def test_ready_order_is_reverse_registration_with_the_embedding_last(named):
    assert named[-1][0] == "embed.weight"
    assert named[0][0].startswith("decoder.1.")


def test_planning_touches_no_process_group(named):
    assert not dist.is_initialized()
    for name in ("per_tensor", "flat", "bucketed", "per_class"):
        buckets, _ = plan_of(name, named, bucket_cap_mb=0.1)
        covers_every_parameter_once(buckets, named)
        assert plan_of(name, named, bucket_cap_mb=0.1)[0] == buckets  # deterministic
    assert not dist.is_initialized()


def test_per_tensor_and_flat(named):
    per_tensor, _ = plan_of("per_tensor", named)
    assert [b.names for b in per_tensor] == [(n,) for n, _ in named]
    flat, _ = plan_of("flat", named)
    assert len(flat) == 1 and flat[0].names == tuple(n for n, _ in named) and flat[0].tensor_class == "mixed"
    assert not strategies.get("flat").overlap and strategies.get("bucketed").overlap


def test_bucketed_caps_in_ready_order_with_a_first_bucket(named):
    buckets, _ = plan_of("bucketed", named, bucket_cap_mb=0.25, first_bucket_mb=0.05)
    covers_every_parameter_once(buckets, named)
    assert [n for b in buckets for n in b.names] == [n for n, _ in named]  # ready order kept
    sizes = dict((n, p.numel() * 4) for n, p in named)
    for i, b in enumerate(buckets[:-1]):
        cap = 0.05 * MiB if i == 0 else 0.25 * MiB
        assert b.nbytes >= cap  # closed once full ...
        assert b.nbytes - sizes[b.names[-1]] < cap  # ... and not before
    assert buckets[0].nbytes < 0.25 * MiB
    assert buckets[-1].names[-1] == "embed.weight"  # ready last, so in the last bucket


def test_per_class_never_mixes_and_uses_each_class_settings(named):
    buckets, class_of = plan_of("per_class", named, bucket_cap_mb=0.1, classes={
        "ffn": {"wire_dtype": "bf16", "bucket_cap_mb": 0.2}, "projection": {"wire_dtype": "fp16"}})
    covers_every_parameter_once(buckets, named)
    for b in buckets:
        assert {class_of[n] for n in b.names} == {b.tensor_class}
    ffn = [b for b in buckets if b.tensor_class == "ffn"]
    assert all(b.settings.wire_dtype == "bf16" and b.nbytes == 2 * b.numel for b in ffn)
    assert all(b.nbytes >= 0.2 * MiB for b in ffn[:-1])
    assert {b.settings.wire_dtype for b in buckets if b.tensor_class == "projection"} == {"fp16"}
    # Ordered by the moment the bucket is expected complete: its last member's ready position.
    pos = {n: i for i, (n, _) in enumerate(named)}
    last = [pos[b.names[-1]] for b in buckets]
    assert last == sorted(last)
    # Its schedule: each bucket all-reduced in its class's wire dtype, on its class's group; exact only in fp32
    sch = schedule.all_reduce_schedule("per_class", buckets, named, 2, overlap=True, class_groups=True)
    assert [(c.dtype, c.group, c.nbytes) for c in sch.collectives] == [
        (b.settings.wire_dtype, b.tensor_class, b.nbytes) for b in buckets]
    assert not sch.exact and not any(c.exact for c in sch.collectives if c.dtype != "fp32")
    fp32 = [b for b in buckets if b.settings.wire_dtype == "fp32"]
    assert schedule.all_reduce_schedule("per_class", fp32, named, 2, overlap=True, class_groups=True).exact


def test_pack_keys_and_oversized_tensors():
    a, b, c = (torch.empty(n, device="meta") for n in (10, 300, 10))
    s = ClassSettings(bucket_cap_mb=100 * 4 / MiB)  # 100 floats
    buckets = pack([("a", a), ("b", b), ("c", c)], {"a": "x", "b": "x", "c": "y"}, key=lambda n, p: n == "c",
                   settings_of=lambda k: s)
    assert [bk.names for bk in buckets] == [("a", "b"), ("c",)]
    assert [bk.tensor_class for bk in buckets] == ["x", "y"]


def test_last_bucket_holds_the_last_parameters_of_each_key_alone():
    sizes = {"e0": 40, "e1": 40, "d0": 30, "d1": 30, "n0": 5, "n1": 5}  # in ready order; n* have a key of their own
    named = [(n, torch.empty(k, device="meta")) for n, k in sizes.items()]
    s = ClassSettings(bucket_cap_mb=100 * 4 / MiB)  # 100 floats
    key = lambda n, p: n.startswith("n")  # noqa: E731
    plain = pack(named, dict.fromkeys(sizes, "x"), key=key, settings_of=lambda k: s)
    assert [b.names for b in plain] == [("e0", "e1", "d0"), ("d1",), ("n0", "n1")]
    # Last buckets of at least 50 floats: d1 (30) is not yet 50, so d0 joins it; the n key's two make only 10
    last = pack(named, dict.fromkeys(sizes, "x"), key=key, settings_of=lambda k: s, last_cap_bytes=50 * 4)
    assert [b.names for b in last] == [("e0", "e1"), ("d0", "d1"), ("n0", "n1")]
    assert [b.index for b in last] == [0, 1, 2] and sum(b.numel for b in last) == sum(sizes.values())
    # The last parameter alone when it already holds the bytes; first and last caps together
    both = pack(named, dict.fromkeys(sizes, "x"), key=key, settings_of=lambda k: s, first_cap_bytes=40 * 4,
                last_cap_bytes=30 * 4)
    assert [b.names for b in both] == [("e0",), ("e1", "d0"), ("d1",), ("n0", "n1")]


def test_registry_errors():
    with pytest.raises(ValueError, match="already registered"):
        strategies.register("bucketed")(type("Again", (BucketingStrategy,), {}))
    with pytest.raises(UserError, match=r"unknown strategy 'bucketd'.*available: auto, bucketed, ddp, flat"):
        strategies.get("bucketd")
    with pytest.raises(UserError, match="strategy 'bucketed': unknown argument 'bucket_mb'; did you mean 'bucket_cap_mb'"):
        strategies.get("bucketed").from_args(bucket_mb=4)
    s = strategies.get("bucketed").from_args(bucket_cap_mb=4)
    assert s.config.bucket_cap_mb == 4 and s.name == "bucketed"
    assert set(strategies.available()) >= {"ddp", "per_tensor", "flat", "bucketed", "per_class", "powersgd", "noop"}


def test_strategies_declare_the_sync_keys_they_read():
    class_keys = {f"classes.{f.name}" for f in dataclasses.fields(ClassSettings)}
    assert set(strategies.CLASS_RULE_KEYS) | set(strategies.CLASS_SETTING_KEYS) == class_keys
    sync_keys = {f.name for f in dataclasses.fields(SyncConfig)} - {"strategy", "classes"}
    for name in strategies.available():
        cls = strategies.get(name)
        assert set(cls.sync_keys) <= sync_keys | class_keys, name
        assert cls.uses_cap == ("bucket_cap_mb" in cls.sync_keys), name
        if issubclass(cls, BucketingStrategy):  # its Config is built from the fields of the same name
            assert {f.name for f in dataclasses.fields(cls.Config)} <= set(cls.sync_keys), name
            if cls.class_groups:  # per-class groups: every class setting travels
                assert set(strategies.CLASS_SETTING_KEYS) <= set(cls.sync_keys), name
    assert strategies.get("noop").sync_keys == ()
    assert "hook" in strategies.get("ddp").sync_keys and "hook" not in strategies.get("powersgd").sync_keys


def test_unused_keys_name_the_key_and_the_strategy_s_keys():
    found = strategies.unused_keys(SyncConfig(strategy="bucketed", hook="allreduce",
                                              classes={"ffn": {"wire_dtype": "bf16", "match": "*.w_1.*"}}))
    assert [k for k, _ in found] == ["sync.hook", "sync.classes.ffn.wire_dtype"]
    assert found[0][1] == ("is not used by strategy 'bucketed' (its keys: sync.bucket_cap_mb, sync.first_bucket_mb, "
                           "sync.last_bucket_mb, sync.hierarchical, sync.ranks_per_node, sync.classes.<class>.(match, min_numel, "
                           "max_numel, tied_split))")
    assert strategies.unused_keys(SyncConfig(strategy="nope", hook="allreduce")) == []  # the name is the error


def test_bucket_is_a_plain_record():
    s = ClassSettings()
    b = Bucket(0, ("w",), 4, 16, "ffn", s)
    assert dataclasses.asdict(b)["settings"]["wire_dtype"] == "fp32" and b.dtype == torch.float32


def test_bucketed_defaults_to_ddps_layout():
    with torch.device("meta"):
        named = ready_order(Transformer(vocab=8000, N=3, d_model=256, d_ff=1024, h=4))
    default, _ = plan_of("bucketed", named)
    assert MiB <= default[0].nbytes < 2 * MiB  # DDP's 1 MiB first bucket ...
    assert all(b.nbytes >= 25 * MiB for b in default[1:-1])  # ... then 25 MiB ones
    capped, _ = plan_of("bucketed", named, bucket_cap_mb=4)
    assert capped[0].nbytes >= 4 * MiB  # a cap given: the first bucket too (as DDP)
