"""Per-class bucket sizes and NCCL protocol/algorithm for a profile's model, MODELED on a cost model.

For the `per_class` plan of the profile's model, a coordinate descent over each tensor class's bucket cap minimizes
the exposed all-reduce time of a replayed step (`dtrain.analysis.simulate`: a profiled step of a run, or a FLOP estimate for
a preset's GPU); then, per class, the (algorithm, protocol) with the least modeled time for the class's buckets is
forced where it beats NCCL's own pick. The result is printed, and merged into the profile as a complete new one.

    python -m dtrain.analysis.recommend --profile dtrain/profiles/base.yaml --topology h100x8-ib:2 --out rec.yaml
    python -m dtrain.analysis.recommend --profile dtrain/profiles/smoke.yaml --topology fit:bench.json --run runs/smoke
    python -m dtrain.analysis.recommend --profile dtrain/profiles/base.yaml --topology h100x8 --fit nccl_tests.log
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import yaml

from dtrain.analysis import simulate as sim
from dtrain.analysis.plans import schedule_of
from dtrain.analysis.runs import load_run
from dtrain.collectives.costmodel import ALGOS, PROTOS, FittedModel, NcclModel, load_model
from dtrain.common.errors import ArgumentParser, UserError, exit_on_user_error
from dtrain.common.files import check_writable, write_atomic
from dtrain.common.schema import deep_merge, read_overlay
from dtrain.common.units import human
from dtrain.engine import config as config_mod
from dtrain.engine.config import drop_unused_knobs

PROG = "dtrain.analysis.recommend"
CAP_CANDIDATES_MB = (0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256)
# The generated profile's comment head (pinned by tests/data/golden/recommend-smoke-local.txt). The warning's
# public source: NCCL's documentation of NCCL_PROTO; a forced protocol can give wrong results where NCCL disables it.
GENERATED_BY = "python -m dtrain.analysis.recommend"
FORCED_WARNING = ("# A forced NCCL protocol/algorithm must pass the benchmark's #wrong check before it is trusted "
                  "(NCCL's documentation of NCCL_PROTO: a protocol forced where NCCL disables it can corrupt data).\n")


class _Costing:
    """The cost of one all-reduce for the search: `model` is a topology preset (NCCL's per-size choice comes from
    it) or a fit; `fitted`, when given, costs every choice with measured per-algo/proto fits, so a forced choice
    can beat NCCL's modeled pick."""

    def __init__(self, model, fitted: FittedModel | None):
        self.model = fitted or model
        self.nccl = model if isinstance(model, NcclModel) else None

    def us(self, nbytes: int, algo: str | None = None, proto: str | None = None) -> float:
        """µs: NCCL's default pick (costed by the fit when there is one), or the forced choice (inf where nobody
        measured it: it cannot be recommended)."""
        if algo is None and proto is None and self.nccl is not None:
            pick = self.nccl.pick(nbytes)
            try:
                return self.model.time_us(nbytes, "allreduce", algo=pick.algo, proto=pick.proto)
            except UserError:  # the fit lacks NCCL's pick: the best measured choice stands in
                return self.model.time_us(nbytes, "allreduce")
        try:
            return self.model.time_us(nbytes, "allreduce", algo=algo, proto=proto)
        except UserError:
            return math.inf

    def ms(self, nbytes: int, algo: str | None = None, proto: str | None = None) -> float:
        """The same in ms, for the replay."""
        return self.us(nbytes, algo, proto) / 1000.0


def _replayer(cfg, timeline, costing: _Costing, vocab: int | None):
    """run(strategy, classes, forced) -> the simulator's Prediction of the step, replayed on `timeline`."""
    prof, curve, calib = timeline[:3]

    def run(strategy, classes=None, forced=None):
        nccl_of = (lambda b: tuple((forced or {}).get(b.tensor_class, (None, None)))) if forced is not None else None
        return sim.predict(cfg, prof, curve, costing.model, calib, strategy, classes=classes, vocab=vocab,
                           cost=costing.ms, nccl_of=nccl_of)

    return run


