"""The profile's NCCL choices: the modes, NCCL's names, and the checks of `collectives.mode`, `collectives.default` and
the NCCL keys of `sync.classes.<name>` (protocol, algorithm, min_ctas, max_ctas).

Imports nothing of `dtrain.collectives.config`, which calls `validate_config` while it validates a profile.
"""

from __future__ import annotations

import dataclasses
import re

from dtrain.collectives.settings import NCCL_ALGORITHMS, NCCL_KEYS, NCCL_PROTOCOLS, ClassSettings

MODES = ("global", "per_group", "tuner")
COLLECTIVES = ("broadcast", "reduce", "allgather", "reducescatter", "allreduce")  # ncclFunc_t 0..4
# The spellings of the tuner config files (NCCL's example plugin, plugins/tuner/example/, and dtrain's), by the same
# indices.
PLUGIN_ALGOS = ("tree", "ring", "collnet_direct", "collnet_chain", "nvls", "nvls_tree", "pat")
PLUGIN_PROTOS = ("ll", "ll128", "simple")
# NCCL's cost model (src/graph/tuning.cc) has no LL/LL128 cell for these algorithms, and no PAT cell for AllReduce.
SIMPLE_ONLY = ("CollNetDirect", "CollNetChain", "NVLS", "NVLSTree")
_CLASS_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def class_nccl(obj) -> ClassSettings:
    """The NCCL choices of a class, as a `ClassSettings` holding only them: from None, a `ClassSettings`, or a mapping
    with those keys (what `ClassSettings.nccl()` gives)."""
    if obj is None:
        return ClassSettings()
    return ClassSettings(**{k: v for k, v in (obj if isinstance(obj, dict) else obj.nccl()).items() if k in NCCL_KEYS})


def as_record(s: ClassSettings) -> dict:
    """The four NCCL keys of `s`, null where NCCL decides: what the run's records and the cost model read."""
    return {k: getattr(s, k) for k in NCCL_KEYS}


def describe(s: ClassSettings) -> str:
    return ", ".join(f"{k} {v}" for k, v in s.nccl().items()) or "NCCL decides"


def validate_config(coll, sync, check) -> None:
    """Check `collectives` (a CollectivesConfig) and the NCCL keys of `sync.classes` (a SyncConfig's);
    `check(ok, dotted_path, message)` raises the config error. Types and unknown keys are the loader's."""
    check(coll.mode in MODES, "collectives.mode", f"must be one of {', '.join(MODES)}, got '{coll.mode}'")
    other = next((f.name for f in dataclasses.fields(ClassSettings) if f.name not in NCCL_KEYS
                  and getattr(coll.default, f.name) != f.default), None)
    check(other is None, f"collectives.default.{other}",
          f"is a class's key, not NCCL's: collectives.default takes {', '.join(NCCL_KEYS)}")
    _check_choice(coll.default, "collectives.default", check)
    for name, spec in sync.classes.items():
        s = class_nccl(spec)
        if not s.nccl():
            continue
        path = f"sync.classes.{name}"
        first = next(iter(s.nccl()))
        check(coll.mode != "global", f"{path}.{first}",
              "needs collectives.mode per_group or tuner: in global mode one NCCL_PROTO/NCCL_ALGO serves the whole "
              "job (put it under collectives.default)")
        check(_CLASS_NAME.fullmatch(name) is not None, path, "is not a usable class name for NCCL settings "
              "(letters, digits and _ only: it travels in an environment variable and a CSV field)")
        _check_choice(s, path, check)


def _check_choice(s: ClassSettings, path: str, check) -> None:
    """One setting's protocol, algorithm and CTA bounds under `path`."""
    check(s.protocol is None or s.protocol in NCCL_PROTOCOLS, f"{path}.protocol",
          f"unknown protocol '{s.protocol}' (NCCL's: {', '.join(NCCL_PROTOCOLS)})")
    check(s.algorithm is None or s.algorithm in NCCL_ALGORITHMS, f"{path}.algorithm",
          f"unknown algorithm '{s.algorithm}' (NCCL's: {', '.join(NCCL_ALGORITHMS)})")
    check(s.algorithm != "PAT", f"{path}.algorithm", "PAT runs AllGather and ReduceScatter only, never the gradient "
                                                    "AllReduce: NCCL would find no algorithm")
    check(s.algorithm not in SIMPLE_ONLY or s.protocol in (None, "Simple"), f"{path}.protocol",
          f"{s.algorithm} runs the Simple protocol only: NCCL has no {s.algorithm}/{s.protocol} cell")
    for bound in ("min_ctas", "max_ctas"):
        v = getattr(s, bound)
        check(v is None or v > 0, f"{path}.{bound}", f"must be positive or null, got {v}")
    check(s.min_ctas is None or s.max_ctas is None or s.min_ctas <= s.max_ctas, f"{path}.min_ctas",
          f"cannot exceed {path}.max_ctas")
