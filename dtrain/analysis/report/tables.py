"""The report's tables: each figure's data, reduced from the runs' records (and benchmark rows) to one frame.

`dtrain.analysis.report.sections` captions and draws them; every frame is also written beside its figure as CSV. Timings
are over each run's steady steps (`dtrain.analysis.runs`' warm-up rule) unless a table says otherwise.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from dtrain.analysis.runs import PHASES, Run, typical_step
from dtrain.collectives import costmodel as cm
from dtrain.collectives.costmodel.loading import is_fit_spec
from dtrain.common.errors import UserError


def _pct(values: pd.Series, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


def load_bench(path: str | Path) -> pd.DataFrame:
    """Rows of a `dtrain.collectives.bench` JSON/CSV (or an nccl-tests log): size (B), time_us, algbw, busbw (GB/s), label
    (the code path, raw or reducer, when both were measured). Rows that failed the correctness pass are left out."""
    ms = cm.read_measurements(path)
    df = pd.DataFrame([vars(m) for m in ms.rows])
    df["source"] = str(path)
    df["ranks"] = ms.ranks
    return df


def summary_table(runs: list[Run], warmup: int | None) -> pd.DataFrame:
    """One row per run: what it was and its median / p95 step, its exposed communication and its quality."""
    rows = []
    for r in runs:
        m = r.steady_frame(warmup)
        bleu = r.bleu
        val = r.val
        rows.append({
            "run": r.label, "series": r.series, "strategy": r.strategy, "bucket_cap_mb": r.bucket_cap_mb,
            "headroom": not r.communicates, "steps": len(r.steps), "measured_steps": len(m),
            "median_ms": float(m["step_ms"].median()) if len(m) else np.nan,
            "p95_ms": _pct(m["step_ms"], 95) if len(m) else np.nan,
            "exposed_ms": float(m["comm_exposed_ms"].median()) if len(m) and "comm_exposed_ms" in m else np.nan,
            "train_s": float(r.step_frame["step_ms"].sum() / 1000) if len(r.steps) else np.nan,
            "val_nll": float(val["val_nll"].iloc[-1]) if len(val) else np.nan,
            "bleu": bleu.get("bleu") if bleu and r.communicates else np.nan,
            "failed": r.launch.get("exit_code") not in (None, 0),
        })
    return pd.DataFrame(rows)


def step_vs_bucket_table(summary: pd.DataFrame) -> pd.DataFrame:
    """The summary grouped by (series, bucket cap): repeated runs of one configuration pooled by their medians."""
    s = summary.dropna(subset=["median_ms"])
    if s.empty:
        return s
    key = s["bucket_cap_mb"].fillna(-1.0)  # groupby drops NaN keys; -1 stands for "no cap" and is undone below
    g = s.assign(cap_key=key).groupby(["series", "cap_key", "headroom"], as_index=False).agg(
        strategy=("strategy", "first"), median_ms=("median_ms", "median"), p95_ms=("p95_ms", "median"),
        runs=("run", "count"))
    g["bucket_cap_mb"] = g["cap_key"].where(g["cap_key"] >= 0)
    return g.drop(columns="cap_key")[["series", "strategy", "bucket_cap_mb", "headroom", "median_ms", "p95_ms",
                                      "runs"]]


def breakdown_table(runs: list[Run], warmup: int | None) -> pd.DataFrame:
    """Mean of each phase per run: means add up (medians do not: the median step is not the sum of the phases'
    medians), so 'other' is the time a step spends outside the timed phases (loss readback, zero_grad)."""
    rows = []
    for r in runs:
        m = r.steady_frame(warmup)
        if m.empty or not all(p in m for p in PHASES):
            continue
        row = {"label": r.label, "headroom": not r.communicates, **{p: float(m[p].mean()) for p in PHASES}}
        row["step_ms"] = float(m["step_ms"].mean())
        row["other_ms"] = max(0.0, row["step_ms"] - sum(row[p] for p in PHASES))
        rows.append(row)
    return pd.DataFrame(rows)


def pick_timeline_run(runs: list[Run], wanted: str | None) -> Run | None:
    """The named run, else the first with per-bucket timestamps, preferring per_class (the classes show)."""
    if wanted:
        for r in runs:
            if wanted in (r.label, r.path.name, str(r.path)):
                return r
        raise UserError(f"--timeline '{wanted}': no such run among the inputs")
    timed = [r for r in runs if r.steps  # and step records to pick from
             and any(b.get("launch_ms") is not None for recs in r.buckets.values() for b in recs)]
    order = {"per_class": 0, "bucketed": 1}
    return min(timed, key=lambda r: order.get(r.strategy, 2), default=None)


def timeline_table(run: Run, warmup: int | None, step: int | None = None
                   ) -> tuple[pd.DataFrame, int, float | None]:
    """The buckets of one step (by default the most typical steady step with bucket timings, `typical_step`) and
    when its backward ended: wait() marks it, else the backward time of one micro-batch."""
    if not run.steps:
        raise UserError(f"{run.path}: no step records (steps.jsonl) to pick a step from")
    if step is None:
        timed = {s for s, recs in run.buckets.items() if any(r.get("launch_ms") is not None for r in recs)}
        pool = [s for s in run.steady(warmup) if s["step"] in timed] or [s for s in run.steps if s["step"] in timed]
        if not pool:
            raise UserError(f"{run.path}: no step has bucket launch and completion times to draw (noop, or DDP "
                            "without a comm hook, records none)")
        step = int(typical_step(run, pool)["step"])
    b = run.bucket_frame[run.bucket_frame["step"] == step].sort_values("bucket")
    cols = ["bucket", "class", "bytes", "ready_ms", "launch_ms", "complete_ms", "wait_start_ms", "wait_ms", "part"]
    b = b.reindex(columns=cols).reset_index(drop=True)
    if b["part"].isna().all():
        b = b.drop(columns="part")  # whole buckets only: no parts to name
    end = b["wait_start_ms"].dropna()
    if len(end):
        backward_end = float(end.iloc[0])
    else:
        s = run.step_frame[run.step_frame["step"] == step]
        accum = (run.config.get("train") or {}).get("accum_steps", 1) or 1
        backward_end = float(s["backward_ms"].iloc[0]) / accum if len(s) else None
    return b, step, backward_end


def pareto_front(x: pd.Series, y: pd.Series) -> pd.Series:
    """True where no other point is at least as fast (lower x) and at least as good (higher y), one strictly."""
    on = []
    for i in x.index:
        dominated = any((x[j] <= x[i] and y[j] >= y[i]) and (x[j] < x[i] or y[j] > y[i]) for j in x.index if j != i)
        on.append(not dominated)
    return pd.Series(on, index=x.index, dtype=bool)


def time_to_target(run: Run, target: float) -> float:
    """Seconds of training (the sum of step times, validation and checkpoints left out) until the first
    validation at or below `target` nats per token; NaN if never."""
    val = run.val
    hit = val[val["val_nll"] <= target]
    if hit.empty or not run.steps:
        return float("nan")
    step = int(hit["step"].iloc[0])
    steps = run.step_frame
    return float(steps.loc[steps["step"] <= step, "step_ms"].sum() / 1000)


def quality_table(runs: list[Run], warmup: int | None, target: float | None) -> tuple[pd.DataFrame, float | None]:
    """Communicating runs with a BLEU score: speed, quality and time to a target validation loss (by default the
    loosest target every one of them reached: the worst of their best validation losses)."""
    scored = [r for r in runs if r.communicates and r.bleu is not None]
    if not scored:
        return pd.DataFrame(), target
    bests = [r.val["val_nll"].min() for r in scored if len(r.val)]
    if target is None and bests:
        target = float(max(bests))
    rows = []
    for r in scored:
        m = r.steady_frame(warmup)
        rows.append({"label": r.label, "series": r.series, "step_ms": float(m["step_ms"].median()),
                     # per 1,000 target tokens (rank 0's): comparable across accumulation and batch sizes
                     "tokens_per_step": float(m["tokens"].mean()),
                     "ms_per_ktok": float((m["step_ms"] / m["tokens"] * 1000).median()),
                     "bleu": float(r.bleu["bleu"]), "steps": len(r.steps),
                     "train_s": float(r.step_frame["step_ms"].sum() / 1000),
                     "best_val_nll": float(r.val["val_nll"].min()) if len(r.val) else np.nan,
                     "to_target_s": time_to_target(r, target) if target is not None else np.nan,
                     "split": r.bleu.get("split"), "signature": r.bleu.get("signature")})
    t = pd.DataFrame(rows)
    t["on_front_step"] = pareto_front(t["ms_per_ktok"], t["bleu"])
    reached = t.dropna(subset=["to_target_s"])
    t["on_front_wall"] = False
    if len(reached):
        t.loc[reached.index, "on_front_wall"] = pareto_front(reached["to_target_s"], reached["bleu"])
    return t, target


def _number(v) -> float | None:
    """A record's field as a float (NaN for a non-finite one), or None where it is missing or not a number."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else float("nan")


