"""Network replay of a recorded step: its collectives, launched at their recorded times, with no computation.

When the simulator's timeline (`dtrain.analysis.simulate`) misses a run's measured completions, the gap has two possible
sources: the network does not behave as the cost model says under that step's concurrency (several collectives in
flight, several process groups), or the training process adds something the network alone would not (computation
sharing the cores, ranks finishing backward apart). This replays the step's buckets on the real network, each an
all-reduce of its recorded size on its recorded process group (one per tensor class for per_class, the world
otherwise), launched at its recorded time (the latest over the ranks, see `dtrain.analysis.runs.slowest_rank_records`),
with no model computing beside them, and puts three completion times side by side: the run's (measured in training),
this replay's (measured, network only), and the cost model's timeline of the same launches (modeled, without the
slowdown the simulator calibrates for computation).

    torchrun --nproc-per-node 2 -m dtrain.analysis.replay runs/m30k --topology fit:bench.json
    python -m dtrain.analysis.testbed run --nodes 2 --nproc-per-node 1 -- -m dtrain.analysis.replay runs/m30k --repeats 9

Run it with the run's world size. Rank 0 reads the run and sends the schedule to the others.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from dtrain.analysis.plans import schedule_of
from dtrain.analysis.runs import load_run
from dtrain.analysis.simulate import default_lanes, off_link_ms, play_timeline, played_ms, reference_step
from dtrain.collectives import costmodel as cm
from dtrain.collectives import dist as ddist
from dtrain.collectives.bench import write_out
from dtrain.collectives.settings import CollectivesConfig
from dtrain.common.errors import ArgumentParser, UserError, exit_on_user_error
from dtrain.common.files import check_writable

PROG = "dtrain.analysis.replay"
IDLE_S = 0.3  # between repeats: about a forward pass, so each repeat starts, like a step's backward, after a pause


@dataclass
class Schedule:
    """What rank 0 read from the run, sent to every rank: per bucket (index order) its tensor class, size and
    recorded launch and completion (ms, the reducer's clock)."""

    run: str
    step: int
    world: int
    backend: str  # the run's: what the simulator's timeline of it assumes (`simulate.default_lanes`)
    class_groups: bool
    classes: list[str]
    nbytes: list[int]
    launch_ms: list[float]
    complete_ms: list[float]
    notes: list[str]


def read_schedule(run_dir: str, step: int | None, median: bool) -> Schedule:
    """The schedule of the run's reference step (`dtrain.analysis.simulate.reference_step`: by default its typical step)."""
    run = load_run(run_dir)
    ref = reference_step(run, step, median=median)
    recs = ref.records
    if not recs or any(r.get(k) is None for r in recs for k in ("launch_ms", "complete_ms")):
        raise UserError(f"{run_dir}: step {ref.step} has no bucket records with launch and completion times")
    return Schedule(str(run.path), ref.step, run.world, str(run.header.get("backend", "gloo")),
                    schedule_of(run.cfg, world=run.world, ranks_per_node=run.ranks_per_node).class_groups,
                    [str(r.get("class")) for r in recs], [int(r["bytes"]) for r in recs],
                    [float(r["launch_ms"]) for r in recs], [float(r["complete_ms"]) for r in recs], ref.notes)


def shared_schedule(args) -> tuple[Schedule, list[float] | None, list[str]]:
    """Rank 0 reads the run (and replays it on the cost model with --topology); every rank gets the schedule, or
    the same error, so that no rank goes on to wait for the others."""
    box = [None]
    if dist.get_rank() == 0:
        try:
            sched = read_schedule(args.run, args.step, args.median)
            box[0] = (sched, *(modeled(sched, args.topology) if args.topology else (None, [])))
        except UserError as e:
            box[0] = str(e)
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], str):
        raise UserError(box[0])
    sched, model_end, header = box[0]
    if sched.world != dist.get_world_size():
        raise UserError(f"{sched.run} ran with {sched.world} ranks; replay it with as many (this job has "
                        f"{dist.get_world_size()})")
    return sched, model_end, header


