"""Profiles: strict YAML → frozen dataclasses (`RunConfig`), with `--set a.b=value` overrides.

First stage of the pipeline: everything downstream reads a `RunConfig` and nothing else. Unknown keys, wrong
types and impossible values are `UserError`s naming the file, the line and the dotted key.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from dtrain.collectives.config import refuse_moved
from dtrain.collectives.config import validate as validate_comm
from dtrain.collectives.settings import CollectivesConfig, SyncConfig
from dtrain.collectives import strategies
from dtrain.collectives.strategies import unused_keys
from dtrain.collectives.auto.space import candidate_raw
from dtrain.common.errors import UserError
from dtrain.common.schema import Source, apply_overrides, build, read_overlay
from dtrain.engine.host_cpu import bf16_native

# The paper's Table 3 models, plus small presets that train on two CPU cores.
MODEL_PRESETS = {
    "base": dict(N=6, d_model=512, d_ff=2048, h=8, dropout=0.1),
    "big": dict(N=6, d_model=1024, d_ff=4096, h=16, dropout=0.3),
    "small": dict(N=3, d_model=256, d_ff=1024, h=4, dropout=0.1),
    "tiny": dict(N=2, d_model=64, d_ff=128, h=4, dropout=0.1),
}
SDPA_BACKENDS = ("auto", "math", "flash", "efficient", "cudnn")
COMPILE_MODES = ("off", "default", "reduce-overhead", "max-autotune")  # torch.compile's `mode`, or off
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager", "cudagraphs")  # torch.compile backends that train
AMP = ("auto", "fp32", "bf16")  # train.amp; `auto` is resolved per device when the trainer starts (`resolve_amp`)


@dataclass(frozen=True)
class ModelConfig:
    preset: str | None = None  # fills the fields below that the profile leaves out
    N: int = 6  # layers in the encoder and in the decoder
    d_model: int = 512
    d_ff: int = 2048
    h: int = 8  # attention heads
    dropout: float = 0.1
    norm: str = "post"  # "post" (the paper: LayerNorm(x + Sublayer(x))) or "pre"


# data.corpus: Multi30k (found or downloaded), any parallel corpus named file by file (`data.files`), or WMT14 as
# the paper trained on it (prepared by `python -m dtrain.engine.corpus download NAME --to DIR`; see docs/data.md).
CORPORA = ("multi30k", "files", "wmt14-en-de", "wmt14-en-fr")
WMT14_LANGS = {"wmt14-en-de": {"en", "de"}, "wmt14-en-fr": {"en", "fr"}}


@dataclass(frozen=True)
class CorpusFiles:
    """`data.files`: each split a [source file, target file] pair (plain or .gz, a sentence a line, line i of one
    translating line i of the other); relative paths are taken from the working directory."""

    train: tuple[str, str]
    val: tuple[str, str]
    test: tuple[str, str] | None = None  # needed when eval.split is test


@dataclass(frozen=True)
class DataConfig:
    corpus: str = "multi30k"
    files: CorpusFiles | None = None  # data.corpus: files only
    dir: str | None = None  # a directory holding the corpus files; searched first
    src: str = "en"
    tgt: str = "de"
    vocab_size: int = 8000  # joint SentencePiece BPE vocabulary
    max_tokens: int = 4096  # per rank and micro-batch: padded tokens of the longer side
    max_len: int = 128  # training pairs longer than this (subword tokens) are dropped
    train_limit: int | None = None  # use only the first n training pairs (smoke tests)
    cache_dir: str | None = None  # default: $XDG_CACHE_HOME/dtrain or ~/.cache/dtrain
    # files and wmt14-*: the BPE model is trained on this many training pairs, sampled (SentencePiece holds its
    # input in memory, so the whole of WMT14 EN-FR would not fit)
    bpe_sample: int = 1_000_000
    # files and wmt14-*: drop training pairs as Moses' clean-corpus-n.perl does (1-250 subword tokens a side, length
    # ratio at most 1.5); null: on for wmt14-*, off for files
    clean: bool | None = None


@dataclass(frozen=True)
class OptimConfig:
    lr_factor: float = 1.0  # multiplies the paper's d_model^-0.5 · min(step^-0.5, step · warmup^-1.5)
    warmup: int = 4000
    betas: tuple[float, float] = (0.9, 0.98)
    eps: float = 1e-9
    clip_norm: float | None = None
    label_smoothing: float = 0.1


@dataclass(frozen=True)
class TrainConfig:
    max_steps: int = 100_000  # optimizer steps
    max_minutes: float | None = None  # wall-clock budget for training; checked every log_every steps
    accum_steps: int = 1  # micro-batches per optimizer step; gradients are synchronized on the last one only
    log_every: int = 10
    val_every: int = 0  # 0: validation loss at the end only
    ckpt_every: int = 1000
    keep_ckpts: int = 5
    average_last: int = 1  # average the last k checkpoints for evaluation (the paper: 5 for base)
    # "fp32", "bf16" (autocast), or "auto": bf16 where the device computes bf16 natively, else fp32 (`resolve_amp`).
    # fp32 by default, so that a profile that does not ask trains the same numbers on every machine.
    amp: str = "fp32"
    threads: int | None = None  # torch intra-op threads per rank; default: torch's (torchrun sets 1 per rank)
    # keep freed host memory for the next step instead of returning it to the OS (glibc; dtrain/common/host_memory.py):
    # on a CPU the activations of every step are otherwise faulted in again, page by page. Set by the entry point for
    # the run and undone when it ends, however it ends; never on a CUDA device
    keep_host_memory: bool = True
    max_bad_steps: int = 5  # consecutive steps with non-finite gradients (each skipped) before the run stops
    sdpa_backend: str = "auto"  # auto: "math" on CPU (fastest for sentence-length sequences), torch's pick on CUDA
    # every rank > 0 also writes its bucket records (<run>/buckets.rank<r>.jsonl, the run directory shared): the
    # simulator then sees when the slowest rank had each bucket ready, not only rank 0; and its step time and CPU
    # time by thread (<run>/steps.rank<r>.jsonl)
    record_ranks: bool = False
    # debugging: every rank writes the training pairs it draws, <run>/samples.rank<r>.jsonl ({"step", "epoch",
    # "pairs": [pair indices]} per micro-batch), to check the data order (each pair once per epoch across resumes)
    record_samples: bool = False
    # torch.compile of the model before the sync strategy wraps it: "off", or the mode ("default",
    # "reduce-overhead": CUDA graphs, "max-autotune"); `compile_backend` is torch.compile's backend ("inductor";
    # "aot_eager" traces forward and backward the same way but runs them eagerly, with no C compiler needed)
    compile: str = "off"
    compile_backend: str = "inductor"
    # rank 0 also writes TensorBoard event files, <run>/tensorboard/ (dtrain.engine.board): the step and eval records
    # of steps.jsonl and eval.jsonl; needs the tensorboard package (pip install 'dtrain[tensorboard]')
    tensorboard: bool = False


@dataclass(frozen=True)
class EvalConfig:
    at_end: bool = True  # decode and score `split` with the (averaged) final model
    split: str = "test"
    beam: int = 4  # 1 = greedy
    length_penalty: float = 0.6
    max_len_b: int = 50  # hypotheses stop at source length + max_len_b
    batch_size: int = 128  # source sentences per decoding batch


@dataclass(frozen=True)
class RunConfig:
    name: str = "run"
    seed: int = 1
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    collectives: CollectivesConfig = field(default_factory=CollectivesConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def config_hash(self) -> str:
        """Identifies the whole resolved profile (recorded in checkpoints, shown by `checkpoint inspect`)."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True, default=str).encode()).hexdigest()[:16]

    def model_hash(self) -> str:
        """Identifies the parameter shapes: a checkpoint only loads into a run with the same hash."""
        shape = {k: v for k, v in dataclasses.asdict(self.model).items() if k not in ("dropout", "preset")}
        shape["vocab_size"] = self.data.vocab_size
        return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]


