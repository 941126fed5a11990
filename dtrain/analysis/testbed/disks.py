"""The testbed's private disks (`dtrain.analysis.testbed run --private-fs`): which paths a node other than node 0 sees on a
disk of its own, and the bind mounts that give it them, so that a multi-node job sees what it would see on separate
machines.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from dtrain.common.errors import UserError
from dtrain.common.paths import cache_root


def private_paths(extra: list[str] = ()) -> list[Path]:
    """What `run --private-fs` makes node-local: the default run directories (`runs/` under the working directory),
    dtrain's cache (BPE models, a downloaded corpus), /tmp, and any `--private-path`. The repository and the data
    folders stay visible: code and data may be on every node. A path that holds the working directory or this
    Python (a checkout or a virtual environment under /tmp) is left shared: covered, the nodes could not run."""
    code = [Path.cwd().absolute(), Path(sys.prefix).absolute(), Path(sys.executable).absolute().parent]
    paths = [Path(p).absolute() for p in (Path.cwd() / "runs", cache_root(), "/tmp", *extra)]
    return [p for p in paths if not any(p == c or p in c.parents for c in code)]


def private_mounts(disk: Path, targets: list[Path]) -> list[tuple[Path, Path]]:
    """(source, target) bind mounts that give a node its own copy of each target: disk/target over target.

    A target inside another is already private with it and is left out. A target holding the node's disk (/tmp holds
    /tmp/<prefix>-node<i>) is mounted last: once it is covered, the other sources are no longer reachable by path."""
    targets = [Path(os.path.normpath(t)) for t in targets]
    if any(t == Path("/") for t in targets):
        raise UserError("--private-path /: the whole filesystem cannot be node-local (the code and data must stay)")
    kept = []
    for t in targets:
        if t not in kept and not any(o != t and o in t.parents for o in targets):
            kept.append(t)
    kept.sort(key=lambda t: t in disk.parents)  # stable: the order given, ancestors of the disk last
    return [(disk / t.relative_to("/"), t) for t in kept]


def prepare_disk(mounts: list[tuple[Path, Path]]) -> None:
    """Create the mount points on the host (empty folders, if missing) and the node's empty private folders."""
    for source, target in mounts:
        target.mkdir(parents=True, exist_ok=True)
        source.mkdir(parents=True, exist_ok=True)
        if target == Path("/tmp"):
            source.chmod(0o1777)  # like /tmp: anyone may create, only the owner may delete
