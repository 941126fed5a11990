"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017): an encoder–decoder with post-LayerNorm.

Sits between the token batches (`dtrain.engine.data`) and the loss. Parameter names matter beyond this file: the tensor
classes of `dtrain.collectives` match them (`*.W_Q.weight` ... are the attention projections, `embed.weight` the one
embedding shared by source, target and the pre-softmax projection).

    python -m dtrain.engine.model --preset base --vocab 37000     # prints the parameter count (paper: 65M; big: 213M)
"""

from __future__ import annotations

import argparse
import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from dtrain.engine.config import MODEL_PRESETS, ModelConfig


class MultiHeadedAttention(nn.Module):
    """h heads of scaled dot-product attention with their own W_Q, W_K, W_V and one W_O (section 3.2.2)."""

    def __init__(self, h: int, d_model: int):
        super().__init__()
        assert d_model % h == 0
        self.h, self.d_k = h, d_model // h
        # Separate matrices (not one fused in_proj) so that each is its own gradient tensor for the study.
        self.W_Q = nn.Linear(d_model, d_model)
        self.W_K = nn.Linear(d_model, d_model)
        self.W_V = nn.Linear(d_model, d_model)
        self.W_O = nn.Linear(d_model, d_model)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        return x.view(B, T, self.h, self.d_k).transpose(1, 2)  # (B, h, T, d_k)

    def project_kv(self, key, value) -> tuple[torch.Tensor, torch.Tensor]:
        return self._heads(self.W_K(key)), self._heads(self.W_V(value))  # (B, h, S, d_k) each

    def attend(self, query, k, v, mask: torch.Tensor | None = None, causal: bool = False):
        # query (B, T, d_model); k, v (B, h, S, d_k); mask broadcastable to (B, h, T, S), True = may attend.
        q = self._heads(self.W_Q(query))
        x = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)  # (B, h, T, d_k)
        B, _, T, _ = x.shape
        return self.W_O(x.transpose(1, 2).reshape(B, T, self.h * self.d_k))

    def forward(self, query, key, value, mask: torch.Tensor | None = None, causal: bool = False):
        return self.attend(query, *self.project_kv(key, value), mask, causal)


class PositionwiseFeedForward(nn.Module):
    """FFN(x) = max(0, x W_1 + b_1) W_2 + b_2 (section 3.3)."""

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.w_1 = nn.Linear(d_model, d_ff)
        self.w_2 = nn.Linear(d_ff, d_model)

    def forward(self, x):
        return self.w_2(F.relu(self.w_1(x)))


class SublayerConnection(nn.Module):
    """Residual around a sublayer, with dropout on the sublayer's output (section 5.4).

    post: LayerNorm(x + Dropout(Sublayer(x))), the paper's; pre: x + Dropout(Sublayer(LayerNorm(x))).
    """

    def __init__(self, d_model: int, dropout: float, pre_norm: bool):
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)
        self.pre_norm = pre_norm

    def forward(self, x, sublayer):
        if self.pre_norm:
            return x + self.dropout(sublayer(self.norm(x)))
        return self.norm(x + self.dropout(sublayer(x)))


class EncoderLayer(nn.Module):
    def __init__(self, d_model, d_ff, h, dropout, pre_norm):
        super().__init__()
        self.self_attn = MultiHeadedAttention(h, d_model)
        self.feed_forward = PositionwiseFeedForward(d_model, d_ff)
        self.sublayer = nn.ModuleList([SublayerConnection(d_model, dropout, pre_norm) for _ in range(2)])

    def forward(self, x, src_mask):
        x = self.sublayer[0](x, lambda y: self.self_attn(y, y, y, src_mask))
        return self.sublayer[1](x, self.feed_forward)


class DecoderLayer(nn.Module):
    def __init__(self, d_model, d_ff, h, dropout, pre_norm):
        super().__init__()
        self.self_attn = MultiHeadedAttention(h, d_model)
        self.src_attn = MultiHeadedAttention(h, d_model)
        self.feed_forward = PositionwiseFeedForward(d_model, d_ff)
        self.sublayer = nn.ModuleList([SublayerConnection(d_model, dropout, pre_norm) for _ in range(3)])

    def forward(self, x, memory, src_mask):
        # Causal self-attention needs no padding mask: targets are right-padded, so a real position i only sees
        # positions <= i, all real; what padded positions compute is ignored by the loss.
        x = self.sublayer[0](x, lambda y: self.self_attn(y, y, y, causal=True))
        x = self.sublayer[1](x, lambda y: self.src_attn(y, memory, memory, src_mask))
        return self.sublayer[2](x, self.feed_forward)

    def step(self, x, memory_kv, src_mask, cache: list):
        """One decoding position: x (B, 1, d_model). `cache` holds this layer's self-attention (k, v) of the
        earlier positions, (B, h, t, d_k) each, and is extended in place; `memory_kv` is the cross-attention's
        (k, v) of the encoder output, computed once per sentence."""

        def self_attn(y):
            k, v = self.self_attn.project_kv(y, y)
            if cache:
                k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
            cache[:] = [k, v]
            return self.self_attn.attend(y, k, v)  # the newest position may see every earlier one

        x = self.sublayer[0](x, self_attn)
        x = self.sublayer[1](x, lambda y: self.src_attn.attend(y, *memory_kv, src_mask))
        return self.sublayer[2](x, self.feed_forward)


class PositionalEncoding(nn.Module):
    """PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(...) (section 3.5), then dropout."""

    def __init__(self, d_model: int, dropout: float, max_len: int = 4096):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("pe", sinusoid_table(max_len, d_model), persistent=False)  # (max_len, d_model)

    def forward(self, x, offset: int = 0):
        return self.dropout(x + self.pe[offset : offset + x.size(1)])


def sinusoid_table(max_len: int, d_model: int) -> torch.Tensor:
    position = torch.arange(max_len, dtype=torch.float64).unsqueeze(1)  # (max_len, 1)
    div_term = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float64) * (-math.log(10000.0) / d_model))
    pe = torch.zeros(max_len, d_model, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(position * div_term)
    pe[:, 1::2] = torch.cos(position * div_term)
    return pe.float()


def _drop_tied_alias(module, state_dict, prefix, local_metadata) -> None:
    state_dict.pop(prefix + "generator.weight", None)  # the same tensor as embed.weight


def _restore_tied_alias(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors) -> None:
    if prefix + "embed.weight" in state_dict:
        state_dict.setdefault(prefix + "generator.weight", state_dict[prefix + "embed.weight"])


class Transformer(nn.Module):
    """EncoderDecoder with one embedding matrix for source, target and the pre-softmax projection (section 3.4)."""

    def __init__(self, vocab: int, N=6, d_model=512, d_ff=2048, h=8, dropout=0.1, norm="post", pad_id: int = 0):
        super().__init__()
        pre_norm = norm == "pre"
        self.d_model, self.pad_id = d_model, pad_id
        self.embed = nn.Embedding(vocab, d_model, padding_idx=pad_id)
        # The pre-softmax projection holds the embedding's own Parameter, as PyTorch ties weights, so that code that
        # follows modules and their parameters sees it read the matrix (a sharded strategy has each module wait
        # for its parameters before it runs). Checkpoints keep the matrix once, as `embed.weight`.
        # Built on the meta device, its own weight never drawn: the random stream initializes what it did before.
        self.generator = nn.Linear(d_model, vocab, bias=False, device="meta")  # logits (B, T, vocab) = x @ E.T
        self.generator.weight = self.embed.weight
        self.register_state_dict_post_hook(_drop_tied_alias)
        self.register_load_state_dict_pre_hook(_restore_tied_alias)
        self.pos = PositionalEncoding(d_model, dropout)
        self.encoder = nn.ModuleList([EncoderLayer(d_model, d_ff, h, dropout, pre_norm) for _ in range(N)])
        self.decoder = nn.ModuleList([DecoderLayer(d_model, d_ff, h, dropout, pre_norm) for _ in range(N)])
        # Pre-norm stacks need a final LayerNorm (their residual stream is never normalized otherwise).
        self.encoder_norm = nn.LayerNorm(d_model) if pre_norm else nn.Identity()
        self.decoder_norm = nn.LayerNorm(d_model) if pre_norm else nn.Identity()
        self._reset_parameters()

    def _reset_parameters(self):
        for name, p in self.named_parameters():
            if p.dim() > 1 and name != "embed.weight":
                nn.init.xavier_uniform_(p)
            elif name.endswith(".bias"):
                nn.init.zeros_(p)
        # The embedding is scaled by sqrt(d_model) on input and tied to the output: N(0, d_model^-1/2) keeps both
        # the scaled input and the logits at unit scale.
        nn.init.normal_(self.embed.weight, 0.0, self.d_model**-0.5)
        with torch.no_grad():
            self.embed.weight[self.pad_id].zero_()

    @classmethod
    def from_config(cls, cfg: ModelConfig, vocab: int, pad_id: int = 0) -> "Transformer":
        return cls(vocab, cfg.N, cfg.d_model, cfg.d_ff, cfg.h, cfg.dropout, cfg.norm, pad_id)

    def src_mask(self, src: torch.Tensor) -> torch.Tensor:
        return (src != self.pad_id)[:, None, None, :]  # (B, 1, 1, S): keys that are not padding

    def embed_tokens(self, tokens: torch.Tensor, offset: int = 0) -> torch.Tensor:
        return self.pos(self.embed(tokens) * math.sqrt(self.d_model), offset)  # (B, T, d_model)

    def encode(self, src, src_mask):
        x = self.embed_tokens(src)
        for layer in self.encoder:
            x = layer(x, src_mask)
        return self.encoder_norm(x)  # (B, S, d_model)

    def decode(self, memory, src_mask, tgt_in):
        x = self.embed_tokens(tgt_in)
        for layer in self.decoder:
            x = layer(x, memory, src_mask)
        return self.decoder_norm(x)  # (B, T, d_model)

    def memory_kv(self, memory) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Cross-attention keys and values of the encoder output, per decoder layer: reused at every step."""
        return [layer.src_attn.project_kv(memory, memory) for layer in self.decoder]

    def decode_step(self, token, pos: int, memory_kv, src_mask, caches: list[list]) -> torch.Tensor:
        """Incremental decoding: token (B, 1) at position `pos` → log-probabilities (B, vocab) of the next one."""
        x = self.embed_tokens(token, offset=pos)
        for layer, kv, cache in zip(self.decoder, memory_kv, caches):
            x = layer.step(x, kv, src_mask, cache)
        return torch.log_softmax(self.generator(self.decoder_norm(x))[:, -1].float(), dim=-1)

    def forward(self, src, tgt_in):
        src_mask = self.src_mask(src)
        return self.generator(self.decode(self.encode(src, src_mask), src_mask, tgt_in))