def _apply_preset(raw: dict, src: Source) -> None:
    model = raw.get("model")
    if not isinstance(model, dict) or model.get("preset") is None:
        return
    name = model["preset"]
    if name not in MODEL_PRESETS:
        raise UserError(
            f"{src.where('model.preset')}: unknown preset '{name}' for 'model.preset' "
            f"(known: {', '.join(MODEL_PRESETS)})"
        )
    raw["model"] = {**MODEL_PRESETS[name], **model}


_NAME = re.compile(r"[A-Za-z0-9_=+-][A-Za-z0-9_.=+-]*")


def _validate(cfg: RunConfig, src: Source) -> None:
    def check(ok: bool, path: str, msg: str):
        if not ok:
            raise UserError(f"{src.where(path)}: '{path}' {msg}")

    # The name becomes the run directory runs/<name>-<time> (and a glob to find it on restart): one path component
    # of the characters dtrain.analysis.sweep allows in run names, so it cannot climb out of runs/ or be hidden.
    check(_NAME.fullmatch(cfg.name) is not None, "name",
          f"must be letters, digits and - _ . = + (a single path component, not starting with '.'), got {cfg.name!r}")
    m, d, o, t = cfg.model, cfg.data, cfg.optim, cfg.train
    for name in ("N", "d_model", "d_ff", "h"):
        check(getattr(m, name) > 0, f"model.{name}", f"must be positive, got {getattr(m, name)}")
    check(m.d_model % m.h == 0, "model.h", f"must divide model.d_model ({m.d_model} % {m.h} != 0)")
    check(0.0 <= m.dropout < 1.0, "model.dropout", f"must be in [0, 1), got {m.dropout}")
    check(m.norm in ("post", "pre"), "model.norm", f"must be 'post' or 'pre', got '{m.norm}'")
    check(d.corpus in CORPORA, "data.corpus", f"must be one of {', '.join(CORPORA)}, got '{d.corpus}'")
    check(d.corpus != "files" or d.files is not None, "data.files",
          "is needed with data.corpus: files ({train: [SRC, TGT], val: [SRC, TGT], test: [SRC, TGT]})")
    check(d.corpus == "files" or d.files is None, "data.files",
          f"is only read with data.corpus: files, not '{d.corpus}'")
    if d.files is not None:
        for split in ("train", "val", "test"):
            pair = getattr(d.files, split)
            check(pair is None or all(p.strip() for p in pair), f"data.files.{split}", "names an empty file path")
        check(d.files.test is not None or not (cfg.eval.at_end and cfg.eval.split == "test"), "data.files.test",
              "is needed to score the test split at the end (eval.at_end with eval.split: test)")
    check(d.src != d.tgt, "data.tgt", f"must differ from data.src ('{d.src}')")
    if d.corpus in WMT14_LANGS:
        check({d.src, d.tgt} == WMT14_LANGS[d.corpus], "data.src",
              f"{d.corpus} is {'/'.join(sorted(WMT14_LANGS[d.corpus]))}: data.src and data.tgt must be those, "
              f"got {d.src}-{d.tgt}")
    check(d.bpe_sample > 0, "data.bpe_sample", f"must be positive, got {d.bpe_sample}")
    check(d.vocab_size >= 16, "data.vocab_size", f"must be at least 16, got {d.vocab_size}")
    check(d.max_tokens > 0, "data.max_tokens", f"must be positive, got {d.max_tokens}")
    check(d.max_len > 1, "data.max_len", f"must be greater than 1, got {d.max_len}")
    check(d.max_tokens >= d.max_len, "data.max_tokens", f"must be at least data.max_len ({d.max_len})")
    check(d.train_limit is None or d.train_limit > 0, "data.train_limit", "must be positive")
    check(o.lr_factor > 0, "optim.lr_factor", f"must be positive, got {o.lr_factor}")
    check(o.warmup > 0, "optim.warmup", f"must be positive, got {o.warmup}")
    check(all(0.0 <= b < 1.0 for b in o.betas), "optim.betas", f"must be in [0, 1), got {list(o.betas)}")
    check(o.eps > 0, "optim.eps", "must be positive")
    check(o.clip_norm is None or o.clip_norm > 0, "optim.clip_norm", "must be positive or null")
    check(0.0 <= o.label_smoothing < 1.0, "optim.label_smoothing", "must be in [0, 1)")
    for name in ("max_steps", "accum_steps", "log_every", "ckpt_every", "keep_ckpts", "average_last"):
        check(getattr(t, name) > 0, f"train.{name}", f"must be positive, got {getattr(t, name)}")
    check(t.val_every >= 0, "train.val_every", "must be 0 or positive")
    check(t.max_bad_steps >= 0, "train.max_bad_steps", "must be 0 or positive")
    check(t.max_minutes is None or t.max_minutes > 0, "train.max_minutes", "must be positive or null")
    check(t.average_last <= t.keep_ckpts, "train.average_last",
          f"cannot exceed train.keep_ckpts ({t.keep_ckpts}): averaged checkpoints must still be on disk")
    check(t.amp in AMP, "train.amp", f"must be one of {', '.join(AMP)}, got '{t.amp}'")
    # A rounded all-gather is exact only where the forward casts the parameters to that dtype anyway (with `auto`,
    # checked where it is resolved)
    check(cfg.sync.gather_dtype != "bf16" or t.amp in ("bf16", "auto"), "sync.gather_dtype",
          f"'{cfg.sync.gather_dtype}' needs the forward under that autocast (train.amp: {cfg.sync.gather_dtype}), "
          f"got train.amp '{t.amp}'")
    check(t.threads is None or t.threads > 0, "train.threads", "must be positive or null")
    check(t.sdpa_backend in SDPA_BACKENDS, "train.sdpa_backend",
          f"must be one of {', '.join(SDPA_BACKENDS)}, got '{t.sdpa_backend}'")
    check(t.compile in COMPILE_MODES, "train.compile", f"must be one of {', '.join(COMPILE_MODES)}, got {t.compile!r}")
    check(t.compile_backend in COMPILE_BACKENDS, "train.compile_backend",
          f"must be one of {', '.join(COMPILE_BACKENDS)}, got {t.compile_backend!r}")
    e = cfg.eval
    check(e.split in ("val", "test"), "eval.split", f"must be 'val' or 'test', got '{e.split}'")
    check(e.beam > 0, "eval.beam", "must be positive")
    check(e.batch_size > 0, "eval.batch_size", "must be positive")
    check(e.max_len_b >= 0, "eval.max_len_b", "must be 0 or positive")
    check(e.length_penalty >= 0, "eval.length_penalty", "must be 0 or positive")
    validate_comm(cfg.sync, cfg.collectives, check)


