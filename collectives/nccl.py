"""Per-tensor-class process groups, and (to come) the NCCL protocol/algorithm settings applied to them.

`class_group` is the one place that creates a tensor class's process group; strategies call it, in the same order
on every rank. On gloo it is a plain group; on NCCL it will carry the class's settings (see nccl-facts.md §1).
"""

from __future__ import annotations

import torch.distributed as dist


def class_group(name: str, settings: dict | None = None, ranks: list[int] | None = None) -> dist.ProcessGroup:
    """A new process group serving tensor class `name` (collective call: every rank, same order)."""
    return dist.new_group(ranks=ranks)


PROTOCOLS = ("LL", "LL128", "Simple")
ALGORITHMS = ("Tree", "Ring", "CollNetDirect", "CollNetChain", "NVLS", "NVLSTree", "PAT")
MODES = ("global", "per_group", "tuner")


def validate_config(cfg, check) -> None:
    """Check the profile's `collectives` section; `check(ok, dotted_path, message)` raises the config error."""
    check(cfg.mode in MODES, "collectives.mode", f"must be one of {', '.join(MODES)}, got '{cfg.mode}'")
    for path, s in [("collectives.default", cfg.default)] + [
        (f"collectives.classes.{name}", s) for name, s in cfg.classes.items()
    ]:
        check(s.proto is None or s.proto in PROTOCOLS, f"{path}.proto",
              f"unknown protocol '{s.proto}' (NCCL's: {', '.join(PROTOCOLS)})")
        check(s.algo is None or s.algo in ALGORITHMS, f"{path}.algo",
              f"unknown algorithm '{s.algo}' (NCCL's: {', '.join(ALGORITHMS)})")
        for bound in ("min_ctas", "max_ctas"):
            v = getattr(s, bound)
            check(v is None or v > 0, f"{path}.{bound}", f"must be positive or null, got {v}")
        check(s.min_ctas is None or s.max_ctas is None or s.min_ctas <= s.max_ctas, f"{path}.min_ctas",
              f"cannot exceed {path}.max_ctas")
