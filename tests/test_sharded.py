"""The sharded strategy: reduce-scatter in backward, each rank updating its shard, all-gather in the next forward.
It must give what DDP gives (the same gradients, the same clipped update, the same checkpoints), and its checkpoints
must resume under any strategy."""

import gc
import threading
import weakref

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from dtrain.collectives import dist as ddist
from dtrain.collectives import attach, strategies
from dtrain.collectives.settings import SyncConfig
from dtrain.collectives.sharded.exchange import REPLICATED, ROWS, SHARDS, exchange_plan
from conftest import NO_EVAL, checkpoint_diff, records, train_ranks
from dtrain.engine import config, verify
from dtrain.common.errors import UserError
from dtrain.engine.model import Transformer

SHARDED = ("--set", "sync.strategy=sharded", "--set", "sync.bucket_cap_mb=0.05")  # many buckets on the tiny model
# verify's check of sharded with the split on 3 ranks (each gradient the exact mean) is in tests/test_strategies.py,
# in the same spawn as every strategy's 3-rank check.


def test_the_split_embedding_gets_a_bucket_of_its_own_first():
    """Whatever the cap, the split parameter is alone in bucket 0 (its gradient is complete when the projection's
    is, the first of backward) and the other buckets are bucketed's plan of the rest."""
    with torch.device("meta"):
        model = Transformer(vocab=1000, N=2, d_model=64, d_ff=256, h=4)

    def plan(**sync):
        raw = {"sync": {"strategy": "sharded", "bucket_cap_mb": 25, **sync}}
        return strategies.schedule_for(config.from_dict(raw, "test").sync, model, 2)

    split = {"classes": {"embedding": {"tied_split": True}}}
    buckets = plan(**split).buckets
    assert buckets[0].names == ("embed.weight",) and [b.index for b in buckets] == list(range(len(buckets)))
    assert len(buckets) > 1 and all("embed.weight" not in b.names for b in buckets[1:])
    sync = config.from_dict({"sync": {"strategy": "sharded", "bucket_cap_mb": 25, **split}}, "test").sync
    exchanges = exchange_plan(sync, model, buckets, 2)
    assert [ex.layout for ex in exchanges] == [REPLICATED] + [SHARDS] * (len(buckets) - 1)
    assert exchanges[0].padded == buckets[0].numel and all(ex.padded % 2 == 0 for ex in exchanges[1:])
    assert len(plan().buckets) == 1  # without the split, 25 MiB puts the whole model in one bucket


def test_the_sharded_split_embedding_is_sharded_by_whole_rows():
    with torch.device("meta"):
        model = Transformer(vocab=1001, N=1, d_model=64, d_ff=256, h=4)
    raw = {"sync": {"strategy": "sharded", "shard_tied_split": True, "classes": {"embedding": {"tied_split": True}}}}
    sync = config.from_dict(raw, "test").sync
    buckets = strategies.schedule_for(sync, model, 3).buckets
    exchanges = exchange_plan(sync, model, buckets, 3)
    assert buckets[0].names == ("embed.weight",) and exchanges[0].layout == ROWS and exchanges[0].row_size == 64
    assert exchanges[0].padded == 1002 * 64 and exchanges[0].chunk == 334 * 64  # 1,001 rows: 334 whole rows a rank
    assert all(ex.layout == SHARDS and ex.row_size == 0 for ex in exchanges[1:])


