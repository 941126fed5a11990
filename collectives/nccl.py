"""Per-tensor-class NCCL settings: which protocol, algorithm and CTA bounds each class's process group gets.

Sits between the profile's `collectives:` section and the groups the strategies create through `class_group`: three
ways to apply the settings (one global environment, per-group environment, dtrain's tuner plugin), the guards NCCL's
behaviour calls for, and the parser that reads back from NCCL's logs what it chose. Facts: reference/nccl-facts.md.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import hashlib
import inspect
import json
import math
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from collectives.settings import NcclSettings
from common.errors import UserError, exit_on_user_error
from common.jsonl import read_jsonl

PROTOCOLS = ("LL", "LL128", "Simple")  # NCCL's protocol indices 0..2 (facts §1)
ALGORITHMS = ("Tree", "Ring", "CollNetDirect", "CollNetChain", "NVLS", "NVLSTree", "PAT")  # indices 0..6
MODES = ("global", "per_group", "tuner")
COLLECTIVES = ("broadcast", "reduce", "allgather", "reducescatter", "allreduce")  # ncclFunc_t 0..4
# The spellings of the tuner config files (NCCL's example plugin and dtrain's), by the same indices (facts §3).
PLUGIN_ALGOS = ("tree", "ring", "collnet_direct", "collnet_chain", "nvls", "nvls_tree", "pat")
PLUGIN_PROTOS = ("ll", "ll128", "simple")
# NCCL's cost model has no LL/LL128 cell for these algorithms, and no PAT cell for AllReduce at all.
SIMPLE_ONLY = ("CollNetDirect", "CollNetChain", "NVLS", "NVLSTree")
NEEDS_HARDWARE = {"CollNetDirect": "a CollNet (SHARP) network plugin", "CollNetChain": "a CollNet (SHARP) network "
                  "plugin", "NVLS": "NVLink SHARP (NVSwitch systems)", "NVLSTree": "NVLink SHARP (NVSwitch systems)"}
# The design's default tensor classes, used when `collectives.tensor_classes` cannot say (it is the authority).
DEFAULT_CLASS_NAMES = ("embedding", "norm_bias", "projection", "ffn", "other")

REPO = Path(__file__).resolve().parents[1]
TUNER_SOURCE = Path(__file__).resolve().parent / "tuner" / "dtrain_tuner.c"
BUILD_DIR = REPO / "build" / "nccl-tuner"  # git-ignored: the plugin and its rules files
CLASS_VAR = "DTRAIN_TUNER_CLASS"  # which class a communicator serves, set only while its group is created
RULES_VAR = "DTRAIN_TUNER_RULES"  # the plugin's rules file, for the whole job
NONBLOCKING_VAR = "TORCH_NCCL_USE_COMM_NONBLOCKING"
_PATH_VARS = ("NCCL_TUNER_PLUGIN", RULES_VAR, "NCCL_DEBUG_FILE")
_NCCL_KEYS = ("proto", "algo", "min_ctas", "max_ctas")
_SYNC_KEYS = {"protocol": "proto", "algorithm": "algo", "min_ctas": "min_ctas", "max_ctas": "max_ctas"}


# ---------------------------------------------------------------------------------------------------------------
# The profile: validation and each class's resolved settings.


def validate_config(cfg, check) -> None:
    """Check the profile's `collectives` section; `check(ok, dotted_path, message)` raises the config error."""
    check(cfg.mode in MODES, "collectives.mode", f"must be one of {', '.join(MODES)}, got '{cfg.mode}'")
    check(cfg.mode != "global" or not cfg.classes, "collectives.classes",
          "needs collectives.mode per_group or tuner: in global mode one NCCL_PROTO/NCCL_ALGO serves the whole job "
          "(put it under collectives.default)")
    for path, s in [("collectives.default", cfg.default)] + [
        (f"collectives.classes.{name}", s) for name, s in cfg.classes.items()
    ]:
        check(path == "collectives.default" or re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", path.rsplit(".", 1)[1]),
              path, "is not a usable class name (letters, digits and _ only: it travels in an environment variable "
              "and a CSV field)")
        check(s.proto is None or s.proto in PROTOCOLS, f"{path}.proto",
              f"unknown protocol '{s.proto}' (NCCL's: {', '.join(PROTOCOLS)})")
        check(s.algo is None or s.algo in ALGORITHMS, f"{path}.algo",
              f"unknown algorithm '{s.algo}' (NCCL's: {', '.join(ALGORITHMS)})")
        check(s.algo != "PAT", f"{path}.algo", "PAT runs AllGather and ReduceScatter only, never the gradient "
                                               "AllReduce: NCCL would find no algorithm")
        check(s.algo not in SIMPLE_ONLY or s.proto in (None, "Simple"), f"{path}.proto",
              f"{s.algo} runs the Simple protocol only: NCCL has no {s.algo}/{s.proto} cell")
        for bound in ("min_ctas", "max_ctas"):
            v = getattr(s, bound)
            check(v is None or v > 0, f"{path}.{bound}", f"must be positive or null, got {v}")
        check(s.min_ctas is None or s.max_ctas is None or s.min_ctas <= s.max_ctas, f"{path}.min_ctas",
              f"cannot exceed {path}.max_ctas")


def class_names(cfg) -> list[str]:
    """Every tensor class a per-class strategy may create a group for, in rule order."""
    try:
        from collectives.tensor_classes import from_config
    except ImportError:  # the tensor classes module is another issue's; fall back on the design's names
        names = list(DEFAULT_CLASS_NAMES)
    else:
        names = [r.name for r in from_config(cfg.sync).rules]
        for n in cfg.collectives.classes:
            if n not in names:
                raise UserError(f"'collectives.classes.{n}' names no tensor class (classes: {', '.join(names)})")
    return names + [n for n in cfg.collectives.classes if n not in names]


def _as_settings(obj) -> NcclSettings:
    """The NCCL part of what a strategy hands `class_group`: None, NcclSettings, a CollectiveSettings or its
    `.nccl()` dict (keys protocol/algorithm/min_ctas/max_ctas), or a dict with the profile's own keys."""
    if obj is None or isinstance(obj, NcclSettings):
        return obj or NcclSettings()
    if callable(getattr(obj, "nccl", None)):
        obj = obj.nccl()
    if not isinstance(obj, dict):
        obj = {k: getattr(obj, k) for k in list(_SYNC_KEYS) + list(_NCCL_KEYS) if hasattr(obj, k)}
    out = {_SYNC_KEYS.get(k, k): v for k, v in obj.items() if k in _SYNC_KEYS or k in _NCCL_KEYS}
    return NcclSettings(**out)


def _merge(*layers: NcclSettings) -> NcclSettings:
    """Field by field, the first layer that sets a value wins."""
    return NcclSettings(**{k: next((getattr(s, k) for s in layers if getattr(s, k) is not None), None)
                           for k in _NCCL_KEYS})


