"""The paper's base configuration projected on a topology preset, and a FLOP-estimated step for a profile without
a recorded run: compute from a FLOP count at an assumed fraction of the GPU's peak, gradients ready uniformly over
backward. Everything here is modeled and states its assumptions.
"""

from __future__ import annotations

from dtrain.analysis.plans import ready_params
from dtrain.analysis.simulate.calibration import Calibration
from dtrain.analysis.simulate.reference import ReferenceStep
from dtrain.collectives import costmodel as cm
from dtrain.collectives.timeline import ReadyCurve
from dtrain.common.errors import UserError
from dtrain.engine import config as config_mod

# Vendor datasheet peaks of the SXM parts (and of the A100 80GB PCIe card): dense TFLOPS for fp32 (no tensor cores; PyTorch's default for fp32
# matmuls) and for bf16 autocast (tensor cores; P100 has none: fp16 without tensor cores stands in, V100 has no
# bf16: its fp16 tensor cores stand in), and HBM GB/s. The projection's compute side rests on these and an assumed
# fraction of peak.
GPU_PEAK = {"P100": {"fp32": 10.6, "bf16": 21.2, "hbm": 732.0}, "V100": {"fp32": 15.7, "bf16": 125.0, "hbm": 900.0},
            "A100": {"fp32": 19.5, "bf16": 312.0, "hbm": 2039.0}, "A100 PCIe": {"fp32": 19.5, "bf16": 312.0, "hbm": 1935.0},
            "H100": {"fp32": 67.0, "bf16": 989.0, "hbm": 3350.0}, "H200": {"fp32": 67.0, "bf16": 989.0, "hbm": 4800.0}}
PAPER_STEP_S = 0.4  # "each training step took about 0.4 seconds" (base model, 8 P100), Vaswani et al. 2017 §5.2
PAPER_TOKENS = 25_000  # source and target tokens per step, each (Vaswani et al. 2017 §5.1)


def flop_step(cfg, topo: cm.Topology, src_tokens: float, tgt_tokens: float, vocab: int | None = None,
              mfu: float = 0.3, sentence_len: int = 27) -> tuple[ReferenceStep, ReadyCurve, list[str]]:
    """A step of `cfg`'s model on one of the topology's GPUs, from a FLOP count at `mfu` of its peak (fp32, or
    bf16 under autocast), for `src_tokens` + `tgt_tokens` per GPU; gradients ready uniformly over backward."""
    if topo.gpu not in GPU_PEAK:
        raise UserError(f"no peak figures for {topo.gpu} (known: {', '.join(GPU_PEAK)})")
    if not 0 < mfu <= 1:
        raise UserError("the fraction of peak (--mfu) must be in (0, 1]")
    params = ready_params(cfg, vocab)
    enc = sum(p.numel() for n, p in params if n.startswith("encoder"))
    dec = sum(p.numel() for n, p in params if n.startswith("decoder"))
    emb = sum(p.numel() for n, p in params if n.startswith("embed"))
    total = sum(p.numel() for _, p in params)
    d, n_layers = cfg.model.d_model, cfg.model.N
    # Forward FLOPs: 2 per weight per token through the layers and the tied generator, plus attention scores and
    # their weighted sum (4·T·d per token, layer and attention block) at an assumed sentence length.
    attn = 4 * sentence_len * d * n_layers * (src_tokens + 2 * tgt_tokens)
    fwd = 2 * (enc * src_tokens + (dec + emb) * tgt_tokens) + attn
    precision = "bf16" if cfg.train.amp == "bf16" else "fp32"
    peak_tflops, hbm = GPU_PEAK[topo.gpu][precision], GPU_PEAK[topo.gpu]["hbm"]
    rate = peak_tflops * 1e12 * mfu
    forward_ms, backward_ms = 1e3 * fwd / rate, 1e3 * 2 * fwd / rate
    optimizer_ms = 1e3 * total * 28 / (hbm * 1e9)  # Adam: ~7 fp32 reads/writes per parameter, memory-bound
    ref = ReferenceStep(0, 0.0, forward_ms, backward_ms, optimizer_ms, 0.0, 0.0)
    notes = [f"{total / 1e6:.1f}M parameters; {src_tokens:.0f} source + {tgt_tokens:.0f} target tokens per GPU "
             f"per step",
             f"compute from FLOPs: {3 * fwd / 1e12:.2f} TFLOP per GPU per step (forward x3) at {mfu:.0%} of the "
             f"{topo.gpu}'s {peak_tflops:g} TFLOPS {precision} peak (assumed), sentences of {sentence_len} tokens "
             f"(assumed)",
             f"optimizer: Adam, memory-bound at {hbm:g} GB/s; gradients ready uniformly over backward (assumed)"]
    return ref, ReadyCurve.uniform(total, backward_ms), notes


def flop_timeline(cfg, topo: cm.Topology, vocab: int | None = None, mfu: float = 0.3) -> tuple:
    """(ReferenceStep, ReadyCurve, Calibration, notes) for a profile on a preset without a recorded run: each GPU
    takes `data.max_tokens` x `train.accum_steps` tokens per side (the batch cap: an upper bound)."""
    tokens = cfg.data.max_tokens * cfg.train.accum_steps
    ref, curve, notes = flop_step(cfg, topo, tokens, tokens, vocab, mfu)
    return ref, curve, Calibration(note="none (modeled compute)"), ["timeline estimated, not profiled:", *notes]


def paper_profile(topo: cm.Topology, vocab: int = 37000, mfu: float = 0.3) -> tuple:
    """(cfg, ReferenceStep, ReadyCurve, notes, implied fraction of peak) for the paper's base model at 25,000 +
    25,000 tokens per step over the topology's GPUs."""
    cfg = config_mod.from_dict({"model": {"preset": "base"}, "data": {"vocab_size": vocab}}, "<paper base>")
    per_gpu = PAPER_TOKENS / topo.ranks
    ref, curve, notes = flop_step(cfg, topo, per_gpu, per_gpu, vocab, mfu)
    # The fraction of peak at which forward + backward alone would take the paper's whole step.
    implied = mfu * (ref.forward_ms + ref.backward_ms) / (PAPER_STEP_S * 1000)
    notes = [f"the paper's base model (vocab {vocab}, shared BPE), {PAPER_TOKENS} source + {PAPER_TOKENS} target "
             f"tokens per step over {topo.ranks} GPUs", *notes]
    return cfg, ref, curve, notes, implied
