"""Group settings: what the job and each process group get from NCCL, per mode, and `class_group`, which creates a
tensor class's group with them.

Three modes (`collectives.mode`): global (one NCCL_PROTO/NCCL_ALGO for the job), per_group (each class's variables set
while its communicator is created), tuner (dtrain's tuner plugin, told the class at communicator init). NCCL reads
NCCL_PROTO/NCCL_ALGO at every communicator init, but NCCL_MIN_CTAS/NCCL_MAX_CTAS once per process, so per-group CTA
bounds go through ncclConfig_t (NCCL's environment-variable and communicator-configuration documentation).
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from dtrain.collectives.dist import choose_backend
from dtrain.collectives.nccl.classes import requested, resolve, resolved
from dtrain.collectives.nccl.guards import NONBLOCKING_VAR, creates_class_groups, guards, nonblocking_init
from dtrain.collectives.nccl.settings import as_record, class_nccl, describe
from dtrain.collectives.nccl.tuner import (CLASS_VAR, EXAMPLE_CONFIG_VAR, RULES_VAR, build_tuner, read_example_config,
                                    rules_path, tuner_lib_path, tuner_rules)
from dtrain.collectives.nccl.versions import nccl_version, per_collective_syntax, version_str
from dtrain.collectives.settings import ClassSettings, CollectivesConfig, SyncConfig
from dtrain.common.errors import UserError
from dtrain.common.files import replace_atomically

_PATH_VARS = ("NCCL_TUNER_PLUGIN", RULES_VAR, EXAMPLE_CONFIG_VAR, "NCCL_DEBUG_FILE")


@dataclass
class GroupSettings:
    name: str  # "world" (the default group) or a tensor class
    settings: ClassSettings
    env: dict[str, str] = field(default_factory=dict)  # set while its communicator is created, restored after
    options: dict[str, int] = field(default_factory=dict)  # ProcessGroupNCCL.Options().config fields
    files: dict[str, str] = field(default_factory=dict)  # what a file is for -> its path


@dataclass
class NcclSetup:
    """Everything `apply_global` and `class_group` do for a profile, as data (`groups` prints it)."""

    mode: str
    version: tuple[int, int, int] | None
    process_env: dict[str, str]  # set before the first communicator exists, kept for the whole job
    files: dict[str, str]  # path -> contents, written before the first communicator exists
    groups: list[GroupSettings]
    warnings: list[str]

    def group(self, name: str) -> GroupSettings | None:
        return next((g for g in self.groups if g.name == name), None)

    def digest(self) -> str:
        """Identical on every rank that resolved the same settings (compared before the first class group); paths
        count by file name only, as nodes may hold the checkout in different places."""
        env = {k: os.path.basename(v) if k in _PATH_VARS else v for k, v in self.process_env.items()}
        body = {"mode": self.mode, "env": env, "files": sorted(self.files.values()),
                "groups": [[g.name, g.env, g.options] for g in self.groups]}
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def proto_algo_env(s: ClassSettings, version) -> dict[str, str]:
    """NCCL_PROTO/NCCL_ALGO for one setting; restricted to all-reduce where NCCL understands that (2.24 on)."""
    scope = "allreduce:" if per_collective_syntax(version) else ""
    env = {}
    if s.protocol:
        env["NCCL_PROTO"] = scope + s.protocol
    if s.algorithm:
        env["NCCL_ALGO"] = scope + s.algorithm
    return env


def cta_options(s: ClassSettings) -> dict[str, int]:
    """Per-communicator CTA bounds go through ncclConfig_t (minCTAs/maxCTAs), never NCCL_MIN/MAX_CTAS, which NCCL
    reads once per process."""
    return {k: getattr(s, k) for k in ("min_ctas", "max_ctas") if getattr(s, k) is not None}


def class_group_settings(mode: str, name: str, s: ClassSettings, version, rules_file: str | None) -> GroupSettings:
    """A class group's variables, options and files in `mode` (global: the job environment serves it)."""
    if mode == "per_group":
        return GroupSettings(name, s, proto_algo_env(s, version), cta_options(s))
    if mode == "tuner":
        return GroupSettings(name, s, {CLASS_VAR: name}, cta_options(s), {"tuner rules": rules_file})
    return GroupSettings(name, s)


