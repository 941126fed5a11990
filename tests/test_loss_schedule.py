import pytest
import torch

from dtrain.engine.loss import LabelSmoothing
from dtrain.engine.schedule import rate


def test_smoothed_distribution_mass():
    crit = LabelSmoothing(vocab=10, pad_id=0, smoothing=0.1)
    target = torch.tensor([3, 5, 0])
    q = crit.target_distribution(target)
    assert q[0, 3] == pytest.approx(0.9) and q[1, 5] == pytest.approx(0.9)
    assert q[0].sum() == pytest.approx(1.0) and q[1].sum() == pytest.approx(1.0)
    assert q[0, 0] == 0.0  # padding never gets mass
    assert q[0, 4] == pytest.approx(0.1 / 8)
    assert q[2].sum() == 0.0  # padded positions contribute nothing


def test_loss_equals_cross_entropy_against_smoothed_distribution():
    crit = LabelSmoothing(vocab=10, pad_id=0, smoothing=0.1)
    logits = torch.randn(2, 3, 10)
    target = torch.tensor([[3, 5, 0], [1, 2, 9]])
    q = crit.target_distribution(target)
    expected = -(q * torch.log_softmax(logits.view(-1, 10), -1)).sum()
    assert crit(logits, target).item() == pytest.approx(expected.item(), rel=1e-5)


def test_no_smoothing_is_plain_nll():
    crit = LabelSmoothing(vocab=10, pad_id=0, smoothing=0.0)
    logits, target = torch.randn(4, 10), torch.tensor([1, 2, 3, 4])
    nll = torch.nn.functional.cross_entropy(logits, target, reduction="sum")
    assert crit(logits[None], target[None]).item() == pytest.approx(nll.item(), rel=1e-5)


def test_schedule_peaks_at_warmup():
    d_model, warmup = 512, 4000
    lrs = [rate(s, d_model, warmup) for s in range(1, 20000)]
    assert max(range(len(lrs)), key=lrs.__getitem__) + 1 == warmup
    assert rate(warmup, d_model, warmup) == pytest.approx(d_model**-0.5 * warmup**-0.5)
    assert rate(100, d_model, warmup) == pytest.approx(100 * rate(1, d_model, warmup))  # linear warm-up
    assert rate(4 * warmup, d_model, warmup) == pytest.approx(rate(warmup, d_model, warmup) / 2)  # 1/sqrt decay


def test_scheduler_steps_per_optimizer_step():
    from dtrain.engine.schedule import make_scheduler

    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.Adam([p], lr=1.0)
    sched = make_scheduler(opt, 512, 10, 1.0)
    seen = []
    for _ in range(12):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen[0] == pytest.approx(rate(1, 512, 10)) and seen[9] == pytest.approx(rate(10, 512, 10))