def train_loss_table(runs: list[Run]) -> pd.DataFrame:
    """Rank 0's training loss at every recorded step of each communicating run, in step order; a non-finite loss is
    NaN (a gap in the curve), a record without one is left out. Columns: run, series, step, loss."""
    rows = []
    for r in runs:
        if not r.communicates:
            continue
        mine = [{"run": r.label, "series": r.series, "step": int(s["step"]), "loss": loss} for s in r.steps
                if isinstance(s.get("step"), int) and (loss := _number(s.get("loss"))) is not None]
        rows += sorted(mine, key=lambda row: row["step"])
    return pd.DataFrame(rows, columns=["run", "series", "step", "loss"])


def validation_table(runs: list[Run]) -> pd.DataFrame:
    """Each communicating run's validation loss at every validation, and its BLEU scores at the steps they were
    taken: those on the split of its last score (the one the summary shows); a score with no step (`dtrain.engine.
    evaluate` run afterwards) cannot be placed and is left out. One row per run and step, in step order.
    Columns: run, series, step, val_nll, bleu (NaN where that step has none)."""
    parts = []
    for r in runs:
        if not r.communicates:
            continue
        val = [{"step": int(e["step"]), "val_nll": nll} for e in r.evals if e.get("kind") == "val"
               and isinstance(e.get("step"), int) and (nll := _number(e.get("val_nll"))) is not None]
        split = (r.bleu or {}).get("split")
        bleu = [{"step": int(e["step"]), "bleu": score} for e in r.evals if e.get("kind") == "bleu"
                and e.get("split") == split and isinstance(e.get("step"), int)
                and (score := _number(e.get("bleu"))) is not None]
        if not val and not bleu:
            continue
        # a step scored twice keeps its later record
        t = pd.merge(pd.DataFrame(val, columns=["step", "val_nll"]).drop_duplicates("step", keep="last"),
                     pd.DataFrame(bleu, columns=["step", "bleu"]).drop_duplicates("step", keep="last"),
                     on="step", how="outer").sort_values("step")
        parts.append(t.assign(run=r.label, series=r.series))
    columns = ["run", "series", "step", "val_nll", "bleu"]
    return pd.concat(parts, ignore_index=True)[columns] if parts else pd.DataFrame(columns=columns)