def build_groups(sync: SyncConfig, coll: CollectivesConfig, version=None, log_dir: str | Path | None = None,
                 tuner_lib: Path | None = None) -> NcclSetup:
    """Everything `apply_global` and `class_group` will do for this profile, as data."""
    settings = resolved(sync, coll)
    warnings = guards(sync, coll, version, settings)
    if not creates_class_groups(sync.strategy):  # only the default group will exist
        settings = {}
    process_env: dict[str, str] = {}
    files: dict[str, str] = {}
    if coll.parse_log:
        log_dir = Path(log_dir) if log_dir is not None else Path("<run-dir>") / "nccl-logs"
        process_env.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="ENV,TUNING",
                           NCCL_DEBUG_FILE=str(log_dir / "nccl.%h.%p.log"))  # %h host, %p pid: one file a rank
    rules_file = None
    if coll.mode == "global":
        # One setting for every communicator: set before the first one exists and never restored.
        process_env.update(proto_algo_env(coll.default, version))
        if coll.default.min_ctas:
            process_env["NCCL_MIN_CTAS"] = str(coll.default.min_ctas)
        if coll.default.max_ctas:
            process_env["NCCL_MAX_CTAS"] = str(coll.default.max_ctas)
        groups = [GroupSettings(g, coll.default) for g in ["world"] + list(settings)]
        return NcclSetup(coll.mode, version, process_env, files, groups, warnings)
    if coll.mode == "tuner":
        rules = tuner_rules(sync, coll)
        rules_file = str(rules_path(rules))
        files[rules_file] = rules
        process_env.update({"NCCL_TUNER_PLUGIN": str(tuner_lib or tuner_lib_path()), RULES_VAR: rules_file})
        example = os.environ.get(EXAMPLE_CONFIG_VAR)
        if example:  # a user's config file of NCCL's example plugin: checked now, not at the first communicator
            read_example_config(example)
            warnings.append(f"{EXAMPLE_CONFIG_VAR}={example}: its rules apply to every communicator after the "
                            "classes' own")
    groups = [GroupSettings("world", ClassSettings())]
    groups += [class_group_settings(coll.mode, n, s, version, rules_file) for n, s in settings.items()]
    return NcclSetup(coll.mode, version, process_env, files, groups, warnings)


def render_groups(setup: NcclSetup, backend: str = "nccl") -> str:
    """The settings as `groups` and `--dry-run` print them: variables, options and files, per process group."""
    syntax = ">= 2.24 assumed (per-collective syntax)" if setup.version is None else version_str(setup.version)
    out = [f"NCCL plan: mode {setup.mode}, NCCL {syntax}"
           + ("" if backend == "nccl" else f"; backend {backend}: requested, not applied")]
    out.append("  job environment (set before the first communicator, kept):")
    out += [f"    {k}={v}" for k, v in setup.process_env.items()] or ["    (none)"]
    for path, text in setup.files.items():
        out.append(f"  file {path}:")
        out += [f"    | {line}" for line in text.rstrip("\n").split("\n")]
    for g in setup.groups:
        head = "world (default group)" if g.name == "world" else f"class {g.name}"
        out.append(f"  group {head}: {describe(g.settings)}")
        if setup.mode == "global" and g.settings.nccl():
            out.append("    env: the job environment above")
        if g.env:
            out.append("    env while its communicator is created, restored after its barrier: "
                       + " ".join(f"{k}={v}" for k, v in g.env.items()))
        if g.options:
            out.append("    options: " + " ".join(f"ProcessGroupNCCL.Options().config.{k}={v}"
                                                  for k, v in g.options.items()))
        out += [f"    file ({what}): {path}" for what, path in g.files.items()]
    out += [f"  warning: {w}" for w in setup.warnings]
    return "\n".join(out) + "\n"


def groups_text(sync: SyncConfig, coll: CollectivesConfig, version=None, backend: str | None = None) -> str:
    """For `dtrain.engine.train --dry-run`: this profile's group settings (NCCL version: the runtime's when CUDA is
    present)."""
    backend = backend or choose_backend(coll)
    version = version if version is not None else nccl_version()
    return render_groups(build_groups(sync, coll, version), backend)


# ---------------------------------------------------------------------------------------------------------------
# Applying them: the job's environment, then one process group per class.


@contextlib.contextmanager
def scoped_env(env: dict[str, str | None]):
    """Set (None: unset) variables for the block, then put back exactly what was there, also on error."""
    saved = {k: os.environ.get(k) for k in env}
    try:
        _set_env(env)
        yield
    finally:
        _set_env(saved)