def from_dict(raw: dict, source: str | Source = "<dict>", lines: dict[str, int] | None = None) -> RunConfig:
    """A profile's raw mapping → a validated `RunConfig`; `source` (a name, or a `Source` with lines) for errors."""
    src = source if isinstance(source, Source) else Source(source, lines)
    _apply_preset(raw, src)
    refuse_moved(raw, src)
    cfg = build(RunConfig, raw, "", src)
    _validate(cfg, src)
    if strategies.get(cfg.sync.strategy).searches:  # each candidate of the search is a profile of its own: checked now
        for name, keys in cfg.sync.tune.candidates.items():
            candidate_config(cfg, name, keys, src)
    return cfg


def candidate_config(cfg: RunConfig, name: str, keys: dict[str, Any], src: Source | None = None) -> RunConfig:
    """The profile of one candidate of `sync.strategy: auto` (`dtrain.engine.autotune`): `sync` replaced by the candidate's
    keys over the profile's class rules. A bad key is a one-line error naming `sync.tune.candidates.<name>` (and
    its file and line, given the profile's `src`)."""
    where = f"sync.tune.candidates.{name}"
    at = f"{src.where(where)}: " if src is not None else ""
    if _NAME.fullmatch(name) is None:  # it names the candidate's folder, <run>/tune/<name>
        raise UserError(f"{at}'{where}': a candidate's name must be letters, digits and - _ . = + (one path "
                        "component, not starting with '.')")
    try:
        sync = candidate_raw(cfg.sync, name, keys)
    except UserError as e:
        raise UserError(f"{at}{e}") from None
    raw = cfg.to_dict()
    raw["sync"] = sync
    try:
        return from_dict(raw, Source(where))
    except UserError as e:
        raise UserError(f"{at}{where}: {str(e).removeprefix(where + ': ')}") from None