def replay_once(sched: Schedule, groups: dict) -> list[float]:
    """One replay; completion time of each bucket (ms, on the run's clock): stamped by the collective's own
    completion callback, so a bucket done early is not held up by waiting in index order."""
    tensors = [torch.zeros(max(1, -(-n // 4))) for n in sched.nbytes]  # fp32 elements covering the recorded bytes
    origin = min(sched.launch_ms)
    done = [float("nan")] * len(tensors)
    dist.barrier()
    time.sleep(IDLE_S)
    t0 = time.perf_counter()
    chained = []
    for i, (t, cls, at) in enumerate(zip(tensors, sched.classes, sched.launch_ms)):
        delay = t0 + (at - origin) / 1000 - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        work = dist.all_reduce(t, group=groups.get(cls), async_op=True)

        def stamp(fut, i=i):
            done[i] = origin + (time.perf_counter() - t0) * 1000
            return None

        chained.append(work.get_future().then(stamp))
    for fut in chained:
        fut.wait()
    return done


def modeled(sched: Schedule, topology: str) -> tuple[list[float], list[str]]:
    """The cost model's timeline of the same launches: no computation, so no calibrated slowdown."""
    model = cm.load_model(topology)
    lanes = default_lanes(sched.backend, model)
    groups = sched.classes if sched.class_groups and lanes > 1 else None
    tl = play_timeline(sched.launch_ms, [played_ms(model, n) for n in sched.nbytes], 0.0, True, 1.0, lanes,
                       [off_link_ms(model, n) for n in sched.nbytes], groups)
    return tl.end, model.header()


def report(sched: Schedule, replays: list[list[float]], model_end: list[float] | None, header: list[str]) -> dict:
    net = [statistics.median(r[i] for r in replays) for i in range(len(sched.nbytes))]
    rows = [{"bucket": i, "class": c, "bytes": n, "launch_ms": ln, "run_complete_ms": rc, "network_complete_ms": nc,
             "model_complete_ms": None if model_end is None else model_end[i]}
            for i, (c, n, ln, rc, nc) in enumerate(zip(sched.classes, sched.nbytes, sched.launch_ms,
                                                       sched.complete_ms, net))]
    last = {"run_ms": max(sched.complete_ms), "network_ms": max(net),
            "network_range_ms": [min(max(r) for r in replays), max(max(r) for r in replays)],
            "model_ms": None if model_end is None else max(model_end)}
    return {"schedule": asdict(sched) | {"repeats": len(replays)}, "notes": header, "rows": rows, "last": last}


def format_report(doc: dict) -> str:
    s, last = doc["schedule"], doc["last"]
    lines = [f"# {PROG}: {s['run']}, step {s['step']}, {len(s['nbytes'])} buckets on "
             f"{'one group per tensor class' if s['class_groups'] else 'the world group'}, "
             f"{s['repeats']} repeats (median per bucket)", *(f"# {n}" for n in s["notes"] + doc["notes"]),
             "# run: completed in training (measured); network: this replay, the same launches with no computation "
             "(measured); model: the cost model's replay of those launches (MODELED, no slowdown)",
             f"{'bucket':>6} {'class':>10} {'bytes':>10} {'launch':>8} {'run':>8} {'network':>8} {'model':>8}   (ms)"]
    for r in doc["rows"]:
        model = "" if r["model_complete_ms"] is None else f"{r['model_complete_ms']:8.1f}"
        lines.append(f"{r['bucket']:>6} {r['class']:>10} {r['bytes']:>10} {r['launch_ms']:8.1f} "
                     f"{r['run_complete_ms']:8.1f} {r['network_complete_ms']:8.1f} {model:>8}")
    lo, hi = last["network_range_ms"]
    text = (f"# last completion: run {last['run_ms']:.1f} ms, network {last['network_ms']:.1f} ms (repeats "
            f"{lo:.1f}-{hi:.1f})")
    if last["model_ms"] is not None:
        text += (f", model {last['model_ms']:.1f} ms: the network adds {last['network_ms'] - last['model_ms']:+.1f} "
                 f"ms to the model, training adds {last['run_ms'] - last['network_ms']:+.1f} ms to the network")
    return "\n".join(lines + [text])



def main(argv=None) -> int:
    ap = ArgumentParser(prog=f"python -m {PROG}",
                        description="Replay a recorded step's collectives on the network at their recorded launch "
                                    "times, with no computation (run under torchrun with the run's world size).")
    # Positional: under torchrun an option named --run would be taken for an abbreviation of torchrun's --run-path.
    ap.add_argument("run", help="a run directory with bucket records (buckets.jsonl)")
    ap.add_argument("--step", type=int, help="the step to replay (default: the most typical steady step)")
    ap.add_argument("--median", action="store_true", help="replay the medians of the steady steps instead of one")
    ap.add_argument("--repeats", type=int, default=9, help="replays of the step (default 9)")
    ap.add_argument("--topology", help="also replay the launches on a cost model (fit:<bench.json> or a preset)")
    ap.add_argument("--json", help="write the result as JSON to this file ('-': stdout)")
    with exit_on_user_error(PROG):
        args = ap.parse_args(argv)
        if args.repeats < 1:
            raise UserError("--repeats must be at least 1")
        if args.json and args.json != "-" and ddist.env_rank()[0] == 0:  # rank 0 writes it
            check_writable(args.json, "--json")
        device, backend = ddist.init(CollectivesConfig())
        try:
            if device.type != "cpu":
                raise UserError(f"the replay sends CPU tensors over gloo; this job's backend is {backend}")
            return _replay(args)
        finally:
            ddist.cleanup()


def _replay(args) -> int:
    sched, model_end, header = shared_schedule(args)
    # Every rank creates the same groups in the same order (new_group is collective over the world).
    groups = {c: dist.new_group() for c in sorted(set(sched.classes))} if sched.class_groups else {}
    replay_once(sched, groups)  # connections set up, buffers allocated: not counted
    replays = []
    for k in range(args.repeats):
        replays.append(replay_once(sched, groups))
        if dist.get_rank() == 0:
            print(f"# repeat {k + 1}/{args.repeats}: last completion {max(replays[-1]):.1f} ms", file=sys.stderr,
                  flush=True)
    if dist.get_rank() == 0:
        doc = report(sched, replays, model_end, header)
        if args.json:
            write_out(args.json, json.dumps(doc, indent=1) + "\n", "--json")
        if args.json != "-":
            print(format_report(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