def resolve(cfg, name: str, passed=None) -> NcclSettings:
    """Class `name`'s NCCL choices: `collectives.classes.<name>`, then what the strategy passed (the NCCL keys of
    `sync.classes.<name>`), then `collectives.default`. Both sources naming a field differently is an error."""
    c = cfg.collectives
    own = c.classes.get(name, NcclSettings())
    if passed is None:
        raw = (getattr(cfg.sync, "classes", None) or {}).get(name, {})
        passed = {k: v for k, v in raw.items() if k in _SYNC_KEYS} if isinstance(raw, dict) else None
    other = _as_settings(passed)
    if c.mode == "global" and other != NcclSettings():
        raise UserError(f"'sync.classes.{name}' sets NCCL choices ({_describe(other)}), which need "
                        f"collectives.mode per_group or tuner")
    for key in _NCCL_KEYS:
        a, b = getattr(own, key), getattr(other, key)
        if a is not None and b is not None and a != b:
            sync_key = next(k for k, v in _SYNC_KEYS.items() if v == key)
            raise UserError(f"'collectives.classes.{name}.{key}' ({a}) contradicts 'sync.classes.{name}.{sync_key}' "
                            f"({b})")
    return _merge(own, other, c.default)


def requested(cfg) -> dict[str, dict]:
    """{class: {proto, algo, min_ctas, max_ctas}} as requested: for the run header and the cost model."""
    return {n: dataclasses.asdict(resolve(cfg, n)) for n in class_names(cfg)}


def _describe(s: NcclSettings) -> str:
    parts = [f"{k} {getattr(s, k)}" for k in _NCCL_KEYS if getattr(s, k) is not None]
    return ", ".join(parts) or "NCCL decides"


# ---------------------------------------------------------------------------------------------------------------
# NCCL's version and the guards.


