"""Tuner mode: dtrain's NCCL tuner plugin (dtrain/collectives/tuner/dtrain_tuner.c), its rules file, and the config files
of NCCL's example tuner plugin (ext-tuner/example/ in NCCL's source): written for it, and read as they are (a user's
file, through NCCL_TUNER_CONFIG_FILE) by dtrain's plugin, which applies them as the example plugin matches them.

A tuner plugin forces a choice by writing 0.0 into that (algorithm, protocol) cell of NCCL's cost table for each
collective (src/include/nccl_tuner.h), per communicator; it cannot re-enable a cell NCCL disabled.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from dtrain.collectives.nccl.classes import resolve, resolved
from dtrain.collectives.nccl.settings import COLLECTIVES, PLUGIN_ALGOS, PLUGIN_PROTOS, describe
from dtrain.collectives.settings import NCCL_ALGORITHMS, NCCL_PROTOCOLS, ClassSettings, CollectivesConfig, SyncConfig
from dtrain.common.errors import UserError
from dtrain.common.paths import cache_root

PACKAGE = Path(__file__).resolve().parents[1]  # dtrain/collectives/
TUNER_SOURCE = PACKAGE / "tuner" / "dtrain_tuner.c"
BUILD_DIR = cache_root() / "nccl-tuner"  # the plugin and its rules files: the package may be installed read-only
CLASS_VAR = "DTRAIN_TUNER_CLASS"  # which class a communicator serves, set only while its group is created
RULES_VAR = "DTRAIN_TUNER_RULES"  # the plugin's rules file, for the whole job
EXAMPLE_CONFIG_VAR = "NCCL_TUNER_CONFIG_FILE"  # the example plugin's config file, which dtrain's plugin reads too
# The example plugin's columns (its README); the last two may be left out (then: any).
EXAMPLE_FIELDS = ("collective_type", "min_bytes", "max_bytes", "algorithm", "protocol", "channels", "nNodes", "nRanks",
                  "numPipeOps", "regBuff")


def tuner_lib_path() -> Path:
    """Where `build_tuner` puts the plugin: the source's hash in the name, so an edited source is rebuilt."""
    digest = hashlib.sha256(TUNER_SOURCE.read_bytes()).hexdigest()[:12]
    return BUILD_DIR / f"libnccl-tuner-dtrain-{digest}.so"


def rules_path(rules: str) -> Path:
    """Where a rules file lives: its content's hash in the name, so every rank of a job names the same file."""
    return BUILD_DIR / f"rules-{hashlib.sha256(rules.encode()).hexdigest()[:12]}.csv"


def tuner_rules(sync: SyncConfig, coll: CollectivesConfig) -> str:
    """dtrain's plugin rules: `class,collective,min_bytes,max_bytes,algorithm,protocol,channels`, one per class
    that asks for something, plus `*` (the default) for classes the file does not name."""
    lines = ["# dtrain NCCL tuner rules (dtrain/collectives/tuner/dtrain_tuner.c), written by dtrain.collectives.nccl",
             "# class,collective,min_bytes,max_bytes,algorithm,protocol,channels  (-1: NCCL decides / no bound)"]
    for name, s in list(resolved(sync, coll).items()) + [("*", coll.default)]:
        if s.protocol or s.algorithm or s.max_ctas:
            algo = PLUGIN_ALGOS[NCCL_ALGORITHMS.index(s.algorithm)] if s.algorithm else "-1"
            proto = PLUGIN_PROTOS[NCCL_PROTOCOLS.index(s.protocol)] if s.protocol else "-1"
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


