"""Command line of the step-time simulator: predictions per strategy and bucket size from recorded runs of one
configuration (every steady step replayed, each configuration's median prediction), their check against measured
runs, or the paper's base configuration projected on a preset. Everything it prints is modeled.

    python -m dtrain.analysis.simulate --run runs/m30k --topology fit:bench.json --strategies flat,bucketed,per_class
    python -m dtrain.analysis.simulate --run runs/m30k --topology fit:bench.json --measured runs/flat runs/b5 runs/b25
    python -m dtrain.analysis.simulate --run il/j1/b2 il/j2/b2 --topology fit:bench.json --measured il/j*/* --every-step
    python -m dtrain.analysis.simulate --run runs/m30k --topology fit:bench.json --typical  # one step: the most typical
    python -m dtrain.analysis.simulate --run runs/m30k --topology fit:bench1.json --also-topology fit:bench2.json  # does the order rest on the fit?
    python -m dtrain.analysis.simulate --paper                  # the paper's base configuration projected on 8 P100
    python -m dtrain.analysis.simulate --plan --profile dtrain/profiles/wmt14-en-de-base.yaml --topology h100x8-ib:2  # a run's plan
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys

from dtrain.analysis.plans import schedule_of
from dtrain.analysis.runs import load_run
from dtrain.analysis.simulate.calibration import Calibration, calibrate
from dtrain.analysis.simulate.check import (
    PREDICTED_TIE,
    EveryStep,
    each_step,
    error_pct,
    every_step,
    measured_runs,
    order_changes,
    paired,
    pooled,
    ranking,
    recorded_steps,
    speed_probe,
)
from dtrain.collectives.costmodel.played import default_lanes
from dtrain.analysis.simulate.paper import PAPER_STEP_S, flop_timeline, paper_profile
from dtrain.analysis.simulate.predict import Prediction, predict, split_cost_ms, sweep
from dtrain.analysis.simulate.reference import ready_curve, reference_step
from dtrain.collectives import costmodel as cm
from dtrain.collectives.timeline import GLOO_LANES
from dtrain.common.errors import ArgumentParser, UserError, exit_on_user_error
from dtrain.engine import config as config_mod
from dtrain.engine.runplan import plan_lines

PROG = "dtrain.analysis.simulate"
DEFAULT_STRATEGIES = ("per_tensor", "flat", "bucketed", "per_class", "ddp", "noop")
DEFAULT_CAPS_MB = (1.0, 5.0, 25.0, 100.0)
LISTED = 10  # --also-topology: pairs listed in the text output
EXAMPLES = "\n".join(line for line in (__doc__ or "").splitlines() if line.startswith("    python -m"))


def _summary(m: list[Prediction], adjusted: bool) -> list[str]:
    values = [r.adjusted_step_ms if adjusted else r.measured_step_ms for r in m]
    errs = [abs(error_pct(r.step_ms, v)) for r, v in zip(m, values)]
    rk = ranking(m, adjusted)
    what = ("speed-adjusted (each run scaled to the profiled run's machine speed by its forward time)" if adjusted
            else "against measurement")
    out = [f"# {what}: max |err| {max(errs):.1f}% (mean {statistics.mean(errs):.1f}%), same ranking: "
           f"{'yes' if rk.agrees else 'no'} ({rk.pairs} pairs, {rk.ties} ties: measurement does not separate them "
           f"or predictions within {PREDICTED_TIE:.1%})"]
    out += [f"#   ordered differently: {a} vs {b}" for a, b in rk.discordant]
    return out


def _row(r: Prediction) -> str:
    ln = f"{r.label:>20} {r.buckets:>7} {r.comm_ms:9.2f} {r.exposed_ms:10.2f} {r.step_ms:9.2f}"
    if r.measured_step_ms is not None:
        lo, hi = r.measured_ci or (r.measured_step_ms,) * 2
        alo, ahi = r.adjusted_ci or (r.adjusted_step_ms,) * 2
        ln += (f" {r.measured_step_ms:10.2f} {f'{lo:.0f}-{hi:.0f}':>9} "
               f"{error_pct(r.step_ms, r.measured_step_ms):6.1f} {r.measured_exposed_ms:10.2f} {r.speed:5.2f} "
               f"{r.adjusted_step_ms:9.2f} {f'{alo:.0f}-{ahi:.0f}':>9} "
               f"{error_pct(r.step_ms, r.adjusted_step_ms):6.1f}  {r.run}")
    if not r.lossless:
        ln += "  (lossy)" if r.communicates else "  (no communication: headroom only)"
    return ln


def _best(rows: list[Prediction]) -> Prediction | None:
    """The fastest lossless, communicating configuration of the sweep (ties: less traffic)."""
    return min((r for r in rows if r.lossless and r.communicates and r.run is None),
               key=lambda r: (round(r.step_ms, 2), r.comm_ms), default=None)


def format_rows(rows: list[Prediction], header: list[str]) -> str:
    lines = [f"# {h}" for h in header]
    has_meas = any(r.measured_step_ms is not None for r in rows)
    head = (f"{'strategy':>20} {'buckets':>7} {'comm ms':>9} {'exposed ms':>10} {'step ms':>9}")
    if has_meas:
        head += (f" {'meas. step':>10} {'interval':>9} {'err %':>6} {'meas. exp.':>10} {'speed':>5} "
                 f"{'adj. step':>9} {'adj. int.':>9} {'err %':>6}  runs")
    lines.append(head + "   (modeled)")
    lines += [_row(r) for r in rows]
    best = _best(rows)
    if best:
        lines.append(f"# best lossless choice (modeled): {best.label}, {best.step_ms:.2f} ms per step")
    unpriced = {r.label: r.unpriced for r in rows if r.unpriced}
    if unpriced:
        lines.append("# host work not charged (the benchmark did not time it: run it with this version's "
                     "--host-work): " + "; ".join(f"{label} {', '.join(kinds)}" for label, kinds in unpriced.items()))
    if has_meas:
        m = [r for r in rows if r.measured_step_ms is not None]
        lines.append("# interval: the range of run medians with repeated runs, else the ~95% order-statistics "
                     "interval of one run's median; speed: the run's forward time over the profiled run's")
        interleaved = all(paired(a, b) is not None for i, a in enumerate(m) for b in m[i + 1:])
        if interleaved:
            lines.append("# every pair ran interleaved (dtrain.analysis.interleave): pairs are separated by their step-by-"
                         "step differences, and no speed adjustment is needed (the drift hits all alike)")
        lines += _summary(m, adjusted=False) + ([] if interleaved else _summary(m, adjusted=True))
    return "\n".join(lines)


def _parse_list(text: str, kind=str) -> list:
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise UserError(f"bad list '{text}': {e}") from e


def parser() -> ArgumentParser:
    ap = ArgumentParser(prog=f"python -m {PROG}", formatter_class=argparse.RawDescriptionHelpFormatter,
                        description="Predict step time and exposed communication per strategy and bucket size from "
                                    "a run's profiled steps and a cost model (modeled, not measured).",
                        epilog=f"examples:\n{EXAMPLES}")
    ap.add_argument("--run", nargs="+", help="a run directory (config.yaml, run.json, steps.jsonl, buckets.jsonl), "
                    "or several runs of one configuration (its runs in several interleaved jobs), pooled")
    ap.add_argument("--topology", help="cost model: a preset (h100x8 ...), fit:<bench.csv|json|fit.json> or "
                                       "nccl-log:<NCCL_DEBUG log>")
    ap.add_argument("--strategies", default=",".join(DEFAULT_STRATEGIES))
    ap.add_argument("--bucket-sizes", default=",".join(f"{c:g}" for c in DEFAULT_CAPS_MB), help="MiB, comma list")
    ap.add_argument("--step", type=int, help="replay this step only (default: every steady step with bucket records "
                                             "replayed, each configuration's median prediction)")
    ap.add_argument("--typical", action="store_true",
                    help="replay only the run's most typical steady step (nearest its medians in every phase)")
    ap.add_argument("--median", action="store_true", help="replay one synthetic step of the steady steps' medians")
    ap.add_argument("--warmup", type=int, help="steps dropped as warm-up (default max(3, 10%%))")
    ap.add_argument("--no-calibrate", action="store_true", help="do not scale the model by the profiled step")
    ap.add_argument("--no-host-cost", action="store_true",
                    help="CPU runs: do not charge what collectives take from the backward they overlap (applied by "
                         "default when the benchmark measured it: dtrain.collectives.bench --overlap)")
    ap.add_argument("--lanes", type=int, help="collectives in flight at once per process group (default: "
                    f"{GLOO_LANES} for a gloo run with a fitted model, as ProcessGroupGloo's threads; 1 otherwise)")
    ap.add_argument("--intra-topology", metavar="TOPOLOGY",
                    help="cost model of the path inside a node (fit:<bench.json> of one node's ranks, with "
                         "--collective all_reduce,reduce_scatter,all_gather): the hierarchical plan's collectives "
                         "inside the node cost what it says (default: their latency)")
    ap.add_argument("--ranks-per-node", type=int, metavar="R",
                    help="the ranks of each node of the job's machine, where the profiled run did not record them "
                         "(runs before run.json's ranks_per_node): a point-to-point exchange's load on a node's link "
                         "and the hierarchical plan's levels follow it (default: the profiled run's record, else "
                         "one rank per node)")
    ap.add_argument("--measured", nargs="*", default=[], help="runs to compare against (their own configs)")
    ap.add_argument("--also-topology", nargs="+", default=[], metavar="TOPOLOGY",
                    help="other cost models of the same machine (fit: of another run of the benchmark): the same "
                         "predictions under each, the pairs whose predicted order changes, and the check against "
                         "--measured again")
    ap.add_argument("--every-step", action="store_true",
                    help="with --measured: repeat the check with each steady step as the profiled step and summarize")
    ap.add_argument("--pool", type=int, default=1, metavar="K",
                    help="--every-step: each profiled step the medians of K consecutive steady steps (default 1)")
    ap.add_argument("--paper", action="store_true", help="project the paper's base configuration (8 P100)")
    ap.add_argument("--plan", action="store_true",
                    help="the plan of --profile's run on --topology (a preset): tokens, steps, checkpoints and the "
                         "MODELED step and run time (FLOP-estimated compute, the profile's strategy on the cost model)")
    ap.add_argument("--profile", help="--plan: the profile")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="--plan: override a profile value, as dtrain.engine.train's --set (repeatable)")
    ap.add_argument("--mfu", type=float, default=0.3,
                    help="--paper, --plan: assumed fraction of the GPU's peak (fp32, or bf16 under train.amp)")
    ap.add_argument("--json", action="store_true")
    return ap


def main(argv=None) -> None:
    ap = parser()
    with exit_on_user_error(PROG):
        _main(ap.parse_args(argv))


def _check(args) -> tuple[list[str], list[float]]:
    """The arguments' one-line errors before any work; the strategies and the caps (MiB)."""
    if args.lanes is not None and args.lanes < 1:
        raise UserError("--lanes must be at least 1")
    if args.ranks_per_node is not None and args.ranks_per_node < 1:
        raise UserError("--ranks-per-node must be at least 1")
    if args.every_step and (args.paper or not args.measured):
        raise UserError("--every-step repeats the check against --measured runs: give --run and --measured")
    if args.pool < 1:
        raise UserError("--pool must be at least 1")
    if args.pool > 1 and not args.every_step:
        raise UserError("--pool applies to --every-step (without it every steady step is pooled already)")
    if args.warmup is not None and args.warmup < 0:
        raise UserError("--warmup must be at least 0")
    if sum((args.median, args.step is not None, args.typical)) > 1:
        raise UserError("--step, --typical and --median each choose the one step replayed: give one of them")
    strategies = _parse_list(args.strategies)
    if not strategies:
        raise UserError("--strategies: give at least one strategy")
    caps = _parse_list(args.bucket_sizes, float)
    if not caps or any(not math.isfinite(c) or c <= 0 for c in caps):
        raise UserError("--bucket-sizes must be positive, finite numbers (MiB)")
    return strategies, caps


