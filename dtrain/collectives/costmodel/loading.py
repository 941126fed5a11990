"""`--topology` specs to cost models: a preset's `NcclModel`, a fit to measurements, or NCCL's printed table."""

from __future__ import annotations

import json
from pathlib import Path

from dtrain.collectives.costmodel.fit import FittedModel
from dtrain.collectives.costmodel.measurements import read_measurements
from dtrain.collectives.costmodel.nccl_model import NcclModel
from dtrain.collectives.costmodel.presets import topology
from dtrain.collectives.costmodel.table_model import NcclTableModel
from dtrain.common.errors import UserError

# `fit:<file>` is the documented spelling of a fitted model; `local:<file>` is the older one, still accepted.
FIT_PREFIXES = ("fit", "local")


def is_fit_spec(spec: str) -> bool:
    """Whether `spec` names a fitted model (`fit:<file>` or `local:<file>`)."""
    return spec.partition(":")[0] in FIT_PREFIXES


def load_model(spec: str):
    """A topology preset's `NcclModel`; `fit:<file>` (or `local:<file>`): a saved fit (JSON) or measurements
    fitted on the spot, named by the spec as given; `nccl-log:<file>`: NCCL's own table from a log
    (`NcclTableModel`)."""
    if spec.startswith("nccl-log:") or spec == "nccl-log":
        path = spec.partition(":")[2]
        if not path:
            raise UserError("topology 'nccl-log' needs a file: 'nccl-log:<rank 0's NCCL_DEBUG log>'")
        return NcclTableModel.from_log(path)
    if is_fit_spec(spec):
        prefix, _, path = spec.partition(":")
        if not path:
            raise UserError(f"topology '{prefix}' needs measurements or a saved fit: "
                            f"'{prefix}:<bench.csv | log | fit.json>'")
        p = Path(path)
        if p.suffix == ".json" and p.is_file():
            try:
                d = json.loads(p.read_text())
            except json.JSONDecodeError as e:
                raise UserError(f"{path}: invalid JSON ({e})") from e
            if isinstance(d, dict) and d.get("kind") == "fitted":
                return FittedModel.from_dict(d, path)
        return FittedModel.from_measurements(read_measurements(path), name=spec)
    return NcclModel(topology(spec))
