"""The same all-reduces launched at once over three layouts of process groups: all on one group, one group per
tensor class (as `per_class` runs them, two of them with two collectives), and one group each; the time until all
are done, the median over rounds that alternate the layouts.

The default sizes are the buckets per_class@8 MiB still has in flight when backward ends on the multi30k-cpu
profile (ffn 8 MiB and 4 MiB, projection 8 MiB and 1 MiB, norm_bias 96 KiB, embedding 7.8 MiB).

    python -m dtrain.analysis.testbed run --nodes 2 --nproc-per-node 1 -- benchmarks/group_layouts.py [--rounds 9]

As training launches them: `--offsets 0,18,32,33,36` (ms after the first launch, per_class@8's in one step), the
rank multiplying matrices until all are done, and `--idle-ms 600` before each round (a step's idle connections).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from dtrain.collectives.bench.groups import all_reduce_together

BUCKETS = [("projection", 8388608), ("ffn", 4194304), ("projection", 1048576), ("norm_bias", 98304),
           ("embedding", 8192000)]  # (class, bytes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--offsets", help="ms after the first launch, one per bucket (default: all at once, ranks idle)")
    ap.add_argument("--idle-ms", type=float, default=0.0, help="sleep before each round")
    args = ap.parse_args()
    offsets = [float(x) / 1e3 for x in args.offsets.split(",")] if args.offsets else None
    if offsets is not None and len(offsets) != len(BUCKETS):
        ap.error(f"--offsets needs {len(BUCKETS)} values, one per bucket")
    compute = torch.randn(256, 256) if offsets is not None else None
    dist.init_process_group("gloo")
    ranks = list(range(dist.get_world_size()))
    one = dist.new_group(ranks)
    by_class = {c: dist.new_group(ranks) for c in dict.fromkeys(c for c, _ in BUCKETS)}
    each = [dist.new_group(ranks) for _ in BUCKETS]
    tensors = [torch.zeros(n // 4) for _, n in BUCKETS]
    layouts = {"one group": [one] * len(BUCKETS), "a group per class": [by_class[c] for c, _ in BUCKETS],
               "a group each": each}
    for groups in layouts.values():  # every group's connections set up first
        all_reduce_together(tensors, groups)
    times = {name: [] for name in layouts}
    for _ in range(args.rounds):
        for name, groups in layouts.items():
            dist.barrier()
            time.sleep(args.idle_ms / 1e3)
            times[name].append(all_reduce_together(tensors, groups, compute, offsets))
    if dist.get_rank() == 0:
        total = sum(n for _, n in BUCKETS)
        for name, t in times.items():
            m = statistics.median(t)
            print(f"{name:18s} {m * 1e3:8.1f} ms  {total / 1e6 / m:6.1f} MB/s")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