@pytest.mark.parametrize("world,whole", [(2, True), (3, True), (4, False)])
def test_the_exchange_plan_narrows_what_only_linear_modules_read(world, whole):
    """With gather_dtype bf16: a sharded bucket's Linear members travel in bf16, its LayerNorm members in fp32;
    the replicated embedding (read by its lookups and the pre-softmax projection, a Linear) is exchanged whole in
    bf16 up to 3 ranks, where that sends fewer bytes than an fp32 ring all-reduce. A step of summed micro-batches
    reduce-scatters in fp32; the all-gather stays narrowed."""
    with torch.device("meta"):
        model = Transformer(vocab=1000, N=1, d_model=64, d_ff=256, h=4)
    raw = {"train": {"amp": "bf16"}, "sync": {"strategy": "sharded", "bucket_cap_mb": 0.05, "gather_dtype": "bf16",
                                              "classes": {"embedding": {"tied_split": True}}}}
    sync = config.from_dict(raw, "test").sync
    buckets = strategies.schedule_for(sync, model, world).buckets
    exchanges = exchange_plan(sync, model, buckets, world)
    embedding, rest = exchanges[0], exchanges[1:]
    assert embedding.whole == whole and embedding.nbytes("all_gather") == 0
    assert embedding.nbytes("reduce_scatter") == buckets[0].nbytes // (2 if whole else 1)
    numel = dict(model.named_parameters())
    for ex in rest:
        assert ex.narrowed == {n for n in ex.bucket.names if "norm" not in n}
        assert ex.nbytes("all_gather") == sum(numel[n].numel() * (2 if n in ex.narrowed else 4)
                                              for n in ex.bucket.names)
        assert ex.nbytes("reduce_scatter") == ex.nbytes("all_gather")
        assert ex.nbytes("reduce_scatter", accumulated=True) == ex.bucket.nbytes
    assert any(ex.narrowed and len(ex.narrowed) < len(ex.bucket.names) for ex in rest)  # a Linear beside a norm


def _fetch_on_two_ranks(rank: int, init: str) -> None:
    """Each rank's rows updated and not all-gathered yet: a lookup's fetch brings exactly the rows any rank looks
    up from their owner, and leaves the peer's other rows as they were."""
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    with ddist.rank_process():
        model = verify.tiny_model()
        handle = attach(model, SyncConfig(strategy="sharded", shard_tied_split=True,
                                          classes={"embedding": {"tied_split": True}}))
        split = handle.splits[0]
        t = split.table
        before = t.table.clone()
        with torch.no_grad():
            t.shard.fill_(rank + 1.0)  # this rank's update of its rows, not sent yet
        t.launched += 1  # as gather() counts an all-gather (none is launched here: only the fetch can bring rows)
        split.lookups_per_forward = 2  # as counted by a synchronized forward: the first lookup fetches
        handle.before_forward()
        tokens = [verify.batch(r, 0, 0)[0] for r in (0, 1)]
        split._fetch(model.embed, (tokens[rank],))
        looked_up = torch.zeros(t.table.shape[0], dtype=torch.bool)
        looked_up[torch.cat([x.reshape(-1) for x in tokens])] = True
        looked_up[model.embed.padding_idx] = False
        owner = torch.arange(t.table.shape[0]) // t.per_rank
        peer = owner != rank
        fetched = t.table[peer & looked_up]
        assert fetched.numel() > 0 and torch.all(fetched == (1 - rank) + 1.0)
        assert torch.equal(t.table[peer & ~looked_up], before[peer & ~looked_up])
        assert torch.all(t.table[~peer] == rank + 1.0)


@pytest.mark.slow
def test_a_lookup_fetches_the_rows_of_every_ranks_tokens_from_their_owner(tmp_path):
    ddist.spawn(_fetch_on_two_ranks, (str(tmp_path / "init"),), 2)


def _narrowed_gather_on_two_ranks(rank: int, init: str) -> None:
    """`gather_dtype: bf16`: the peer's chunk of each Linear's parameters arrives as its bf16 value, everything else
    (LayerNorm) exact; a forward outside bf16 autocast refuses to read it; `wait_params` brings the exact values; a
    synchronized forward outside that autocast is refused even then (its gradients would be narrowed)."""
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    with ddist.rank_process():
        model = verify.tiny_model()
        handle = attach(model, SyncConfig(strategy="sharded", bucket_cap_mb=0.05, gather_dtype="bf16"))
        reducer = handle.reducer
        narrowed = [i for i, sh in enumerate(reducer.shards) if sh.exact_idx]
        assert narrowed and any(reducer.shards[i].exact_idx[0].numel() for i in narrowed)  # some LayerNorm inside
        expected = {}
        with torch.no_grad():
            for i in narrowed:  # each rank's update of its shard: values bf16 cannot hold
                sh = reducer.shards[i]
                chunks = [torch.randn(sh.shard.numel(), generator=torch.Generator().manual_seed(100 * i + r))
                          for r in (0, 1)]
                expected[i] = chunks
                sh.shard.copy_(chunks[rank])
        reducer.gather_pending = True
        handle.stepped()
        reducer.wait_params()
        peer = 1 - rank
        for i in narrowed:
            sh, s = reducer.shards[i], reducer.shards[i].shard.numel()
            got, want = sh.params[peer * s: (peer + 1) * s], expected[i][peer]
            exact = torch.zeros(s, dtype=torch.bool)
            exact[sh.exact_idx[peer]] = True
            assert torch.equal(got[exact], want[exact])
            assert torch.equal(got[~exact], want[~exact].to(torch.bfloat16).float())
            assert not torch.equal(got[~exact], want[~exact])  # rounded indeed
            assert torch.equal(sh.shard.detach(), expected[i][rank])  # this rank's own stays exact
        src, tgt_in, _ = verify.batch(rank, 0, 0)
        with pytest.raises(UserError, match="gather_dtype"):
            handle.module(src, tgt_in)
        handle.wait_params()
        for i in narrowed:
            sh, s = reducer.shards[i], reducer.shards[i].shard.numel()
            assert torch.equal(sh.params[peer * s: (peer + 1) * s], expected[i][peer]) and not sh.rounded
        with pytest.raises(UserError, match="gather_dtype"):  # exact now, but its gradients would go narrowed
            handle.module(src, tgt_in)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            handle.module(src, tgt_in)


