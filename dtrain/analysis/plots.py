"""The report's figures, one function per figure, each drawn from the table (a pandas frame) behind it.

Sits at the end of the pipeline: `dtrain.analysis.report` builds the tables and the captions, these functions only draw.
They use matplotlib's object API (a `Figure`, no pyplot state), so a test can build a figure and inspect its
artists: every line, bar group and span carries the label of the series it shows.
"""

from __future__ import annotations

import matplotlib
import matplotlib.lines
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.patches import Patch

CLASS_COLORS = {"embedding": "tab:purple", "projection": "tab:blue", "ffn": "tab:orange", "norm_bias": "tab:green",
                "mixed": "tab:gray", "other": "tab:brown"}
PHASE_COLORS = {"data_ms": "tab:gray", "forward_ms": "tab:blue", "backward_ms": "tab:orange",
                "comm_exposed_ms": "tab:red", "optimizer_ms": "tab:green", "other_ms": "lightgray"}
PHASE_NAMES = {"data_ms": "data", "forward_ms": "forward", "backward_ms": "backward",
               "comm_exposed_ms": "exposed communication", "optimizer_ms": "optimizer", "other_ms": "other"}
PROTO_STYLES = {"LL": (0, (1, 1)), "LL128": "--", "Simple": "-."}
HEADROOM = "no communication: headroom"
# Where in a candidate's row of the tuning figure each mark sits (rows are 1 apart), so that a prediction, a median
# and a paired interval at nearly the same time stay apart.
TUNING_ROW = {"predicted": -0.22, "measured": 0.0, "paired": 0.22}
# Dash patterns of the curve figures, one per run in turn beside its colour.
RUN_DASHES = ("-", (0, (5, 2)), (0, (1, 1.5)), (0, (6, 2, 1, 2)))


def _figure(width: float = 7.0, height: float = 4.2) -> Figure:
    return Figure(figsize=(width, height), layout="constrained")


