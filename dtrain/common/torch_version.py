"""The PyTorch release dtrain needs, and the gate of each feature that needs a later one.

`FLOOR` is pyproject's `torch>=` (tests/test_torch_floor.py holds the two equal): the newest of the releases that
introduced an API the normal paths call (`NORMAL_PATH`: the trainer, and every strategy under its default keys).
A feature that needs a later release calls `require_torch(version, feature)` where it is built (`GATED` lists
them), so that an older torch stops there with one line naming the release, not with a TypeError or an
AttributeError from inside torch. Each release below is the first whose wheel (its Python sources) has the API;
the pull request that added it is named beside it (github.com/pytorch/pytorch).

torch is imported where a version is read, not with this module: `dtrain.common` is the leaf every tool imports.
"""

from __future__ import annotations

import re

from dtrain.common.errors import UserError

# pyproject.toml's `torch>=` (tests/test_torch_floor.py checks the two agree)
FLOOR = "2.8"

# What the normal paths call, with the release that introduced it: FLOOR is the newest of these.
NORMAL_PATH: dict[str, str] = {
    # GradSync.grad_norm (dtrain.collectives.sync.total_norm), every step of the trainer (#139662)
    "torch.nn.utils.get_total_norm": "2.6",
    # the trainer's `optim.clip_norm`, dtrain.collectives.wrap's clip_grad_norm_ (#139662)
    "torch.nn.utils.clip_grads_with_norm_": "2.6",
    # fsdp2: FSDP2 public under torch.distributed.fsdp, with its MixedPrecisionPolicy (2.5: under _composable)
    "torch.distributed.fsdp.MixedPrecisionPolicy": "2.6",
    # fsdp2: the root's fully_shard, always given the (maybe empty) set of the split's parameters (#146631)
    "fully_shard(..., ignored_params=...)": "2.7",
    # fsdp2 resuming (local_optimizer_state): each rank cuts its own shard of the whole state (#143883)
    "distribute_tensor(..., src_data_rank=None)": "2.7",
    # fsdp2's wait_params, before every validation and checkpoint (#149103)
    "FSDPModule.set_reshard_after_forward(..., recurse=False)": "2.8",
}

# Features that need a later release than FLOOR: feature (as require_torch names it) -> the release.
GATED: dict[str, str] = {
    # async, p2p: FSDPModule.set_custom_all_gather / set_custom_reduce_scatter (#155189)
    "sync.fsdp2_collectives": "2.9",
    # under ddp and powersgd: DistributedDataParallel(bucket_cap_mb_list=[first, cap])
    "sync.first_bucket_mb": "2.11",
}

_RELEASE = re.compile(r"(\d+)\.(\d+)")


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string: '2.13.0+cpu', '2.9.0a0+git1234', '2.10.0.dev20250101',
    '2.8.0rc1' and '2.8' alike. A pre-release counts as its release (a nightly of 2.9 has 2.9's APIs, or most)."""
    m = _RELEASE.match(str(version).strip())
    if not m:
        raise ValueError(f"not a torch version: {version!r}")
    return int(m.group(1)), int(m.group(2))


def running() -> str:
    """The running torch's version string (`torch.__version__`)."""
    import torch

    return str(torch.__version__)


def at_least(version: str) -> bool:
    """Whether the running torch is release `version` ('2.9') or later."""
    return release(running()) >= release(version)


def require_torch(version: str, feature: str) -> None:
    """A one-line `UserError` unless the running torch is release `version` or later: `feature` (the key or
    option that asks for it, e.g. 'sync.fsdp2_collectives') needs it."""
    if not at_least(version):
        raise UserError(f"{feature} needs torch >= {version} (this is {running()})")
