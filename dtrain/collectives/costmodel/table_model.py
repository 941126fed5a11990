"""NCCL's own model of the machine it ran on: the latency/bandwidth table a communicator prints at init.

No preset's assumptions: channels and links are what NCCL's topology search found there.
"""

from __future__ import annotations

from pathlib import Path

from dtrain.collectives.costmodel.base import ALGOS, PROTOS, Choice, check_coll, timed_choice
from dtrain.collectives.costmodel.nccl_model import NcclPick, tree_corrected
from dtrain.collectives.nccl.log import parse_init_table, read_log
from dtrain.common.errors import UserError


class NcclTableModel(NcclPick):
    """NCCL's table as printed with `NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=TUNING` (one row per collective, `lat/bw`
    per algorithm and protocol: µs and GB/s of algorithm bandwidth; 0.0 bandwidth = disabled). Time = lat + bytes /
    (1000 · bw), with Tree's per-size correction (`nccl_model.TREE_CORRECTION`). Not applied: the multi-node
    Ring/Simple latency factor, which needs the channel count the table does not print."""

    kind = "nccl-table"
    unavailable = "is disabled in NCCL's table"

    def __init__(self, cells: dict[tuple[str, str, str], tuple[float, float]], ranks: int | None, name: str,
                 source: str):
        self.cells, self.ranks, self.name, self.source = cells, ranks, name, source

    @classmethod
    def from_log(cls, path: str | Path) -> "NcclTableModel":
        """The first complete table in the log and the rank count from an INIT line (`dtrain.collectives.nccl.log`), every
        algorithm NCCL printed."""
        table = parse_init_table(read_log(path), str(path))
        cells = {k: v for k, v in (table.cells if table else {}).items() if k[1] in ALGOS}
        if not cells:
            raise UserError(f"{path}: no NCCL tuning table found (rank 0 prints it, with NCCL_DEBUG=INFO "
                            "NCCL_DEBUG_SUBSYS=TUNING or INIT,TUNING)")
        return cls(cells, table.ranks, f"nccl-log:{path}", str(path))

    def choice(self, nbytes: int, algo: str, proto: str, coll: str = "allreduce") -> Choice:
        lat, bw = self.cells[(coll, algo, proto)]
        return timed_choice(algo, proto, nbytes, lat, tree_corrected(bw, nbytes, algo, proto), coll, self.ranks)

    def choices(self, nbytes: int, coll: str = "allreduce") -> list[Choice]:
        check_coll(coll)
        return [self.choice(nbytes, a, p, coll) for a in ALGOS for p in PROTOS
                if self.cells.get((coll, a, p), (0.0, 0.0))[1] > 0]

    def header(self) -> list[str]:
        return [f"MODELED (not measured): NCCL's own latency/bandwidth table as printed at init ({self.source}), "
                f"{self.ranks or '?'} ranks; every algorithm/protocol it enabled"]
