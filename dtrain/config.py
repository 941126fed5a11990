"""Profiles: strict YAML → frozen dataclasses (`RunConfig`), with `--set a.b=value` overrides.

First stage of the pipeline: everything downstream reads a `RunConfig` and nothing else. Unknown keys, wrong
types and impossible values are `UserError`s naming the file, the line and the dotted key.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from dtrain.errors import UserError

# The paper's Table 3 models, plus small presets that train on two CPU cores.
MODEL_PRESETS = {
    "base": dict(N=6, d_model=512, d_ff=2048, h=8, dropout=0.1),
    "big": dict(N=6, d_model=1024, d_ff=4096, h=16, dropout=0.3),
    "small": dict(N=3, d_model=256, d_ff=1024, h=4, dropout=0.1),
    "tiny": dict(N=2, d_model=64, d_ff=128, h=4, dropout=0.1),
}
SDPA_BACKENDS = ("auto", "math", "flash", "efficient", "cudnn")


@dataclass(frozen=True)
class ModelConfig:
    preset: str | None = None  # fills the fields below that the profile leaves out
    N: int = 6  # layers in the encoder and in the decoder
    d_model: int = 512
    d_ff: int = 2048
    h: int = 8  # attention heads
    dropout: float = 0.1
    norm: str = "post"  # "post" (the paper: LayerNorm(x + Sublayer(x))) or "pre"


@dataclass(frozen=True)
class DataConfig:
    corpus: str = "multi30k"
    dir: str | None = None  # a directory holding the corpus files; searched first
    src: str = "en"
    tgt: str = "de"
    vocab_size: int = 8000  # joint SentencePiece BPE vocabulary
    max_tokens: int = 4096  # per rank and micro-batch: padded tokens of the longer side
    max_len: int = 128  # training pairs longer than this (subword tokens) are dropped
    train_limit: int | None = None  # use only the first n training pairs (smoke tests)
    cache_dir: str | None = None  # default: $XDG_CACHE_HOME/dtrain or ~/.cache/dtrain


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
    amp: str = "fp32"  # "fp32" or "bf16" (autocast)
    threads: int | None = None  # torch intra-op threads per rank; default: torch's (torchrun sets 1 per rank)
    max_bad_steps: int = 5  # consecutive steps with non-finite gradients (each skipped) before the run stops
    sdpa_backend: str = "auto"  # auto: "math" on CPU (fastest for sentence-length sequences), torch's pick on CUDA
    # every rank > 0 also writes its bucket records (<run>/buckets.rank<r>.jsonl, the run directory shared): the
    # simulator then sees when the slowest rank had each bucket ready, not only rank 0
    record_ranks: bool = False


@dataclass(frozen=True)
class DistConfig:
    backend: str = "auto"  # auto: nccl when CUDA is present, else gloo
    timeout_s: float = 600.0


@dataclass(frozen=True)
class SyncConfig:
    strategy: str = "ddp"  # ddp, per_tensor, flat, bucketed, per_class, powersgd, noop (see collectives/strategies)
    bucket_cap_mb: float | None = None  # None: DDP's default (25 MiB, with a 1 MiB first bucket); 25 for the others
    first_bucket_mb: float | None = None  # ddp, bucketed: cap of the bucket ready first; None: as bucket_cap_mb
    hook: str | None = None  # ddp: a stock DDP comm hook: allreduce, fp16_compress, bf16_compress
    classes: dict = field(default_factory=dict)  # tensor class rules and settings: collectives/tensor_classes.py
    powersgd_rank: int = 1  # powersgd: matrix approximation rank
    powersgd_start_iter: int = 2  # powersgd: plain all-reduce before this iteration (error feedback needs >= 2)


@dataclass(frozen=True)
class NcclSettings:
    """One tensor class's NCCL choices; null = NCCL decides. Validated and applied by `collectives.nccl`."""

    proto: str | None = None  # LL, LL128, Simple
    algo: str | None = None  # Ring, Tree, CollNetDirect, CollNetChain, NVLS, NVLSTree, PAT
    min_ctas: int | None = None
    max_ctas: int | None = None


@dataclass(frozen=True)
class CollectivesConfig:
    mode: str = "global"  # global | per_group | tuner
    default: NcclSettings = field(default_factory=NcclSettings)
    classes: dict[str, NcclSettings] = field(default_factory=dict)  # tensor class → settings
    parse_log: bool = False  # NCCL_DEBUG=INFO, SUBSYS=ENV,TUNING into a log file, checked against the bucket plan
    validated: bool = False  # the forced settings passed the benchmark's #wrong check on this platform


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
    dist: DistConfig = field(default_factory=DistConfig)
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


# ----------------------------------------------------------------------------------------------------------------
# Loading: YAML nodes keep their line numbers so an error can point at the line.


