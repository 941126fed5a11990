"""A spawned rank's body in `dist.rank_process()`: on success the process ends there, without the interpreter's
finalization (nothing after the block runs, the exit status is 0); on an error spawn reports that error."""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dtrain.collectives import dist as ddist


def _rank(rank: int, init: str, out: str, fail_rank: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    with ddist.rank_process():
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t)  # the synchronous collective whose release races the interpreter's finalization
        if rank == fail_rank:
            raise ValueError(f"rank {rank} refuses")
        Path(out, f"rank{rank}").write_text(str(t.item()))
    Path(out, f"after{rank}").write_text("ran on")  # never reached: the process ended in the block


@pytest.mark.slow
def test_a_rank_ends_in_the_block_after_its_work(tmp_path):
    mp.spawn(_rank, args=(str(tmp_path / "init"), str(tmp_path), -1), nprocs=2, join=True)
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == ["3.0", "3.0"]
    assert not list(tmp_path.glob("after*"))


@pytest.mark.slow
def test_an_error_in_the_block_reaches_spawn(tmp_path):
    with pytest.raises(mp.ProcessRaisedException, match="rank 1 refuses"):
        mp.spawn(_rank, args=(str(tmp_path / "init"), str(tmp_path), 1), nprocs=2, join=True)
    assert not (tmp_path / "rank1").exists()