# What bf16 autocast costs on a CPU without bf16 instructions (docs/profiles.md has the measurement)
EMULATED_BF16_COST = ("about 20x slower per step than fp32 (measured: 18,100 ms vs 880 ms a step, multi30k-cpu, "
                      "2 ranks, 1,024 tokens)")


@functools.cache
def _say_once(message: str) -> None:
    """Once per process: an interleaved job or a search builds a trainer per configuration from the same profile."""
    print(message, file=sys.stderr, flush=True)


def resolve_amp(cfg: RunConfig, device, main: bool = True) -> tuple[RunConfig, dict]:
    """`train.amp` as `device` runs it: `auto` becomes bf16 where the device computes bf16 natively
    (`dtrain.engine.host_cpu.bf16_native`), fp32 elsewhere. Returns the profile with that precision (what the run
    records in config.yaml) and run.json's record of the choice: {"amp", "amp_setting", "amp_reason"}. `main` (the
    rank that speaks) says in one line what `auto` picked, or warns of an explicit bf16's cost on a CPU without bf16
    instructions (kept: the profile asked for it)."""
    setting = cfg.train.amp
    native, why = bf16_native(device)
    if setting == "auto":
        amp, reason = ("bf16" if native else "fp32"), why
        if amp == "fp32" and cfg.sync.gather_dtype == "bf16":
            raise UserError(f"'sync.gather_dtype' 'bf16' needs the forward under bf16 autocast, but 'train.amp' auto "
                            f"picks fp32 here ({why}); set train.amp: bf16, or sync.gather_dtype: fp32")
        if main:
            _say_once(f"dtrain.engine.config: train.amp auto: {amp} here ({why})")
    else:
        amp, reason = setting, f"set in the profile; {why}"
        if amp == "bf16" and not native and device.type == "cpu" and main:
            _say_once(f"dtrain.engine.config: warning: 'train.amp' bf16: bf16 autocast on a CPU without bf16 "
                      f"instructions ({torch.backends.cpu.get_cpu_capability()}) is emulated: {EMULATED_BF16_COST}; "
                      "train.amp: auto picks fp32 here")
    resolved = cfg if amp == setting else dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, amp=amp))
    return resolved, {"amp": amp, "amp_setting": setting, "amp_reason": reason}


