"""The communication library's part of a profile: validation of its sections, and loading them on their own.

`dtrain.engine.config` validates a whole profile and calls `validate` for `sync` and `collectives`. The library's own
command-line tools (the benchmark, the NCCL tools) call `load`, which reads just those sections of a profile with the
same strict loader and the same file:line errors, and returns them as the pair `(sync, collectives)` that the NCCL
functions take; the engine's sections are left to the engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from dtrain.collectives import hooks
from dtrain.collectives.nccl.settings import validate_config
from dtrain.collectives.settings import CollectivesConfig, SyncConfig
from dtrain.collectives.strategies import available, get, unused_keys
from dtrain.collectives.tensor_classes import config_problems
from dtrain.common.errors import UserError
from dtrain.common.schema import Source, apply_overrides, build, read_overlay


def validate(sync: SyncConfig, coll: CollectivesConfig, check: Callable[[bool, str, str], None]) -> None:
    """`check(ok, dotted_key, message)` for every rule of the two sections (the caller adds file and line)."""
    check(coll.backend in ("auto", "gloo", "nccl"), "collectives.backend",
          f"must be auto, gloo or nccl, got '{coll.backend}'")
    check(coll.timeout_s > 0, "collectives.timeout_s", "must be positive")
    s = sync
    check(s.bucket_cap_mb is None or s.bucket_cap_mb > 0, "sync.bucket_cap_mb",
          f"must be positive or null, got {s.bucket_cap_mb}")
    for key in ("first_bucket_mb", "last_bucket_mb"):
        value = getattr(s, key)
        check(value is None or value > 0, f"sync.{key}", f"must be positive or null, got {value}")
    check(s.ranks_per_node is None or s.ranks_per_node > 0, "sync.ranks_per_node",
          f"must be positive or null, got {s.ranks_per_node}")
    check(s.powersgd_rank > 0, "sync.powersgd_rank", f"must be positive, got {s.powersgd_rank}")
    check(s.powersgd_start_iter >= 2, "sync.powersgd_start_iter",
          f"must be at least 2 (DDP rebuilds its buckets after iteration 1), got {s.powersgd_start_iter}")
    check(s.gather_dtype in (None, "bf16"), "sync.gather_dtype", f"must be bf16 or null, got '{s.gather_dtype}'")
    t = s.tune
    for key, ok, need in (("budget_steps", t.budget_steps > 0, "positive"), ("top_k", t.top_k > 0, "positive"),
                          ("probe_steps", t.probe_steps > 0, "positive"),
                          ("warmup_rounds", t.warmup_rounds >= 0, "0 or more"),
                          ("min_rounds", t.min_rounds >= 2, "at least 2 (a paired difference needs two rounds)"),
                          ("loss_tolerance", t.loss_tolerance >= 0, "0 or more"),
                          ("retune_drift", t.retune_drift is None or t.retune_drift > 0, "positive or null"),
                          ("retune_window", t.retune_window >= 3, "at least 3")):
        check(ok, f"sync.tune.{key}", f"must be {need}, got {getattr(t, key)}")
    for path, msg in config_problems(s):
        check(False, path, msg)
    # Strategy names are checked against the registry at attach time, and here early.
    check(s.strategy in available(), "sync.strategy",
          f"unknown strategy '{s.strategy}' (available: {', '.join(available())})")
    for path, msg in get(s.strategy).problems(s) if s.strategy in available() else []:  # its own keys' values
        check(False, path, msg)
    reads_hook = s.strategy in available() and "hook" in get(s.strategy).sync_keys
    if reads_hook:  # a name torch does not ship, a missing option, an option the hook's state does not take
        for path, msg in hooks.hook_problems(s):
            check(False, path, msg)
    for path, msg in unused_keys(s):  # a knob the strategy ignores would silently change nothing
        # ddp with the per-class hook reads the classes' wire dtypes and NCCL settings, as per_class does
        hook_reads = reads_hook and hooks.hook_name(s.hook) == hooks.PER_CLASS and any(
            path.startswith("sync.classes.") and path.endswith("." + k.split(".")[1]) for k in hooks.PER_CLASS_KEYS)
        check(hook_reads, path, msg)
    validate_config(coll, s, check)  # collectives.* and the NCCL keys of sync.classes


def refuse_moved(raw: dict, src: Source) -> None:
    """A profile's `dist` section, whose keys are `collectives`' now: one line saying where they went."""
    if "dist" in raw:
        raise UserError(f"{src.where('dist')}: 'dist' is part of 'collectives' now: write collectives.backend and "
                        "collectives.timeout_s")


def from_dict(raw: dict, source: str | Source = "<dict>",
              lines: dict[str, int] | None = None) -> tuple[SyncConfig, CollectivesConfig]:
    """The library's sections of a profile's raw mapping, `(sync, collectives)`; the other sections are not read."""
    src = source if isinstance(source, Source) else Source(source, lines)
    refuse_moved(raw, src)
    sync = build(SyncConfig, raw.get("sync", {}), "sync", src)
    coll = build(CollectivesConfig, raw.get("collectives", {}), "collectives", src)

    def check(ok: bool, path: str, msg: str) -> None:
        if not ok:
            raise UserError(f"{src.where(path)}: '{path}' {msg}")

    validate(sync, coll, check)
    return sync, coll


def load(path: str | Path, overrides: list[str] = ()) -> tuple[SyncConfig, CollectivesConfig]:
    """`(sync, collectives)` of a profile (with its includes), with `--set` overrides of those sections."""
    raw, src = read_overlay(path)
    return from_dict(raw, apply_overrides(raw, src, overrides))