def nccl_version() -> tuple[int, int, int] | None:
    """The NCCL PyTorch runs with (facts: check at run time), or None without CUDA."""
    if not torch.cuda.is_available():
        return None
    try:
        v = torch.cuda.nccl.version()
    except Exception:  # a build without NCCL
        return None
    if isinstance(v, int):  # NCCL_VERSION_CODE: major * 10000 + minor * 100 + patch (2.9 onwards)
        v = (v // 10000, v // 100 % 100, v % 100)
    return tuple(v[:3])


def parse_version(text: str | None) -> tuple[int, int, int] | None:
    if text is None:
        return None
    m = re.fullmatch(r"(\d+)\.(\d+)(?:\.(\d+))?", text.strip())
    if not m:
        raise UserError(f"--nccl-version '{text}': expected MAJOR.MINOR[.PATCH], e.g. 2.21.5")
    return int(m[1]), int(m[2]), int(m[3] or 0)


def _vs(v) -> str:
    return ".".join(map(str, v)) if v else "unknown"


def _per_collective_syntax(version) -> bool:
    """`allreduce:LL128` is understood from 2.24 on (facts §1); unknown version: render for a current NCCL."""
    return version is None or version >= (2, 24, 0)


def _creates_class_groups(strategy: str) -> bool:
    """Whether the strategy sends each class through its own group (`class_groups` of collectives.strategies)."""
    from collectives.strategies import get

    return bool(getattr(get(strategy), "class_groups", False))


def guards(cfg, version, settings: dict[str, NcclSettings]) -> list[str]:
    """Errors (raised as UserError) and warnings (returned) for these settings under this NCCL version."""
    c, warn = cfg.collectives, []
    forced = {n: s for n, s in settings.items() if s.proto or s.algo}
    if c.mode == "per_group" and version and (2, 27, 0) <= version <= (2, 27, 4):
        raise UserError(f"'collectives.mode' per_group cannot work on NCCL {_vs(version)}: 2.27.0-2.27.4 cache "
                        f"NCCL_PROTO/NCCL_ALGO after the first communicator (fixed in 2.27.5), so every group would "
                        f"get the first one's settings; use mode tuner or NCCL >= 2.27.5")
    if c.mode == "tuner" and version and version < (2, 22, 0):
        raise UserError(f"'collectives.mode' tuner needs NCCL >= 2.22 (the plugin exports tuner interfaces v3-v6); "
                        f"this is NCCL {_vs(version)}")
    if c.mode == "global" and not _per_collective_syntax(version):
        d = c.default
        if d.algo not in (None, "Ring"):
            raise UserError(f"'collectives.default.algo' {d.algo} needs NCCL >= 2.24 in global mode: before it "
                            f"NCCL_ALGO has no per-collective syntax, so {d.algo} would also be forced on "
                            f"broadcasts and all-gathers, which only Ring runs (this is NCCL {_vs(version)})")
        if d.proto:
            warn.append(f"NCCL {_vs(version)} has no per-collective syntax: NCCL_PROTO={d.proto} applies to every "
                        f"collective of the job, not only the gradient all-reduces")
    if c.mode in ("per_group", "tuner") and os.environ.get(NONBLOCKING_VAR, "0") not in ("0", ""):
        raise UserError(f"'collectives.mode' {c.mode} needs blocking communicator init, but {NONBLOCKING_VAR}="
                        f"{os.environ[NONBLOCKING_VAR]}: NCCL would read the class's variables from a background "
                        f"thread after dtrain restored them (unset it)")
    if c.mode in ("global", "per_group"):
        ll128 = sorted(n for n, s in forced.items() if s.proto == "LL128")
        if ll128 and not c.validated:
            who = "every gradient all-reduce" if c.mode == "global" else ", ".join(ll128)
            warn.append(f"LL128 is forced for {who}: where NCCL disables LL128 by default, forcing it can "
                        f"give wrong results; validate these settings with the benchmark (#wrong must be 0), then set "
                        f"collectives.validated: true")
        for n, s in sorted(forced.items()):
            if s.algo in NEEDS_HARDWARE:
                warn.append(f"{n}: {s.algo} needs {NEEDS_HARDWARE[s.algo]}; forced through the environment where it "
                            f"is missing, NCCL fails at the first all-reduce")
    if c.mode in ("per_group", "tuner") and not _creates_class_groups(cfg.sync.strategy):
        warn.append(f"sync.strategy '{cfg.sync.strategy}' creates no per-class process groups: the classes' "
                    f"settings reach no communicator (use sync.strategy per_class)")
    if c.parse_log and version and version < (2, 21, 0):
        warn.append(f"collectives.parse_log: NCCL {_vs(version)} predates the TUNING log formats parse-log reads")
    return warn


# ---------------------------------------------------------------------------------------------------------------
# The plan: what the job and each process group get, per mode.


@dataclass
class GroupPlan:
    name: str  # "world" (the default group) or a tensor class
    settings: NcclSettings
    env: dict[str, str] = field(default_factory=dict)  # set while its communicator is created, restored after
    options: dict[str, int] = field(default_factory=dict)  # ProcessGroupNCCL.Options().config fields
    files: dict[str, str] = field(default_factory=dict)  # what a file is for -> its path


@dataclass
class NcclPlan:
    mode: str
    version: tuple[int, int, int] | None
    process_env: dict[str, str]  # set before the first communicator exists, kept for the whole job
    files: dict[str, str]  # path -> contents, written before the first communicator exists
    groups: list[GroupPlan]
    warnings: list[str]

    def group(self, name: str) -> GroupPlan | None:
        return next((g for g in self.groups if g.name == name), None)

    def digest(self) -> str:
        """Identical on every rank that resolved the same settings (compared before the first class group); paths
        count by file name only, as nodes may hold the checkout in different places."""
        env = {k: os.path.basename(v) if k in _PATH_VARS else v for k, v in self.process_env.items()}
        body = {"mode": self.mode, "env": env, "files": sorted(self.files.values()),
                "groups": [[g.name, g.env, g.options] for g in self.groups]}
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def _proto_algo_env(s: NcclSettings, version) -> dict[str, str]:
    """NCCL_PROTO/NCCL_ALGO for one setting; restricted to all-reduce where NCCL understands that (facts §1)."""
    scope = "allreduce:" if _per_collective_syntax(version) else ""
    env = {}
    if s.proto:
        env["NCCL_PROTO"] = scope + s.proto
    if s.algo:
        env["NCCL_ALGO"] = scope + s.algo
    return env


def _cta_options(s: NcclSettings) -> dict[str, int]:
    """Per-communicator CTA bounds go through ncclConfig_t, never NCCL_MIN/MAX_CTAS, read once per process (§1)."""
    return {k: getattr(s, k) for k in ("min_ctas", "max_ctas") if getattr(s, k) is not None}


def tuner_lib_path() -> Path:
    """Where `build_tuner` puts the plugin: the source's hash in the name, so an edited source is rebuilt."""
    digest = hashlib.sha256(TUNER_SOURCE.read_bytes()).hexdigest()[:12]
    return BUILD_DIR / f"libnccl-tuner-dtrain-{digest}.so"


def tuner_rules(cfg) -> str:
    """dtrain's plugin rules: `class,collective,min_bytes,max_bytes,algorithm,protocol,channels`, one per class
    that asks for something, plus `*` (the default) for classes the file does not name."""
    lines = ["# dtrain NCCL tuner rules (collectives/tuner/dtrain_tuner.c), written by collectives.nccl",
             "# class,collective,min_bytes,max_bytes,algorithm,protocol,channels  (-1: NCCL decides / no bound)"]
    for name, s in [(n, resolve(cfg, n)) for n in class_names(cfg)] + [("*", cfg.collectives.default)]:
        if s.proto or s.algo or s.max_ctas:
            algo = PLUGIN_ALGOS[ALGORITHMS.index(s.algo)] if s.algo else "-1"
            proto = PLUGIN_PROTOS[PROTOCOLS.index(s.proto)] if s.proto else "-1"
            lines.append(f"{name},allreduce,0,-1,{algo},{proto},{s.max_ctas or -1}")
    return "\n".join(lines) + "\n"


def build_plan(cfg, version=None, log_dir: str | Path | None = None, tuner_lib: Path | None = None) -> NcclPlan:
    """Everything `apply_global` and `class_group` will do for this profile, as data (the dry-run prints it)."""
    c = cfg.collectives
    names = class_names(cfg)
    settings = {n: resolve(cfg, n) for n in names}
    warnings = guards(cfg, version, settings)
    if not _creates_class_groups(cfg.sync.strategy):  # only the default group will exist
        names, settings = [], {}
    process_env: dict[str, str] = {}
    files: dict[str, str] = {}
    if c.parse_log:
        log_dir = Path(log_dir) if log_dir is not None else Path("<run-dir>") / "nccl-logs"
        process_env.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="ENV,TUNING",
                           NCCL_DEBUG_FILE=str(log_dir / "nccl.%h.%p.log"))  # %h host, %p pid: one file a rank
    groups = [GroupPlan("world", NcclSettings())]
    if c.mode == "global":
        # One setting for every communicator: set before the first one exists and never restored.
        process_env.update(_proto_algo_env(c.default, version))
        if c.default.min_ctas:
            process_env["NCCL_MIN_CTAS"] = str(c.default.min_ctas)
        if c.default.max_ctas:
            process_env["NCCL_MAX_CTAS"] = str(c.default.max_ctas)
        groups = [GroupPlan(g, c.default) for g in ["world"] + names]
    elif c.mode == "per_group":
        groups += [GroupPlan(n, s, _proto_algo_env(s, version), _cta_options(s)) for n, s in settings.items()]
    else:
        rules = tuner_rules(cfg)
        rules_path = BUILD_DIR / f"rules-{hashlib.sha256(rules.encode()).hexdigest()[:12]}.csv"
        files[str(rules_path)] = rules
        process_env.update({"NCCL_TUNER_PLUGIN": str(tuner_lib or tuner_lib_path()), RULES_VAR: str(rules_path)})
        groups += [GroupPlan(n, s, {CLASS_VAR: n}, _cta_options(s), {"tuner rules": str(rules_path)})
                   for n, s in settings.items()]
    return NcclPlan(c.mode, version, process_env, files, groups, warnings)


def render_plan(plan: NcclPlan, backend: str = "nccl") -> str:
    """The plan as the dry-run prints it: variables, options and files, per process group."""
    syntax = ">= 2.24 assumed (per-collective syntax)" if plan.version is None else _vs(plan.version)
    out = [f"NCCL plan: mode {plan.mode}, NCCL {syntax}"
           + ("" if backend == "nccl" else f"; backend {backend}: requested, not applied")]
    out.append("  job environment (set before the first communicator, kept):")
    out += [f"    {k}={v}" for k, v in plan.process_env.items()] or ["    (none)"]
    for path, text in plan.files.items():
        out.append(f"  file {path}:")
        out += [f"    | {line}" for line in text.rstrip("\n").split("\n")]
    for g in plan.groups:
        head = "world (default group)" if g.name == "world" else f"class {g.name}"
        out.append(f"  group {head}: {_describe(g.settings)}")
        if plan.mode == "global" and g.settings != NcclSettings():
            out.append("    env: the job environment above")
        if g.env:
            out.append("    env while its communicator is created, restored after its barrier: "
                       + " ".join(f"{k}={v}" for k, v in g.env.items()))
        if g.options:
            out.append("    options: " + " ".join(f"ProcessGroupNCCL.Options().config.{k}={v}"
                                                  for k, v in g.options.items()))
        out += [f"    file ({what}): {path}" for what, path in g.files.items()]
    out += [f"  warning: {w}" for w in plan.warnings]
    return "\n".join(out) + "\n"