def _paper(args, strategies: list[str], caps: list[float]) -> tuple[list[Prediction], list[str]]:
    """The paper's base configuration on a preset: rows and header."""
    topo = cm.topology(args.topology or "p100x8")
    model = cm.NcclModel(topo)
    cfg, ref, curve, notes, implied = paper_profile(topo, mfu=args.mfu)
    rows = sweep(cfg, ref, curve, model, Calibration(), strategies, caps)
    header = ["MODELED projection of the paper's base configuration (no measurement)", *notes, *model.header(),
              f"paper: {PAPER_STEP_S} s per step; at that step time the compute alone implies {implied:.0%} of "
              f"fp32 peak"]
    return rows, header


def _plan(args) -> list[str]:
    """The plan of a profile's run on a preset (`dtrain.engine.runplan`), with the simulator's step: the FLOP-estimated
    compute of `data.max_tokens` x `train.accum_steps` tokens per GPU (the cap: an upper bound) and the profile's
    strategy's buckets played on the preset's cost model."""
    if not (args.profile and args.topology) or args.run or args.paper:
        raise UserError("--plan takes --profile and --topology (a preset such as h100x8 or h100x8-ib:2), not --run "
                        "or --paper")
    cfg = config_mod.load(args.profile, args.overrides)
    topo = cm.topology(args.topology)
    ref, curve, calib, notes = flop_timeline(cfg, topo, mfu=args.mfu)
    p = predict(cfg, ref, curve, cm.NcclModel(topo), calib, cfg.sync.strategy)
    source = (f"dtrain.analysis.simulate: compute {ref.forward_ms + ref.backward_ms:.1f} + optimizer {ref.optimizer_ms:.1f}"
              f" ms from FLOPs, {cfg.sync.strategy} in {p.buckets} bucket(s), {p.comm_ms:.1f} ms of all-reduce of "
              f"which {p.exposed_ms:.1f} ms exposed")
    return ["MODELED (no measurement)", *plan_lines(cfg, topo, p.step_ms, source), *notes]