def step_vs_bucket(table: pd.DataFrame, title: str = "") -> Figure:
    """Median step time against the bucket cap, one line per strategy (p95 as whiskers). Strategies without a cap,
    and the no-communication baseline, are horizontal lines across the whole axis.

    Columns: series, bucket_cap_mb (NaN: no cap), median_ms, p95_ms, headroom (bool)."""
    fig = _figure()
    ax = fig.add_subplot()
    # One colour per strategy, whether it is drawn as a line over the caps or as a horizontal line (axhline does
    # not advance the colour cycle by itself).
    cycle = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    color = {s: cycle[i % len(cycle)] for i, s in enumerate(sorted(table["series"].unique()))}
    capped = table[table["bucket_cap_mb"].notna() & ~table["headroom"]]
    for series, g in capped.groupby("series", sort=True):
        g = g.sort_values("bucket_cap_mb")
        ax.plot(g["bucket_cap_mb"], g["median_ms"], marker="o", color=color[series], label=series,
                gid=f"series:{series}")
        ax.vlines(g["bucket_cap_mb"], g["median_ms"], g["p95_ms"], color=color[series], linewidth=1, alpha=0.6)
    flat = table[table["bucket_cap_mb"].isna() | table["headroom"]]
    for series, g in flat.groupby("series", sort=True):
        headroom = bool(g["headroom"].iloc[0])
        label = f"{series} ({HEADROOM})" if headroom else f"{series} (no bucket cap)"
        ax.axhline(g["median_ms"].median(), linestyle=":" if headroom else "--", linewidth=1.2,
                   color="black" if headroom else color[series], label=label, gid=f"series:{series}")
    if not capped.empty:
        ax.set_xscale("log")
        ticks = sorted(capped["bucket_cap_mb"].unique())
        ax.set_xticks(ticks)
        ax.set_xticklabels([f"{t:g}" for t in ticks])
        ax.set_xticks([], minor=True)  # a log axis labels minor ticks in 6x10^-1 form between the caps otherwise
    ax.set_xlabel("bucket size cap (MiB, sync.bucket_cap_mb)")
    ax.set_ylabel("step time (ms): median, whisker to p95")
    ax.set_title(title or "Step time vs bucket size", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    return fig


def busbw(table: pd.DataFrame, title: str = "") -> Figure:
    """Bus bandwidth against message size: measured curves solid, the cost model's per-protocol curves dashed and
    labelled modeled. Columns: kind ("measured" | "modeled"), curve, size (B), busbw (GB/s)."""
    fig = _figure()
    ax = fig.add_subplot()
    for (kind, curve), g in table.groupby(["kind", "curve"], sort=False):
        g = g.sort_values("size")
        if kind == "measured":
            ax.plot(g["size"], g["busbw"], marker="o", markersize=3, label=f"measured: {curve}",
                    gid=f"measured:{curve}")
        else:
            proto = curve.rsplit(" ", 1)[-1]
            ax.plot(g["size"], g["busbw"], linestyle=PROTO_STYLES.get(proto, "--"), label=f"modeled: {curve}",
                    gid=f"modeled:{curve}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size (bytes, log scale)")
    ax.set_ylabel("bus bandwidth (GB/s, nccl-tests convention)")
    ax.set_title(title or "All-reduce bus bandwidth: measured and modeled", fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    return fig


def allreduce_size(table: pd.DataFrame, title: str = "") -> Figure:
    """Each bucket's measured all-reduce time against its bytes, coloured by tensor class, over the cost model's
    curve, one panel per strategy (shared axes). Columns: kind (measured | modeled), strategy, class, bytes,
    time_ms."""
    strategies = sorted(table["strategy"].unique())
    fig = _figure(max(5.0, 3.6 * len(strategies) + 1.5), 4.0)
    axes = fig.subplots(1, len(strategies), sharex=True, sharey=True, squeeze=False)[0]
    classes = list(dict.fromkeys(table.loc[table["kind"] == "measured", "class"]))
    for ax, strategy in zip(axes, strategies):
        t = table[table["strategy"] == strategy]
        m = t[t["kind"] == "measured"]
        for c in classes:
            pts = m[m["class"] == c]
            if not pts.empty:
                ax.scatter(pts["bytes"], pts["time_ms"], s=10, alpha=0.6, color=CLASS_COLORS.get(c, "tab:cyan"),
                           label=c, gid=f"class:{strategy}:{c}")
        curve = t[t["kind"] == "modeled"].sort_values("bytes")
        if not curve.empty:
            ax.plot(curve["bytes"], curve["time_ms"], color="black", linestyle="--", linewidth=1.2,
                    label="modeled", gid=f"modeled:{strategy}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(strategy, fontsize=9)
        ax.set_xlabel("bucket size (bytes)")
        ax.grid(True, which="major", alpha=0.3)
    axes[0].set_ylabel("all-reduce time, launch to completion (ms)")
    handles = [Patch(color=CLASS_COLORS.get(c, "tab:cyan"), label=c) for c in classes]
    if (table["kind"] == "modeled").any():
        handles.append(matplotlib.lines.Line2D([], [], color="black", linestyle="--", label="modeled"))
    fig.legend(handles=handles, fontsize=7, loc="outside right center")
    fig.suptitle(title or "All-reduce time vs bucket size: measured points, modeled curve", fontsize=10)
    return fig


def breakdown(table: pd.DataFrame, title: str = "") -> Figure:
    """Stacked median phase times per configuration; the no-communication baseline hatched as headroom.
    Columns: label, headroom, and the phase columns of PHASE_NAMES (ms)."""
    fig = _figure(max(6.0, 0.55 * len(table) + 3), 4.6)
    ax = fig.add_subplot()
    x = range(len(table))
    bottom = pd.Series(0.0, index=table.index)
    hatches = ["//" if h else None for h in table["headroom"]]
    for phase, name in PHASE_NAMES.items():
        if phase not in table:
            continue
        bars = ax.bar(x, table[phase], bottom=bottom, color=PHASE_COLORS[phase], label=name, gid=f"phase:{phase}",
                      edgecolor="white", linewidth=0.5)
        for bar, hatch in zip(bars, hatches):
            bar.set_hatch(hatch)
        bottom = bottom + table[phase]
    ax.set_xticks(list(x))
    ax.set_xticklabels([f"{lab}\n({HEADROOM})" if h else lab for lab, h in zip(table["label"], table["headroom"])],
                       rotation=35, ha="right", fontsize=7)
    ax.set_ylabel("mean time per step (ms)")
    ax.set_xlabel("configuration (run)")
    ax.set_title(title or "Where a step's time goes", fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def timeline(table: pd.DataFrame, backward_end_ms: float | None, title: str = "") -> Figure:
    """One step's buckets against its backward pass: a thin line from ready to launch (waiting for the buckets
    before it), a bar from launch to completion coloured by tensor class, hatched for a part of a tensor's
    communication (a sharded strategy's all-gathers, which run in the forward before time 0; a split embedding's
    lookup rows). Columns: bucket, class, ready_ms, launch_ms, complete_ms (ms from the start of the synchronized
    backward), wait_start_ms, and optionally part."""
    fig = _figure(7.5, max(3.0, 0.22 * len(table) + 1.8))
    ax = fig.add_subplot()
    part = table["part"] if "part" in table else pd.Series([None] * len(table), index=table.index)
    gathers = table[part == "all_gather"]
    if not gathers.empty and gathers["launch_ms"].notna().any():
        # A sharded strategy's all-gathers start with this step's forward (before time 0) and run while it computes.
        ax.axvspan(float(gathers["launch_ms"].min()), 0, color="0.97", hatch="..", label="forward pass",
                   gid="forward")
    if backward_end_ms:
        ax.axvspan(0, backward_end_ms, color="0.92", label="backward pass", gid="backward")
    wait = table["wait_start_ms"].dropna()
    if not wait.empty:
        ax.axvline(wait.iloc[0], color="black", linewidth=1, linestyle="--", label="wait() called", gid="wait")
    for i, r in table.iterrows():
        color = CLASS_COLORS.get(r["class"], "tab:cyan")
        y = r["bucket"]
        if pd.notna(r["ready_ms"]) and pd.notna(r["launch_ms"]) and r["launch_ms"] > r["ready_ms"]:
            ax.hlines(y, r["ready_ms"], r["launch_ms"], color=color, linewidth=1)
        if pd.notna(r["ready_ms"]):
            ax.plot([r["ready_ms"]], [y], marker="|", color=color, markersize=8)
        if pd.notna(r["launch_ms"]) and pd.notna(r["complete_ms"]):
            # Parts of one tensor's communication: hatched where it is not a whole bucket's all-reduce.
            hatch = {"all_gather": "///", "reduce_scatter": "", "lookup": "xx"}.get(part[i])
            ax.barh(y, r["complete_ms"] - r["launch_ms"], left=r["launch_ms"], height=0.6, color=color,
                    hatch=hatch, edgecolor="black" if hatch else None, linewidth=0.3 if hatch else 0,
                    gid=f"bucket:{int(y)}")
    classes = list(dict.fromkeys(table["class"]))
    handles = [Patch(color=CLASS_COLORS.get(c, "tab:cyan"), label=c) for c in classes]
    extra, labels = ax.get_legend_handles_labels()
    ax.legend(handles=handles + extra, labels=classes + labels, fontsize=7, loc="upper left",
              bbox_to_anchor=(1.0, 1.0))
    ax.invert_yaxis()  # bucket 0 (ready first) on top
    ax.set_xlabel("time since the start of the synchronized backward (ms)")
    ax.set_ylabel("bucket index")
    ax.set_title(title or "One step's gradient buckets", fontsize=10)
    ax.grid(True, axis="x", alpha=0.3)
    return fig


def pareto(table: pd.DataFrame, title: str = "") -> Figure:
    """BLEU against the median step time per 1,000 target tokens, and against training time to a target validation
    loss; the Pareto front (faster and at least as good as everything slower) drawn through its points. One colour
    per configuration, named in the legend (labels written next to close points overlap). Columns: label, ms_per_ktok,
    bleu, to_target_s, on_front_step, on_front_wall."""
    fig = _figure(11.0, 4.2)
    cmap = matplotlib.colormaps["tab10" if len(table) <= 10 else "tab20"]
    color = {lab: cmap(i % cmap.N) for i, lab in enumerate(table["label"])}
    panels = [("ms_per_ktok", "on_front_step", "median step time per 1,000 target tokens (ms)"),
              ("to_target_s", "on_front_wall", "training time to the target validation loss (s)")]
    for i, (x, front, xlabel) in enumerate(panels):
        ax = fig.add_subplot(1, 2, i + 1)
        d = table.dropna(subset=[x, "bleu"])
        for _, r in d.iterrows():
            ax.scatter([r[x]], [r["bleu"]], color=color[r["label"]], zorder=3, s=36, label=r["label"],
                       gid=f"point:{x}:{r['label']}")
        f = d[d[front]].sort_values(x)
        if not f.empty:
            ax.plot(f[x], f["bleu"], color="tab:red", marker="o", markerfacecolor="none", markersize=11,
                    drawstyle="steps-post", label="Pareto front", gid=f"front:{x}")
        if d.empty:
            ax.text(0.5, 0.5, "no run reached the target", transform=ax.transAxes, ha="center", fontsize=8)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("BLEU (sacreBLEU)")
        ax.grid(True, alpha=0.3)
    handles, labels = fig.axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="outside right center")
    fig.suptitle(title or "What communication savings cost in quality", fontsize=10)
    return fig


def run_styles(labels: list[str]) -> dict[str, dict]:
    """A colour and a dash pattern per run, the same in every curve figure: runs that computed the same updates
    draw the same curve, and different dash patterns let each show through the one drawn over it."""
    cmap = matplotlib.colormaps["tab10" if len(labels) <= 10 else "tab20"]
    return {lab: {"color": cmap(i % cmap.N), "linestyle": RUN_DASHES[i % len(RUN_DASHES)]}
            for i, lab in enumerate(labels)}


def train_loss(table: pd.DataFrame, styles: dict[str, dict], title: str = "") -> Figure:
    """Training loss against step, one line per run, as recorded (no smoothing). Columns: run, step, loss."""
    fig = _figure(8.0, 4.2)
    ax = fig.add_subplot()
    for run, g in table.groupby("run", sort=False):
        ax.plot(g["step"], g["loss"], linewidth=1.2, label=run, gid=f"loss:{run}", **styles[run])
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss, rank 0 (nats per target token)")
    ax.set_title(title or "Training loss", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def validation(table: pd.DataFrame, styles: dict[str, dict], bleu: bool, title: str = "") -> Figure:
    """Validation loss against step, one line per run, a point per validation; with `bleu`, a second panel of BLEU
    against step from the same table. Columns: run, step, val_nll, bleu."""
    panels = [("val_nll", "validation loss (nats per target token)")] + ([("bleu", "BLEU (sacreBLEU)")] if bleu else [])
    fig = _figure(8.0 + 4.0 * (len(panels) - 1), 4.2)
    for i, (column, ylabel) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        for run, g in table.dropna(subset=[column]).groupby("run", sort=False):
            ax.plot(g["step"], g[column], marker="o", markersize=3, linewidth=1.2, label=run,
                    gid=f"{column}:{run}", **styles[run])
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    handles, labels = fig.axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="outside right center")
    fig.suptitle(title or ("Validation loss and BLEU" if bleu else "Validation loss"), fontsize=10)
    return fig


def tuning(table: pd.DataFrame, title: str = "", reference: str = "winner") -> Figure:
    """An auto-tuning search, one row per candidate (top: the first row of `table`): its predicted step time (open
    diamond, MODELED), its measured median (dot), and the paired comparison with a reference put on the time axis
    (the reference's median plus the median paired difference, a bar over its 95% interval), each at its TUNING_ROW
    offset. The reference's row (`reference` names it: the winner, or the leader of a search cut short) is
    highlighted and its median drawn as a dotted line; candidates pruned by the prediction have grey names.
    Columns: candidate, reference (bool), pruned (bool), predicted_ms, measured_ms, paired_ms, paired_low,
    paired_high.
    """
    fig = _figure(7.5, max(2.8, 0.4 * len(table) + 1.6))
    ax = fig.add_subplot()
    y = pd.Series(range(len(table)), index=table.index, dtype=float)
    for i in table.index[table["reference"]]:
        ax.axhspan(y[i] - 0.45, y[i] + 0.45, color="gold", alpha=0.35, linewidth=0, label=reference,
                   gid="reference")
        if pd.notna(table.at[i, "measured_ms"]):
            ax.axvline(table.at[i, "measured_ms"], color="black", linestyle=":", linewidth=1,
                       label=f"{reference}'s measured median", gid="reference_ms")
    predicted = table["predicted_ms"].notna()  # the tuner may have made no prediction for a candidate
    ax.scatter(table.loc[predicted, "predicted_ms"], y[predicted] + TUNING_ROW["predicted"], marker="D",
               facecolors="none", edgecolors="tab:gray", zorder=3, label="predicted (MODELED)", gid="predicted")
    measured = table["measured_ms"].notna()
    if measured.any():
        ax.scatter(table.loc[measured, "measured_ms"], y[measured] + TUNING_ROW["measured"], color="tab:blue",
                   zorder=4, label="measured median", gid="measured")
    paired = table["paired_ms"].notna()
    if paired.any():
        # Around the reference, not around the candidate's own median: the paired difference is what decided.
        row = y[paired] + TUNING_ROW["paired"]
        ax.hlines(row, table.loc[paired, "paired_low"], table.loc[paired, "paired_high"], color="tab:red",
                  linewidth=2, label=f"{reference} + paired difference, 95% interval", gid="paired")
        ax.scatter(table.loc[paired, "paired_ms"], row, marker="|", s=80, color="tab:red", zorder=4,
                   gid="paired_median")
    ax.set_yticks(list(y))
    ax.set_yticklabels(table["candidate"], fontsize=8)
    for label, ref, pruned in zip(ax.get_yticklabels(), table["reference"], table["pruned"]):
        label.set_fontweight("bold" if ref else "normal")
        label.set_color("tab:gray" if pruned else "black")
    ax.set_ylim(len(table) - 0.5, -0.5)  # the first row (fastest measured) on top
    ax.set_xlabel("step time (ms)")
    ax.set_ylabel("candidate")
    ax.set_title(title or "Auto-tuning search: predicted and measured step time", fontsize=10)
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def scaling(table: pd.DataFrame, title: str = "") -> Figure:
    """Step time (left) and exposed communication (right) against the job's shape, one colour per configuration:
    measured solid with dots, MODELED dashed with open circles. Columns: shape, ranks, nodes, configuration,
    measured_step_ms, modeled_step_ms, measured_exposed_ms, modeled_exposed_ms."""
    fig = _figure(10.0, 4.2)
    shapes = list(dict.fromkeys(table.sort_values(["ranks", "nodes"], kind="stable")["shape"]))
    x = {s: i for i, s in enumerate(shapes)}
    colors = matplotlib.colormaps["tab10"]
    panels = (("step", "step time (ms)"), ("exposed", "exposed communication (ms)"))
    for k, (what, ylabel) in enumerate(panels):
        ax = fig.add_subplot(1, 2, k + 1)
        for c, (config, rows) in enumerate(table.groupby("configuration", sort=False)):
            xs = [x[s] for s in rows["shape"]]
            color = colors(c % 10)
            ax.plot(xs, rows[f"measured_{what}_ms"], "-o", color=color, label=config, gid=f"measured:{config}")
            ax.plot(xs, rows[f"modeled_{what}_ms"], "--o", color=color, markerfacecolor="none",
                    gid=f"modeled:{config}")
        ax.set_xticks(range(len(shapes)))
        ax.set_xticklabels(shapes)
        ax.set_xlabel("nodes x ranks per node")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    ax.plot([], [], "k-o", label="measured")
    ax.plot([], [], "k--o", markerfacecolor="none", label="MODELED")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(title or "Step time and exposed communication against the job's shape", fontsize=10)
    return fig