@pytest.mark.slow
def test_a_narrowed_all_gather_rounds_only_what_autocast_rounds(tmp_path):
    ddist.spawn(_narrowed_gather_on_two_ranks, (str(tmp_path / "init"),), 2)


# The bf16 runs below: 6 steps (the clip active in the first ones), stopped after 3 and resumed. Bit-for-bit equality
# and an exact resume need no more, and each step under bf16 autocast is emulated, 15-20x slower per operation, on a
# CPU without bf16 instructions (CI may run on one).
STEPS, STOP = 6, 3


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory):
    """STEPS steps of stock DDP with given settings, run once per distinct settings in this module: settings -> its run
    directory."""
    done = {}

    def run(same: tuple):
        if same not in done:
            done[same] = tmp_path_factory.mktemp("ddp") / "run"
            train_ranks("--run-dir", str(done[same]), "--set", "sync.strategy=ddp", "--set", f"train.max_steps={STEPS}",
                        *same)
        return done[same]

    return run


def resumed_sharded_against(tmp_path, ddp_reference, same: tuple, sharded: tuple = ()):
    """STEPS steps of stock DDP, and of `sharded` (with `sharded`'s extra settings) stopped after STOP and resumed,
    both with `same`: (the resume's torchrun result, the checkpoint diff of the two, [DDP's grad norms, sharded's])."""
    same = (*same, *NO_EVAL)
    reference = ddp_reference(same)
    run = tmp_path / "sharded"
    train_ranks("--run-dir", str(run), *SHARDED, *sharded, "--set", f"train.max_steps={STOP}", *same)
    r = train_ranks("--run-dir", str(run), *SHARDED, *sharded, "--resume", "--set", f"train.max_steps={STEPS}", *same)
    norms = [[s["grad_norm"] for s in records(d / "steps.jsonl")] for d in (reference, run)]
    return r, checkpoint_diff(reference, run), norms


