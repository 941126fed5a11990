"""What a person watching a run sees: the plain progress lines where stderr is not a terminal (a batch job's log),
tqdm's bar where it is, and the TensorBoard events of `train.tensorboard` (read back with TensorBoard's own reader).

The run: four steps of dtrain/profiles/smoke.yaml with `train.amp: auto` in this process, on a one-rank gloo group
(as a plain `python -m dtrain.engine.train` runs), its stderr a file. And `dtrain.common.progress.Bar`, the other
long commands' progress, in a terminal and in a file.
"""

import contextlib
import io
import json
import re
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import dtrain
from dtrain.collectives import dist as ddist
from dtrain.common.errors import UserError
from dtrain.common.progress import Bar
from dtrain.common.jsonl import read_jsonl
from dtrain.common.rundir import StepRecord
from dtrain.engine import config as config_mod
from dtrain.engine.board import FOLDER, Board, summary_writer
from dtrain.engine.host_cpu import bf16_native
from dtrain.engine.log import source
from dtrain.engine.progress import Progress
from dtrain.engine.trainer import Trainer

PROFILE = "dtrain/profiles/smoke.yaml"
# validation at the end only (the whole val split: seconds)
SETTINGS = ["train.max_steps=4", "train.log_every=2", "train.val_every=0", "eval.at_end=false",
            "train.average_last=1", "train.tensorboard=true", "train.amp=auto"]
LINE = re.compile(r"smoke step (\d+)/4 loss (\d+\.\d{3}) lr (\d\.\de-\d\d) step_ms (\d+) tok/s ([\d,]+) "
                  r"elapsed (\d\d:\d\d) eta (\d\d:\d\d)")


def step_record(step: int) -> StepRecord:
    return StepRecord(step, 0, loss=7.0, tokens=100, lr=1e-3, grad_norm=1.0, skipped=False, data_ms=0.1,
                      forward_ms=1.0, backward_ms=2.0, comm_exposed_ms=0.5, optimizer_ms=1.0, step_ms=10.0,
                      time=1000.0 + step)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(scope="module")
def fitted(tmp_path_factory, multi30k_dir):
    """The run's directory and what it wrote to stderr."""
    run = tmp_path_factory.mktemp("fit") / "run"
    run.mkdir()
    cfg = config_mod.load(PROFILE, SETTINGS)
    owned = not dist.is_initialized()
    err = io.StringIO()  # not a terminal
    try:
        with contextlib.redirect_stderr(err):
            Trainer(cfg, run, ddist.init(cfg.collectives)[0], "gloo").fit()
    finally:
        if owned:
            dist.destroy_process_group()
    return run, err.getvalue()


def window(steps: list[dict]) -> tuple[str, str]:
    """A log interval's loss and tokens per second, as the progress line prints them, from its step records."""
    tokens = sum(s["tokens"] for s in steps)
    seconds = sum(s["step_ms"] / 1000 for s in steps)
    return f"{sum(s['loss'] * s['tokens'] for s in steps) / tokens:.3f}", f"{tokens / seconds:,.0f}"


@pytest.mark.slow
def test_plain_progress_lines_where_stderr_is_not_a_terminal(fitted):
    run, err = fitted
    lines = [line for line in err.splitlines() if line.startswith("smoke step")]
    assert len(lines) == 2 and all(LINE.fullmatch(line) for line in lines), err
    assert "\r" not in err  # no bar redraws
    steps = read_jsonl(run / "steps.jsonl")
    for line, interval in zip(lines, (steps[:2], steps[2:])):
        step, loss, lr, step_ms, tok_s, _, eta = LINE.fullmatch(line).groups()
        last = interval[-1]
        assert int(step) == last["step"] and (loss, tok_s) == window(interval)
        assert lr == f"{last['lr']:.1e}" and step_ms == f"{last['step_ms']:.0f}"
    assert LINE.fullmatch(lines[-1]).group(7) == "00:00"  # nothing left after the last step


@pytest.mark.slow
def test_tensorboard_events_are_the_run_records(fitted):
    run, err = fitted
    events = EventAccumulator(str(run / FOLDER))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"train/loss", "train/lr", "train/grad_norm", "train/step_ms",
                                             "train/comm_exposed_ms", "train/tokens_per_s", "val/nll", "val/ppl"}

    def scalars(tag):  # TensorBoard keeps float32 values
        return [(e.step, e.value) for e in events.Scalars(tag)]

    f32 = lambda x: float(np.float32(x))  # noqa: E731
    steps = read_jsonl(run / "steps.jsonl")
    for field in ("loss", "lr", "grad_norm", "step_ms", "comm_exposed_ms"):  # named as in steps.jsonl
        assert scalars(f"train/{field}") == [(s["step"], f32(s[field])) for s in steps], field
    assert [e.wall_time for e in events.Scalars("train/loss")] == [s["time"] for s in steps]
    vals = [e for e in read_jsonl(run / "eval.jsonl") if e["kind"] == "val"]
    assert scalars("val/nll") == [(e["step"], f32(e["val_nll"])) for e in vals] and [e["step"] for e in vals] == [4]
    # The throughput the progress lines show (rounded there to a whole number), at the end of each log interval
    shown = [float(LINE.fullmatch(line).group(5).replace(",", "")) for line in err.splitlines()
             if line.startswith("smoke step")]
    tokens_per_s = scalars("train/tokens_per_s")
    assert [s for s, _ in tokens_per_s] == [2, 4]
    assert all(abs(v - printed) <= 0.5 + 1e-6 * v for (_, v), printed in zip(tokens_per_s, shown, strict=True))