def _search_caps(run, classes: list[str], totals: dict, caps: dict, start):
    """Coordinate descent over the classes' bucket caps (two rounds settle it) from the profile's caps: the
    prediction with the least (exposed, comm) time and the caps that give it. A class's candidates stop at the
    first cap that holds the whole class."""

    def key(pred):
        return (round(pred.exposed_ms, 3), round(pred.comm_ms, 3))

    best = start
    for _ in range(2):
        for c in classes:
            for cap in CAP_CANDIDATES_MB:
                trial = {**caps, c: cap}
                pred = run("per_class", {k: {"bucket_cap_mb": v} for k, v in trial.items()})
                if key(pred) < key(best):
                    best, caps = pred, trial
                if cap * 2**20 >= totals[c]:
                    break
    return best, caps


def _pick_label(model, nbytes: int) -> str:
    c = model.pick(nbytes)
    return f"{c.algo}/{c.proto}" if c.proto else c.algo


def _class_choices(costing: _Costing, classes, base_plan, plan, caps, totals) -> tuple[list[dict], dict]:
    """Per class: its buckets at the recommended caps, their time under NCCL's default and under the best forced
    (algo, proto), and that choice where it beats the default by a margin. Returns (rows, {class: (algo, proto)})."""
    nccl = costing.nccl
    options = [(a, p) for a in ALGOS for p in PROTOS if nccl is None or nccl.enabled(a, p)]
    rows, forced = [], {}
    for c in classes:
        sizes = [b.nbytes for b in plan if b.tensor_class == c]
        default = sum(costing.us(n) for n in sizes)
        t, a, p = min((sum(costing.us(n, a, p) for n in sizes), a, p) for a, p in options)
        pin = t < default * 0.995  # force only what beats NCCL's own choice by a margin
        if pin:
            forced[c] = (a, p)
        rows.append({"class": c, "bytes": totals[c],
                     "profile_buckets": [b.nbytes for b in base_plan if b.tensor_class == c],
                     "cap_mb": caps[c], "buckets": sizes,
                     "picks": sorted({_pick_label(nccl, n) for n in sizes}) if nccl else [],
                     "comm_us_default": round(default, 2), "comm_us_best_forced": round(t, 2),
                     "recommended": {"algo": a, "proto": p} if pin else None})
    return rows, forced


def _summary(pred) -> dict:
    return {"buckets": pred.buckets, "comm_ms": round(pred.comm_ms, 3), "exposed_ms": round(pred.exposed_ms, 3),
            "step_ms": round(pred.step_ms, 3)}


def recommend(cfg, model, fitted: FittedModel | None = None, timeline=None, vocab: int | None = None) -> dict:
    """Per tensor class of the `per_class` plan: bucket caps that minimize the modeled exposed communication of
    the step, then the (algo, proto) with the least modeled time for the class's buckets (None: NCCL's own pick).

    `model` is a topology preset (NCCL's per-size choice comes from it) or a fit; `fitted`, when given, costs every
    choice with measured per-algo/proto fits, so a forced choice can beat NCCL's modeled pick. `timeline` is
    (ReferenceStep, ReadyCurve, Calibration[, notes]) from `dtrain.analysis.simulate`; by default a FLOP estimate for the
    preset."""
    costing = _Costing(model, fitted)
    if timeline is None:
        if costing.nccl is None:
            raise UserError("recommend with a fitted model needs --run (a profiled step) for the backward timeline")
        timeline = sim.flop_timeline(cfg, costing.nccl.topo, vocab=vocab)
    run = _replayer(cfg, timeline, costing, vocab)

    actual = run(cfg.sync.strategy)
    base_plan = schedule_of(cfg, "per_class", vocab=vocab).buckets
    classes = list(dict.fromkeys(b.tensor_class for b in base_plan))
    totals = {c: sum(b.nbytes for b in base_plan if b.tensor_class == c) for c in classes}
    caps = {c: b.settings.bucket_cap_mb for c in classes for b in base_plan if b.tensor_class == c}
    at_profile_caps = run("per_class")
    best, caps = _search_caps(run, classes, totals, caps, at_profile_caps)
    overrides = {c: {"bucket_cap_mb": caps[c]} for c in classes}
    plan = schedule_of(cfg, "per_class", classes=overrides, vocab=vocab).buckets
    rows, forced = _class_choices(costing, classes, base_plan, plan, caps, totals)
    final = run("per_class", overrides, forced) if forced else best
    return _result(cfg, model, timeline, rows, caps, forced, (actual, at_profile_caps, best, final))