def bleu_points(table: pd.DataFrame) -> int:
    """The most steps any one run of a `validation_table` was scored at."""
    counts = table.dropna(subset=["bleu"]).groupby("run")["step"].nunique()
    return int(counts.max()) if len(counts) else 0


def busbw_table(bench_paths: list[Path], topology: str | None) -> tuple[pd.DataFrame, str]:
    """Measured rows of the benchmark files, and the cost model's bus bandwidth per protocol (its best algorithm for
    that protocol) for `topology` over the same sizes (8 B to 1 GiB when nothing was measured)."""
    parts = []
    for p in bench_paths:
        d = load_bench(p)
        many = len(bench_paths) > 1
        d["curve"] = [f"{Path(p).stem} {lab}" if many else str(lab) for lab in d["label"]]
        d["kind"] = "measured"
        parts.append(d[["kind", "curve", "size", "busbw"]].dropna())
    described = ""
    if topology:
        model = cm.load_model(topology)
        described = getattr(getattr(model, "topo", None), "describe", lambda: topology)()
        sizes = sorted({int(s) for part in parts for s in part["size"]}) or [2 ** k for k in range(3, 31)]
        best: dict[tuple[str, int], float] = {}  # (protocol, size) → the fastest algorithm's bus bandwidth
        for size in sizes:
            for c in sorted(model.choices(size), key=lambda c: -c.time_us):
                best[(c.proto or c.algo, size)] = c.busbw  # a fitted model's curves are its labels
        rows = [{"kind": "modeled", "curve": f"{topology} {proto}", "size": size, "busbw": bw}
                for (proto, size), bw in best.items()]
        parts.append(pd.DataFrame(rows).sort_values(["curve", "size"], kind="stable"))
    if not parts:
        return pd.DataFrame(columns=["kind", "curve", "size", "busbw"]), described
    return pd.concat(parts, ignore_index=True), described