def sdpa_backend(name: str, device: torch.device):
    """A context manager restricting scaled_dot_product_attention to one kernel (`train.sdpa_backend`).

    On CPU the fused flash kernel's backward is slower than the math path for sequences of tens of tokens (see
    docs/benchmark.md), so "auto" picks math there.
    """
    if name == "auto":
        if device.type != "cpu":
            return contextlib.nullcontext()
        name = "math"
    kernel = {"math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION,
              "efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[name]
    return sdpa_kernel(kernel)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m dtrain.engine.model", description="Print a preset's parameter count.")
    ap.add_argument("--preset", choices=sorted(MODEL_PRESETS), default="base")
    ap.add_argument("--vocab", type=int, default=37000, help="shared vocabulary size (paper: 37000 BPE for EN-DE)")
    args = ap.parse_args(argv)
    cfg = ModelConfig(**MODEL_PRESETS[args.preset])
    with torch.device("meta"):  # shapes only: counting big needs no memory
        model = Transformer.from_config(cfg, args.vocab)
    n = count_parameters(model)
    paper = {"base": 65e6, "big": 213e6}.get(args.preset)
    line = f"{args.preset}: {n:,} parameters ({n / 1e6:.1f}M) with vocab {args.vocab}"
    if paper:
        line += f"; paper Table 3: {paper / 1e6:.0f}M ({(n - paper) / paper:+.1%})"
    print(line)


if __name__ == "__main__":
    main()