def load(path: str | Path, overrides: list[str] = ()) -> RunConfig:
    """Read a profile (with its includes), apply `--set` overrides, validate. Raises `UserError` naming file, line
    and key."""
    raw, src = read_overlay(path)
    return from_dict(raw, apply_overrides(raw, src, overrides))


# Per-class NCCL keys that earlier versions recorded under `collectives.classes.<class>`, and their names now.
_RECORDED_NCCL_KEYS = {"proto": "protocol", "algo": "algorithm", "min_ctas": "min_ctas", "max_ctas": "max_ctas"}


def upgrade_recorded(raw: dict, src: Source) -> dict:
    """A run's recorded config.yaml as this version reads it. Earlier versions wrote per-class NCCL choices under
    `collectives.classes.<class>` (proto, algo, min_ctas, max_ctas; now `sync.classes.<class>`), named
    `collectives.default`'s `proto` and `algo` (now `protocol` and `algorithm`, as a class's), held the backend and
    its timeout in a section `dist` (now `collectives.backend` and `collectives.timeout_s`) and could record a knob
    that the run's strategy never read (now refused in a profile): the choices move, the ignored knobs go, so that
    recorded runs stay readable."""
    if isinstance(raw.get("dist"), dict):
        raw.setdefault("collectives", {}).update(raw.pop("dist"))
    coll = raw.get("collectives")
    default = coll.get("default") if isinstance(coll, dict) else None
    for old, new in _RECORDED_NCCL_KEYS.items():  # `collectives.default` named them as NCCL's variables do
        if isinstance(default, dict) and old in default and old != new:
            default[new] = default.pop(old)
    if isinstance(coll, dict) and isinstance(coll.get("classes"), dict):
        classes = raw.setdefault("sync", {}).setdefault("classes", {}) or {}
        raw["sync"]["classes"] = classes
        for name, spec in coll.pop("classes").items():
            for old, new in _RECORDED_NCCL_KEYS.items():
                if isinstance(spec, dict) and spec.get(old) is not None:
                    classes.setdefault(name, {})[new] = spec[old]
    return drop_unused_knobs(raw, src)


def drop_unused_knobs(raw: dict, src: Source) -> dict:
    """`raw` without the `sync` keys that its strategy does not read (`dtrain.collectives.strategies.unused_keys`)."""
    if isinstance(raw.get("sync"), dict):
        sync = build(SyncConfig, raw["sync"], "sync", src)
        for key, _ in unused_keys(sync):
            *parents, last = key.split(".")
            node = raw
            for p in parents:
                node = node[p]
            node.pop(last, None)
    return raw


def load_recorded(path: str | Path) -> RunConfig:
    """The resolved profile a run recorded (its config.yaml), from this version or an earlier one."""
    raw, src = read_overlay(path)
    return from_dict(upgrade_recorded(raw, src), src)


def dump(cfg: RunConfig) -> str:
    data = cfg.to_dict()
    data["optim"]["betas"] = list(data["optim"]["betas"])
    return yaml.safe_dump(data, sort_keys=False)
