"""The report's scaling section: step time and exposed communication against the job's shape (N nodes x R ranks
per node), measured and MODELED, one line per configuration.

Its input is the simulator's JSON for each shape (`python -m dtrain.analysis.simulate --run ... --measured ...
--json`): the measured medians of the configurations it was checked against, and its prediction for each. A
point's two figures so come from the same runs, and the modeled one from a benchmark fit on that shape.

    python -m dtrain.analysis.report runs/shapes --out reports/shapes \\
        --scaling 2x2=runs/shapes/sim-2x2.json --scaling 4x1=runs/shapes/sim-4x1.json
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd

from dtrain.analysis import plots
from dtrain.analysis.report.sections import Section, missing
from dtrain.common.errors import UserError

COLUMNS = ["shape", "nodes", "ranks_per_node", "ranks", "configuration", "measured_step_ms", "modeled_step_ms",
           "error_pct", "measured_exposed_ms", "modeled_exposed_ms", "runs"]


def parse_spec(spec: str) -> tuple[str, int, int, Path]:
    """'NxR=FILE' -> (shape, N, R, FILE)."""
    m = re.fullmatch(r"\s*(\d+)x(\d+)\s*=\s*(.+)", spec)
    if not m or int(m[1]) < 1 or int(m[2]) < 1:
        raise UserError(f"--scaling {spec!r}: give NODESxRANKS=FILE (e.g. 2x2=sim-2x2.json), FILE the JSON of "
                        "python -m dtrain.analysis.simulate ... --measured ... --json")
    return f"{m[1]}x{m[2]}", int(m[1]), int(m[2]), Path(m[3])


def scaling_table(specs: list[str]) -> pd.DataFrame:
    """One row per shape and measured configuration (COLUMNS), shapes in order of ranks, then of nodes."""
    rows = []
    for spec in specs:
        shape, nodes, per_node, path = parse_spec(spec)
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise UserError(f"--scaling {shape}: cannot read {path}: {e}") from e
        if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list):
            raise UserError(f"--scaling {shape}: {path} is not the simulator's JSON (no 'rows')")
        world = doc.get("world")
        if world is not None and world != nodes * per_node:
            raise UserError(f"--scaling {shape}: {path} is a simulation of {world} ranks, not {nodes * per_node}")
        measured = [r for r in doc["rows"] if r.get("measured_step_ms") is not None]
        if not measured:
            raise UserError(f"--scaling {shape}: {path} has no measured configuration (run the simulator with "
                            "--measured)")
        for r in measured:
            rows.append({"shape": shape, "nodes": nodes, "ranks_per_node": per_node, "ranks": nodes * per_node,
                         "configuration": r["label"], "measured_step_ms": r["measured_step_ms"],
                         "modeled_step_ms": r["step_ms"],
                         "error_pct": 100.0 * (r["step_ms"] - r["measured_step_ms"]) / r["measured_step_ms"],
                         # DDP waits inside backward(): its runs record no exposed time to set beside the model's
                         "measured_exposed_ms": (float("nan") if r.get("strategy") == "ddp"
                                                 else r.get("measured_exposed_ms")),
                         "modeled_exposed_ms": r["exposed_ms"],
                         "runs": r.get("run") or ""})
    t = pd.DataFrame(rows, columns=COLUMNS)
    return t.sort_values(["ranks", "nodes", "configuration"], kind="stable", ignore_index=True)


def section_scaling(specs: list[str]) -> Section:
    key, title = "scaling", "Scaling with the job's shape: measured and modeled"
    if not specs:
        return missing(key, title, "no --scaling simulations given (one simulator JSON per shape)")
    t = scaling_table(specs)
    worst = t.loc[t["error_pct"].abs().idxmax()]
    caption = (f"x: the job's shape, nodes x ranks per node, in order of ranks; left y: step time (ms), right y: "
               f"communication exposed after backward (ms; DDP waits inside backward and records none: modeled "
               f"only). Solid with dots: measured, the median over each configuration's steady steps and runs; "
               f"dashed with open "
               f"circles: MODELED by dtrain.analysis.simulate from a benchmark fit on the same shape, the median "
               f"prediction over the profiled steps. |error| mean {t['error_pct'].abs().mean():.1f}%, max "
               f"{abs(worst['error_pct']):.1f}% ({worst['configuration']} at {worst['shape']}).")
    return Section(key, title, caption, t, plots.scaling(t))

