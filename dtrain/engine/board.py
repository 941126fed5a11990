"""TensorBoard event files of a run (`train.tensorboard: true`): rank 0 writes <run>/tensorboard/ through
`torch.utils.tensorboard.SummaryWriter`, from the very records that go to steps.jsonl and eval.jsonl, so the two
agree.

    train/loss  train/lr  train/grad_norm  train/step_ms  train/comm_exposed_ms    every step: its StepRecord
    train/tokens_per_s    every train.log_every steps: all ranks' target tokens per second over the interval,
                          the figure the progress line shows
    val/nll  val/ppl      every ValRecord (train.val_every, and at the end)
    <split>/bleu          the final BLEU score (val/bleu or test/bleu, after eval.split)

    tensorboard --logdir runs/        # every run under runs/, each under its folder's name

torch.utils.tensorboard needs the `tensorboard` package, an optional extra (`pip install 'dtrain[tensorboard]'`):
it is imported only by a run that asks for it.
"""

from __future__ import annotations

from pathlib import Path

from dtrain.common.errors import UserError
from dtrain.common.rundir import StepRecord, ValRecord

FOLDER = "tensorboard"  # <run>/tensorboard/


def summary_writer():
    """torch's SummaryWriter class; a one-line error naming the key where the tensorboard package is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # torch.utils.tensorboard raises it without the tensorboard package
        raise UserError("train.tensorboard: true needs the tensorboard package: "
                        "pip install 'dtrain[tensorboard]'") from None
    return SummaryWriter


class Board:
    """The scalars of one `Trainer.fit` (rank 0 with `train.tensorboard`); `Board(None)` writes nothing.

    `first_step`: the first step this process trains. A resumed run opens a new event file in the same folder,
    which begins with TensorBoard's restart marker (SummaryWriter's `purge_step`): TensorBoard then hides what the
    interrupted attempt wrote from that step on, the steps computed again, as the resume drops them from
    steps.jsonl."""

    def __init__(self, run_dir: Path | None, first_step: int = 1):
        self.writer = None
        if run_dir is not None:
            self.writer = summary_writer()(log_dir=str(Path(run_dir) / FOLDER),
                                           purge_step=first_step if first_step > 1 else None)
        self.last_step = 0  # the last step written: a step seen again in this process is not written twice

    def step(self, rec: StepRecord) -> None:
        """One step's record, stamped with its own wall-clock time (`time`), as in steps.jsonl."""
        if self.writer is None or rec.step <= self.last_step:
            return
        self.last_step = rec.step
        for tag, value in (("loss", rec.loss), ("lr", rec.lr), ("grad_norm", rec.grad_norm),
                           ("step_ms", rec.step_ms), ("comm_exposed_ms", rec.comm_exposed_ms)):
            self.writer.add_scalar(f"train/{tag}", value, rec.step, walltime=rec.time)

    def interval(self, step: int, tokens_per_s: float) -> None:
        """The end of a log interval: its throughput; and the events so far reach the disk, as often as the
        progress line does."""
        if self.writer is None:
            return
        self.writer.add_scalar("train/tokens_per_s", tokens_per_s, step)
        self.writer.flush()

    def eval(self, record: ValRecord | dict) -> None:
        """A validation record, or the BLEU record `dtrain.engine.evaluate.write_score` returns (split, bleu, step)."""
        if self.writer is None:
            return
        if isinstance(record, ValRecord):
            self.writer.add_scalar("val/nll", record.val_nll, record.step)
            self.writer.add_scalar("val/ppl", record.val_ppl, record.step)
        else:
            self.writer.add_scalar(f"{record['split']}/bleu", record["bleu"], record["step"])
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
