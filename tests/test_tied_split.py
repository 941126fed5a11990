"""The tied embedding's split gradient: the projection part goes out with the first bucket, each lookup's rows as
its backward ends, and each row is added up as autograd adds it: the same bits as the unsplit gradient (one rank
here; 2 and 3 ranks through dtrain.engine.verify, 2 ranks against DDP's training in test_sharded)."""

import pytest
import torch

from dtrain.collectives import attach
from dtrain.collectives.settings import ClassSettings, SyncConfig
from dtrain.common.errors import UserError
from dtrain.engine import verify

from test_strategies import one_rank, plain_grads, step  # noqa: F401 (fixture)

SPLIT = {"embedding": ClassSettings(tied_split=True)}


@pytest.mark.parametrize("name", ["bucketed", "per_class"])
@pytest.mark.parametrize("accum", [1, 2])
def test_split_gradient_equals_the_whole(one_rank, name, accum):  # noqa: F811
    model = verify.tiny_model()
    handle = attach(model, SyncConfig(strategy=name, bucket_cap_mb=0.01, classes=SPLIT))
    optimizer = torch.optim.Adam(model.parameters())
    for s in range(3):
        step(handle, model, step_no=s, accum=accum)
        want = plain_grads(s, accum)
        for n, p in model.named_parameters():
            assert torch.equal(p.grad, want[n]), n  # autograd's order of additions, row by row
        records = handle.step_records()
        # one lookup part per lookup, in backward's order: the decoder's input, then the encoder's
        lookups = [r for r in records if r.part == "lookup"]
        assert len(lookups) == 2 and lookups[0].bucket + 1 == lookups[1].bucket
        projection = [r for r in records if r.part == "projection"]  # a bucket of the embedding alone
        assert len(projection) == (1 if name == "per_class" else len(projection)) <= 1
        for lookup in lookups:  # the rows of one lookup's tokens, fewer than the vocabulary
            assert 0 < lookup.numel < model.embed.weight.numel()
            assert lookup.nbytes == lookup.numel * 4 and lookup.wire_dtype == "fp32"
            # the split's own work for that lookup on this thread: its mask, its rows, adding them
            assert 0 < lookup.host_ms < 1000
            assert lookup.to_json(s)["host_ms"] == lookup.host_ms
        assert all("host_ms" not in r.to_json(s) for r in records if r.part != "lookup")
        if s > 0:  # re-planned in the observed order: the projection part is ready before every other bucket
            first = min(r.ready_ms for r in records if r.part != "lookup")
            embedding = [r for r in records if r.bucket == handle.reducer.bucket_of("embed.weight")]
            assert embedding[0].ready_ms == first
            # the encoder's lookup is the last thing backward computes; the decoder's goes out before it
            assert lookups[1].ready_ms >= max(r.ready_ms for r in records if r.part is None)
            assert lookups[0].launch_ms <= lookups[1].ready_ms
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        model.load_state_dict(verify.tiny_model().state_dict())  # keep the weights of `plain_grads`


def test_lookups_outside_a_synchronized_step_are_untouched(one_rank):  # noqa: F811
    model = verify.tiny_model()
    handle = attach(model, SyncConfig(strategy="bucketed", bucket_cap_mb=0.01, classes=SPLIT))
    src, tgt_in, _ = verify.batch(0, 0, 0)
    with torch.no_grad():
        assert torch.equal(handle.module(src, tgt_in), model(src, tgt_in))


def test_split_needs_an_embedding(one_rank):  # noqa: F811
    model = verify.tiny_model()
    classes = {"ffn": ClassSettings(tied_split=True)}
    with pytest.raises(UserError, match="tied_split"):
        attach(model, SyncConfig(strategy="per_class", classes=classes))


def test_a_wait_without_a_synchronized_forward_adds_no_stale_rows(one_rank):  # noqa: F811
    model = verify.tiny_model()
    handle = attach(model, SyncConfig(strategy="per_class", bucket_cap_mb=0.01, classes=SPLIT))
    step(handle, model, step_no=0)
    model.zero_grad(set_to_none=True)
    src, tgt_in, tgt_out = verify.batch(0, 1, 0)
    with handle.no_sync():  # the lookups write .grad themselves; wait() must not add the last step's rows again
        verify.loss_fn(handle.module(src, tgt_in), tgt_out, 1).backward()
    handle.wait()
    torch.testing.assert_close(model.embed.weight.grad, plain_grads(1)["embed.weight"], rtol=1e-6, atol=1e-7)
