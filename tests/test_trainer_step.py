"""The training step's reads from the device: none inside the micro-batch loop (the loss is summed on the device),
and the step record's loss, norm and skip decision exactly what host-side sums of the same values give.

One process, a one-rank gloo group (as a plain `python -m dtrain.engine.train` runs), dtrain/profiles/smoke.yaml with two
micro-batches per step.
"""

import math

import pytest
import torch
import torch.distributed as dist

from dtrain.collectives import dist as ddist
from dtrain.engine import config as config_mod
from dtrain.engine.trainer import Trainer


@pytest.fixture
def trainer(tmp_path, multi30k_dir):
    """A trainer on a one-rank gloo group, gone after the test: later tests start their own."""
    owned = not dist.is_initialized()
    cfg = config_mod.load("dtrain/profiles/smoke.yaml", ["train.accum_steps=2", "eval.at_end=false",
                                                  "train.average_last=1"])
    yield Trainer(cfg, tmp_path / "run", ddist.init(cfg.collectives)[0], "gloo")
    if owned:
        dist.destroy_process_group()


def test_micro_batch_loop_reads_nothing_from_the_device(trainer, monkeypatch):
    # Float tensors only: collate counts a batch's target tokens on the host, before the batch moves to the device.
    def refusing(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args):
            if self.is_floating_point():
                raise AssertionError(f"Tensor.{name} of a float tensor inside the micro-batch loop")
            return original(self, *args)
        return read

    with monkeypatch.context() as m:
        for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
            m.setattr(torch.Tensor, name, refusing(name))
        data_s, spans, loss_sum, ntokens = trainer._forward_backward()
    assert isinstance(loss_sum, torch.Tensor) and loss_sum.dtype == torch.float64 and loss_sum.dim() == 0
    assert len(spans["forward"]) == len(spans["backward"]) == 2 and ntokens > 0 and data_s >= 0


def test_step_record_is_the_host_sum_of_the_micro_batch_losses(trainer):
    seen = []
    criterion = trainer.criterion

    def recording(logits, target):
        loss = criterion(logits, target)
        seen.append(loss.detach().clone())
        return loss

    trainer.criterion = recording
    norms = []
    grad_norm = trainer.sync.grad_norm
    trainer.sync.grad_norm = lambda exact=False: norms.append(grad_norm(exact)) or norms[-1]
    rec = trainer.train_step()
    assert len(seen) == 2 and len(norms) == 1
    host_sum = 0.0
    for loss in seen:  # what the loop computed before: a Python float sum of each micro-batch's loss
        host_sum += loss.item()
    assert rec.loss == host_sum / rec.tokens
    assert rec.grad_norm == float(norms[0]) and math.isfinite(rec.grad_norm) and not rec.skipped
    assert rec.forward_ms > 0 and rec.backward_ms > 0 and rec.step_ms >= rec.forward_ms + rec.backward_ms


def test_non_finite_gradient_skips_the_update(trainer):
    trainer.sync.grad_norm = lambda exact=False: torch.tensor(float("nan"))
    before = [p.detach().clone() for p in trainer.model.parameters()]
    rec = trainer.train_step()
    assert rec.skipped and math.isnan(rec.grad_norm) and trainer.bad_steps == 1
    assert all(torch.equal(a, p) for a, p in zip(before, trainer.model.parameters()))
    assert trainer.scheduler.last_epoch == 0  # the schedule did not advance either