def plan_text(cfg, version=None, backend: str | None = None) -> str:
    """For `dtrain.train --dry-run`: the plan of this profile (NCCL version: the runtime's when CUDA is present)."""
    from collectives.dist import choose_backend

    backend = backend or choose_backend(cfg.dist)
    version = version if version is not None else nccl_version()
    return render_plan(build_plan(cfg, version), backend)


# ---------------------------------------------------------------------------------------------------------------
# Tuner mode: building dtrain's plugin, and the CSV for NCCL's example plugin.


def build_tuner(force: bool = False) -> Path:
    """Compile the plugin with the system C compiler (no CUDA needed); safe when several ranks race to do it."""
    lib = tuner_lib_path()
    if lib.exists() and not force:
        return lib
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise UserError("collectives.mode tuner: no C compiler found to build the NCCL tuner plugin (install gcc or "
                        "set CC)")
    lib.parent.mkdir(parents=True, exist_ok=True)
    tmp = lib.with_name(f".{lib.name}.{os.getpid()}")
    cmd = [cc, "-O2", "-std=c11", "-D_GNU_SOURCE", "-Wall", "-Wextra", "-shared", "-fPIC", "-o", str(tmp),
           str(TUNER_SOURCE)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise UserError(f"building the NCCL tuner plugin failed: {' '.join(cmd)}: {proc.stderr.strip()}")
    os.replace(tmp, lib)  # atomic: a concurrent rank sees the old file or the new one, never half of one
    return lib


def example_tuner_csv(cfg, name: str, nproc: int, nnodes: int, channels: int) -> str:
    """One communicator's config for NCCL's example plugin (facts §3). That plugin sets one channel before matching
    and parses `-1` algorithms as ring, so every collective gets a line, every size is covered and every line has an
    explicit channel count; a choice left to NCCL becomes ring/simple, the only cell valid for every collective."""
    nranks = nproc * nnodes
    s = NcclSettings() if name == "world" else resolve(cfg, name)
    algo = PLUGIN_ALGOS[ALGORITHMS.index(s.algo)] if s.algo else "ring"
    proto = PLUGIN_PROTOS[PROTOCOLS.index(s.proto)] if s.proto else "simple"
    ch = s.max_ctas or channels
    lines = [f"# NCCL example tuner plugin config for the '{name}' communicator ({cfg.name}: {nranks} ranks on "
             f"{nnodes} node(s)), from collectives.nccl",
             f"# use: NCCL_TUNER_PLUGIN=<the example plugin>, NCCL_TUNER_CONFIG_FILE=<this file> while this group "
             f"is created; requested: {_describe(s)}",
             "# collective_type,min_bytes,max_bytes,algorithm,protocol,channels,nNodes,nRanks,numPipeOps,regBuff"]
    for coll in COLLECTIVES:
        a, p = (algo, proto) if coll == "allreduce" else ("ring", "simple")
        lines.append(f"{coll},0,-1,{a},{p},{ch},{nnodes},{nranks},-1,-1")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------------
# Driving the plugin without NCCL: its exported structs through ctypes, on a cost table shaped like NCCL's.

_LOGGER = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_ulong, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p)
_INIT_OLD = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_size_t, ctypes.c_size_t, _LOGGER, ctypes.POINTER(ctypes.c_void_p))
_INIT_NEW = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint64, ctypes.c_size_t,
                             ctypes.c_size_t, _LOGGER, ctypes.c_void_p, ctypes.c_void_p)
_GET_V3 = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_int,
                           ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int))
_GET_V4 = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_int,
                           ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int))
_FINI = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)


class _TunerV3(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("init", _INIT_OLD), ("getCollInfo", _GET_V3), ("finalize", _FINI)]


class _TunerV4(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("init", _INIT_OLD), ("getCollInfo", _GET_V4), ("finalize", _FINI)]


class _TunerV5(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("init", _INIT_NEW), ("getCollInfo", _GET_V4), ("finalize", _FINI)]


class _TunerV6(ctypes.Structure):
    _fields_ = _TunerV5._fields_ + [("getChunkSize", ctypes.c_void_p)]


TUNER_VERSIONS = {3: _TunerV3, 4: _TunerV4, 5: _TunerV5, 6: _TunerV6}


class TunerHarness:
    """One loaded plugin, one exported version: `init` a communicator, call `get_coll_info`, `finalize`."""

    def __init__(self, lib_path: Path, version: int):
        self.lib = ctypes.CDLL(str(lib_path))
        self.version = version
        self.api = TUNER_VERSIONS[version].in_dll(self.lib, f"ncclTunerPlugin_v{version}")
        self.messages: list[tuple[int, str]] = []  # (level, format string) of what the plugin logged
        # Only the fixed arguments are read: enough to see which message was logged and how often.
        self._logger = _LOGGER(lambda level, flags, file, line, fmt: self.messages.append((level, fmt.decode())))

    def init(self, nranks: int, nnodes: int) -> ctypes.c_void_p:
        ctx = ctypes.c_void_p()
        if self.version >= 5:
            rc = self.api.init(ctypes.byref(ctx), 0x1234, nranks, nnodes, self._logger, None, None)
        else:
            rc = self.api.init(nranks, nnodes, self._logger, ctypes.byref(ctx))
        if rc != 0:
            raise RuntimeError(f"tuner v{self.version} init returned {rc}")
        return ctx

    def get_coll_info(self, ctx, coll: str, nbytes: int, table: list[float]) -> tuple[list[float], int, int]:
        """The cost table after the call, nChannels (0 = NCCL's), and the return code."""
        arr = (ctypes.c_float * len(table))(*table)
        nch = ctypes.c_int(0)  # NCCL initializes it to 0, "NCCL decides"
        args = [ctx, COLLECTIVES.index(coll), nbytes, 1, ctypes.cast(arr, ctypes.c_void_p), len(ALGORITHMS),
                len(PROTOCOLS)]
        args += [ctypes.byref(nch)] if self.version == 3 else [0, ctypes.byref(nch)]
        rc = self.api.getCollInfo(*args)
        return list(arr), nch.value, rc

    def finalize(self, ctx) -> int:
        return self.api.finalize(ctx)


