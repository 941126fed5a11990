"""Interleaved jobs (`dtrain.analysis.interleave`) read back as the comparison they were run for: each configuration's median
step against a baseline (stock DDP) and against the run without communication, the share of the baseline's
communication overhead it removes, and its step-by-step difference to the baseline.

    python -m dtrain.analysis.paired runs/p8/job1 runs/p8/job2 --baseline ddp-2
    python -m dtrain.analysis.paired runs/p8/job1 runs/p8/job2 --baseline ddp-2 --cpu --rank 1

Every configuration of one job trained the same steps within seconds of each other, so the machine's drift is
shared by the configurations' records of one step and cancels in their difference. The paired difference is the
median of those differences over the (job, step) pairs both have, with its ~95% order-statistics interval
(`dtrain.common.stats.paired_median`). Medians pool every job's steady steps (the warm-up rule of `dtrain.analysis.runs`).

    overhead removed   (baseline - configuration) / (baseline - noop), by pooled medians
    of paired overhead  the paired difference to the baseline over the baseline's paired difference to noop

With `--cpu`, each configuration's CPU time in the step (`dtrain.engine.host_cpu`: the training thread, the backend's
threads, the rest) and the time off the CPU (the step less its CPU time: waiting for the link or the peer, or
runnable while the other processes held the cores), as paired differences to noop, and the median page faults.
Names are the runs' folder names less the prefix they share (the profile's name), e.g. `ddp-2`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import asdict, dataclass, field

from dtrain.analysis.runs import find_runs, steady_records
from dtrain.common import rundir
from dtrain.common.errors import UserError, exit_on_user_error
from dtrain.common.stats import paired_median

PROG = "dtrain.analysis.paired"
PHASES = ("forward_ms", "backward_ms", "comm_exposed_ms", "optimizer_ms")
CPU_GROUPS = ("cpu_main_ms", "cpu_backend_ms", "cpu_other_ms")

Key = tuple[int, int]  # (job index, step)


@dataclass
class Configuration:
    name: str
    steps: dict[Key, dict] = field(default_factory=dict)  # steady step records of every job

    def median(self, key: str = "step_ms", job: int | None = None) -> float | None:
        values = [r[key] for (j, _), r in self.steps.items() if key in r and (job is None or j == job)]
        return statistics.median(values) if values else None


@dataclass
class Row:
    name: str
    median_ms: float
    per_job_ms: list[float | None]
    phases_ms: dict[str, float | None]
    vs_baseline: float | None = None
    overhead_removed: float | None = None  # a fraction
    paired_ms: tuple[float, float, float] | None = None  # configuration - baseline: median, low, high
    of_paired_overhead: float | None = None  # a fraction
    cpu_over_noop_ms: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    minor_faults: float | None = None


def load_jobs(paths: list[str], rank: int = 0, warmup: int | None = None) -> dict[str, Configuration]:
    """Configuration name -> its steady steps in every job (`paths`: one interleaved job's folder each). `rank`:
    whose records (rank 0's steps.jsonl, else steps.rank<r>.jsonl from `train.record_ranks`)."""
    configs: dict[str, Configuration] = {}
    for j, path in enumerate(paths):
        runs = find_runs([path])
        if not runs:
            raise UserError(f"{path}: no runs there (expected an interleaved job's folder of run folders)")
        names = short_names([r.name for r in runs])
        for run in runs:
            c = configs.setdefault(names[run.name], Configuration(names[run.name]))
            c.steps.update({(j, int(r["step"])): r for r in steady_records(_records(run, rank), warmup)})
    return configs


def short_names(run_names: list[str]) -> dict[str, str]:
    """Run folder name -> its name less the prefix every run of the job shares up to a '-' (the profile's name)."""
    prefix = os.path.commonprefix(run_names) if len(run_names) > 1 else ""
    prefix = prefix[:prefix.rfind("-") + 1]
    return {n: n[len(prefix):] or n for n in run_names}


def _records(run, rank: int) -> list[dict]:
    name = rundir.STEPS if rank == 0 else rundir.rank_steps_file(rank)
    if not (run / name).is_file():
        hint = " (recorded with train.record_ranks: true)" if rank else ""
        raise UserError(f"{run}: no {name}{hint}")
    return rundir.read_steps(run, rank)


def _step_ms(r: dict) -> float | None:
    return r.get("step_ms")


def _paired(a: Configuration, b: Configuration, value=_step_ms) -> tuple[float, float, float] | None:
    """value(a's record) - value(b's record) over the (job, step) pairs where both have one; None under 3 pairs."""
    pairs = [(value(a.steps[k]), value(b.steps[k])) for k in sorted(a.steps.keys() & b.steps.keys())]
    pairs = [(x, y) for x, y in pairs if x is not None and y is not None]
    if len(pairs) < 3:
        return None
    return paired_median([x for x, _ in pairs], [y for _, y in pairs])


def _cpu(r: dict) -> float | None:
    """A step's CPU time, every thread group (`dtrain.engine.host_cpu`)."""
    return sum(r[g] for g in CPU_GROUPS) if all(g in r for g in CPU_GROUPS) else None


def _off_cpu(r: dict) -> float | None:
    """A step's time off the CPU: its wall time less its CPU time."""
    cpu = _cpu(r)
    return None if cpu is None else r["step_ms"] - cpu


def compare(configs: dict[str, Configuration], baseline: str, noop: str | None, cpu: bool = False) -> list[Row]:
    """One row per configuration, fastest first."""
    if baseline not in configs:
        raise UserError(f"--baseline {baseline}: no such configuration (there are: {', '.join(sorted(configs))})")
    if noop is not None and noop not in configs:
        raise UserError(f"--noop {noop}: no such configuration (there are: {', '.join(sorted(configs))})")
    base, none = configs[baseline], configs.get(noop) if noop else None
    jobs = 1 + max((j for c in configs.values() for j, _ in c.steps), default=0)
    b_med = base.median()
    n_med = none.median() if none else None
    paired_overhead = _paired(base, none) if none else None
    cpu_values = {"cpu_ms": _cpu, **{g: (lambda r, g=g: r.get(g)) for g in CPU_GROUPS}, "off_cpu_ms": _off_cpu}
    rows = []
    for c in configs.values():
        m = c.median()
        if m is None:
            continue
        row = Row(c.name, m, [c.median(job=j) for j in range(jobs)], {p: c.median(p) for p in PHASES})
        row.vs_baseline = m / b_med if b_med else None
        if n_med is not None and b_med != n_med:
            row.overhead_removed = (b_med - m) / (b_med - n_med)
        if c is not base:
            row.paired_ms = _paired(c, base)
            if row.paired_ms and paired_overhead and paired_overhead[0]:
                row.of_paired_overhead = -row.paired_ms[0] / paired_overhead[0]
        if cpu and none and c is not none:
            for key, value in cpu_values.items():
                d = _paired(c, none, value)
                if d:
                    row.cpu_over_noop_ms[key] = d
        row.minor_faults = c.median("minor_faults")
        rows.append(row)
    return sorted(rows, key=lambda r: r.median_ms)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _interval(d: tuple[float, float, float] | None) -> str:
    return "-" if d is None else f"{d[0]:+.1f} ({d[1]:+.1f} .. {d[2]:+.1f})"


def render(rows: list[Row], baseline: str, noop: str | None, cpu: bool) -> str:
    head = ["configuration", "per job (ms)", "median", "fwd", "bwd", "exposed", "opt", f"vs {baseline}",
            "overhead removed", f"paired vs {baseline} (ms)", "of paired overhead"]
    table = [head]
    for r in rows:
        table.append([r.name, " / ".join(_ms(v) for v in r.per_job_ms), _ms(r.median_ms),
                      *(_ms(r.phases_ms[p]) for p in PHASES),
                      "-" if r.vs_baseline is None else f"{r.vs_baseline:.3f}x",
                      "-" if r.overhead_removed is None else f"{100 * r.overhead_removed:.1f}%",
                      _interval(r.paired_ms),
                      "-" if r.of_paired_overhead is None else f"{100 * r.of_paired_overhead:.0f}%"])
    out = [_align(table)]
    if noop is None:
        out.append("(no --noop configuration: no overhead columns)")
    if cpu:
        head = ["configuration", "CPU over noop (ms)", "training thread", "backend threads", "other threads",
                "off CPU", "minor faults"]
        table = [head] + [[r.name, *(_interval(r.cpu_over_noop_ms.get(k)) for k in ("cpu_ms",) + CPU_GROUPS
                                     + ("off_cpu_ms",)),
                           "-" if r.minor_faults is None else f"{r.minor_faults:.0f}"]
                          for r in rows if r.name != noop]
        out.append(_align(table))
    return "\n\n".join(out)


def _align(table: list[list[str]]) -> str:
    width = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return "\n".join("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, width))).rstrip()
                     for row in table)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description="Compare the configurations of interleaved jobs step by "
                                 "step: against a baseline and the run without communication.")
    ap.add_argument("jobs", nargs="+", help="interleaved jobs' folders (dtrain.analysis.interleave --out)")
    ap.add_argument("--baseline", default="ddp-2", help="the configuration compared against (default ddp-2)")
    ap.add_argument("--noop", default="noop", help="the configuration without communication (default noop; "
                                                   "'none': no overhead columns)")
    ap.add_argument("--rank", type=int, default=0, help="whose step records (default 0; others need "
                                                         "train.record_ranks)")
    ap.add_argument("--warmup", type=int, help="first steps left out (default: the warm-up rule of dtrain.analysis.runs)")
    ap.add_argument("--cpu", action="store_true", help="also CPU time by thread group and off-CPU time over noop")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    with exit_on_user_error(PROG):
        if args.rank < 0:
            raise UserError(f"--rank must be 0 or more, got {args.rank}")
        noop = None if args.noop == "none" else args.noop
        configs = load_jobs(args.jobs, args.rank, args.warmup)
        rows = compare(configs, args.baseline, noop, args.cpu)
        if args.json:
            print(json.dumps({"jobs": args.jobs, "baseline": args.baseline, "noop": noop, "rank": args.rank,
                              "rows": [asdict(r) for r in rows]}, indent=1))
        else:
            print(f"{len(args.jobs)} job(s), rank {args.rank}; steady steps pooled; paired over the same "
                  "(job, step)")
            print(render(rows, args.baseline, noop, args.cpu))
    return 0


if __name__ == "__main__":
    sys.exit(main())
