"""The one-GPU check: two NCCL ranks on one GPU, per_group then tuner mode, each checked with the log parser.

NCCL refuses two ranks of a communicator on one GPU of one host, but the host is identified by a hash that
NCCL_HOSTID overrides (NCCL's environment-variable documentation): with a host id per rank, NCCL treats them as two
hosts and carries their traffic over its socket transport, so algorithm and protocol selection, the debug log,
per-communicator settings and the tuner plugin behave as on two nodes.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dtrain.collectives.config import from_dict
from dtrain.collectives.nccl.check import check_decisions, render_check
from dtrain.collectives.nccl.classes import resolve
from dtrain.collectives.nccl.groups import apply_global, class_group
from dtrain.collectives.nccl.log import read_logs
from dtrain.collectives.nccl.versions import nccl_version, version_str
from dtrain.common.errors import UserError

GPU_CHECK_BUCKETS = {"projection": 65536, "embedding": 8 << 20}  # distinct sizes: TUNING lines name no communicator


def gpu_check_config(mode: str):
    """The library's sections of the check's profile, `(sync, collectives)`: projection on LL, embedding on Simple,
    both Ring."""
    return from_dict({"sync": {"strategy": "per_class", "classes": {
        "projection": {"protocol": "LL", "algorithm": "Ring"},
        "embedding": {"protocol": "Simple", "algorithm": "Ring"}}},
        "collectives": {"mode": mode, "parse_log": True}}, f"gpu-check-{mode}")


def _rank(rank: int, mode: str, out_dir: str, port: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      NCCL_HOSTID=f"rank{rank}", NCCL_SOCKET_IFNAME="lo", NCCL_IB_DISABLE="1")
    apply_global(*gpu_check_config(mode), backend="nccl", log_dir=Path(out_dir) / mode)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=device)  # bound: groups created eagerly
    try:
        groups = {name: class_group(name) for name in GPU_CHECK_BUCKETS}
        for _ in range(3):
            for name, nbytes in GPU_CHECK_BUCKETS.items():
                t = torch.full((nbytes // 4,), float(rank + 1), device=device)
                dist.all_reduce(t, group=groups[name])
                if not bool((t == 3.0).all()):  # the forced choice must also be correct (the #wrong check)
                    raise RuntimeError(f"{mode}/{name}: wrong all-reduce result")
        torch.cuda.synchronize()
    finally:
        dist.destroy_process_group()


def gpu_check(out_dir: str | Path) -> int:
    """Run both modes, parse their logs, print and write the parse-log tables; 1 when a bucket is off its choice."""
    if not torch.cuda.is_available():
        raise UserError("gpu-check needs a CUDA GPU, and none is visible here")
    out, status = Path(out_dir), 0
    for mode in ("per_group", "tuner"):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        mp.spawn(_rank, args=(mode, str(out), port), nprocs=2, join=True)
        decisions, envs = read_logs(sorted((out / mode).glob("nccl.*.log")))
        buckets = [{"index": i, "class": n, "nbytes": b} for i, (n, b) in enumerate(GPU_CHECK_BUCKETS.items())]
        sync, coll = gpu_check_config(mode)
        table, mismatches = check_decisions(decisions, buckets, {n: resolve(sync, coll, n) for n in GPU_CHECK_BUCKETS})
        text = f"== {mode} (NCCL {version_str(nccl_version())}) ==\n" + render_check(table, mismatches, envs)
        (out / mode / "parse-log.txt").write_text(text)
        print(text, flush=True)
        status = max(status, 1 if mismatches else 0)
    return status