class _Source:
    """Where values came from: a file name and, per dotted key, its line."""

    def __init__(self, name: str, lines: dict[str, int] | None = None):
        self.name, self.lines = name, lines or {}

    def where(self, path: str) -> str:
        line = self.lines.get(path)
        if line is None and "." in path:  # a missing key: point at its parent mapping
            line = self.lines.get(path.rsplit(".", 1)[0])
        return f"{self.name}:{line}" if line else self.name


def _node_to_python(node: yaml.Node, path: str, lines: dict[str, int]):
    lines[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        out = {}
        for k, v in node.value:
            key = yaml.safe_load(yaml.serialize(k)) if not isinstance(k, yaml.ScalarNode) else k.value
            sub = f"{path}.{key}" if path else str(key)
            if key in out:
                raise UserError(f"line {k.start_mark.line + 1}: duplicate key '{sub}'")
            out[key] = _node_to_python(v, sub, lines)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_node_to_python(v, f"{path}[{i}]", lines) for i, v in enumerate(node.value)]
    return yaml.safe_load(yaml.serialize(node))


def _read_yaml(path: Path) -> tuple[dict, dict[str, int]]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{path}: profile not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot read profile ({e.__class__.__name__})") from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise UserError(f"{where}: malformed YAML: {getattr(e, 'problem', None) or e}") from None
    lines: dict[str, int] = {}
    try:
        raw = {} if node is None else _node_to_python(node, "", lines)
    except UserError as e:
        raise UserError(f"{path}:{e}") from None
    if not isinstance(raw, dict):
        raise UserError(f"{path}: a profile must be a mapping of sections, not {type(raw).__name__}")
    return raw, lines


