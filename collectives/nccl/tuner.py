"""Tuner mode: dtrain's NCCL tuner plugin (collectives/tuner/dtrain_tuner.c), its rules file, and the config files
for NCCL's example tuner plugin (plugins/tuner/example/ in NCCL's source).

A tuner plugin forces a choice by writing 0.0 into that (algorithm, protocol) cell of NCCL's cost table for each
collective (src/include/nccl_tuner.h), per communicator; it cannot re-enable a cell NCCL disabled.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from collectives.nccl.classes import resolve, resolved
from collectives.nccl.settings import COLLECTIVES, PLUGIN_ALGOS, PLUGIN_PROTOS, describe
from collectives.settings import NCCL_ALGORITHMS, NCCL_PROTOCOLS, NcclSettings
from common.errors import UserError

PACKAGE = Path(__file__).resolve().parents[1]  # collectives/
TUNER_SOURCE = PACKAGE / "tuner" / "dtrain_tuner.c"
BUILD_DIR = PACKAGE.parent / "build" / "nccl-tuner"  # git-ignored: the plugin and its rules files
CLASS_VAR = "DTRAIN_TUNER_CLASS"  # which class a communicator serves, set only while its group is created
RULES_VAR = "DTRAIN_TUNER_RULES"  # the plugin's rules file, for the whole job


def tuner_lib_path() -> Path:
    """Where `build_tuner` puts the plugin: the source's hash in the name, so an edited source is rebuilt."""
    digest = hashlib.sha256(TUNER_SOURCE.read_bytes()).hexdigest()[:12]
    return BUILD_DIR / f"libnccl-tuner-dtrain-{digest}.so"


def rules_path(rules: str) -> Path:
    """Where a rules file lives: its content's hash in the name, so every rank of a job names the same file."""
    return BUILD_DIR / f"rules-{hashlib.sha256(rules.encode()).hexdigest()[:12]}.csv"


def tuner_rules(cfg) -> str:
    """dtrain's plugin rules: `class,collective,min_bytes,max_bytes,algorithm,protocol,channels`, one per class
    that asks for something, plus `*` (the default) for classes the file does not name."""
    lines = ["# dtrain NCCL tuner rules (collectives/tuner/dtrain_tuner.c), written by collectives.nccl",
             "# class,collective,min_bytes,max_bytes,algorithm,protocol,channels  (-1: NCCL decides / no bound)"]
    for name, s in list(resolved(cfg).items()) + [("*", cfg.collectives.default)]:
        if s.proto or s.algo or s.max_ctas:
            algo = PLUGIN_ALGOS[NCCL_ALGORITHMS.index(s.algo)] if s.algo else "-1"
            proto = PLUGIN_PROTOS[NCCL_PROTOCOLS.index(s.proto)] if s.proto else "-1"
            lines.append(f"{name},allreduce,0,-1,{algo},{proto},{s.max_ctas or -1}")
    return "\n".join(lines) + "\n"


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


def example_tuner_csv(cfg, name: str, nproc: int, nnodes: int, channels: int, profile_name: str) -> str:
    """One communicator's config for NCCL's example plugin (its README: `NCCL_TUNER_CONFIG_FILE`, one rule a line,
    the first matching line wins). That plugin sets one channel before matching and parses `-1` algorithms as ring,
    so every collective gets a line, every size is covered and every line has an explicit channel count; a choice
    left to NCCL becomes ring/simple, the only cell valid for every collective."""
    nranks = nproc * nnodes
    s = NcclSettings() if name == "world" else resolve(cfg, name)
    algo = PLUGIN_ALGOS[NCCL_ALGORITHMS.index(s.algo)] if s.algo else "ring"
    proto = PLUGIN_PROTOS[NCCL_PROTOCOLS.index(s.proto)] if s.proto else "simple"
    ch = s.max_ctas or channels
    lines = [f"# NCCL example tuner plugin config for the '{name}' communicator ({profile_name}: {nranks} ranks on "
             f"{nnodes} node(s)), from collectives.nccl",
             f"# use: NCCL_TUNER_PLUGIN=<the example plugin>, NCCL_TUNER_CONFIG_FILE=<this file> while this group "
             f"is created; requested: {describe(s)}",
             "# collective_type,min_bytes,max_bytes,algorithm,protocol,channels,nNodes,nRanks,numPipeOps,regBuff"]
    for coll in COLLECTIVES:
        a, p = (algo, proto) if coll == "allreduce" else ("ring", "simple")
        lines.append(f"{coll},0,-1,{a},{p},{ch},{nnodes},{nranks},-1,-1")
    return "\n".join(lines) + "\n"
