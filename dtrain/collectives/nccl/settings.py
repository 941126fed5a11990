"""The profile's NCCL choices: the modes, NCCL's names, and the checks of `collectives.mode`, `collectives.default` and
the NCCL keys of `sync.classes.<name>` (protocol, algorithm, min_ctas, max_ctas).

Imports nothing of `dtrain.collectives.config`, which calls `validate_config` while it validates a profile.
"""

from __future__ import annotations

import re

from dtrain.collectives.settings import NCCL_ALGORITHMS, NCCL_PROTOCOLS, NcclSettings

MODES = ("global", "per_group", "tuner")
COLLECTIVES = ("broadcast", "reduce", "allgather", "reducescatter", "allreduce")  # ncclFunc_t 0..4
# The spellings of the tuner config files (NCCL's example plugin, plugins/tuner/example/, and dtrain's), by the same
# indices.
PLUGIN_ALGOS = ("tree", "ring", "collnet_direct", "collnet_chain", "nvls", "nvls_tree", "pat")
PLUGIN_PROTOS = ("ll", "ll128", "simple")
# NCCL's cost model (src/graph/tuning.cc) has no LL/LL128 cell for these algorithms, and no PAT cell for AllReduce.
SIMPLE_ONLY = ("CollNetDirect", "CollNetChain", "NVLS", "NVLSTree")
NCCL_KEYS = ("protocol", "algorithm", "min_ctas", "max_ctas")  # NcclSettings' fields, a class's keys of the same name
_CLASS_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def class_nccl(obj) -> NcclSettings:
    """The NCCL choices of a class: from None, NcclSettings, a `ClassSettings` (attributes protocol/algorithm/min_ctas/
    max_ctas), or a mapping with those keys (what `ClassSettings.nccl()` gives)."""
    if obj is None or isinstance(obj, NcclSettings):
        return obj or NcclSettings()
    if isinstance(obj, dict):
        return NcclSettings(**{k: v for k, v in obj.items() if k in NCCL_KEYS})
    return NcclSettings(**{k: getattr(obj, k, None) for k in NCCL_KEYS})


def describe(s: NcclSettings) -> str:
    parts = [f"{k} {getattr(s, k)}" for k in NCCL_KEYS if getattr(s, k) is not None]
    return ", ".join(parts) or "NCCL decides"


def validate_config(coll, sync, check) -> None:
    """Check `collectives` (a CollectivesConfig) and the NCCL keys of `sync.classes` (a SyncConfig's);
    `check(ok, dotted_path, message)` raises the config error. Types and unknown keys are the loader's."""
    check(coll.mode in MODES, "collectives.mode", f"must be one of {', '.join(MODES)}, got '{coll.mode}'")
    _check_choice(coll.default, "collectives.default", check)
    for name, spec in sync.classes.items():
        s = class_nccl(spec)
        if s == NcclSettings():
            continue
        path = f"sync.classes.{name}"
        first = next(k for k in NCCL_KEYS if getattr(s, k) is not None)
        check(coll.mode != "global", f"{path}.{first}",
              "needs collectives.mode per_group or tuner: in global mode one NCCL_PROTO/NCCL_ALGO serves the whole "
              "job (put it under collectives.default)")
        check(_CLASS_NAME.fullmatch(name) is not None, path, "is not a usable class name for NCCL settings "
              "(letters, digits and _ only: it travels in an environment variable and a CSV field)")
        _check_choice(s, path, check)


def _check_choice(s: NcclSettings, path: str, check) -> None:
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
