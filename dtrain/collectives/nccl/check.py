"""Observed against requested: NCCL's TUNING decisions joined to the run's bucket plan (`buckets.jsonl`), and the
buckets whose all-reduce NCCL ran on another (algorithm, protocol) than their class asked for."""

from __future__ import annotations

import json
from pathlib import Path

from dtrain.collectives.nccl.classes import resolved
from dtrain.collectives.nccl.groups import run_record
from dtrain.collectives.nccl.log import Decision, EnvSetting, read_logs
from dtrain.collectives.nccl.settings import describe
from dtrain.collectives.settings import ClassSettings, CollectivesConfig, SyncConfig
from dtrain.common import rundir
from dtrain.common.errors import UserError
from dtrain.common.jsonl import read_jsonl


def load_buckets(path: str | Path) -> list[dict]:
    """Buckets from `buckets.jsonl` (one record a bucket and step) or a JSON list: {index, class, nbytes}, unique."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot read bucket records ({e.__class__.__name__})") from None
    try:
        records = json.loads(text)
        records = records if isinstance(records, list) else [records]
    except json.JSONDecodeError:
        records = read_jsonl(Path(path))  # one record a line; a bad line is named
    out = {}
    for r in records:
        if not isinstance(r, dict):
            raise UserError(f"{path}: a bucket record is not a JSON object: {r!r}")
        cls = r.get("tensor_class", r.get("class"))
        nbytes = r.get("nbytes", r.get("bytes"))
        if cls is None or nbytes is None:
            raise UserError(f"{path}: bucket record without class or nbytes: {r}")
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
            raise UserError(f"{path}: bucket record with nbytes {nbytes!r}, not a byte count: {r}")
        key = r.get("index", r.get("bucket", len(out)))
        out[key] = {"index": key, "class": cls, "nbytes": nbytes}
    return list(out.values())


def _satisfies(d: Decision, s: ClassSettings) -> bool:
    return (s.algorithm is None or d.algo == s.algorithm) and (s.protocol is None or d.proto == s.protocol)


def check_decisions(decisions: list[Decision], buckets: list[dict], want: dict[str, ClassSettings]):
    """Attribute each decision to the classes whose buckets have its size (TUNING lines name no communicator) and
    list the buckets whose observed choice differs from the requested one. Returns (table rows, mismatches)."""
    by_size: dict[int, set[str]] = {}
    for b in buckets:
        by_size.setdefault(b["nbytes"], set()).add(b["class"])
    grads = [d for d in decisions if d.collective in (None, "allreduce")]
    rows: dict[tuple, int] = {}
    for d in decisions:
        classes = by_size.get(d.nbytes, set()) if d in grads else set()
        key = ("|".join(sorted(classes)) or "(no bucket)", d.collective or "?", d.nbytes, d.algo, d.proto,
               "?" if d.channels is None else d.channels)
        rows[key] = rows.get(key, 0) + 1
    mismatches = []
    for b in sorted(buckets, key=lambda b: (str(b["class"]), str(b["index"]))):
        s = want.get(b["class"], ClassSettings())
        seen = [d for d in grads if d.nbytes == b["nbytes"]]
        if not seen:
            mismatches.append({**b, "requested": describe(s), "observed": "no TUNING line of this size"})
            continue
        if s.protocol is None and s.algorithm is None:
            continue
        peers = [want.get(c, ClassSettings()) for c in by_size[b["nbytes"]]]
        unexplained = [d for d in seen if not any(_satisfies(d, p) for p in peers)]
        if unexplained or not any(_satisfies(d, s) for d in seen):
            observed = sorted({f"{d.algo}/{d.proto}" for d in (unexplained or seen)})
            mismatches.append({**b, "requested": describe(s), "observed": ", ".join(observed)})
    table = [dict(zip(("communicator", "collective", "bytes", "algorithm", "protocol", "channels"), k), lines=n)
             for k, n in sorted(rows.items(), key=lambda kv: (kv[0][0], kv[0][2], str(kv[0][1])))]
    return table, mismatches


def render_check(table, mismatches, envs: list[EnvSetting] | None = None) -> str:
    out = []
    if envs:
        out.append("settings NCCL honoured (ENV), in order:")
        out += [f"  line {e.line} {e.source}: {e.var}={e.value}" for e in envs]
    cols = ("communicator", "collective", "bytes", "algorithm", "protocol", "channels", "lines")
    cells = [cols] + [tuple(str(r[c]) for c in cols) for r in table]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    out += ["  ".join(v.ljust(w) if i < 2 else v.rjust(w) if i in (2, 6) else v.ljust(w)
                      for i, (v, w) in enumerate(zip(row, widths))).rstrip() for row in cells]
    if mismatches:
        out.append(f"{len(mismatches)} bucket(s) not on the requested choice:")
        out += [f"  bucket {m['index']} ({m['class']}, {m['nbytes']} B): requested {m['requested']}, observed "
                f"{m['observed']}" for m in mismatches]
    else:
        out.append("every bucket on its requested choice" if table else "no TUNING lines found")
    return "\n".join(out) + "\n"


def verify_run(sync: SyncConfig, coll: CollectivesConfig, run_dir: str | Path,
               log_dir: str | Path | None = None) -> dict | None:
    """After a run with `collectives.parse_log`: parse its NCCL logs, join them to `buckets.jsonl`, write
    `nccl_check.txt` into the run directory. Returns {decisions, mismatches}; None when there is nothing to read."""
    run_dir = Path(run_dir)
    if log_dir is None:
        debug_file = (run_record() or {}).get("job_env", {}).get("NCCL_DEBUG_FILE")
        log_dir = Path(debug_file).parent if debug_file else run_dir / "nccl-logs"
    logs = sorted(Path(log_dir).glob("nccl.*.log"))
    if not coll.parse_log or not logs or not (run_dir / rundir.BUCKETS).exists():
        return None
    decisions, envs = read_logs(logs)
    table, mismatches = check_decisions(decisions, load_buckets(run_dir / rundir.BUCKETS), resolved(sync, coll))
    (run_dir / "nccl_check.txt").write_text(render_check(table, mismatches, envs))
    return {"decisions": len(decisions), "mismatches": mismatches}
