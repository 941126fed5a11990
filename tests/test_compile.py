"""`train.compile`: the model compiled in place before the sync strategy wraps it trains as the eager one does, behind
every strategy; and a bad value is a one-line error naming the key.

One process, a one-rank gloo group (as a plain `python -m dtrain.engine.train` runs), dtrain/profiles/smoke.yaml without dropout
(compiled dropout draws other random numbers than eager dropout, so only a dropout-free model can be compared step
for step). Inductor compiles C++ on CPU (it needs a C compiler, which this machine has) and takes seconds per graph,
so the strategy matrix uses the `aot_eager` backend: the same capture of forward and backward into graphs, which is
what changes when gradient hooks fire, run eagerly; the inductor comparison is marked slow (minutes on two cores).
"""

import math

import pytest
import torch
import torch._inductor.config as inductor_config
import torch.distributed as dist

from dtrain.collectives import dist as ddist
from dtrain.common.errors import UserError
from dtrain.engine import config as config_mod
from dtrain.engine.trainer import Trainer

STEPS = 2
BASE = ["model.dropout=0.0", "eval.at_end=false", "train.average_last=1", "model.N=1"]


@pytest.fixture(scope="module")
def one_rank(multi30k_dir):
    """A one-rank gloo group for this module's tests, gone after them: later tests start their own."""
    owned = not dist.is_initialized()
    ddist.init(config_mod.RunConfig().collectives)
    yield
    if owned:
        dist.destroy_process_group()


def losses(tmp_path, name, *overrides) -> list[tuple[float, float, bool]]:
    """(loss, grad_norm, skipped) of the first STEPS steps of the smoke profile with `overrides`."""
    cfg = config_mod.load("dtrain/profiles/smoke.yaml", [*BASE, *overrides])
    trainer = Trainer(cfg, tmp_path / name, ddist.init(cfg.collectives)[0], "gloo")
    # compiled in place: the module strategies wrap calls the compiled forward, and keeps its parameter names
    assert (trainer.model._compiled_call_impl is not None) == (cfg.train.compile != "off")
    assert all("_orig_mod" not in n for n in trainer.model.state_dict())
    out = []
    for _ in range(STEPS):
        rec = trainer.train_step()
        out.append((rec.loss, rec.grad_norm, rec.skipped))
    return out


def assert_close(a, b, rel):
    for (la, na, sa), (lb, nb, sb) in zip(a, b, strict=True):
        assert not sa and not sb
        assert math.isclose(la, lb, rel_tol=rel), (a, b)
        assert math.isclose(na, nb, rel_tol=10 * rel), (a, b)


@pytest.mark.slow
def test_inductor_matches_eager(tmp_path, one_rank, monkeypatch):
    # Inductor compiles in this process: a pool of compile workers (Python processes importing torch) would cost
    # more than it saves on the 2 cores the tests share
    monkeypatch.setattr(inductor_config, "compile_threads", 1)
    # One batch an epoch, the same pairs each step: one shape, so the model compiles once (a second shape would
    # compile it again, for dynamic shapes: as long again, most of it C++)
    one_batch = ("data.train_limit=24", "data.max_tokens=4000")
    eager = losses(tmp_path, "eager", *one_batch)
    torch._dynamo.reset()
    compiled = losses(tmp_path, "inductor", "train.compile=default", *one_batch)
    # Inductor fuses and reorders float32 reductions: equal to rounding, not bit for bit.
    assert_close(compiled, eager, 1e-4)
    assert eager[1][0] != eager[0][0]  # the second step saw the first update


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "per_tensor", "flat", "bucketed", "per_class", "sharded", "powersgd",
                                      "noop"])
def test_every_strategy_trains_the_compiled_model(tmp_path, one_rank, strategy):
    eager = losses(tmp_path, "eager", f"sync.strategy={strategy}")
    compiled = losses(tmp_path, "compiled", f"sync.strategy={strategy}", "train.compile=default",
                      "train.compile_backend=aot_eager")
    assert_close(compiled, eager, 1e-5)


@pytest.mark.parametrize("override,expected", [
    ("train.compile=fast", "'train.compile' must be one of off, default, reduce-overhead, max-autotune, got 'fast'"),
    ("train.compile_backend=tvm", "'train.compile_backend' must be one of inductor, aot_eager"),
])
def test_bad_compile_value_names_the_key(override, expected):
    with pytest.raises(UserError) as e:
        config_mod.load("dtrain/profiles/smoke.yaml", [override])
    assert expected in str(e.value) and "\n" not in str(e.value)
