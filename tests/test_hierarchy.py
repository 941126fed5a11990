"""The hierarchical plan (`sync.hierarchical`): its levels' process groups, its padded buckets, its mean against the
per-tensor reference on 2 nodes x 2 ranks and 2 x 3, and nothing of it left after `close()`."""

import threading

import pytest
import torch
import torch.distributed as dist

from dtrain.collectives import dist as ddist
from dtrain.collectives import attach
from dtrain.collectives.hierarchy import HierarchicalReducer, ranks_per_node
from dtrain.collectives.reducer import allreduce_each
from dtrain.collectives.settings import SyncConfig
from dtrain.common.errors import UserError
from dtrain.engine import config, verify


def test_ranks_per_node_comes_from_the_setting_or_torchrun(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert ranks_per_node(SyncConfig(strategy="bucketed", hierarchical=True, ranks_per_node=2), 4) == 2
    with pytest.raises(UserError, match="needs 'sync.ranks_per_node' when the job is not started by torchrun"):
        ranks_per_node(SyncConfig(strategy="bucketed", hierarchical=True), 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert ranks_per_node(SyncConfig(strategy="bucketed", hierarchical=True), 8) == 4
    for r, world in ((1, 4), (4, 4), (3, 4)):  # one rank a node, one node, nodes of unequal size
        with pytest.raises(UserError, match=f"{r} ranks per node of a world of {world}"):
            ranks_per_node(SyncConfig(strategy="bucketed", hierarchical=True, ranks_per_node=r), world)


def test_only_the_planned_strategies_without_class_groups_read_it():
    for strategy in ("bucketed", "flat", "per_tensor"):
        config.from_dict({"sync": {"strategy": strategy, "hierarchical": True, "ranks_per_node": 2}})
    for strategy in ("ddp", "per_class", "sharded"):
        with pytest.raises(UserError, match=f"'sync.hierarchical' is not used by strategy '{strategy}'"):
            config.from_dict({"sync": {"strategy": strategy, "hierarchical": True}})
    with pytest.raises(UserError, match="sync.ranks_per_node.*must be positive or null, got 0"):
        config.from_dict({"sync": {"strategy": "bucketed", "ranks_per_node": 0}})


def _two_by_two(rank: int, init: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=4)
    with ddist.rank_process():
        threads, groups = threading.active_count(), len(dist.distributed_c10d._world.pg_map)
        model = verify.tiny_model()
        reference = verify.tiny_model()
        handle = attach(model, SyncConfig(strategy="bucketed", bucket_cap_mb=0.01, hierarchical=True,
                                          ranks_per_node=2))
        reducer = handle.reducer
        assert isinstance(reducer, HierarchicalReducer)
        assert handle.stats()["hierarchical"] == {"ranks_per_node": 2, "nodes": 2}
        node, index = divmod(rank, 2)
        assert dist.get_process_group_ranks(reducer.levels.intra) == [2 * node, 2 * node + 1]
        assert dist.get_process_group_ranks(reducer.levels.inter) == [index, 2 + index]
        assert all(st.buffer.numel() % 2 == 0 and st.buffer.numel() - st.bucket.numel in (0, 1)
                   for st in reducer.buckets)
        for step in range(2):  # the second after the re-plan in the observed order
            src, tgt_in, tgt_out = verify.batch(rank, step, 0)
            verify.loss_fn(handle.module(src, tgt_in), tgt_out, 1).backward()
            verify.loss_fn(reference(src, tgt_in), tgt_out, 1).backward()
            handle.wait()
            records = handle.step_records()
            assert all(r.complete_ms is not None and r.launch_ms <= r.complete_ms for r in records)
            ref = [p.grad.clone() for p in reference.parameters()]
            allreduce_each(ref)
            for (name, p), r in zip(model.named_parameters(), ref):
                torch.testing.assert_close(p.grad, r, rtol=1e-6, atol=1e-8, msg=name)
            model.zero_grad(set_to_none=True)
            reference.zero_grad(set_to_none=True)
        handle.close()
        assert threading.active_count() == threads  # the reducer's pipeline thread ended
        assert len(dist.distributed_c10d._world.pg_map) == groups  # both levels' groups destroyed


@pytest.mark.slow
def test_two_nodes_of_two_ranks_reduce_through_both_levels_and_leave_nothing(tmp_path):
    ddist.spawn(_two_by_two, (str(tmp_path / "init"),), 4)


@pytest.mark.slow
@pytest.mark.parametrize("nproc, per_node", [(4, 2), (6, 3)])  # 3 ranks a node: buckets padded (d_model 32)
def test_verify_matches_the_reference_with_accumulation_and_the_split(nproc, per_node):
    """`dtrain.verify` with 2 micro-batches a step (one step without accumulation is checked on 2x2 above)."""
    overrides = ["sync.hierarchical=true", f"sync.ranks_per_node={per_node}", "sync.classes.embedding.tied_split=true"]
    results = verify.run(nproc, ["bucketed", "flat"], accums=(2,), steps=3, overrides=overrides)
    for per_strategy in results.values():
        for name, r in per_strategy.items():
            assert r["lossless"] and r["max_rel"] <= verify.TOLERANCE, (name, r)