_SCIENTIFIC = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(tp, value, path: str, src: _Source):
    """Check `value` against the annotation `tp` (strictly: no str → int, no int → bool)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(a, value, path, src)
            except UserError as e:
                errors.append(e)
        raise errors[0]
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path, src)
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise UserError(f"{src.where(path)}: '{path}' must be a list of {len(args)} values, got {value!r}")
        return tuple(_coerce(a, v, f"{path}[{i}]", src) for i, (a, v) in enumerate(zip(args, value)))
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise UserError(f"{src.where(path)}: '{path}' must be a mapping, got {value!r}")
        args = typing.get_args(tp)
        if not args:
            return value
        return {_coerce(args[0], k, path, src): _coerce(args[1], v, f"{path}.{k}", src) for k, v in value.items()}
    if tp is float and isinstance(value, str) and _SCIENTIFIC.match(value):
        value = float(value)  # PyYAML (YAML 1.1) reads `1e-9` as a string; users mean the number
    ok = {
        bool: lambda v: isinstance(v, bool),
        int: lambda v: isinstance(v, int) and not isinstance(v, bool),
        float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        str: lambda v: isinstance(v, str),
    }[tp](value)
    if not ok:
        raise UserError(f"{src.where(path)}: '{path}' must be {_type_name(tp)}, got {value!r}")
    if tp is float:
        # YAML's .inf and .nan (and 1e999) are floats, but no setting means anything with them: `x > 0` lets inf
        # through and every comparison lets nan fail silently, so range checks below would not catch them.
        try:
            number = float(value)
        except OverflowError:  # an integer beyond the float range
            number = math.inf
        if not math.isfinite(number):
            raise UserError(f"{src.where(path)}: '{path}' must be a finite number, got {value!r}")
        return number
    return value


def _build(cls, raw, path: str, src: _Source):
    if not isinstance(raw, dict):
        raise UserError(f"{src.where(path)}: '{path}' must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in names:
            sub = f"{path}.{key}" if path else str(key)
            raise UserError(
                f"{src.where(sub)}: unknown key '{sub}' (known: {', '.join(sorted(names))})"
            )
    kwargs = {k: _coerce(hints[k], v, f"{path}.{k}" if path else k, src) for k, v in raw.items()}
    return cls(**kwargs)


def _apply_preset(raw: dict, src: _Source) -> None:
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


def apply_override(raw: dict, assignment: str) -> None:
    """`a.b=value`: the value is parsed as YAML (so `1e-3`, `true`, `null`, `[1, 2]` mean what they say)."""
    key, sep, text = assignment.partition("=")
    if not sep or not key:
        raise UserError(f"--set '{assignment}': expected KEY=VALUE, e.g. --set train.max_steps=100")
    try:
        value = yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        value = text
    parts = key.split(".")
    node = raw
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise UserError(f"--set '{assignment}': '{p}' is not a section")
    node[parts[-1]] = value


_NAME = re.compile(r"[A-Za-z0-9_=+-][A-Za-z0-9_.=+-]*")


def _validate(cfg: RunConfig, src: _Source) -> None:
    def check(ok: bool, path: str, msg: str):
        if not ok:
            raise UserError(f"{src.where(path)}: '{path}' {msg}")

    # The name becomes the run directory runs/<name>-<time> (and a glob to find it on restart): one path component
    # of the characters analysis.sweep allows in run names, so it cannot climb out of runs/ or be hidden.
    check(_NAME.fullmatch(cfg.name) is not None, "name",
          f"must be letters, digits and - _ . = + (a single path component, not starting with '.'), got {cfg.name!r}")
    m, d, o, t = cfg.model, cfg.data, cfg.optim, cfg.train
    for name in ("N", "d_model", "d_ff", "h"):
        check(getattr(m, name) > 0, f"model.{name}", f"must be positive, got {getattr(m, name)}")
    check(m.d_model % m.h == 0, "model.h", f"must divide model.d_model ({m.d_model} % {m.h} != 0)")
    check(0.0 <= m.dropout < 1.0, "model.dropout", f"must be in [0, 1), got {m.dropout}")
    check(m.norm in ("post", "pre"), "model.norm", f"must be 'post' or 'pre', got '{m.norm}'")
    check(d.corpus == "multi30k", "data.corpus", f"must be 'multi30k' (the only corpus so far), got '{d.corpus}'")
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
    check(t.amp in ("fp32", "bf16"), "train.amp", f"must be 'fp32' or 'bf16', got '{t.amp}'")
    check(t.threads is None or t.threads > 0, "train.threads", "must be positive or null")
    check(t.sdpa_backend in SDPA_BACKENDS, "train.sdpa_backend",
          f"must be one of {', '.join(SDPA_BACKENDS)}, got '{t.sdpa_backend}'")
    check(cfg.dist.backend in ("auto", "gloo", "nccl"), "dist.backend",
          f"must be auto, gloo or nccl, got '{cfg.dist.backend}'")
    check(cfg.dist.timeout_s > 0, "dist.timeout_s", "must be positive")
    s = cfg.sync
    check(s.bucket_cap_mb is None or s.bucket_cap_mb > 0, "sync.bucket_cap_mb",
          f"must be positive or null, got {s.bucket_cap_mb}")
    check(s.hook in (None, "allreduce", "fp16_compress", "bf16_compress"), "sync.hook",
          f"must be null, allreduce, fp16_compress or bf16_compress, got '{s.hook}'")
    check(s.first_bucket_mb is None or s.first_bucket_mb > 0, "sync.first_bucket_mb",
          f"must be positive or null, got {s.first_bucket_mb}")
    check(s.powersgd_rank > 0, "sync.powersgd_rank", f"must be positive, got {s.powersgd_rank}")
    check(s.powersgd_start_iter >= 2, "sync.powersgd_start_iter",
          f"must be at least 2 (DDP rebuilds its buckets after iteration 1), got {s.powersgd_start_iter}")
    from collectives.tensor_classes import config_problems

    for path, msg in config_problems(s):
        check(False, path, msg)
    e = cfg.eval
    check(e.split in ("val", "test"), "eval.split", f"must be 'val' or 'test', got '{e.split}'")
    check(e.beam > 0, "eval.beam", "must be positive")
    check(e.batch_size > 0, "eval.batch_size", "must be positive")
    check(e.max_len_b >= 0, "eval.max_len_b", "must be 0 or positive")
    check(e.length_penalty >= 0, "eval.length_penalty", "must be 0 or positive")
    # Strategy names are checked against the registry of `collectives` at attach time, and here early.
    from collectives.strategies import available

    check(s.strategy in available(), "sync.strategy",
          f"unknown strategy '{s.strategy}' (available: {', '.join(available())})")
    from collectives.nccl import validate_config

    validate_config(cfg.collectives, check)


def from_dict(raw: dict, source: str = "<dict>", lines: dict[str, int] | None = None) -> RunConfig:
    src = _Source(source, lines)
    _apply_preset(raw, src)
    cfg = _build(RunConfig, raw, "", src)
    _validate(cfg, src)
    return cfg


def load(path: str | Path, overrides: list[str] = ()) -> RunConfig:
    """Read a profile, apply `--set` overrides, validate. Raises `UserError` naming file, line and key."""
    path = Path(path)
    raw, lines = _read_yaml(path)
    for assignment in overrides:
        apply_override(raw, assignment)
        lines.pop(assignment.partition("=")[0], None)  # the value no longer comes from that line
    name = str(path)
    if overrides:
        name += " (with --set)"
    return from_dict(raw, name, lines)


def dump(cfg: RunConfig) -> str:
    data = cfg.to_dict()
    data["optim"]["betas"] = list(data["optim"]["betas"])
    return yaml.safe_dump(data, sort_keys=False)
