"""examples/plain_loop.py: `collectives.attach`, and the loop's own DDP with the per-class comm hook, in a plain
PyTorch loop, no dtrain trainer, on 2 gloo ranks."""

import pytest
import torch

from conftest import REPO, launch_ranks


def plain_loop(tmp_path, *args, steps=20):
    """Run the example on 2 ranks (torchrun's environment, without its agent); its final parameters (rank 0's) and
    what it printed."""
    out = tmp_path / f"params-{len(list(tmp_path.glob('params-*')))}.pt"
    r = launch_ranks([REPO / "examples" / "plain_loop.py", "--steps", steps, "--save", out, *args], cwd=tmp_path,
                     timeout=180)
    assert "parameters equal on every rank: True" in r.stdout, r.stdout
    return torch.load(out), r.stdout


def max_rel(a: dict, b: dict) -> float:
    return max(((a[n] - b[n]).abs().max() / b[n].abs().max()).item() for n in b)


@pytest.fixture(scope="module")
def per_class_run(tmp_path_factory):
    """attach(strategy='per_class') for 20 steps: the reference of the comparisons below."""
    return plain_loop(tmp_path_factory.mktemp("per_class"), "--strategy", "per_class")


@pytest.mark.slow
def test_plain_loop_keeps_every_rank_equal(per_class_run):
    _, out = per_class_run  # plain_loop checked the line "parameters equal on every rank: True"
    assert "per_class: last loss" in out


@pytest.mark.slow
def test_own_ddp_with_the_per_class_hook_matches_the_per_class_strategy(tmp_path, per_class_run):
    """20 steps: the loop's own DDP + `per_class_hook`, and attach's `ddp` strategy running the same hook
    (`sync.hook: per_class`), end with the parameters of attach(strategy='per_class'), run the same way."""
    reference, _ = per_class_run
    own, out = plain_loop(tmp_path, "--own-ddp")
    assert "own DDP + per_class hook" in out
    via_attach, out = plain_loop(tmp_path, "--strategy", "ddp", "--hook", "per_class")
    assert "ddp + per_class" in out
    assert set(own) == set(via_attach) == set(reference) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert max_rel(own, reference) <= 1e-6 and max_rel(via_attach, reference) <= 1e-6
    # ... and the check can fail: bf16 on the wire changes the result
    lossy, _ = plain_loop(tmp_path, "--own-ddp", "--wire-dtype", "bf16")
    assert max_rel(lossy, reference) > 1e-6


@pytest.mark.slow
def test_fsdp2_through_attach_in_the_plain_loop_trains_as_the_others(tmp_path, per_class_run):
    """Stock FSDP2 behind the seam in a plain loop: units are the Sequential's Linear layers, SGD runs over their
    DTensor shards, and the whole parameters read back through `handle.model_state()` equal per_class's."""
    reference, _ = per_class_run
    params, out = plain_loop(tmp_path, "--strategy", "fsdp2")
    assert "fsdp2: last loss" in out
    assert set(params) == set(reference) and max_rel(params, reference) <= 1e-6


def gpt_lm(tmp_path, *args):
    """examples/gpt_lm.py on 2 ranks, small: its final parameters (rank 0's) and what it printed."""
    out = tmp_path / f"gpt-{len(list(tmp_path.glob('gpt-*')))}.pt"
    r = launch_ranks([REPO / "examples" / "gpt_lm.py", "--layers", "1", "--d-model", "32", "--context", "32",
                      "--batch", "4", "--steps", "24", "--save", out, *args], cwd=tmp_path, timeout=180)
    return torch.load(out), r.stdout


@pytest.mark.slow
def test_the_language_model_searches_with_auto_and_trains_as_ddp(tmp_path):
    """A second model, decoder-only with a tied embedding: auto's search (the split among its candidates) in the
    loop, and the parameters DDP gives, bit for bit on 2 CPU ranks (every candidate is lossless)."""
    space = "{ddp-25: {strategy: ddp}, split: {strategy: bucketed, bucket_cap_mb: 0.5, classes.embedding.tied_split: true}}"
    searched, out = gpt_lm(tmp_path, "--candidates", space, "--budget", "20")
    assert "auto picked " in out and "of the loop's steps" in out, out
    assert "ddp-25" in out and "split" in out and "rounds" in out, out
    reference, _ = gpt_lm(tmp_path, "--strategy", "ddp-25")  # a candidate by name: DDP at 25 MiB, no search
    assert set(searched) == set(reference) and "embed.weight" in reference
    assert all(torch.equal(searched[n], reference[n]) for n in reference)
