"""NCCL's version: the one PyTorch runs with, a `--nccl-version` given on the command line, and what depends on it."""

from __future__ import annotations

import re

import torch

from dtrain.common.errors import UserError


def nccl_version() -> tuple[int, int, int] | None:
    """The NCCL PyTorch runs with (behaviour differs between versions, so it is read at run time), or None without
    CUDA."""
    if not torch.cuda.is_available():
        return None
    try:
        v = torch.cuda.nccl.version()
    except Exception:  # a build without NCCL
        return None
    if isinstance(v, int):  # NCCL_VERSION_CODE: major * 10000 + minor * 100 + patch (2.9 onwards)
        v = (v // 10000, v // 100 % 100, v % 100)
    return tuple(v[:3])


def parse_version(text: str | None) -> tuple[int, int, int] | None:
    if text is None:
        return None
    m = re.fullmatch(r"(\d+)\.(\d+)(?:\.(\d+))?", text.strip())
    if not m:
        raise UserError(f"--nccl-version '{text}': expected MAJOR.MINOR[.PATCH], e.g. 2.21.5")
    return int(m[1]), int(m[2]), int(m[3] or 0)


def version_str(v) -> str:
    return ".".join(map(str, v)) if v else "unknown"


def per_collective_syntax(version) -> bool:
    """`allreduce:LL128` in NCCL_PROTO/NCCL_ALGO is understood from NCCL 2.24 on (NCCL_PROTO and NCCL_ALGO in NCCL's
    environment-variable documentation); an unknown version: render for a current NCCL."""
    return version is None or version >= (2, 24, 0)