def _recorded(args, strategies: list[str], caps: list[float]) -> tuple[list[Prediction], list[str], EveryStep | None]:
    """Recorded runs of one configuration played with every strategy and cap, and the measured runs beside: rows,
    header, and with --every-step the check repeated over their steady steps."""
    if not args.run or not args.topology:
        raise UserError("give --run and --topology (or --paper)")
    runs = [load_run(p) for p in args.run]
    run = runs[0]
    other = next((r for r in runs if r.cfg.config_hash() != run.cfg.config_hash()), None)
    if other is not None:
        raise UserError(f"--run: {other.path} is not the configuration of {run.path}: the profiled runs pooled "
                        "must be runs of one configuration (e.g. its runs in several interleaved jobs)")
    model = cm.load_model(args.topology)
    if model.ranks and run.world > 1 and model.ranks != run.world:
        print(f"# note: the cost model has {model.ranks} ranks, the run {run.world}", file=sys.stderr)
    model.ranks_per_node = args.ranks_per_node or run.ranks_per_node
    if args.intra_topology:
        model.inside_node = cm.load_model(args.intra_topology)
    if model.ranks and model.ranks_per_node and model.ranks % model.ranks_per_node:
        raise UserError(f"{model.ranks_per_node} ranks per node do not divide the cost model's {model.ranks} ranks")
    on_cpu = run.on_cpu
    lanes = args.lanes or default_lanes(str(run.header.get("backend", "gloo")), model)
    measured_dirs = [load_run(p) for p in args.measured]
    class_groups = schedule_of(run.cfg, world=run.world, ranks_per_node=run.ranks_per_node).class_groups
    host_cost = on_cpu and not args.no_host_cost
    calibs, sources = [], []  # of every step played

    def player(this):
        def play(ref, curve, calib):
            calibs.append(calib)
            sources.append(curve.source)
            return (sweep(this.cfg, ref, curve, model, calib, strategies, caps, this.vocab)
                    + measured_runs(measured_dirs, this, ref, curve, model, calib, args.warmup))
        return play

    recorded = recorded_steps(run, args.warmup)
    per_run = None  # with the default: per run and step, the measured configurations' predictions
    if args.step is not None or args.median or args.typical or not recorded:  # no records: the typical step alone
        if len(runs) > 1:
            raise UserError("--step, --typical and --median replay one step of one run: give one --run")
        ref = reference_step(run, args.step, args.warmup, args.median)
        curve = ready_curve(run, ref)
        calib = (Calibration(note="off", lanes=lanes) if args.no_calibrate
                 else calibrate(ref, model, host_cost, lanes, class_groups))
        calib.streams = not on_cpu
        rows = player(run)(ref, curve, calib)
        which = "medians of its steady steps" if args.median else f"step {ref.step}"
        notes = [f"ready times: {curve.source}", f"calibration: {calib.note}"]
    else:  # the default: every recorded steady step replayed, each configuration's median prediction
        played = [each_step(r, model, host_cost, lanes, args.warmup, player(r), not args.no_calibrate) for r in runs]
        per_step = [rows for steps in played for rows in steps]
        rows = pooled(per_step)
        if not args.no_calibrate:  # --every-step's check calibrates every step, as these were
            per_run = [[[r for r in rows if r.measured_step_ms is not None] for rows in steps] for steps in played]
        ref = reference_step(run, warmup=args.warmup, steps=[s["step"] for s in recorded])
        which = (f"each configuration's median prediction over {len(per_step)} steady steps with bucket records"
                 + (f" of {len(runs)} runs" if len(runs) > 1 else "") + ", each replayed as the profiled step; "
                 + ("the first run's medians" if len(runs) > 1 else "their medians"))
        slow = sorted(c.slowdown for c in calibs)
        notes = [f"ready times: {', '.join(dict.fromkeys(sources))}, per step",
                 f"calibration: per step (the first: {calibs[0].note}); collectives x{slow[0]:.3f}-{slow[-1]:.3f} "
                 f"slower while backward computes (median x{statistics.median(slow):.3f})"]
    measured = [r for r in rows if r.measured_step_ms is not None]
    header = [f"MODELED from run {', '.join(str(r.path) for r in runs)} (strategy {run.strategy}, world "
              f"{run.world}), {which}: data {ref.data_ms:.1f} + forward {ref.forward_ms:.1f} + backward "
              f"{ref.backward_ms:.1f} + optimizer {ref.optimizer_ms:.1f} ms (measured {ref.step_ms:.1f} ms, exposed "
              f"{ref.exposed_ms:.1f})", *notes, *model.header(), *ref.notes]
    if model.ranks_per_node:
        header.append(f"the machine's layout: {model.ranks_per_node} ranks per node")
    if model.inside_node is not None:
        header.append(f"inside a node (the hierarchical plan's reduce-scatter and all-gather): {args.intra_topology}")
    if ref.split_lookups:
        thread = (f"{ref.split_host_ms:.1f} on the computing thread" if ref.split_host_ms else
                  "its work on the computing thread not recorded (records older than their host_ms)")
        header.append(f"the split's own work, taken out of each prediction without the split: "
                      f"{split_cost_ms(ref, model, run.vocab):.1f} ms ({thread}; the rest its masks' all-reduces)")
    if measured:
        header.append(speed_probe(ref, measured))
    robust = (every_step(runs, model, measured_dirs, host_cost, lanes, args.warmup, args.pool, per_run)
              if args.every_step else None)
    return rows, header, robust