def example_tuner_csv(sync: SyncConfig, coll: CollectivesConfig, name: str, nproc: int, nnodes: int, channels: int,
                      profile_name: str) -> str:
    """One communicator's config for NCCL's example plugin (its README: `NCCL_TUNER_CONFIG_FILE`, one rule a line,
    the first matching line wins). That plugin sets one channel before matching and parses `-1` algorithms as ring,
    so every collective gets a line, every size is covered and every line has an explicit channel count; a choice
    left to NCCL becomes ring/simple, the only cell valid for every collective."""
    nranks = nproc * nnodes
    s = ClassSettings() if name == "world" else resolve(sync, coll, name)
    algo = PLUGIN_ALGOS[NCCL_ALGORITHMS.index(s.algorithm)] if s.algorithm else "ring"
    proto = PLUGIN_PROTOS[NCCL_PROTOCOLS.index(s.protocol)] if s.protocol else "simple"
    ch = s.max_ctas or channels
    lines = [f"# NCCL example tuner plugin config for the '{name}' communicator ({profile_name}: {nranks} ranks on "
             f"{nnodes} node(s)), from dtrain.collectives.nccl",
             f"# use: NCCL_TUNER_PLUGIN=<the example plugin>, NCCL_TUNER_CONFIG_FILE=<this file> while this group "
             f"is created; requested: {describe(s)}",
             "# collective_type,min_bytes,max_bytes,algorithm,protocol,channels,nNodes,nRanks,numPipeOps,regBuff"]
    for coll in COLLECTIVES:
        a, p = (algo, proto) if coll == "allreduce" else ("ring", "simple")
        lines.append(f"{coll},0,-1,{a},{p},{ch},{nnodes},{nranks},-1,-1")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class ExampleRule:
    """One line of the example plugin's config. -1 is "any" for n_nodes, n_ranks, num_pipe_ops and reg_buff, "NCCL's
    count" for channels; max_bytes None is no bound (the file's -1, which that plugin's strtoull reads as the
    largest size)."""

    line: int
    collective: str
    min_bytes: int
    max_bytes: int | None
    algorithm: str
    protocol: str
    channels: int
    n_nodes: int
    n_ranks: int
    num_pipe_ops: int = -1
    reg_buff: int = -1

    def matches(self, collective: str, nbytes: int, n_nodes: int, n_ranks: int, num_pipe_ops: int = 1,
                reg_buff: int = 0) -> bool:
        """Whether the example plugin would consider this line for that call (its pluginGetCollInfo's test); the
        first such line whose cell NCCL has not disabled wins."""
        return (self.collective == collective and self.min_bytes <= nbytes
                and (self.max_bytes is None or nbytes <= self.max_bytes)
                and self.n_nodes in (-1, n_nodes) and self.n_ranks in (-1, n_ranks)
                and self.num_pipe_ops in (-1, num_pipe_ops) and self.reg_buff in (-1, reg_buff))


def _example_int(where: str, name: str, text: str, lo: int, wildcard: bool = True) -> int:
    try:
        v = int(text, 10)
    except ValueError:
        v = None
    if v is None or not ((wildcard and v == -1) or v >= lo):
        allowed = f"an integer >= {lo}" + (" or -1 (any)" if wildcard else "")
        raise UserError(f"{where}: {name} must be {allowed}, not '{text}'")
    return v


def _example_name(where: str, name: str, text: str, known) -> str:
    if text not in known:
        hint = " (the example plugin would silently read it as the default)" if text != "-1" else \
            " (-1 is no wildcard here: the example plugin reads it as the default)"
        raise UserError(f"{where}: unknown {name} '{text}'{hint}; one of {', '.join(known)}")
    return text


def read_example_config(path: str | Path) -> list[ExampleRule]:
    """A config file of NCCL's example tuner plugin, checked: `#` comments and blank lines skipped (and a heading
    line of the column names, as its README suggests for spreadsheets), 8 to 10 comma-separated fields a line, names
    spelt as the plugin spells them. A bad line is one UserError naming the file, the line and the field; the example
    plugin itself would skip it, or read an unknown name as allreduce/ring/simple."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read the tuner config '{path}' ({EXAMPLE_CONFIG_VAR}): {e}") from e
    rules = []
    for n, raw in enumerate(text.splitlines(), 1):
        s = raw.strip()
        if not s or s.startswith("#"):
            continue
        where = f"{path}:{n}"
        f = [x.strip() for x in s.split(",")]
        if f[0] == EXAMPLE_FIELDS[0]:
            continue
        if not 8 <= len(f) <= 10:
            raise UserError(f"{where}: {len(f)} fields; the example tuner plugin's format has 8 to 10: "
                            f"{','.join(EXAMPLE_FIELDS)}")
        if len(raw) >= 255:  # its fgets reads 256 bytes a line: a longer one would be cut in two
            raise UserError(f"{where}: line longer than the example plugin's 255 characters")
        coll = _example_name(where, "collective_type", f[0], COLLECTIVES)
        lo = _example_int(where, "min_bytes", f[1], 0, wildcard=False)
        hi = None if f[2] == "-1" else _example_int(where, "max_bytes", f[2], 0, wildcard=False)
        if hi is not None and hi < lo:
            raise UserError(f"{where}: max_bytes {hi} is below min_bytes {lo}: the line can never match")
        algo = _example_name(where, "algorithm", f[3], PLUGIN_ALGOS)
        proto = _example_name(where, "protocol", f[4], PLUGIN_PROTOS)
        rules.append(ExampleRule(
            n, coll, lo, hi, algo, proto, _example_int(where, "channels", f[5], 1),
            _example_int(where, "nNodes", f[6], 1), _example_int(where, "nRanks", f[7], 1),
            _example_int(where, "numPipeOps", f[8], 1) if len(f) > 8 else -1,
            _example_int(where, "regBuff", f[9], 0) if len(f) > 9 else -1))
        if rules[-1].reg_buff > 1:
            raise UserError(f"{where}: regBuff must be 0, 1 or -1 (any), not '{f[9]}'")
    return rules
