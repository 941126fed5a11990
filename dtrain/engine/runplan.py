"""The plan of a run before it starts (`python -m dtrain.engine.train --dry-run [--topology T]`): what one step holds, how
many steps, epochs and checkpoints, and, on a cluster shape (a `dtrain.collectives.costmodel` topology preset), the MODELED
all-reduce of one step's gradient and what the run would take at a given step time.

The step's compute is not estimated here: that is the simulator's FLOP-based step (`dtrain.analysis.simulate.paper`, one
layer up), which `python -m dtrain.analysis.simulate --plan` prints through `plan_lines` with its step time filled in. The
dry run prints that command. Nothing here is measured.
"""

from __future__ import annotations

import shlex

import torch

from dtrain.collectives import costmodel as cm
from dtrain.collectives.dist import env_rank
from dtrain.engine.config import RunConfig
from dtrain.engine.describe import schedule_lines
from dtrain.engine.model import Transformer, count_parameters

# Training pairs where the profile or the recipe says how many (before cleaning and data.max_len): Multi30k's
# training split, and the paper's figures for WMT14 (Vaswani et al. 2017, section 5.1). Tokens per pair are not
# known before the BPE model and the token cache exist, so epochs are counted in pairs only where a step's pair
# count is known, which it never is beforehand: token batches hold as many pairs as fit.
CORPUS_PAIRS = {"multi30k": (29_000, "Multi30k's training split"),
                "wmt14-en-de": (4_500_000, "about 4.5M, Vaswani et al. 2017 section 5.1"),
                "wmt14-en-fr": (36_000_000, "36M, Vaswani et al. 2017 section 5.1")}


def parameters(cfg: RunConfig) -> int:
    """The model's parameter count, built on meta tensors (no memory even for the big model)."""
    with torch.device("meta"):
        return count_parameters(Transformer.from_config(cfg.model, cfg.data.vocab_size))


def ranks_of(topology: cm.Topology | None) -> int:
    """The cluster shape's GPUs, else this launch's world size (torchrun's environment; 1 outside it)."""
    return topology.ranks if topology is not None else env_rank()[2]


def simulator_command(profile: str, overrides: list[str], topology: str) -> str:
    """The command that prints this plan with the simulator's modeled step time."""
    sets = [f"--set {shlex.quote(o)}" for o in overrides]
    return " ".join(["python -m dtrain.analysis.simulate --plan --profile", shlex.quote(profile), *sets,
                     "--topology", shlex.quote(topology)])


def _hours(ms: float) -> str:
    return f"{ms / 3.6e6:.1f} h" if ms >= 3.6e6 else f"{ms / 6e4:.1f} min"


def plan_lines(cfg: RunConfig, topology: cm.Topology | None = None, step_ms: float | None = None,
               step_source: str = "") -> list[str]:
    """The plan as lines: the step, the run, the checkpoints; with `topology` the modeled all-reduce of the whole
    gradient; with `step_ms` (MODELED, from `step_source`) the time per step, between checkpoints and for the run."""
    d, t = cfg.data, cfg.train
    ranks = ranks_of(topology)
    per_rank = d.max_tokens * t.accum_steps
    tokens = per_rank * ranks
    n_params = parameters(cfg)
    where = topology.describe().split(";")[0] if topology is not None else (
        f"{ranks} rank(s) of this launch (give --topology for a cluster shape)")
    out = [f"plan of '{cfg.name}' on {where}",
           f"  model: {n_params / 1e6:.1f}M parameters ({cfg.model.N} layers, d_model {cfg.model.d_model}), vocab "
           f"{d.vocab_size}, {t.amp}; gradient {n_params * 4 / 2**20:.0f} MiB in fp32",
           f"  tokens per step: at most {tokens:,} per side = data.max_tokens {d.max_tokens:,} x train.accum_steps "
           f"{t.accum_steps} x {ranks} rank(s) (max_tokens caps a micro-batch's padded tokens of its longer side: "
           f"real batches hold fewer)"]
    steps = f"  steps: {t.max_steps:,} (warm-up {cfg.optim.warmup:,})"
    if t.max_minutes is not None:
        steps += f", or fewer: train.max_minutes {t.max_minutes:g} stops the run first if it comes first"
    out.append(steps)
    pairs = CORPUS_PAIRS.get(d.corpus)
    if d.train_limit is not None:
        pairs = (min(d.train_limit, pairs[0]) if pairs else d.train_limit, "data.train_limit")
    corpus = f"{pairs[0]:,} training pairs ({pairs[1]})" if pairs else "training pairs unknown (data.corpus: files)"
    out.append(f"  epochs: unknown before the token cache is built (its meta.json counts the tokens kept); corpus "
               f"{corpus}; the run draws at most {tokens * t.max_steps / 1e9:.2f}G tokens per side")
    n_ckpt = t.max_steps // t.ckpt_every + (t.max_steps % t.ckpt_every != 0)
    val = f"validation every {t.val_every:,} steps" if t.val_every else "validation at the end only"
    out.append(f"  checkpoints: every {t.ckpt_every:,} steps ({n_ckpt} in all, the last {t.keep_ckpts} kept, the last "
               f"{t.average_last} averaged for the final evaluation); {val}")
    with torch.device("meta"):
        shape = Transformer.from_config(cfg.model, cfg.data.vocab_size)
    out += ["  " + line for line in schedule_lines(cfg, shape, ranks)]
    if topology is not None:
        model = cm.NcclModel(topology)
        ms = model.allreduce_ms(n_params * 4)
        pick = model.pick(n_params * 4)
        out.append(f"  MODELED (dtrain.collectives.costmodel, {topology.name}): one all-reduce of the whole fp32 gradient "
                   f"{ms:.2f} ms ({pick.algo}/{pick.proto}); sync.strategy {cfg.sync.strategy} splits it into "
                   f"buckets and hides part of it behind backward")
    if step_ms is not None:
        out.append(f"  MODELED step {step_ms:.1f} ms ({step_source}); {t.ckpt_every:,} steps between checkpoints "
                   f"{_hours(step_ms * t.ckpt_every)}; the whole run {_hours(step_ms * t.max_steps)} "
                   f"({t.max_steps:,} steps, without validation, checkpoint writes and the final evaluation)")
    return out