def _also(args, strategies: list[str], caps: list[float], rows: list[Prediction]) -> list[dict]:
    """`rows` predicted again under each of --also-topology's cost models: the best choice, the pairs whose order
    changes, and the check against --measured."""
    out, mine = [], _best(rows)
    for topology in args.also_topology:
        other, _, _ = _recorded(argparse.Namespace(**(vars(args) | {"topology": topology, "every_step": False})),
                                strategies, caps)
        best = _best(other)
        flips = order_changes(rows, other)
        pairs = len(rows) * (len(rows) - 1) // 2
        lines = [f"# under --also-topology {topology} (MODELED): best lossless choice "
                 + (f"{best.label}, {best.step_ms:.2f} ms per step" if best else "none")
                 + ("" if best is None or mine is None else
                    " (the same)" if best.label == mine.label else f" (under --topology: {mine.label})"),
                 f"#   ordered oppositely to --topology's predictions: {len(flips)} of {pairs} pairs"
                 + "".join(f"\n#     {a} ahead of {b} under --topology, behind under this one"
                           for a, b in flips[:LISTED]) + (f"\n#     and {len(flips) - LISTED} more (--json: all)"
                                                          if len(flips) > LISTED else "")]
        measured = [r for r in other if r.measured_step_ms is not None]
        doc = {"topology": topology, "best": best.label if best else None, "order_changes": flips}
        if measured:
            lines += ["#   " + ln[2:] for ln in _summary(measured, adjusted=False)]
            rk = ranking(measured)
            doc["ranking"] = dataclasses.asdict(rk) | {"agrees": rk.agrees}
        out.append(doc | {"lines": lines})
    return out