def sample_cost_table(nbytes: int, nranks: int = 8, nnodes: int = 1, channels: int = 16) -> list[float]:
    """A stand-in for NCCL's AllReduce cost table (µs), Ring and Tree cells from facts §4 for Hopper over NVLink
    (network between nodes); the other algorithms' cells are disabled (-1.0), as on a machine without NVLS or
    CollNet. For driving the plugin only: `collectives.costmodel` is the project's model of NCCL."""
    ppn, scale = nranks // nnodes, min(2, (nnodes > 1) + (nnodes > 2))
    ll_max = (141.0, 45.0, 35.0)[scale]
    tree_max = (38.7, 41.4, 36.0)[scale]
    bus = channels * 20.6  # NVLink per-channel bandwidth used by NCCL's topology search on Hopper
    table = [-1.0] * (len(ALGORITHMS) * len(PROTOCOLS))
    for p in range(3):
        steps, inter = 2 * (nranks - 1), 2 * (nnodes - 1)
        lat = (6.6, 14.0, 8.4)[p] + (steps - inter) * (0.6, 1.9, 3.4)[p] + inter * (2.7, 4.0, 14.0)[p]
        if nnodes > 1 and p == 2:
            lat *= 1.4
        bw = (min(bus * 0.5, ll_max), min(bus * 0.92, channels * 36.7), bus)[p]
        table[1 * 3 + p] = lat + nbytes / (1000 * bw * nranks / steps)
        tlat = (6.8, 14.0, 8.4)[p] + 2 * ((ppn - 1) * (0.6, 1.25, 4.0)[p] + math.log2(nnodes) * (5.0, 8.5, 14.0)[p])
        tbw = min(bus * 0.92, channels * tree_max)
        tbw = (min(tbw / 3.8, ll_max), tbw * (7 / 9 if nnodes == 1 else 120 / 128), tbw)[p]
        table[0 * 3 + p] = tlat + nbytes / (1000 * tbw * 0.5)
    return table


def cell_name(index: int) -> str:
    return f"{ALGORITHMS[index // 3]}/{PROTOCOLS[index % 3]}"


def tuner_table(cfg, sizes=(1024, 65536, 1 << 20, 16 << 20, 256 << 20), nranks: int = 8, nnodes: int = 1,
                versions=(3, 4, 5, 6)) -> list[dict]:
    """For each exported version, class and size: NCCL's own pick on the sample table, and what the plugin forced."""
    lib = build_tuner()
    rules = tuner_rules(cfg)
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    rules_path = BUILD_DIR / f"rules-{hashlib.sha256(rules.encode()).hexdigest()[:12]}.csv"
    rules_path.write_text(rules)
    rows = []
    with _scoped_env({RULES_VAR: str(rules_path)}):
        for v in versions:
            h = TunerHarness(lib, v)
            for name in ["world"] + class_names(cfg):
                with _scoped_env({CLASS_VAR: None if name == "world" else name}):
                    ctx = h.init(nranks, nnodes)  # the plugin reads the class at init, as under NCCL
                for n in sizes:
                    before = [ctypes.c_float(t).value for t in sample_cost_table(n, nranks, nnodes)]  # as NCCL's
                    after, nch, rc = h.get_coll_info(ctx, "allreduce", n, before)
                    pick = min((i for i, t in enumerate(after) if t >= 0), key=lambda i: after[i])
                    nccl = min((i for i, t in enumerate(before) if t >= 0), key=lambda i: before[i])
                    rows.append({"version": v, "class": name, "bytes": n, "nccl": cell_name(nccl),
                                 "chosen": cell_name(pick), "forced": after != before, "channels": nch, "rc": rc})
                h.finalize(ctx)
    return rows


def render_tuner_table(rows: list[dict]) -> str:
    """One line per class and size: NCCL's pick on the sample table, then each version's cell (`-`: left alone)."""
    versions = sorted({r["version"] for r in rows})
    cells = {(r["class"], r["bytes"], r["version"]): r for r in rows}
    keys = list(dict.fromkeys((r["class"], r["bytes"]) for r in rows))
    head = ["class", "bytes", "NCCL's pick"] + [f"v{v} forced" for v in versions] + ["channels"]
    out = [head]
    for cls, n in keys:
        rs = [cells[cls, n, v] for v in versions]
        forced = [(r["chosen"] if r["forced"] else "-") + ("" if r["rc"] == 0 else f" rc={r['rc']}") for r in rs]
        channels = {r["channels"] for r in rs}
        out.append([cls, str(n), rs[0]["nccl"]] + forced + [" ".join(str(c or "NCCL's") for c in sorted(channels))])
    widths = [max(len(row[i]) for row in out) for i in range(len(head))]
    return "\n".join("  ".join(v.rjust(w) if i == 1 else v.ljust(w) for i, (v, w) in enumerate(zip(row, widths)))
                     .rstrip() for row in out) + "\n"


# ---------------------------------------------------------------------------------------------------------------
# Applying the plan: the job's environment, then one process group per class.


@contextlib.contextmanager
def _scoped_env(env: dict[str, str | None]):
    """Set (None: unset) variables for the block, then put back exactly what was there, also on error."""
    saved = {k: os.environ.get(k) for k in env}
    try:
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class TorchGroups:
    """Process groups through torch.distributed; tests pass a fake with the same four methods."""

    def new_group(self, ranks, options: dict[str, int], desc: str):
        kwargs = {}
        if options:
            opts = dist.ProcessGroupNCCL.Options()
            for k, v in options.items():
                if not hasattr(opts.config, k):
                    raise UserError(f"'collectives.classes.*.{k}': this PyTorch's ProcessGroupNCCL.Options has no "
                                    f"config.{k}")
                setattr(opts.config, k, v)
            kwargs["pg_options"] = opts
        if "group_desc" in inspect.signature(dist.new_group).parameters:
            kwargs["group_desc"] = desc
        return dist.new_group(ranks=ranks, **kwargs)

    def barrier(self, pg) -> None:
        if pg is None or pg == dist.GroupMember.NON_GROUP_MEMBER:
            return
        if dist.get_backend(pg) == "nccl":
            dist.barrier(group=pg, device_ids=[torch.cuda.current_device()])
        else:
            dist.barrier(group=pg)

    def gather(self, obj) -> list:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return [obj]
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out

    def device_bound(self) -> bool:
        pg = dist.distributed_c10d._get_default_group()
        return getattr(pg, "bound_device_id", None) is not None


@dataclass
class _State:
    cfg: object
    backend: str
    plan: NcclPlan
    factory: object
    record: dict
    checked: bool = False


_STATE: _State | None = None


