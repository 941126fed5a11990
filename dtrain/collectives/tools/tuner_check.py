"""Driving dtrain's tuner plugin without NCCL: its exported structs (tuner interfaces v3-v6, as NCCL's tuner plugin
headers declare them: src/include/nccl_tuner.h, later src/include/plugin/tuner/) called through ctypes on a cost
table of NCCL's model (`dtrain.collectives.costmodel`), for the `tuner-check` verb and the tests."""

from __future__ import annotations

import ctypes
from pathlib import Path

from dtrain.collectives.costmodel import NcclModel, Topology
from dtrain.collectives.nccl.classes import class_names
from dtrain.collectives.nccl.groups import scoped_env
from dtrain.collectives.nccl.settings import COLLECTIVES
from dtrain.collectives.nccl.tuner import (BUILD_DIR, CLASS_VAR, EXAMPLE_CONFIG_VAR, RULES_VAR, build_tuner,
                                    read_example_config, rules_path, tuner_rules)
from dtrain.collectives.settings import NCCL_ALGORITHMS, NCCL_PROTOCOLS, CollectivesConfig, SyncConfig

NVLINK_CHANNEL_BW = 20.6  # GB/s per channel that NCCL's topology search finds over Hopper's NVLink
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

    def get_coll_info(self, ctx, coll: str, nbytes: int, table: list[float], num_pipe_ops: int = 1,
                      reg_buff: int = 0) -> tuple[list[float], int, int]:
        """The cost table after the call, nChannels (0 = NCCL's), and the return code. `reg_buff` (whether the user
        buffer can be registered) exists from v4 on."""
        arr = (ctypes.c_float * len(table))(*table)
        nch = ctypes.c_int(0)  # NCCL initializes it to 0, "NCCL decides"
        args = [ctx, COLLECTIVES.index(coll), nbytes, num_pipe_ops, ctypes.cast(arr, ctypes.c_void_p),
                len(NCCL_ALGORITHMS), len(NCCL_PROTOCOLS)]
        args += [ctypes.byref(nch)] if self.version == 3 else [reg_buff, ctypes.byref(nch)]
        rc = self.api.getCollInfo(*args)
        return list(arr), nch.value, rc

    def finalize(self, ctx) -> int:
        return self.api.finalize(ctx)


def sample_cost_table(nbytes: int, nranks: int = 8, nnodes: int = 1, channels: int = 16) -> list[float]:
    """A stand-in for NCCL's AllReduce cost table (µs): the Ring and Tree cells of the project's model of NCCL
    (`dtrain.collectives.costmodel.NcclModel`, src/graph/tuning.cc) for Hopper GPUs over NVLink (the network between
    nodes), `channels` channels at NVLink's per-channel bandwidth; the other algorithms' cells disabled (-1.0), as on a
    machine without NVLS, CollNet or PAT. Indexed [algorithm * 3 + protocol], as NCCL passes it to the plugin."""
    topo = Topology("tuner-check sample", "H100", 90, nnodes, nranks // nnodes, "nvlink", channels, NVLINK_CHANNEL_BW,
                    nvls_enable=False, pat_enable=False)
    model = NcclModel(topo)
    table = [-1.0] * (len(NCCL_ALGORITHMS) * len(NCCL_PROTOCOLS))
    for c in model.choices(nbytes):
        if c.algo in ("Ring", "Tree"):
            table[NCCL_ALGORITHMS.index(c.algo) * 3 + NCCL_PROTOCOLS.index(c.proto)] = c.time_us
    return table


def cell_name(index: int) -> str:
    return f"{NCCL_ALGORITHMS[index // 3]}/{NCCL_PROTOCOLS[index % 3]}"


def tuner_table(sync: SyncConfig, coll: CollectivesConfig, sizes=(1024, 65536, 1 << 20, 16 << 20, 256 << 20),
                nranks: int = 8, nnodes: int = 1, versions=(3, 4, 5, 6),
                example_config: str | None = None) -> list[dict]:
    """For each exported version, class and size: NCCL's own pick on the sample table, and what the plugin forced.
    `example_config`: a config file of NCCL's example tuner plugin, checked, then read by the plugin
    (NCCL_TUNER_CONFIG_FILE) after the profile's rules."""
    if example_config is not None:
        read_example_config(example_config)  # one line naming file and line, before the plugin refuses it
    lib = build_tuner()
    rules = tuner_rules(sync, coll)
    path = rules_path(rules)
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    path.write_text(rules)
    rows = []
    with scoped_env({RULES_VAR: str(path), EXAMPLE_CONFIG_VAR: example_config}):
        for v in versions:
            h = TunerHarness(lib, v)
            for name in ["world"] + class_names(sync):
                with scoped_env({CLASS_VAR: None if name == "world" else name}):
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