@pytest.mark.slow
def test_run_json_records_the_dtrain_version_and_commit_and_the_precision(fitted):
    run, _ = fitted
    header = json.loads((run / "run.json").read_text())
    versions = header["versions"]
    assert versions["dtrain"] == dtrain.__version__
    assert {k: versions[k] for k in ("commit", "dirty") if k in versions} == source()
    # train.amp: auto, resolved on this CPU: bf16 where it has bf16 instructions, else fp32, and why
    native, reason = bf16_native(torch.device("cpu"))
    amp = "bf16" if native else "fp32"
    assert {k: header[k] for k in ("amp", "amp_setting", "amp_reason")} == {
        "amp": amp, "amp_setting": "auto", "amp_reason": reason}
    # it names the capability torch uses here, or the variable that caps it (run as an older CPU would)
    assert reason.startswith(f"CPU capability {torch.backends.cpu.get_cpu_capability()} ") or "_CPU_" in reason
    assert config_mod.load_recorded(run / "config.yaml").train.amp == amp  # the precision it trained in


def test_a_step_seen_again_is_not_written_twice(tmp_path):
    board = Board(tmp_path)
    for step in (1, 2, 2, 1, 3):
        board.step(step_record(step))
    board.close()
    events = EventAccumulator(str(tmp_path / FOLDER))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3]


def test_a_resumed_run_hides_the_steps_it_computes_again(tmp_path):
    """Steps 1-5 written, the checkpoint at 3: the resumed process writes 4-6 anew, and TensorBoard shows each step
    once, 4 and 5 from the resumed run (as steps.jsonl keeps them)."""
    first = Board(tmp_path)
    for step in range(1, 6):
        first.step(step_record(step))
    first.close()
    resumed = Board(tmp_path, first_step=4)
    for step in range(4, 7):
        rec = step_record(step)
        rec.loss = 5.0
        resumed.step(rec)
    resumed.close()
    assert len(list((tmp_path / FOLDER).iterdir())) == 2  # an event file each
    events = EventAccumulator(str(tmp_path / FOLDER))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 7.0), (2, 7.0), (3, 7.0), (4, 5.0),
                                                                          (5, 5.0), (6, 5.0)]


def test_without_the_tensorboard_package_the_key_is_a_one_line_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # its import now fails, as when not installed
    with pytest.raises(UserError, match=r"^train.tensorboard: .* pip install 'dtrain\[tensorboard\]'$"):
        summary_writer()
    cfg = config_mod.load(PROFILE, ["train.tensorboard=true"])
    with pytest.raises(UserError, match="train.tensorboard"):  # before anything else: no corpus, no group
        Trainer(cfg, "unused", None, "gloo")
    Board(None).step(step_record(1))  # off: nothing to import, nothing written


def test_a_terminal_keeps_the_bar_and_other_ranks_show_nothing():
    for enabled, shown in ((True, True), (False, False)):
        tty = Terminal()
        with contextlib.redirect_stderr(tty):
            progress = Progress("smoke", 6, 0, enabled=enabled)
            progress.update(3)
            progress.log(3, 6.5, 1.2e-4, 150.0, 13305.0)
            progress.close()
        out = tty.getvalue()
        assert "smoke step" not in out
        assert ("loss=6.500" in out and "tok_s=13,305" in out and "\r" in out) == shown, out


def test_a_long_command_s_bar_is_plain_lines_in_a_file_and_tqdm_s_in_a_terminal(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("dtrain.common.progress.time.monotonic", lambda: clock[0])
    err, out = io.StringIO(), io.StringIO()  # not terminals
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        bar = Bar(40, "interleaved x4", "step", every_s=30)
        for i in range(40):
            clock[0] += 2.0  # a 2 s step: a line every 15 steps
            bar.update()
            bar.set_postfix_str(f"ddp {i} ms")
        bar.write("a message of its own")
        bar.close()
        quiet = Bar(3, "building", "config", enabled=False)  # another rank's: nothing
        quiet.update(3)
        quiet.close()
    assert err.getvalue().splitlines() == [
        "interleaved x4 step 15/40 ddp 13 ms elapsed 00:30 eta 00:50",
        "interleaved x4 step 30/40 ddp 28 ms elapsed 01:00 eta 00:20",
        "interleaved x4 step 40/40 ddp 39 ms elapsed 01:20 eta 00:00",  # at close: the count reached
    ]
    assert "\r" not in err.getvalue() and out.getvalue() == "a message of its own\n"
    tty = Terminal()
    with contextlib.redirect_stderr(tty):
        bar = Bar(3, "sweep m", "run")
        bar.update()
        bar.set_postfix(done=1, failed=0)
        bar.close()
    assert "\r" in tty.getvalue() and "sweep m" in tty.getvalue() and "done=1, failed=0" in tty.getvalue()