def apply_global(cfg, backend: str | None = None, version=..., factory=None, log_dir=None) -> dict:
    """Call once per process before `init_process_group`: validates, sets the job's NCCL variables (global mode,
    tuner plugin, debug log), builds the plugin in tuner mode, and arms `class_group`. Returns the run-header record,
    which `run_record()` completes as groups are created. On gloo nothing is set: requested, not applied."""
    global _STATE
    from collectives.dist import choose_backend

    backend = backend or choose_backend(cfg.dist)
    applied = backend == "nccl"
    if applied and dist.is_initialized():
        raise RuntimeError("collectives.nccl.apply_global must run before init_process_group: the default group's "
                           "communicator would already exist without the job's NCCL variables")
    version = (nccl_version() if applied else None) if version is ... else version
    if applied and cfg.collectives.parse_log and log_dir is None:
        raise UserError("'collectives.parse_log' needs --run-dir: NCCL's log file is named before the first "
                        "communicator exists, earlier than a run directory is chosen")
    plan = build_plan(cfg, version, log_dir)
    if applied and plan.mode == "tuner":
        build_tuner()
    warnings = list(plan.warnings)
    if applied:
        for path, text in plan.files.items():
            p = Path(path)
            p.parent.mkdir(parents=True, exist_ok=True)
            tmp = p.with_name(f".{p.name}.{os.getpid()}")
            tmp.write_text(text)
            os.replace(tmp, p)
        if "NCCL_DEBUG_FILE" in plan.process_env:
            Path(plan.process_env["NCCL_DEBUG_FILE"]).parent.mkdir(parents=True, exist_ok=True)
        for k, v in plan.process_env.items():
            if os.environ.get(k) not in (None, v):
                warnings.append(f"{k}={os.environ[k]} in the environment is replaced by the profile's {v}")
            os.environ[k] = v
        if plan.mode != "global":
            warnings += [f"{k}={os.environ[k]} in the environment applies to every class that sets no {k}"
                         for k in ("NCCL_PROTO", "NCCL_ALGO") if k in os.environ]
    if os.environ.get("RANK", "0") == "0":
        for w in warnings:
            print(f"collectives.nccl: warning: {w}", file=sys.stderr, flush=True)
    record = {
        "mode": plan.mode, "backend": backend, "applied": applied,
        "status": "applied" if applied else f"requested, not applied (backend {backend})",
        "nccl_version": _vs(version) if version else None,
        "requested": {"default": dataclasses.asdict(cfg.collectives.default), "classes": requested(cfg)},
        "job_env": plan.process_env, "files": sorted(plan.files), "groups": [], "warnings": warnings,
    }
    _STATE = _State(cfg, backend, plan, factory or TorchGroups(), record)
    return record


def run_record() -> dict | None:
    """What was requested and applied, for the run header (`run.json`): None when `apply_global` was not called."""
    return None if _STATE is None else _STATE.record


def reset() -> None:
    """Forget the applied profile (tests; a process that trains twice)."""
    global _STATE
    _STATE = None


def class_group(name: str, settings=None, ranks: list[int] | None = None):
    """A new process group serving tensor class `name` (collective call: every rank, same order).

    per_group: the class's NCCL_PROTO/NCCL_ALGO are set while its communicator is created (eagerly, the device being
    bound at init) and through a barrier on it, then restored (facts §1). tuner: the same, with the class's name for
    the plugin. CTA bounds go through the group's options. global, gloo, or no `apply_global`: a plain group.
    """
    state = _STATE
    if state is None:
        return dist.new_group(ranks=ranks)
    want = resolve(state.cfg, name, settings)
    mode = state.plan.mode
    g = state.plan.group(name)
    if g is None or g.settings != want:  # a class the plan did not list, or settings the strategy changed
        g = GroupPlan(name, want)
        if mode == "per_group":
            g = GroupPlan(name, want, _proto_algo_env(want, state.plan.version), _cta_options(want))
        elif mode == "tuner":
            g = GroupPlan(name, want, {CLASS_VAR: name}, _cta_options(want),
                          {"tuner rules": state.plan.process_env[RULES_VAR]})
    entry = {"class": name, "ranks": ranks, "requested": dataclasses.asdict(want), "env": g.env,
             "options": g.options, "files": g.files}
    if state.backend != "nccl" or mode == "global":
        pg = state.factory.new_group(ranks, {}, f"dtrain:{name}")
        entry["applied"] = "job environment" if state.backend == "nccl" and want != NcclSettings() else False
        state.record["groups"].append(entry)
        return pg
    if os.environ.get(NONBLOCKING_VAR, "0") not in ("0", ""):
        raise UserError(f"'collectives.mode' {mode} needs blocking communicator init: unset {NONBLOCKING_VAR}")
    if not state.checked:  # every rank of a communicator must use the same settings (facts §1)
        digests = state.factory.gather(state.plan.digest())
        if len(set(digests)) > 1:
            raise UserError(f"collectives: the ranks resolved different NCCL settings (plan digests "
                            f"{sorted(set(digests))}): every rank must load the same profile")
        state.checked = True
    if not state.factory.device_bound():
        state.record["warnings"].append(f"{name}: no device bound at init, so the communicator is created by the "
                                        f"barrier below, still inside the class's variables")
    with _scoped_env(g.env):
        pg = state.factory.new_group(ranks, g.options, f"dtrain:{name}")
        state.factory.barrier(pg)  # creates (or finishes creating) the communicator while the variables are set
    entry["applied"] = True
    state.record["groups"].append(entry)
    return pg


# ---------------------------------------------------------------------------------------------------------------
# Verification: what NCCL chose, read from NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=ENV,TUNING output (facts §2).

_PREFIX = re.compile(r"^(?P<host>[^\s:]+):(?P<pid>\d+):(?P<tid>\d+) \[(?P<dev>\d+)\] NCCL INFO ")
_NAMED = re.compile(r"(?P<coll>[A-Za-z]+): (?P<bytes>\d+) Bytes -> Algo (?P<algo>[A-Za-z_]+) proto "
                    r"(?P<proto>[A-Za-z0-9_]+) channel\{Lo\.\.Hi\}=\{(?P<lo>\d+)\.\.(?P<hi>\d+)\}")
_NUMERIC = re.compile(r"(?:^|\s)(?P<bytes>\d+) Bytes -> Algo (?P<algo>\d+) proto (?P<proto>\d+) time ")
_ENV = re.compile(r"(?P<var>NCCL_[A-Z0-9_]+) set by environment to (?P<value>\S+)")
_ALGO_BY_KEY = {a.upper(): a for a in ALGORITHMS}
_PROTO_BY_KEY = {p.upper(): p for p in PROTOCOLS}


@dataclass(frozen=True)
class Decision:
    """One TUNING line: a collective NCCL planned, and the (algorithm, protocol, channels) it chose."""

    line: int
    source: str  # host:pid of the logging rank, "-" when the line has no NCCL prefix
    collective: str | None  # None in the 2.21-2.23 format, which does not say
    nbytes: int
    algo: str
    proto: str
    channels: int | None  # None in the 2.21-2.23 format


@dataclass(frozen=True)
class EnvSetting:
    line: int
    source: str
    var: str
    value: str


