"""Cost models of one collective: NCCL's analytical model (Ring, Tree, NVLS, NVLSTree, CollNet, PAT x LL/LL128/Simple,
each where NCCL enables it) on topology presets, NCCL's own printed table, and fits to measurements.

Given a collective's size a model predicts its time and the (algorithm, protocol) NCCL would pick, for
`dtrain.analysis.simulate` and `dtrain.analysis.recommend`. Every number it prints is modeled, not measured, unless a row says
otherwise.

    base          the modeled algorithms/protocols/collectives, `Choice`, the cost of one all-reduce (`CollectiveCost`)
    presets       `Topology`, the preset tables, `topology(spec)`
    nccl_model    NCCL 2.30's analytical model (src/graph/tuning.cc): `NcclModel`; docs/costmodel.md
    table_model   `NcclTableModel`: NCCL's printed table as a model (read by `dtrain.collectives.nccl.log`)
    measurements  `read_measurements`: nccl-tests logs and the benchmark's CSV/JSON
    fit           size regimes and `FittedModel`
    played        what a collective costs a replayed step beyond its own time: off the link, on the host
    loading       `load_model(spec)`: a preset, `fit:<file>` (alias `local:<file>`) or `nccl-log:<file>`
    tables        the CLI's documents and text; `cli` the command line (`python -m dtrain.collectives.costmodel --help`)
"""

from dtrain.collectives.costmodel.base import ALGOS, COLLECTIVES, PROTOS, Choice, CollectiveCost
from dtrain.collectives.costmodel.cli import main
from dtrain.collectives.costmodel.fit import FittedModel, Regime, fit_per_op, fit_regimes
from dtrain.collectives.costmodel.loading import load_model
from dtrain.collectives.costmodel.measurements import Measurement, MeasurementSet, read_measurements
from dtrain.collectives.costmodel.nccl_model import NcclModel
from dtrain.collectives.costmodel.presets import Topology, preset_names, topology
from dtrain.collectives.costmodel.table_model import NcclTableModel
from dtrain.collectives.costmodel.tables import fit_report, format_fit, format_table, pick_changes, table

__all__ = ["ALGOS", "COLLECTIVES", "PROTOS", "Choice", "CollectiveCost", "FittedModel", "Regime", "fit_per_op",
           "fit_regimes", "load_model", "Measurement", "MeasurementSet", "read_measurements", "NcclModel",
           "Topology", "preset_names", "topology", "NcclTableModel", "fit_report", "format_fit", "format_table",
           "pick_changes", "table", "main"]