def _main(args) -> None:
    if args.also_topology and (args.paper or args.plan or not args.run):
        raise UserError("--also-topology predicts --run's configurations again under other cost models: give --run "
                        "and --topology, not --paper or --plan")
    if args.plan:
        print("\n".join("# " + line for line in _plan(args)))
        return
    strategies, caps = _check(args)
    robust = None
    if args.paper:
        rows, header = _paper(args, strategies, caps)
    else:
        rows, header, robust = _recorded(args, strategies, caps)
    also = _also(args, strategies, caps, rows)
    if args.json:
        doc = {"modeled": True, "notes": header, "world": None if args.paper else load_run(args.run[0]).world,
               "rows": [{k: v for k, v in vars(r).items() if k != "samples"} | {"label": r.label} for r in rows]}
        if any(r.measured_step_ms is not None for r in rows):
            for key, adjusted in (("ranking", False), ("ranking_adjusted", True)):
                rk = ranking(rows, adjusted)
                doc[key] = dataclasses.asdict(rk) | {"agrees": rk.agrees}
        if robust is not None:
            doc["every_step"] = dataclasses.asdict(robust)
        if also:
            doc["also_topologies"] = [{k: v for k, v in a.items() if k != "lines"} for a in also]
        print(json.dumps(doc, indent=1))
    else:
        print(format_rows(rows, header))
        if robust is not None:
            print("\n".join("# " + ln for ln in robust.lines()))
        for a in also:
            print("\n".join(a["lines"]))


if __name__ == "__main__":
    main()
