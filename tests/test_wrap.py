"""`dtrain.collectives.wrap`: a DDP loop's model and optimizer under every strategy, changed in one line; models no one
here wrote (`transformers`' GPT-2 and Marian, examples/wrap_models.py) against stock DDP on 2 gloo ranks."""

import json

import pytest
import torch
from torch import nn

from conftest import REPO, launch_ranks
from dtrain.collectives.plan import plan_params
from dtrain.collectives.settings import SyncConfig
from dtrain.collectives.sharded.grads import hidden_grad
from dtrain.collectives.strategies import get
from dtrain.collectives.sync import GradSync, param_groups_of
from dtrain.collectives.tensor_classes import from_config, tied_embedding, with_tied_embedding
from dtrain.collectives.tied_split import unsplittable
from dtrain.collectives.wrap import sync_config
from dtrain.common.errors import UserError


class TiedLM(nn.Module):
    """A tiny language model whose output projection holds the embedding's weight, tied by assignment (as the
    GPT scripts and `tie_word_embeddings` tie it), under names that are not dtrain's."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(16, 8)
        self.block = nn.Linear(8, 8)
        self.ln = nn.LayerNorm(8)
        self.pos = nn.Embedding(4, 8)
        self.pos.weight.requires_grad_(False)  # a fixed table
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, x):
        return self.head(self.ln(self.block(self.wte(x))))


# -- fast: the pieces --------------------------------------------------------------------------------------------

def test_a_hidden_gradient_names_the_call_that_read_it():
    p = nn.Parameter(torch.randn(3, 4))
    p.grad = hidden_grad(p)
    with pytest.raises(UserError, match=r"clip_grad_norm_ \(test_wrap.py:\d+\).*model.clip_grad_norm_"):
        torch.nn.utils.clip_grad_norm_([p], 1.0)
    p.grad = None  # what zero_grad(set_to_none=True) does: no read, no error


def test_the_sharded_plan_never_mixes_optimizer_groups():
    model = TiedLM()
    named = [(n, p) for n, p in reversed(list(model.named_parameters())) if p.requires_grad]
    strategy = get("sharded").from_sync(SyncConfig(strategy="sharded", bucket_cap_mb=1))
    strategy.group_of = {n: int(p.dim() < 2) for n, p in named}  # decay the matrices, not biases and norms
    buckets, _, _ = plan_params(strategy, from_config(SyncConfig()), named)
    assert {n for b in buckets for n in b.names} == {n for n, _ in named}
    assert all(len({strategy.group_of[n] for n in b.names}) == 1 for b in buckets)
    assert len(buckets) == 2  # one per group at this cap: they would be one bucket without the groups
    strategy.group_of = {}
    buckets, _, _ = plan_params(strategy, from_config(SyncConfig()), named)
    assert len(buckets) == 1


def test_optimizer_groups_must_hold_the_model_s_own_parameters_once():
    model = TiedLM()
    with pytest.raises(UserError, match="not one of the model's parameters"):
        param_groups_of(model, [[nn.Parameter(torch.zeros(2))]])
    with pytest.raises(UserError, match="an earlier group holds too"):
        param_groups_of(model, [[model.block.weight], [model.block.weight]])
    handle = GradSync(model, SyncConfig(), param_groups=[[model.block.weight], [model.block.bias]])
    handle.check_optimizer(torch.optim.SGD([{"params": [model.block.weight]}, {"params": [model.block.bias]}]))
    with pytest.raises(UserError, match=r"optimizer.step: .*handle.optimizer_groups\(\).*wrap"):
        handle.check_optimizer(torch.optim.SGD([model.block.weight, model.block.bias], lr=0.1))


def test_a_tie_by_assignment_is_found_under_any_name():
    model = TiedLM()
    assert tied_embedding(model) == "wte.weight"  # not the fixed table, not an untied embedding
    assert tied_embedding(nn.Sequential(nn.Embedding(4, 2), nn.Linear(2, 4))) is None
    sync = with_tied_embedding(SyncConfig(strategy="bucketed"), model)
    assert from_config(sync).assign(model.named_parameters())["wte.weight"] == "embedding"
    assert unsplittable(model, "wte.weight") is None


def test_an_embedding_with_a_forward_of_its_own_is_not_split():
    class Scaled(nn.Embedding):
        def forward(self, x):
            return super().forward(x) * 2.0

    model = TiedLM()
    model.wte = Scaled(16, 8)
    model.head.weight = model.wte.weight
    assert "forward of its own" in unsplittable(model, "wte.weight")


def test_wrap_reads_a_strategy_name_or_a_mapping_strictly():
    assert sync_config("sharded").strategy == "sharded"
    assert sync_config({"strategy": "bucketed", "bucket_cap_mb": 2}).bucket_cap_mb == 2
    assert sync_config({"strategy": "bucketed", "classes.embedding.tied_split": True}).classes[
        "embedding"].tied_split
    with pytest.raises(UserError, match="bucket_cap"):
        sync_config({"strategy": "bucketed", "bucket_cap": 2})
    with pytest.raises(UserError, match="'sync.hook' is not used by strategy 'sharded'"):
        sync_config({"strategy": "sharded", "hook": "bf16_compress"})


# -- slow: real models on 2 ranks, against stock DDP -------------------------------------------------------------

def wrap_models(tmp_path, *args, ranks=2, check=True):
    """examples/wrap_models.py on `ranks` gloo ranks (torchrun's environment, without its agent); its table (rank 0's
    JSON) and the completed process."""
    out = tmp_path / f"table-{len(list(tmp_path.glob('table-*')))}.json"
    r = launch_ranks([REPO / "examples" / "wrap_models.py", "--json", out, *args], nproc=ranks, check=check,
                     cwd=tmp_path)
    if check:
        return {row["strategy"]: row for row in json.loads(out.read_text())}, r
    return None, r


@pytest.mark.slow
def test_gpt2_in_the_gpt_scripts_loop_under_bf16_autocast_and_clipping(tmp_path):
    """Two AdamW groups, accumulation under no_sync, clipping to 0.5 (active: the norms are above it), a cosine
    schedule built before wrap, bf16 autocast; the split where the tie is found. ddp and bucketed: DDP's parameters
    and optimizer state bit for bit. sharded, fsdp2 and auto clip by a norm summed in another order than DDP's
    (torch's, over DTensors, for fsdp2), which bf16 autocast then carries on: close, not equal."""
    table, _ = wrap_models(tmp_path, "--model", "gpt2", "--amp", "bf16", "--clip", "0.5", "--split", "--steps", "12",
                           "--auto-budget", "10")
    assert table["ddp"]["max_abs"] == table["bucketed"]["max_abs"] == 0.0
    assert table["bucketed"]["optimizer_max_abs"] == 0.0
    for s in ("sharded", "fsdp2", "auto"):
        assert 0.0 < table[s]["max_rel"] < 0.05, table[s]
    assert table["auto"]["pick"] is not None and table["auto"]["steps_spent"] > 0  # picked within the run


@pytest.mark.slow
def test_marian_resumed_from_a_ddp_checkpoint_is_ddp_bit_for_bit_under_every_strategy(tmp_path):
    """Marian (its sinusoidal position tables do not train) resumed after 6 steps of stock DDP from DDP's model and
    optimizer state dicts, loaded before wrap, 8 more steps without clipping: every strategy, auto's switches
    included, ends with DDP's parameters and an optimizer state dict of DDP's form and values. Stock FSDP2 sums the
    shared matrix's three uses (two lookups, the output projection) in another order than autograd does under DDP:
    close, not equal (with two uses, GPT-2's, it is bit for bit)."""
    table, _ = wrap_models(tmp_path, "--model", "marian", "--clip", "0", "--steps", "14", "--resume", "6", "--split",
                           "--auto-budget", "7")
    for s in ("ddp", "bucketed", "sharded", "auto"):
        assert table[s]["max_abs"] == 0.0 and table[s]["optimizer_max_abs"] == 0.0, table[s]
    assert table["fsdp2"]["max_rel"] < 1e-4 and table["fsdp2"]["optimizer_max_abs"] < 1e-6


@pytest.mark.slow
def test_torch_s_clipping_under_sharded_is_an_error_naming_the_call(tmp_path):
    _, r = wrap_models(tmp_path, "--model", "gpt2", "--strategies", "sharded", "--torch-clip", "--steps", "2",
                       check=False)
    assert r.returncode != 0
    assert ("clip_grad_norm_ (wrap_models.py:" in r.stderr and "model.clip_grad_norm_(max_norm)" in r.stderr
            and "each rank holds only its shard" in r.stderr), r.stderr[-2000:]


def ddp_form(source: str) -> str:
    """examples/ddp_loop.py as the DDP loop it was: each line marked "# DDP form: X" replaced by X."""
    out = []
    for line in source.splitlines():
        code, _, original = line.partition("  # DDP form: ")
        out.append(code[: len(code) - len(code.lstrip())] + original if original else line)
    return "\n".join(out) + "\n"


@pytest.mark.slow
def test_the_ddp_tutorial_loop_differs_from_its_ddp_form_in_two_lines_and_trains_alike(tmp_path):
    import difflib

    source = (REPO / "examples" / "ddp_loop.py").read_text()
    stock = tmp_path / "ddp_form.py"
    stock.write_text(ddp_form(source))
    changed = [d for d in difflib.unified_diff(stock.read_text().splitlines(), source.splitlines(), lineterm="", n=0)
               if d.startswith("+") and not d.startswith("+++")]
    assert len(changed) == 2, changed
    states = {}
    for name, script, strategy in (("ddp", stock, "-"), ("sharded", REPO / "examples" / "ddp_loop.py", "sharded")):
        out = tmp_path / f"{name}.pt"
        launch_ranks([script, strategy, out], cwd=tmp_path, timeout=180)
        states[name] = torch.load(out)
    assert states["ddp"].keys() == states["sharded"].keys()  # DDP's "module." keys: each loads into the other
    assert all(torch.equal(states["ddp"][k], states["sharded"][k]) for k in states["ddp"])
