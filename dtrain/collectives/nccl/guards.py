"""What NCCL's behaviour calls for before settings are applied: errors (raised) and warnings (returned), by mode and
NCCL version."""

from __future__ import annotations

import os

from dtrain.collectives import registry
from dtrain.collectives.nccl.versions import per_collective_syntax, version_str
from dtrain.collectives.settings import ClassSettings, CollectivesConfig, SyncConfig
from dtrain.common.errors import UserError

NONBLOCKING_VAR = "TORCH_NCCL_USE_COMM_NONBLOCKING"
NEEDS_HARDWARE = {"CollNetDirect": "a CollNet (SHARP) network plugin", "CollNetChain": "a CollNet (SHARP) network "
                  "plugin", "NVLS": "NVLink SHARP (NVSwitch systems)", "NVLSTree": "NVLink SHARP (NVSwitch systems)"}


def creates_class_groups(strategy: str) -> bool:
    """Whether the strategy sends each class through its own group (its `class_groups` in dtrain.collectives.registry)."""
    return registry.get(strategy).class_groups


def _searched(sync) -> list[str]:
    """The strategies a run can use: its own, or under a search (`auto`) its candidates' (none named: the default
    space, which holds per_class)."""
    if not registry.get(sync.strategy).searches:
        return [sync.strategy]
    return [keys["strategy"] for keys in sync.tune.candidates.values()] or ["per_class"]


def nonblocking_init() -> bool:
    """Non-blocking communicator init: NCCL would read the class's variables from a background thread, after they
    were restored (PyTorch's TORCH_NCCL_USE_COMM_NONBLOCKING; NCCL's ncclConfig_t.blocking)."""
    return os.environ.get(NONBLOCKING_VAR, "0") not in ("0", "")


def guards(sync: SyncConfig, coll: CollectivesConfig, version, settings: dict[str, ClassSettings]) -> list[str]:
    """Errors (raised as UserError) and warnings (returned) for these settings under this NCCL version."""
    warn = []
    vs = version_str(version)
    if coll.mode == "per_group" and version and (2, 27, 0) <= version <= (2, 27, 4):
        raise UserError(f"'collectives.mode' per_group cannot work on NCCL {vs}: 2.27.0-2.27.4 cache "
                        f"NCCL_PROTO/NCCL_ALGO after the first communicator (fixed in 2.27.5), so every group would "
                        f"get the first one's settings; use mode tuner or NCCL >= 2.27.5")
    if coll.mode == "tuner" and version and version < (2, 22, 0):
        raise UserError(f"'collectives.mode' tuner needs NCCL >= 2.22 (the plugin exports tuner interfaces v3-v6); "
                        f"this is NCCL {vs}")
    if coll.mode == "global" and not per_collective_syntax(version):
        d = coll.default
        if d.algorithm not in (None, "Ring"):
            raise UserError(f"'collectives.default.algorithm' {d.algorithm} needs NCCL >= 2.24 in global mode: before "
                            f"it NCCL_ALGO has no per-collective syntax, so {d.algorithm} would also be forced on "
                            f"broadcasts and all-gathers, which only Ring runs (this is NCCL {vs})")
        if d.protocol:
            warn.append(f"NCCL {vs} has no per-collective syntax: NCCL_PROTO={d.protocol} applies to every "
                        f"collective of the job, not only the gradient all-reduces")
    if coll.mode in ("per_group", "tuner") and nonblocking_init():
        raise UserError(f"'collectives.mode' {coll.mode} needs blocking communicator init, but {NONBLOCKING_VAR}="
                        f"{os.environ[NONBLOCKING_VAR]}: NCCL would read the class's variables from a background "
                        f"thread after dtrain restored them (unset it)")
    if coll.mode in ("global", "per_group"):
        warn += _forced_warnings(coll, {n: s for n, s in settings.items() if s.protocol or s.algorithm})
    if coll.mode in ("per_group", "tuner") and not any(map(creates_class_groups, _searched(sync))):
        what = "nor does any candidate of its search" if registry.get(sync.strategy).searches else ""
        warn.append(f"sync.strategy '{sync.strategy}' creates no per-class process groups{what and ', ' + what}: "
                    f"the classes' settings reach no communicator (use sync.strategy per_class)")
    if coll.parse_log and version and version < (2, 21, 0):
        warn.append(f"collectives.parse_log: NCCL {vs} predates the TUNING log formats parse-log reads")
    return warn


def _forced_warnings(coll: CollectivesConfig, forced: dict[str, ClassSettings]) -> list[str]:
    """Settings forced through the environment: LL128 (NCCL's maintainers call NCCL_PROTO a debugging knob; forced
    where NCCL disables LL128 it can give wrong results), and algorithms that need hardware NCCL may not find."""
    warn = []
    ll128 = sorted(n for n, s in forced.items() if s.protocol == "LL128")
    if ll128 and not coll.validated:
        who = "every gradient all-reduce" if coll.mode == "global" else ", ".join(ll128)
        warn.append(f"LL128 is forced for {who}: where NCCL disables LL128 by default, forcing it can "
                    f"give wrong results; validate these settings with the benchmark (#wrong must be 0), then set "
                    f"collectives.validated: true")
    for n, s in sorted(forced.items()):
        if s.algorithm in NEEDS_HARDWARE:
            warn.append(f"{n}: {s.algorithm} needs {NEEDS_HARDWARE[s.algorithm]}; forced through the environment where it "
                        f"is missing, NCCL fails at the first all-reduce")
    return warn
