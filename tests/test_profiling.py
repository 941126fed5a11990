"""dtrain.engine.profiler: the step window, the no-op span outside a window, and a traced one-rank training run whose
bucket all-reduces carry their bucket index and tensor class from launch to completion."""

import json
import re

import pytest
import torch
import torch.distributed as dist

from dtrain.collectives.spans import SPAN_PREFIX, comm_span
from dtrain.engine.profiler import StepProfiler, parse_window
from dtrain.engine import verify
from dtrain.collectives import attach
from dtrain.collectives.settings import SyncConfig
from dtrain.common.errors import UserError


@pytest.mark.parametrize("spec, want", [("10:3", (10, 3)), ("10-12", (10, 3)), (" 1:1 ", (1, 1))])
def test_window(spec, want):
    assert parse_window(spec) == want


@pytest.mark.parametrize("spec", ["10", "0:3", "5-4", "a:b", ""])
def test_bad_window(spec):
    with pytest.raises(UserError, match="profile window"):
        parse_window(spec)


def test_span_outside_a_window_is_free():
    fut = torch.futures.Future()
    with comm_span(0, "ffn", 64) as span:
        assert span.until(fut) is fut  # nothing wraps the collective's future


def test_window_behind_the_run_stays_off(tmp_path):
    prof = StepProfiler("3:2", tmp_path).start(step=10)  # resumed past the window
    prof.step()
    prof.stop()
    assert not prof.enabled and not (tmp_path / "profile").exists()


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_trace_of_a_one_rank_run_has_labelled_spans(tmp_path, one_rank):
    model = verify.tiny_model()
    handle = attach(model, SyncConfig(strategy="per_class", bucket_cap_mb=0.01))
    optimizer = torch.optim.Adam(model.parameters())
    prof = StepProfiler("3:2", tmp_path, rank=0).start(step=0)
    for s in range(5):  # steps 1..5; 2 is the warm-up, 3 and 4 are recorded
        src, tgt_in, tgt_out = verify.batch(0, s, 0)
        verify.loss_fn(handle.module(src, tgt_in), tgt_out, 1).backward()
        handle.wait()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        prof.step()
    prof.stop()
    assert prof.path == tmp_path / "profile" / "rank0.steps3-4.json"
    events = json.loads(prof.path.read_text())["traceEvents"]
    steps = sorted(e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#"))
    assert len(steps) == 2
    # Async begin/end pairs (the spans overlap each other and the backward), named and with their fields as args.
    begins = [e for e in events if e.get("name", "").startswith(SPAN_PREFIX) and e["ph"] == "b"]
    ends = {e["id"]: e for e in events if e.get("name", "").startswith(SPAN_PREFIX) and e["ph"] == "e"}
    assert len(ends) == len(begins) and not [e for e in events if e.get("name", "").startswith(SPAN_PREFIX)
                                             and e["ph"] not in "be"]
    buckets = {(st.bucket.index, st.bucket.tensor_class, st.bucket.nbytes) for st in handle.reducer.buckets}
    assert len(buckets) > 3
    got = []
    for e in begins:
        m = re.fullmatch(re.escape(SPAN_PREFIX) + r"\[bucket=(\d+) class=(\w+) bytes=(\d+) wire=fp32\]", e["name"])
        assert m, e["name"]
        a = e["args"]
        assert (a["bucket"], a["class"], a["bytes"], a["wire_dtype"]) == (int(m[1]), m[2], int(m[3]), "fp32")
        got.append((a["bucket"], a["class"], a["bytes"]))
        assert ends[e["id"]]["ts"] >= e["ts"] and e["cat"] == "dtrain_comm"
    assert set(got) == buckets
    assert len(got) == 2 * len(buckets)  # every bucket of both recorded steps, nothing from the warm-up
    assert {c for _, c, _ in got} >= {"embedding", "projection", "ffn", "norm_bias"}