def _result(cfg, model, timeline, rows, caps, forced, preds) -> dict:
    """The recommendation's document; its `overlay` is what merges into the profile: the per_class strategy with each
    class's cap, and where a choice is forced, the class's `protocol`/`algorithm` on its own communicator
    (`collectives.mode: per_group`)."""
    actual, at_profile_caps, best, final = preds
    overlay = {"sync": {"strategy": "per_class", "classes": {c: {"bucket_cap_mb": cap} for c, cap in caps.items()}}}
    for c, (a, p) in forced.items():
        overlay["sync"]["classes"][c].update(protocol=p, algorithm=a)
    if forced:
        overlay["collectives"] = {"mode": "per_group"}
    return {"topology": model.name, "modeled": True, "profile_strategy": cfg.sync.strategy,
            "timeline": list(timeline[3]) if len(timeline) > 3 else [], "classes": rows,
            "profile_plan_default": _summary(actual), "per_class_profile_caps_default": _summary(at_profile_caps),
            "recommended_caps_default": _summary(best), "recommended": _summary(final), "overlay": overlay}


def format_recommend(rec: dict) -> str:
    lines = [f"# MODELED recommendation for {rec['topology']}: per-class bucket caps minimizing the exposed "
             f"all-reduce time of a replayed step, then per-class NCCL choices",
             "# (under NCCL's own analytic model its per-size pick is never beaten; a forced choice can only win "
             "with --fit from measurements per algo/proto)"] + [f"# {n}" for n in rec["timeline"]]
    lines.append(f"{'class':>11} {'bytes':>7} {'profile bkts':>12} | {'cap MiB':>7} {'buckets':>7} "
                 f"{'NCCL picks':>22} {'default ms':>10} {'best forced':>11} {'choice':>13}")
    for r in rec["classes"]:
        choice = f"{r['recommended']['algo']}/{r['recommended']['proto']}" if r["recommended"] else "NCCL's"
        lines.append(f"{r['class']:>11} {human(r['bytes']):>7} {len(r['profile_buckets']):>12} | "
                     f"{r['cap_mb']:>7g} {len(r['buckets']):>7} {'+'.join(r['picks']):>22} "
                     f"{r['comm_us_default'] / 1000:10.3f} {r['comm_us_best_forced'] / 1000:11.3f} {choice:>13}")
    lines.append(f"{'per step (modeled)':>30} {'buckets':>7} {'comm ms':>9} {'exposed ms':>10} {'step ms':>9}")
    for label, k in ((f"profile's plan ({rec['profile_strategy']}), NCCL default", "profile_plan_default"),
                     ("per_class at profile caps, default", "per_class_profile_caps_default"),
                     ("per_class at recommended caps", "recommended_caps_default"),
                     ("recommendation", "recommended")):
        v = rec[k]
        lines.append(f"{label:>30.30} {v['buckets']:>7} {v['comm_ms']:9.3f} {v['exposed_ms']:10.3f} "
                     f"{v['step_ms']:9.2f}")
    return "\n".join(lines)


