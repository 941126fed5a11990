"""Step-time simulator: one recorded backward played again with other bucket plans.

Sits after the records: from the reference step of a run (compute phases from steps.jsonl, gradient-ready times from
buckets.jsonl) and a cost model (`dtrain.collectives.costmodel`: a fit to the benchmark, or a topology preset) it predicts
step time and exposed communication per strategy and bucket size. With a preset (NCCL) the collectives run on a
single communication stream; for a gloo run with a fitted model, two at a time per process group (ProcessGroupGloo's
threads), sharing the link per connection (between groups, then within one), and on a CPU machine the benchmark's
measured cost of a collective to the computation it overlaps (`dtrain.collectives.bench --overlap`) lengthens backward.
Everything it prints is modeled.

    timeline      the engine: collectives played onto a timeline (`play_timeline`), the gradient-ready curve
    costs         one collective's cost under the model: its part off the link, what it takes from an overlapped backward
    reference     the reference step of a run (`reference_step`) and its ready curve
    calibration   what the reference step's own collectives say about the model on this run
    predict       a configuration's step played on the reference step; the sweep over strategies and caps
    check         predictions against measured runs: intervals, speed adjustment, ranking, every step as reference
    paper         the paper's base configuration projected on a preset; FLOP-estimated steps
    __main__      the command line (`python -m dtrain.analysis.simulate --help`)
"""

from dtrain.analysis.simulate.calibration import Calibration, calibrate
from dtrain.analysis.simulate.check import (EveryStep, Ranking, each_step, every_step, measured_runs, median_ci, paired,
                                     pooled, ranking, recorded_steps, run_level, speed_probe)
from dtrain.collectives.costmodel.played import default_lanes, host_ms, off_link_ms, played_ms
from dtrain.analysis.simulate.paper import flop_step, flop_timeline, paper_profile
from dtrain.analysis.simulate.predict import Prediction, predict, requested_nccl, sweep
from dtrain.analysis.simulate.reference import ReferenceStep, ready_curve, reference_step
from dtrain.collectives.timeline import GLOO_LANES, ReadyCurve, Timeline, play_timeline, through

__all__ = ["GLOO_LANES", "Calibration", "EveryStep", "Prediction", "Ranking", "ReadyCurve", "ReferenceStep",
           "Timeline", "calibrate", "default_lanes", "each_step", "every_step", "flop_step", "flop_timeline",
           "host_ms", "measured_runs", "median_ci", "off_link_ms", "paired", "paper_profile", "play_timeline",
           "played_ms", "pooled", "predict", "ranking", "ready_curve", "recorded_steps", "reference_step",
           "requested_nccl", "run_level", "speed_probe", "sweep", "through"]
