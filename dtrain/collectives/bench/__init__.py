"""all_reduce_perf, reduce_scatter_perf and all_gather_perf for torch.distributed: a sweep of sizes in nccl-tests'
flags and table format.

Measures the raw path (`dist.all_reduce`, `dist.reduce_scatter_single`, `dist.all_gather_single`) and, for all-reduce,
the project's reducer path side by side, over the default group or a tensor class's group, under torchrun on loopback
or across the emulated cluster of `dtrain.analysis.testbed`.

    torchrun --nproc_per_node=2 -m dtrain.collectives.bench -b 8 -e 64M -f 4
    torchrun --nproc_per_node=2 -m dtrain.collectives.bench -b 1M -e 256M -d bfloat16 --class ffn --json bench.json
    torchrun --nproc_per_node=2 -m dtrain.collectives.bench -b 1K -e 64M --collective reduce_scatter,all_gather
    python -m dtrain.analysis.testbed run --nodes 2 --nproc-per-node 1 -- -m dtrain.collectives.bench -b 8 -e 256M

    collectives  the collectives (all_reduce, reduce_scatter, all_gather): nccl-tests' size and count of each
    paths        the paths measured (raw, reducer), the data types and ops by nccl-tests' names
    correctness  the correctness pass (`#wrong`)
    measure      one measurement (`Row`), timed as nccl-tests times it
    overlap      `--overlap`: the computation an all-reduce takes from a backward it overlaps (CPU)
    output       nccl-tests' table column for column, the project's columns as comments, JSON / CSV
    cli          the command line and the sweep (`python -m dtrain.collectives.bench --help`)
"""

from dtrain.collectives.bench.cli import PROG, class_group_for, main, parse_args, parse_dtypes, parse_ops, sweep_sizes
from dtrain.collectives.bench.collectives import (ALL_GATHER, ALL_REDUCE, COLLECTIVES, NO_OP, REDUCE_SCATTER, Collective,
                                          parse_collectives)
from dtrain.collectives.bench.correctness import PERIOD, check, count_wrong, expected_period, fill, pattern
from dtrain.collectives.bench.measure import Row, bandwidths, measure
from dtrain.collectives.bench.output import (FIELDS, extra_line, extra_lines, footer, header, line, ratio_lines, to_csv,
                                     to_json, write_out)
from dtrain.collectives.bench.overlap import measure_overlap, overlap_cost
from dtrain.collectives.bench.paths import (ALIASES, DTYPES, OPS, BenchPath, bench_paths, raw_all_gather, raw_path,
                                    raw_reduce_scatter, reducer_path, run_bound)

__all__ = ["PROG", "class_group_for", "main", "parse_args", "parse_dtypes", "parse_ops", "sweep_sizes", "ALL_GATHER",
           "ALL_REDUCE", "COLLECTIVES", "NO_OP", "REDUCE_SCATTER", "Collective", "parse_collectives", "PERIOD",
           "check", "count_wrong", "expected_period", "fill", "pattern", "Row", "bandwidths", "measure", "FIELDS",
           "extra_line", "extra_lines", "footer", "header", "line", "ratio_lines", "to_csv", "to_json", "write_out",
           "measure_overlap", "overlap_cost", "ALIASES", "DTYPES", "OPS", "BenchPath", "bench_paths", "raw_all_gather",
           "raw_path", "raw_reduce_scatter", "reducer_path", "run_bound"]