def parse_log(lines) -> tuple[list[Decision], list[EnvSetting]]:
    """The TUNING decisions (both formats) and the ENV lines of an NCCL log, in order."""
    decisions, envs = [], []
    for i, raw in enumerate(lines, 1):
        m = _PREFIX.match(raw)
        source = f"{m['host']}:{m['pid']}" if m else "-"
        text = raw[m.end():] if m else raw
        if d := _NAMED.search(text):
            algo = _ALGO_BY_KEY.get(d["algo"].upper().replace("_", ""), d["algo"])
            proto = _PROTO_BY_KEY.get(d["proto"].upper(), d["proto"])
            decisions.append(Decision(i, source, d["coll"].lower(), int(d["bytes"]), algo, proto,
                                      int(d["hi"]) - int(d["lo"]) + 1))
        elif d := _NUMERIC.search(text):
            a, p = int(d["algo"]), int(d["proto"])
            decisions.append(Decision(i, source, None, int(d["bytes"]),
                                      ALGORITHMS[a] if a < len(ALGORITHMS) else str(a),
                                      PROTOCOLS[p] if p < len(PROTOCOLS) else str(p), None))
        elif e := _ENV.search(text):
            envs.append(EnvSetting(i, source, e["var"], e["value"].rstrip(".")))  # NCCL ends numbers with "."
    return decisions, envs


