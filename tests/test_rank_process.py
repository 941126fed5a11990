"""A spawned rank's body in `dist.rank_process()`: on success the process ends there, without the interpreter's
finalization (nothing after the block runs, the exit status is 0); on an error spawn reports that error. And what
`dist.spawn` gives each rank of the caller's process."""

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import launch_ranks
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
    ddist.spawn(_rank, (str(tmp_path / "init"), str(tmp_path), -1), 2)
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == ["3.0", "3.0"]
    assert not list(tmp_path.glob("after*"))


@pytest.mark.slow
def test_an_error_in_the_block_reaches_spawn(tmp_path):
    with pytest.raises(mp.ProcessRaisedException, match="rank 1 refuses"):
        ddist.spawn(_rank, (str(tmp_path / "init"), str(tmp_path), 1), 2)
    assert not (tmp_path / "rank1").exists()


def _report(rank: int, out: str) -> None:
    Path(out, f"rank{rank}.json").write_text(json.dumps({"env": os.environ.get("DTRAIN_SPAWN_PROBE"),
                                                         "cwd": os.getcwd()}))


@pytest.mark.slow
def test_spawned_ranks_see_the_callers_environment_and_folder_at_each_call(tmp_path, monkeypatch):
    """The ranks fork from a server started by an earlier call, which keeps its own environment and folder: each
    rank still gets the caller's, as at this call."""
    ddist.spawn(_report, (str(tmp_path),), 1)  # the server runs from here on, if no earlier test started it
    monkeypatch.setenv("DTRAIN_SPAWN_PROBE", "set after the server started")
    monkeypatch.chdir(tmp_path)
    ddist.spawn(_report, (str(tmp_path),), 2)
    for r in range(2):
        seen = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert seen == {"env": "set after the server started", "cwd": str(tmp_path)}


@pytest.mark.slow
def test_a_forked_rank_that_hangs_is_stopped_with_its_stacks(tmp_path):
    """`launch_ranks` (tests/conftest.py) stops ranks still running at its timeout, and its error carries where each
    one was: a hang in CI is then diagnosed from its log."""
    script = tmp_path / "hangs.py"
    script.write_text("import time\n\n\ndef wait_forever():\n    time.sleep(600)\n\n\nwait_forever()\n")
    with pytest.raises(TimeoutError) as e:
        launch_ranks([script], cwd=tmp_path, timeout=3)
    for r in range(2):
        assert f"rank {r}:" in str(e.value)
    assert str(e.value).count('hangs.py", line 5 in wait_forever') == 2