def _set_env(env: dict[str, str | None]) -> None:
    for k, v in env.items():
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
                    raise UserError(f"'sync.classes.*.{k}': this PyTorch's ProcessGroupNCCL.Options has no "
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
    sync: SyncConfig
    coll: CollectivesConfig
    backend: str
    setup: NcclSetup
    factory: object
    record: dict
    checked: bool = False


_STATE: _State | None = None


def _set_job_env(setup: NcclSetup) -> list[str]:
    """Write the setup's files and set the job's variables; returns warnings about variables it replaces or that
    reach every class."""
    warnings = []
    for path, text in setup.files.items():
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        replace_atomically(path, text)
    if "NCCL_DEBUG_FILE" in setup.process_env:
        Path(setup.process_env["NCCL_DEBUG_FILE"]).parent.mkdir(parents=True, exist_ok=True)
    for k, v in setup.process_env.items():
        if os.environ.get(k) not in (None, v):
            warnings.append(f"{k}={os.environ[k]} in the environment is replaced by the profile's {v}")
        os.environ[k] = v
    if setup.mode != "global":
        warnings += [f"{k}={os.environ[k]} in the environment applies to every class that sets no {k}"
                     for k in ("NCCL_PROTO", "NCCL_ALGO") if k in os.environ]
    return warnings


def apply_global(sync: SyncConfig, coll: CollectivesConfig, backend: str | None = None, version=..., factory=None,
                 log_dir=None) -> dict:
    """Call once per process before `init_process_group`: validates, sets the job's NCCL variables (global mode,
    tuner plugin, debug log), builds the plugin in tuner mode, and arms `class_group`. Returns the run-header record,
    which `run_record()` completes as groups are created. On gloo nothing is set: requested, not applied."""
    global _STATE
    backend = backend or choose_backend(coll)
    applied = backend == "nccl"
    if applied and dist.is_initialized():
        raise RuntimeError("dtrain.collectives.nccl.apply_global must run before init_process_group: the default group's "
                           "communicator would already exist without the job's NCCL variables")
    version = (nccl_version() if applied else None) if version is ... else version
    if applied and coll.parse_log and log_dir is None:
        raise UserError("'collectives.parse_log' needs --run-dir: NCCL's log file is named before the first "
                        "communicator exists, earlier than a run directory is chosen")
    setup = build_groups(sync, coll, version, log_dir)
    if applied and setup.mode == "tuner":
        build_tuner()
    warnings = list(setup.warnings) + (_set_job_env(setup) if applied else [])
    if applied and os.environ.get("RANK", "0") == "0":  # elsewhere the run says in one line that none applies
        for w in warnings:
            print(f"dtrain.collectives.nccl: warning: {w}", file=sys.stderr, flush=True)
    record = {
        "mode": setup.mode, "backend": backend, "applied": applied,
        "status": "applied" if applied else f"requested, not applied (backend {backend})",
        "nccl_version": version_str(version) if version else None,
        "requested": {"default": as_record(coll.default), "classes": requested(sync, coll)},
        "job_env": setup.process_env, "files": sorted(setup.files), "groups": [], "warnings": warnings,
    }
    _STATE = _State(sync, coll, backend, setup, factory or TorchGroups(), record)
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
    bound at init) and through a barrier on it, then restored: NCCL reads them at every communicator init. tuner: the
    same, with the class's name for the plugin. CTA bounds go through the group's options. global, gloo, or no
    `apply_global`: see `attached_group`.
    """
    state = _STATE
    if state is None:
        return attached_group(name, settings, ranks)
    want = resolve(state.sync, state.coll, name, settings)
    mode = state.setup.mode
    g = state.setup.group(name)
    if g is None or g.settings != want:  # a class the setup did not list, or settings the strategy changed
        g = class_group_settings(mode, name, want, state.setup.version, state.setup.process_env.get(RULES_VAR))
    entry = {"class": name, "ranks": ranks, "requested": as_record(want), "env": g.env,
             "options": g.options, "files": g.files}
    if state.backend != "nccl" or mode == "global":
        pg = state.factory.new_group(ranks, {}, f"dtrain:{name}")
        entry["applied"] = "job environment" if state.backend == "nccl" and want.nccl() else False
        state.record["groups"].append(entry)
        return pg
    if nonblocking_init():
        raise UserError(f"'collectives.mode' {mode} needs blocking communicator init: unset {NONBLOCKING_VAR}")
    if not state.checked:  # every rank of a communicator must use the same settings
        digests = state.factory.gather(state.setup.digest())
        if len(set(digests)) > 1:
            raise UserError(f"collectives: the ranks resolved different NCCL settings (plan digests "
                            f"{sorted(set(digests))}): every rank must load the same profile")
        state.checked = True
    if not state.factory.device_bound():
        state.record["warnings"].append(f"{name}: no device bound at init, so the communicator is created by the "
                                        f"barrier below, still inside the class's variables")
    pg = _created(state.factory, name, g, ranks)
    entry["applied"] = True
    state.record["groups"].append(entry)
    return pg


def attached_group(name: str, settings=None, ranks: list[int] | None = None):
    """A class's group where no profile was applied (`attach` from a user's own loop, with no `apply_global`): on
    NCCL the class's own choices (`settings`, as `class_group` takes them) are applied to its communicator as in
    per_group mode, which needs nothing set before `init_process_group`; elsewhere, or with no choice, a plain group."""
    want = class_nccl(settings)
    factory = TorchGroups()
    if not want.nccl() or dist.get_backend() != "nccl":
        return factory.new_group(ranks, {}, f"dtrain:{name}")
    if nonblocking_init():
        raise UserError(f"'sync.classes.{name}' sets NCCL choices ({describe(want)}), which are applied while its "
                        f"communicator is created: unset {NONBLOCKING_VAR}")
    return _created(factory, name, class_group_settings("per_group", name, want, nccl_version(), None), ranks)


def _created(factory, name: str, g: GroupSettings, ranks: list[int] | None):
    """Class `name`'s group, created under its variables and options (`g`): its barrier creates (or finishes
    creating) the communicator while they are set; then they are put back."""
    with scoped_env(g.env):
        pg = factory.new_group(ranks, g.options, f"dtrain:{name}")
        factory.barrier(pg)
    return pg