def network_model(bench_paths: list[Path], topology: str | None):
    """The cost model of the network the runs measured, and how it was chosen: `--topology fit:<file>` as given;
    else a fit of the benchmark measured beside the runs (a sweep's bench.json, or --bench: the same launcher, hence
    the same network: the testbed's emulated links too); else the `--topology` preset, which is not that network;
    else none."""
    if topology and is_fit_spec(topology):
        return cm.load_model(topology), f"fitted to {topology.partition(':')[2]} (--topology)"
    if bench_paths:
        spec = f"fit:{bench_paths[0]}"
        return cm.load_model(spec), f"fitted to the benchmark measured beside the runs ({bench_paths[0]})"
    if topology:
        model = cm.load_model(topology)
        described = getattr(getattr(model, "topo", None), "describe", lambda: topology)()
        return model, f"NCCL's model of the preset {described}: not the network these runs measured"
    return None, ""


def allreduce_size_table(runs: list[Run], model) -> pd.DataFrame:
    """Every recorded bucket with launch and completion times (rank 0's, every step): its bytes and its time
    (complete - launch), and the cost model's all-reduce time over the same range of sizes, per strategy.
    Columns: kind (measured | modeled), strategy, run, step, bucket, class, bytes, time_ms."""
    rows = []
    for r in runs:
        b = r.bucket_frame
        if b.empty or "launch_ms" not in b or "complete_ms" not in b:
            continue
        b = b.dropna(subset=["launch_ms", "complete_ms"])
        for _, x in b.iterrows():
            rows.append({"kind": "measured", "strategy": r.strategy, "run": r.label, "step": int(x["step"]),
                         "bucket": int(x["bucket"]), "class": x["class"], "bytes": int(x["bytes"]),
                         "time_ms": float(x["complete_ms"] - x["launch_ms"])})
    t = pd.DataFrame(rows)
    if t.empty or model is None:
        return t
    lo, hi = max(1.0, t["bytes"].min() / 2), t["bytes"].max() * 2
    sizes = sorted({int(v) for v in np.geomspace(lo, hi, 40)})
    modeled = [{"kind": "modeled", "strategy": s, "bytes": n, "time_ms": model.allreduce_ms(n)}
               for s in t["strategy"].unique() for n in sizes]
    return pd.concat([t, pd.DataFrame(modeled)], ignore_index=True)
