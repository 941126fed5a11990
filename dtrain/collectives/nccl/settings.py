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
NCCL_KEYS = ("proto", "algo", "min_ctas", "max_ctas")  # NcclSettings' fields
# A class's keys in `sync.classes.<name>` -> NcclSettings' fields.
CLASS_KEYS = {"protocol": "proto", "algorithm": "algo", "min_ctas": "min_ctas", "max_ctas": "max_ctas"}
_CLASS_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def class_nccl(obj) -> NcclSettings:
    """The NCCL choices of a class: from None, NcclSettings, a `ClassSettings` or `CollectiveSettings` (attributes
    protocol/algorithm/min_ctas/max_ctas), or a mapping with those keys (what `CollectiveSettings.nccl()` gives)."""
    if obj is None or isinstance(obj, NcclSettings):
        return obj or NcclSettings()
    if isinstance(obj, dict):
        return NcclSettings(**{CLASS_KEYS[k]: v for k, v in obj.items() if k in CLASS_KEYS})
    return NcclSettings(**{field: getattr(obj, key, None) for key, field in CLASS_KEYS.items()})


def describe(s: NcclSettings) -> str:
    parts = [f"{k} {getattr(s, k)}" for k in NCCL_KEYS if getattr(s, k) is not None]
    return ", ".join(parts) or "NCCL decides"


def validate_config(coll, sync, check) -> None:
    """Check `collectives` (a CollectivesConfig) and the NCCL keys of `sync.classes` (a SyncConfig's);
    `check(ok, dotted_path, message)` raises the config error. Types and unknown keys are the loader's."""
    check(coll.mode in MODES, "collectives.mode", f"must be one of {', '.join(MODES)}, got '{coll.mode}'")
    _check_choice(coll.default, "collectives.default", "proto", "algo", check)
    for name, spec in sync.classes.items():
        s = class_nccl(spec)
        if s == NcclSettings():
            continue
        path = f"sync.classes.{name}"
        first = next(k for k, f in CLASS_KEYS.items() if getattr(s, f) is not None)
        check(coll.mode != "global", f"{path}.{first}",
              "needs collectives.mode per_group or tuner: in global mode one NCCL_PROTO/NCCL_ALGO serves the whole "
              "job (put it under collectives.default)")
        check(_CLASS_NAME.fullmatch(name) is not None, path, "is not a usable class name for NCCL settings "
              "(letters, digits and _ only: it travels in an environment variable and a CSV field)")
        _check_choice(s, path, "protocol", "algorithm", check)


def _check_choice(s: NcclSettings, path: str, proto_key: str, algo_key: str, check) -> None:
    """One setting's protocol, algorithm and CTA bounds, named as the profile names them under `path`."""
    check(s.proto is None or s.proto in NCCL_PROTOCOLS, f"{path}.{proto_key}",
          f"unknown protocol '{s.proto}' (NCCL's: {', '.join(NCCL_PROTOCOLS)})")
    check(s.algo is None or s.algo in NCCL_ALGORITHMS, f"{path}.{algo_key}",
          f"unknown algorithm '{s.algo}' (NCCL's: {', '.join(NCCL_ALGORITHMS)})")
    check(s.algo != "PAT", f"{path}.{algo_key}", "PAT runs AllGather and ReduceScatter only, never the gradient "
                                                "AllReduce: NCCL would find no algorithm")
    check(s.algo not in SIMPLE_ONLY or s.proto in (None, "Simple"), f"{path}.{proto_key}",
          f"{s.algo} runs the Simple protocol only: NCCL has no {s.algo}/{s.proto} cell")
    for bound in ("min_ctas", "max_ctas"):
        v = getattr(s, bound)
        check(v is None or v > 0, f"{path}.{bound}", f"must be positive or null, got {v}")
    check(s.min_ctas is None or s.max_ctas is None or s.min_ctas <= s.max_ctas, f"{path}.min_ctas",
          f"cannot exceed {path}.max_ctas")
