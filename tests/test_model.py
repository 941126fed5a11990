import math

import pytest
import torch

from dtrain.engine.config import MODEL_PRESETS, ModelConfig
from dtrain.engine.model import Transformer, count_parameters, sinusoid_table


def test_output_shape(tiny_model):
    src = torch.randint(4, 50, (3, 7))
    tgt = torch.randint(4, 50, (3, 5))
    assert tiny_model(src, tgt).shape == (3, 5, 50)


def test_decoder_position_never_sees_later_positions(tiny_model):
    src = torch.randint(4, 50, (2, 6))
    tgt = torch.randint(4, 50, (2, 8))
    changed = tgt.clone()
    changed[:, 5:] = torch.randint(4, 50, (2, 3))
    a, b = tiny_model(src, tgt), tiny_model(src, changed)
    assert torch.allclose(a[:, :5], b[:, :5], atol=1e-5)
    assert not torch.allclose(a[:, 5:], b[:, 5:], atol=1e-5)


def test_source_padding_is_masked(tiny_model):
    src = torch.randint(4, 50, (1, 6))
    padded = torch.cat([src, torch.zeros(1, 4, dtype=torch.long)], dim=1)  # 4 pad tokens (id 0)
    tgt = torch.randint(4, 50, (1, 5))
    assert torch.allclose(tiny_model(src, tgt), tiny_model(padded, tgt), atol=1e-5)


def test_embedding_is_shared_and_scaled(tiny_model):
    # One matrix: input embedding of source and target, and the pre-softmax projection.
    names = [n for n, _ in tiny_model.named_parameters()]
    assert names.count("embed.weight") == 1 and not any("generator" in n for n in names)
    x = torch.randn(1, 1, 32)
    assert torch.allclose(tiny_model.generator(x), x @ tiny_model.embed.weight.T)
    tok = torch.tensor([[7]])
    expected = tiny_model.embed.weight[7] * math.sqrt(32) + sinusoid_table(1, 32)[0]
    assert torch.allclose(tiny_model.embed_tokens(tok)[0, 0], expected, atol=1e-6)


def test_attention_has_separate_projections(tiny_model):
    names = {n for n, _ in tiny_model.named_parameters()}
    for w in ("W_Q", "W_K", "W_V", "W_O"):
        assert f"encoder.0.self_attn.{w}.weight" in names
        assert f"decoder.1.src_attn.{w}.weight" in names


def test_positional_encoding_values():
    pe = sinusoid_table(50, 16)
    pos, i = 7, 3
    assert pe[pos, 2 * i].item() == pytest.approx(math.sin(pos / 10000 ** (2 * i / 16)), abs=1e-6)
    assert pe[pos, 2 * i + 1].item() == pytest.approx(math.cos(pos / 10000 ** (2 * i / 16)), abs=1e-6)
    assert torch.all(pe[0, 0::2] == 0) and torch.all(pe[0, 1::2] == 1)


@pytest.mark.parametrize("preset,paper", [("base", 65e6), ("big", 213e6)])
def test_parameter_counts_match_table_3(preset, paper):
    with torch.device("meta"):
        model = Transformer.from_config(ModelConfig(**MODEL_PRESETS[preset]), vocab=37000)
    assert abs(count_parameters(model) - paper) / paper < 0.04


def test_pre_norm_option_runs_and_differs():
    torch.manual_seed(0)
    post = Transformer(50, N=1, d_model=16, d_ff=32, h=2, dropout=0.0, norm="post").eval()
    torch.manual_seed(0)
    pre = Transformer(50, N=1, d_model=16, d_ff=32, h=2, dropout=0.0, norm="pre").eval()
    src, tgt = torch.randint(4, 50, (2, 5)), torch.randint(4, 50, (2, 4))
    assert not torch.allclose(post(src, tgt), pre(src, tgt))
    assert "encoder_norm.weight" in dict(pre.named_parameters())


def test_incremental_decoding_matches_full_decoder(tiny_model):
    src = torch.randint(4, 50, (2, 6))
    tgt = torch.randint(4, 50, (2, 5))
    mask = tiny_model.src_mask(src)
    memory = tiny_model.encode(src, mask)
    full = torch.log_softmax(tiny_model.generator(tiny_model.decode(memory, mask, tgt)), -1)
    kv, caches = tiny_model.memory_kv(memory), [[] for _ in tiny_model.decoder]
    for t in range(tgt.size(1)):
        step = tiny_model.decode_step(tgt[:, t : t + 1], t, kv, mask, caches)
        assert torch.allclose(step, full[:, t], atol=1e-5)


def test_model_cli_prints_count(capsys):
    from dtrain.engine.model import main

    main(["--preset", "base", "--vocab", "37000"])
    out = capsys.readouterr().out
    assert "63,082,496" in out and "65M" in out