def overlay_yaml(profile_path: str, rec: dict, argv: list[str]) -> str:
    """The profile with the recommendation merged in: a complete profile, ready for `--profile`. Its comment head
    says the caps and choices are modeled, and that a forced NCCL choice must pass the benchmark's #wrong check
    before it is trusted."""
    raw, src = read_overlay(profile_path)  # the profile resolved over its includes: the output stands alone
    deep_merge(raw, rec["overlay"])
    drop_unused_knobs(raw, src)  # knobs of the profile's strategy that the recommended one would not read
    raw["name"] = f"{raw.get('name', Path(profile_path).stem)}-rec-{rec['topology'].replace(':', 'x')}"
    nccl = " and NCCL choices" if "collectives" in rec["overlay"] else ""
    head = (f"# Generated by: {GENERATED_BY} {' '.join(argv)}\n"
            f"# From {profile_path}, with per-class bucket caps{nccl}"
            f" MODELED for {rec['topology']}: {rec['recommended']['exposed_ms']:.3f} ms of exposed all-reduce per step "
            f"vs {rec['profile_plan_default']['exposed_ms']:.3f} ms for the profile's plan.\n"
            + FORCED_WARNING)
    return head + yaml.safe_dump(raw, sort_keys=False)


def _timeline(args, cfg, model, fitted):
    """(timeline, vocab) for `recommend`: the run's profiled step with --run, else a FLOP estimate for a preset
    (None for a fit: `recommend` then says --run is needed)."""
    if args.run:
        run = load_run(args.run)
        prof = sim.reference_step(run)
        calib = sim.calibrate(prof, fitted or model)
        return (prof, sim.ready_curve(run, prof), calib, [f"timeline: step {prof.step} of {args.run}",
                                                          f"calibration: {calib.note}"]), run.vocab
    if isinstance(model, NcclModel):
        return sim.flop_timeline(cfg, model.topo, mfu=args.mfu), None
    return None, None


def main(argv=None) -> None:
    ap = ArgumentParser(prog=f"python -m {PROG}",
                        description="Per-class bucket sizes and NCCL protocol/algorithm for a profile's model "
                                    "(modeled).")
    ap.add_argument("--profile", required=True)
    ap.add_argument("--topology", required=True, help="a preset (NCCL's choice) or fit:<file> (alias local:<file>)")
    ap.add_argument("--fit", help="cost every choice with this fit (per algo/proto) instead of the analytic model")
    ap.add_argument("--run", help="replay this run's profiled step (default: a FLOP estimate for the preset's GPU)")
    ap.add_argument("--mfu", type=float, default=0.3, help="without --run: assumed fraction of the GPU's peak")
    ap.add_argument("--out", help="write the profile with the recommendation merged in (YAML)")
    ap.add_argument("--json", action="store_true")
    argv = list(sys.argv[1:] if argv is None else argv)
    with exit_on_user_error(PROG):
        args = ap.parse_args(argv)
        if args.out:
            check_writable(args.out, "--out")  # before the work, not after it
        cfg = config_mod.load(args.profile)
        model = load_model(args.topology)
        fitted = load_model(f"local:{args.fit}") if args.fit else None
        timeline, vocab = _timeline(args, cfg, model, fitted)
        rec = recommend(cfg, model, fitted, timeline, vocab)
        argv_used = (["--profile", args.profile, "--topology", args.topology]
                     + (["--fit", args.fit] if args.fit else []) + (["--run", args.run] if args.run else []))
        text = overlay_yaml(args.profile, rec, argv_used)
        if args.out:
            config_mod.from_dict(yaml.safe_load(text), args.out)  # the overlay must be a valid profile
            write_atomic(args.out, text, "--out")
        print(json.dumps(rec, indent=1) if args.json else format_recommend(rec)
              + (f"\n# profile written to {args.out}" if args.out else "\n# profile with the recommendation "
                 "(--out to save it):\n" + text))


if __name__ == "__main__":
    main()