@pytest.mark.slow
@pytest.mark.parametrize("embedding,accum", [("replicated", 1), ("sharded", 2)])
def test_sharded_split_training_equals_ddp(tmp_path, ddp_reference, embedding, accum):
    """STEPS clipped steps under bf16 autocast: the split embedding (replicated, or with `shard_tied_split` sharded by
    rows, its lookups fetching their rows in forward) with the rest of the model sharded, its Linear parameters
    exchanged in bf16 (`gather_dtype`), gives stock DDP's parameters and optimizer state bit for bit on 2 ranks, and
    the checkpoint (written with the exact parameters) resumes under it exactly.

    One micro-batch a step: the Linear gradients, and the replicated embedding's projection part, go in bf16 (bf16
    values widened, exact). Two: they are sums of bf16 values and go in fp32. (A sharded embedding's no_sync()
    micro-batches' lookups would wait for the whole matrix, so only a step's first forward fetches rows.) Without the
    split and in fp32, `sharded` is compared with the reference at 2 and 3 ranks, with accumulation, by
    tests/test_strategies.py."""
    shard_rows = ("--set", "sync.shard_tied_split=true") if embedding == "sharded" else ()
    r, diff, norms = resumed_sharded_against(
        tmp_path, ddp_reference,
        ("--set", "train.amp=bf16", "--set", "optim.clip_norm=0.5", "--set", f"train.accum_steps={accum}",
         "--set", "data.max_tokens=300"),  # bf16 autocast is 15-20x slower on CPUs without bf16 instructions
        ("--set", "sync.classes.embedding.tied_split=true", "--set", "sync.gather_dtype=bf16", *shard_rows))
    assert f"at step {STOP}" in r.stdout
    # Its checkpoint all-gathered the optimizer state's shards with torch's current API: a normal run warns of nothing.
    assert "FutureWarning" not in r.stderr and "DeprecationWarning" not in r.stderr, r.stderr[-2000:]
    assert "max |A - B| over parameters: 0 " in diff and "optimizer states: identical" in diff, diff
    # The embedding's gradient counted once in the global norm, and the clip active.
    assert norms[0] == norms[1] and len(norms[0]) == STEPS and max(norms[0]) > 0.5
    recs = records(tmp_path / "sharded" / "buckets.jsonl")
    wires = {part: {b["wire_dtype"] for b in recs if b.get("part") == part}
             for part in ("all_gather", "reduce_scatter")}
    assert "bf16" in wires["all_gather"]  # a sharded embedding's rows go in fp32
    # How long the forward blocked on each all-gather: measured on every one, never negative.
    assert all(b["wait_ms"] >= 0 for b in recs if b.get("part") == "all_gather")
    assert wires["reduce_scatter"] == {"bf16" if accum == 1 else "fp32"}
    if embedding == "replicated":  # its projection part: exchanged whole
        projection = {b["wire_dtype"] for b in recs if b.get("part") == "projection"}
        assert projection == {"bf16" if accum == 1 else "fp32"}


@pytest.mark.slow
def test_clipping_changes_the_update(tmp_path, straight_run):
    """Clipping scales the gradients the optimizer reads (it once scaled nothing: given gradient tensors instead of
    parameters, torch's clip_grads_with_norm_ finds no .grad to scale)."""
    train_ranks("--run-dir", str(tmp_path / "clipped"), "--set", "train.max_steps=10", "--set", "optim.clip_norm=0.05",
                *NO_EVAL)
    diff = checkpoint_diff(straight_run / "checkpoints" / "step-0000010.pt", tmp_path / "clipped")
    assert "max |A - B| over parameters: " in diff and "max |A - B| over parameters: 0 " not in diff, diff


def _close_on_two_ranks(rank: int, init: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    with ddist.rank_process():
        groups = distributed_c10d._world.pg_map  # torch's registry of live process groups
        before = (len(groups), {t.name for t in threading.enumerate()})
        split = {"embedding": {"tied_split": True}}
        for sync in (SyncConfig(strategy="sharded", bucket_cap_mb=0.05, shard_tied_split=True, classes=split),
                     SyncConfig(strategy="sharded", bucket_cap_mb=0.05, classes=split),
                     SyncConfig(strategy="bucketed", bucket_cap_mb=0.05, classes=split)):
            model = verify.tiny_model()
            handle = attach(model, sync)
            for step in range(2):  # two steps: the first one's update is all-gathered in the second forward
                src, tgt_in, tgt_out = verify.batch(rank, step, 0)
                verify.loss_fn(handle.module(src, tgt_in), tgt_out, 1).backward()
                handle.wait()
                handle.stepped()
            assert len(groups) > before[0]
            reducer = weakref.ref(handle.reducer)
            handle.close()
            del handle
            gc.collect()
            assert reducer() is None, sync  # no thread, hook or callback holds the reducer and its buffers
            assert (len(groups), {t.name for t in threading.enumerate()}) == before, sync
            src, tgt_in, tgt_out = verify.batch(rank, 2, 0)
            verify.loss_fn(model(src, tgt_in), tgt_out, 1).backward()  # the model runs on without the hooks


@pytest.mark.slow
def test_a_closed_handle_leaves_no_thread_process_group_or_buffer_behind(tmp_path):
    """What the tuner does with a candidate it drops: `close()` ends the sharded handle's completion thread,
    destroys the process groups it and its split created, removes its hooks, and nothing holds its reducer."""
    ddist.spawn(_close_on_two_ranks, (str(tmp_path / "init"),), 2)
