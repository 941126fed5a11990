"""The CLI's documents and their text form: a model's table of every choice per size with NCCL's pick, and a fit's
report of measured against fitted (and a preset's modeled) time per size."""

from __future__ import annotations

import statistics

from dtrain.collectives.costmodel.base import ALGOS, PROTOS
from dtrain.collectives.costmodel.fit import FittedModel, regime_dict
from dtrain.collectives.costmodel.measurements import MeasurementSet
from dtrain.common.errors import UserError
from dtrain.common.units import human


def table(model, sizes: list[int], coll: str = "allreduce") -> dict:
    """The `--json` document: per size every choice and the pick."""
    rows = []
    for s in sizes:
        cs = model.choices(s, coll)
        pick = model.pick(s, coll)  # a one-line error where the model has no choice for this collective
        rows.append({"size": s, "pick": {"algo": pick.algo, "proto": pick.proto or None},
                     "choices": [{"algo": c.algo, "proto": c.proto or None, "time_us": round(c.time_us, 3),
                                  "algbw": round(c.algbw, 4), "busbw": round(c.busbw, 4)} for c in cs]})
    return {"topology": model.name, "modeled": True, "coll": coll, "ranks": model.ranks, "notes": model.header(),
            "rows": rows}


def _label(c: dict) -> str:
    return f"{c['algo']}/{c['proto']}" if c.get("proto") else c["algo"]


def pick_changes(doc: dict) -> list[tuple[int, str, str]]:
    """(size, from, to) wherever the pick differs from the previous size's."""
    out, prev = [], None
    for r in doc["rows"]:
        cur = _label(r["pick"])
        if prev is not None and cur != prev:
            out.append((r["size"], prev, cur))
        prev = cur
    return out


def format_table(doc: dict) -> str:
    labels = [_label(c) for c in doc["rows"][0]["choices"]]
    lines = [f"# {n}" for n in doc["notes"]]
    lines.append(f"# {doc['coll']}, {doc['ranks'] or '?'} ranks; each cell: time(us) busbw(GB/s); "
                 "pick = least modeled time")
    lines.append(f"{'size(B)':>12} {'':>5} " + " ".join(f"{lab:>16}" for lab in labels) + f"  {'pick':<12}")
    for r in doc["rows"]:
        cells = [f"{c['time_us']:9.1f} {c['busbw']:6.1f}" for c in r["choices"]]
        pick = _label(r["pick"])
        lines.append(f"{r['size']:>12} {human(r['size']):>5} " + " ".join(cells) + f"  {pick:<12}")
    changes = pick_changes(doc)
    lines.append("# pick changes: " + ("; ".join(f"{a} -> {b} at {human(s)}" for s, a, b in changes) or "none"))
    return "\n".join(lines)


def fit_report(ms: MeasurementSet, fm: FittedModel, preset=None) -> dict:
    """Per collective and size: measured, fitted and (optionally) the preset's modeled time, with relative errors."""
    rows = []
    order = {c: i for i, c in enumerate(fm.colls)}
    for m in sorted(ms.rows, key=lambda m: (order[ms.coll_of(m)], m.label, m.size)):
        coll = ms.coll_of(m)
        fit = fm.label_time_us(m.label, m.size, coll)
        row = {"coll": coll, "size": m.size, "label": m.label, "measured_us": m.typical_us,
               "fitted_us": round(fit, 3), "fit_err_pct": round(100 * (fit - m.typical_us) / m.typical_us, 2)}
        if preset is not None:
            a, _, p = m.label.partition("/")
            forced = dict(algo=a if a in ALGOS else None, proto=p if p in PROTOS else None)
            try:
                mod = preset.time_us(m.size, coll, **forced)
            except UserError:
                mod = preset.time_us(m.size, coll)
            row["preset_us"] = round(mod, 3)
            row["preset_err_pct"] = round(100 * (mod - m.typical_us) / m.typical_us, 2)
        rows.append(row)
    errs = [abs(r["fit_err_pct"]) for r in rows]
    return {"source": ms.source, "coll": ms.coll, "colls": fm.colls, "ranks": ms.ranks, "skipped_wrong": ms.skipped,
            "fits": {lab: [regime_dict(r) for r in regs] for lab, regs in fm.fits.items()},
            "other_colls": {c: {lab: [regime_dict(r) for r in regs] for lab, regs in fits.items()}
                            for c, fits in fm.other_colls.items()},
            "fit_error_pct": {"median_abs": round(statistics.median(errs), 2), "max_abs": round(max(errs), 2)},
            "rows": rows, "model": fm.to_dict()}


def format_fit(rep: dict, preset_name: str | None) -> str:
    """The report as text; with several collectives, each fit and row names its collective."""
    several = len(rep["colls"]) > 1
    lines = [f"# fit of {rep['source']}: {', '.join(rep['colls'])}, {rep['ranks'] or '?'} ranks"
             + (f", {rep['skipped_wrong']} row(s) with #wrong > 0 left out" if rep["skipped_wrong"] else ""),
             "# model per label: t = lat + bytes / (1000 * bw), one line per size regime (fitted to measurements: "
             "the median operation where the benchmark recorded it, else the mean)"
             + ("; per collective, over nccl-tests' size of it" if several else "")]

    def coll(name: str) -> str:  # the collective's column, with several
        return f"{name:>13} " if several else ""

    fits = {rep["coll"]: rep["fits"], **rep["other_colls"]}
    for name, by_label in fits.items():
        for lab, regs in by_label.items():
            lo = 0
            for r in regs:
                hi = "inf" if r["max_bytes"] is None else human(r["max_bytes"])
                bw = "inf" if r["bw_GBps"] is None else f"{r['bw_GBps']:.3f}"
                lines.append(f"{coll(name)}{lab:>14}  sizes {human(lo):>5} .. {hi:<6} lat {r['lat_us']:9.2f} us   "
                             f"bw {bw:>9} GB/s")
                lo = r["max_bytes"] or 0
    head = f"{'size(B)':>12} {'':>5} {coll('coll')}{'label':>14} {'measured':>10} {'fitted':>10} {'err%':>7}"
    if preset_name:
        head += f" {preset_name + ' (modeled)':>22} {'err%':>7}"
    lines.append(head)
    for r in rep["rows"]:
        ln = (f"{r['size']:>12} {human(r['size']):>5} {coll(r['coll'])}{r['label']:>14} {r['measured_us']:10.2f} "
              f"{r['fitted_us']:10.2f} {r['fit_err_pct']:7.1f}")
        if "preset_us" in r:
            ln += f" {r['preset_us']:22.2f} {r['preset_err_pct']:7.1f}"
        lines.append(ln)
    e = rep["fit_error_pct"]
    lines.append(f"# fit error: median |err| {e['median_abs']}%, max |err| {e['max_abs']}%")
    return "\n".join(lines)