def load_buckets(path: str | Path) -> list[dict]:
    """Buckets from `buckets.jsonl` (one record a bucket and step) or a JSON list: {index, class, nbytes}, unique."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot read bucket records ({e.__class__.__name__})") from None
    try:
        records = json.loads(text)
        records = records if isinstance(records, list) else [records]
    except json.JSONDecodeError:
        records = read_jsonl(Path(path))  # one record a line; a bad line is named
    out = {}
    for r in records:
        if not isinstance(r, dict):
            raise UserError(f"{path}: a bucket record is not a JSON object: {r!r}")
        cls = r.get("tensor_class", r.get("class"))
        nbytes = r.get("nbytes", r.get("bytes"))
        if cls is None or nbytes is None:
            raise UserError(f"{path}: bucket record without class or nbytes: {r}")
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
            raise UserError(f"{path}: bucket record with nbytes {nbytes!r}, not a byte count: {r}")
        key = r.get("index", r.get("bucket", len(out)))
        out[key] = {"index": key, "class": cls, "nbytes": nbytes}
    return list(out.values())


def _satisfies(d: Decision, s: NcclSettings) -> bool:
    return (s.algo is None or d.algo == s.algo) and (s.proto is None or d.proto == s.proto)


def check_decisions(decisions: list[Decision], buckets: list[dict], want: dict[str, NcclSettings]):
    """Attribute each decision to the classes whose buckets have its size (TUNING lines name no communicator) and
    list the buckets whose observed choice differs from the requested one. Returns (table rows, mismatches)."""
    by_size: dict[int, set[str]] = {}
    for b in buckets:
        by_size.setdefault(b["nbytes"], set()).add(b["class"])
    grads = [d for d in decisions if d.collective in (None, "allreduce")]
    rows: dict[tuple, int] = {}
    for d in decisions:
        classes = by_size.get(d.nbytes, set()) if d in grads else set()
        key = ("|".join(sorted(classes)) or "(no bucket)", d.collective or "?", d.nbytes, d.algo, d.proto,
               "?" if d.channels is None else d.channels)
        rows[key] = rows.get(key, 0) + 1
    mismatches = []
    for b in sorted(buckets, key=lambda b: (str(b["class"]), str(b["index"]))):
        s = want.get(b["class"], NcclSettings())
        seen = [d for d in grads if d.nbytes == b["nbytes"]]
        if not seen:
            mismatches.append({**b, "requested": _describe(s), "observed": "no TUNING line of this size"})
            continue
        if s.proto is None and s.algo is None:
            continue
        peers = [want.get(c, NcclSettings()) for c in by_size[b["nbytes"]]]
        unexplained = [d for d in seen if not any(_satisfies(d, p) for p in peers)]
        if unexplained or not any(_satisfies(d, s) for d in seen):
            observed = sorted({f"{d.algo}/{d.proto}" for d in (unexplained or seen)})
            mismatches.append({**b, "requested": _describe(s), "observed": ", ".join(observed)})
    table = [dict(zip(("communicator", "collective", "bytes", "algorithm", "protocol", "channels"), k), lines=n)
             for k, n in sorted(rows.items(), key=lambda kv: (kv[0][0], kv[0][2], str(kv[0][1])))]
    return table, mismatches


def render_check(table, mismatches, envs: list[EnvSetting] | None = None) -> str:
    out = []
    if envs:
        out.append("settings NCCL honoured (ENV), in order:")
        out += [f"  line {e.line} {e.source}: {e.var}={e.value}" for e in envs]
    cols = ("communicator", "collective", "bytes", "algorithm", "protocol", "channels", "lines")
    cells = [cols] + [tuple(str(r[c]) for c in cols) for r in table]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    out += ["  ".join(v.ljust(w) if i < 2 else v.rjust(w) if i in (2, 6) else v.ljust(w)
                      for i, (v, w) in enumerate(zip(row, widths))).rstrip() for row in cells]
    if mismatches:
        out.append(f"{len(mismatches)} bucket(s) not on the requested choice:")
        out += [f"  bucket {m['index']} ({m['class']}, {m['nbytes']} B): requested {m['requested']}, observed "
                f"{m['observed']}" for m in mismatches]
    else:
        out.append("every bucket on its requested choice" if table else "no TUNING lines found")
    return "\n".join(out) + "\n"


def verify_run(cfg, run_dir: str | Path, log_dir: str | Path | None = None) -> dict | None:
    """After a run with `collectives.parse_log`: parse its NCCL logs, join them to `buckets.jsonl`, write
    `nccl_check.txt` into the run directory. Returns {decisions, mismatches}; None when there is nothing to read."""
    run_dir = Path(run_dir)
    if log_dir is None:
        debug_file = (run_record() or {}).get("job_env", {}).get("NCCL_DEBUG_FILE")
        log_dir = Path(debug_file).parent if debug_file else run_dir / "nccl-logs"
    log_dir = Path(log_dir)
    logs = sorted(log_dir.glob("nccl.*.log"))
    if not cfg.collectives.parse_log or not logs or not (run_dir / "buckets.jsonl").exists():
        return None
    decisions, envs = [], []
    for path in logs:
        d, e = parse_log(path.read_text(errors="replace").splitlines())
        decisions += d
        envs += e
    want = {n: resolve(cfg, n) for n in class_names(cfg)}
    table, mismatches = check_decisions(decisions, load_buckets(run_dir / "buckets.jsonl"), want)
    (run_dir / "nccl_check.txt").write_text(render_check(table, mismatches, envs))
    return {"decisions": len(decisions), "mismatches": mismatches}


# ---------------------------------------------------------------------------------------------------------------
# The one-GPU check: two NCCL ranks on one GPU, each its own NCCL host (facts §6), per_group then tuner mode.

GPU_CHECK_BUCKETS = {"projection": 65536, "embedding": 8 << 20}  # distinct sizes: TUNING lines name no communicator


def _gpu_check_config(mode: str):
    from dtrain.config import from_dict

    return from_dict({"name": f"gpu-check-{mode}", "sync": {"strategy": "per_class"}, "collectives": {
        "mode": mode, "parse_log": True, "classes": {"projection": {"proto": "LL", "algo": "Ring"},
                                                     "embedding": {"proto": "Simple", "algo": "Ring"}}}})


def _gpu_check_rank(rank: int, mode: str, out_dir: str, port: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      NCCL_HOSTID=f"rank{rank}", NCCL_SOCKET_IFNAME="lo", NCCL_IB_DISABLE="1")
    apply_global(_gpu_check_config(mode), backend="nccl", log_dir=Path(out_dir) / mode)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=device)  # bound: groups created eagerly
    try:
        groups = {name: class_group(name) for name in GPU_CHECK_BUCKETS}
        for _ in range(3):
            for name, nbytes in GPU_CHECK_BUCKETS.items():
                t = torch.full((nbytes // 4,), float(rank + 1), device=device)
                dist.all_reduce(t, group=groups[name])
                if not bool((t == 3.0).all()):  # the forced choice must also be correct (the #wrong check)
                    raise RuntimeError(f"{mode}/{name}: wrong all-reduce result")
        torch.cuda.synchronize()
    finally:
        dist.destroy_process_group()


def gpu_check(out_dir: str | Path) -> int:
    """Run both modes, parse their logs, print and write the parse-log tables; 1 when a bucket is off its choice."""
    import socket

    import torch.multiprocessing as mp

    if not torch.cuda.is_available():
        raise UserError("gpu-check needs a CUDA GPU, and none is visible here")
    out, status = Path(out_dir), 0
    for mode in ("per_group", "tuner"):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        mp.spawn(_gpu_check_rank, args=(mode, str(out), port), nprocs=2, join=True)
        decisions, envs = [], []
        for path in sorted((out / mode).glob("nccl.*.log")):
            d, e = parse_log(path.read_text(errors="replace").splitlines())
            decisions += d
            envs += e
        cfg = _gpu_check_config(mode)
        buckets = [{"index": i, "class": n, "nbytes": b} for i, (n, b) in enumerate(GPU_CHECK_BUCKETS.items())]
        table, mismatches = check_decisions(decisions, buckets, {n: resolve(cfg, n) for n in GPU_CHECK_BUCKETS})
        text = f"== {mode} (NCCL {_vs(nccl_version())}) ==\n" + render_check(table, mismatches, envs)
        (out / mode / "parse-log.txt").write_text(text)
        print(text, flush=True)
        status = max(status, 1 if mismatches else 0)
    return status


# ---------------------------------------------------------------------------------------------------------------
# Command line.


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="collectives.nccl", description="Per-class NCCL settings: plan, tuner, logs.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan", help="print which variables, options and files each process group gets")
    p.add_argument("--profile", required=True)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--nccl-version", help="render for this NCCL (default: the runtime's, else >= 2.24)")
    p.add_argument("--backend", choices=("nccl", "gloo"), help="default: the profile's dist.backend choice")
    sub.add_parser("build-tuner", help="compile dtrain's NCCL tuner plugin; prints its path")
    t = sub.add_parser("tuner-config", help="the rules as CSV for NCCL's example tuner plugin, one per communicator")
    t.add_argument("--profile", required=True)
    t.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    t.add_argument("--nproc", type=int, required=True, help="ranks per node")
    t.add_argument("--nnodes", type=int, default=1)
    t.add_argument("--channels", type=int, default=16,
                   help="channels where the profile sets no max_ctas (the example plugin would use 1)")
    t.add_argument("--out", help="a directory for nccl_tuner.<class>.conf files (default: print them)")
    c = sub.add_parser("tuner-check", help="drive the built plugin through ctypes: the cell forced per version, "
                                           "class and size")
    c.add_argument("--profile", required=True)
    c.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    c.add_argument("--nproc", type=int, default=8)
    c.add_argument("--nnodes", type=int, default=1)
    lg = sub.add_parser("parse-log", help="NCCL ENV,TUNING log -> (communicator, collective, bytes, algorithm, "
                                          "protocol, channels); exit 1 when a bucket is off its requested choice")
    lg.add_argument("logs", nargs="+")
    lg.add_argument("--profile", help="the run's profile: the requested choices")
    lg.add_argument("--buckets", help="the run's buckets.jsonl (or a JSON list of {index, class, nbytes})")
    g = sub.add_parser("gpu-check", help="two NCCL ranks on one GPU (distinct NCCL_HOSTID), per_group then tuner "
                                         "mode, each checked with parse-log; exit 1 when a bucket is off its choice")
    g.add_argument("--out", default="runs/nccl-gpu-check")
    args = ap.parse_args(argv)
    with exit_on_user_error("collectives.nccl"):
        from dtrain import config as config_mod

        if args.cmd == "build-tuner":
            print(build_tuner(force=True))
            return 0
        if args.cmd == "gpu-check":
            return gpu_check(args.out)
        if args.cmd == "parse-log":
            decisions, envs = [], []
            for path in args.logs:
                try:
                    text = Path(path).read_text(errors="replace")
                except OSError as e:
                    raise UserError(f"{path}: cannot read log ({e.strerror})") from None
                d, e = parse_log(text.splitlines())
                decisions += d
                envs += e
            cfg = config_mod.load(args.profile) if args.profile else None
            buckets = load_buckets(args.buckets) if args.buckets else []
            want = {n: resolve(cfg, n) for n in class_names(cfg)} if cfg else {}
            table, mismatches = check_decisions(decisions, buckets, want)
            print(render_check(table, mismatches, envs), end="")
            return 1 if mismatches else 0
        cfg = config_mod.load(args.profile, getattr(args, "overrides", []))
        if args.cmd == "plan":
            print(plan_text(cfg, parse_version(args.nccl_version), args.backend), end="")
        elif args.cmd == "tuner-config":
            if args.nproc < 1 or args.nnodes < 1 or args.channels < 1:
                raise UserError("--nproc, --nnodes and --channels must be positive")
            for name in ["world"] + class_names(cfg):
                text = example_tuner_csv(cfg, name, args.nproc, args.nnodes, args.channels)
                if args.out:
                    Path(args.out).mkdir(parents=True, exist_ok=True)
                    (Path(args.out) / f"nccl_tuner.{name}.conf").write_text(text)
                    print(Path(args.out) / f"nccl_tuner.{name}.conf")
                else:
                    print(text)
        elif args.cmd == "tuner-check":
            rows = tuner_table(cfg, nranks=args.nproc * args.nnodes, nnodes=args.nnodes)
            print(render_tuner_table(rows), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
