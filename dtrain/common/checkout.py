"""The git commit a folder is checked out at: which code a run ran, for its run.json (`dtrain.engine.log`).

Asked of git itself (`git rev-parse HEAD`, `git status --porcelain`), quietly, and never an error: a folder outside
a checkout, or a machine without git, simply has no commit to record.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

GIT_TIMEOUT_S = 10  # a checkout on a hung network disk must not hold up a run's start


def _git(folder: Path, *args: str) -> str | None:
    """git's standard output, or None where git is missing, fails or takes too long."""
    try:
        # --no-optional-locks: `status` then leaves the index alone (git-status(1), "BACKGROUND REFRESH"), so a
        # run starting never competes with a person's git command in the same checkout.
        r = subprocess.run(["git", "--no-optional-locks", *args], cwd=folder, stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, timeout=GIT_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout if r.returncode == 0 else None


def git_commit(folder: Path) -> dict:
    """{"commit": the checkout's HEAD} for a `folder` whose files git tracks, with "dirty": True where `git status
    --porcelain` lists changes (tracked or untracked) anywhere in the checkout; {} otherwise."""
    folder = Path(folder)
    if not folder.is_dir():
        return {}
    # Tracked, not merely inside some repository: a copy installed into a virtual environment that lies (ignored)
    # inside another project's checkout is not that project's code.
    if _git(folder, "ls-files", "--error-unmatch", "--", ".") is None:
        return {}
    head = (_git(folder, "rev-parse", "--verify", "HEAD") or "").strip()
    if not head:  # a repository without a commit yet
        return {}
    status = _git(folder, "status", "--porcelain")
    return {"commit": head} | ({"dirty": True} if status else {})
