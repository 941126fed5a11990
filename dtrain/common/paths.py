"""Where dtrain keeps things outside a run directory: the user cache (corpora, BPE models, token caches, the NCCL
tuner plugin it builds) and the profiles shipped inside the package, which a command may name without a path
(`--profile smoke` for `dtrain/profiles/smoke.yaml`).
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

from dtrain.common.errors import UserError

PROFILES = Path(__file__).resolve().parents[1] / "profiles"  # package data: dtrain/profiles/**.yaml


def cache_root(cache_dir: str | None = None) -> Path:
    """`cache_dir` if given, else $XDG_CACHE_HOME/dtrain, else ~/.cache/dtrain: writable wherever dtrain is
    installed, unlike the package's own folder."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dtrain"


def shipped_profiles() -> list[str]:
    """The names of the shipped profiles, as `resolve_profile` takes them (`smoke`, `sweeps/smoke`, ...)."""
    return sorted(str(p.relative_to(PROFILES).with_suffix("")) for p in PROFILES.rglob("*.yaml"))


def resolve_profile(name: str | Path, what: str = "profile") -> Path:
    """A profile's file (or a sweep matrix's, a testbed profile's: `what`): `name` itself where it is a file, else
    the shipped one of that name, with or without `.yaml` and `profiles/` (`smoke`, `sweeps/smoke.yaml`,
    `profiles/ll128.yaml`): a file of that path under the working directory wins. A name that is neither is
    a one-line error listing the shipped profiles and the nearest of them."""
    path = Path(name)
    if path.is_file():
        return path
    # `dtrain/profiles/x.yaml` from another folder than the checkout's; `profiles/x.yaml`, the README's form (the
    # profile's place inside the package), as older runs also recorded it
    rel = path
    for prefix in (("dtrain", "profiles"), ("profiles",)):
        if path.parts[:len(prefix)] == prefix:
            rel = Path(*path.parts[len(prefix):])
            break
    for candidate in (PROFILES / rel, PROFILES / rel.with_name(rel.name + ".yaml")):
        if not rel.is_absolute() and candidate.is_file():
            return candidate
    known = shipped_profiles()
    near = difflib.get_close_matches(str(rel.with_suffix("") if rel.suffix == ".yaml" else rel), known, n=1)
    hint = f"; did you mean '{near[0]}'?" if near else ""
    folders = sorted({k.split("/")[0] + "/..." for k in known if "/" in k})
    shown = ", ".join([k for k in known if "/" not in k] + folders)
    raise UserError(f"{name}: {what} not found: neither a file nor one shipped with dtrain ({shown}){hint}")
