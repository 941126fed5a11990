"""The training loop: micro-batches → forward → backward → gradient sync (one seam) → Adam step, with records,
validation, checkpoints and the final evaluation. It never branches on which sync strategy runs.

Preemption: SIGTERM or SIGUSR1 on any rank (`StopRequest`) stops the job at the end of the step in progress, with a
checkpoint; every rank learns of it through one small all-reduce per step, so all stop after the same step even when
only some were signalled. `dtrain.engine.train` then exits with `PREEMPTED_EXIT`.
"""

from __future__ import annotations

import math
import random
import re
import shutil
import signal
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

from dtrain.collectives import attach, nccl
from dtrain.collectives import dist as ddist
from dtrain.collectives.sync import move_optimizer
from dtrain.collectives.timing import ms_between, stamp
from dtrain.common.errors import JobFailure, UserError
from dtrain.common import host_memory
from dtrain.common.jsonl import append_jsonl, read_jsonl, rewrite_jsonl
from dtrain.common.rundir import StepRecord, ValRecord, rank_buckets_file, rank_steps_file
from dtrain.engine import checkpoint
from dtrain.engine.board import Board, summary_writer
from dtrain.engine.config import RunConfig, resolve_amp
from dtrain.engine.data import BatchStream, TokenBatcher, collate
from dtrain.engine.evaluate import score_split, write_score
from dtrain.engine.faults import Fault, FaultInjector
from dtrain.engine.host_cpu import HostCpu
from dtrain.engine.log import RunWriter
from dtrain.engine.loss import LabelSmoothing
from dtrain.engine.model import Transformer, count_parameters, sdpa_backend
from dtrain.engine.profiler import StepProfiler
from dtrain.engine.progress import Progress
from dtrain.engine.schedule import make_scheduler
from dtrain.engine.startup import load_corpus, resume_state
from dtrain.engine.telemetry import Telemetry
from dtrain.engine.tokenizer import PAD


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# The exit status of a rank stopped by a signal after saving its checkpoint: EX_TEMPFAIL of BSD's sysexits.h
# ("temporary failure ... the user is invited to retry"); resume the run with --resume.
PREEMPTED_EXIT = 75
RETUNE = "retune"  # why fit() stopped: the tuner's watch asked for a new search
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """Set by SIGTERM or SIGUSR1: the job should checkpoint and exit at the end of the current step. The handler only
    records the signal (a Python handler runs between bytecodes of the main thread, so never inside a collective);
    a repeated signal changes nothing, since torchrun's agent and a scheduler's process-group kill may both deliver
    one, and the agent escalates to SIGKILL on its own when the workers take too long."""

    def __init__(self):
        self.signum = 0  # 0: none yet; else the first signal's number

    def install(self) -> StopRequest:
        for s in STOP_SIGNALS:
            signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if not self.signum:
            self.signum = int(signum)


def samples_file(rank: int) -> str:
    return f"samples.rank{rank}.jsonl"


class Trainer:
    def __init__(self, cfg: RunConfig, run_dir: Path, device: torch.device, backend: str, faults: list[Fault] = (),
                 stop: StopRequest | None = None):
        if cfg.train.tensorboard:  # on every rank, before the corpus: all stop alike, at once
            summary_writer()
        # train.amp as this device runs it (`auto` resolved), and run.json's record of why
        cfg, self.amp = resolve_amp(cfg, device, main=ddist.rank() == 0)
        self.cfg, self.run_dir, self.device, self.backend = cfg, Path(run_dir), device, backend
        self.stop = stop  # None: no handler installed, and no per-step stop all-reduce
        self.samples: list[dict] = []  # train.record_samples: this step's micro-batches, written after it
        self.rank, self.world = ddist.rank(), ddist.world_size()
        self.faults = FaultInjector(list(faults), self.rank)
        self.phase = "start-up"  # named in the error if a collective fails or times out
        self.bad_steps = 0  # consecutive steps with non-finite gradients
        self.main = self.rank == 0
        self.writer = RunWriter(self.run_dir, self.main, self.rank, cfg.train.record_ranks)
        self.board = Board(None)  # fit() opens rank 0's with train.tensorboard
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        # Process-wide: in an interleaved job every configuration shares the allocator of its process.
        # set by the entry point around the whole run (`host_memory.kept_freed_memory`), never by the trainer
        self.host_memory = host_memory.record()

        d = cfg.data
        corpus = load_corpus(cfg)
        self.data_dir, self.tokenizer = corpus.data_dir, corpus.tokenizer
        self.train_pairs, self.val_pairs = corpus.train, corpus.val
        self.stream = BatchStream(self.train_pairs, TokenBatcher(self.train_pairs.lengths(), d.max_tokens, cfg.seed,
                                                                 self.rank, self.world))
        # The same seed on every rank gives the same initial model; dropout then differs per rank.
        torch.manual_seed(cfg.seed)
        vocab = self.tokenizer.vocab_size
        self.model = Transformer.from_config(cfg.model, vocab, PAD).to(device)
        torch.manual_seed(cfg.seed * 1000 + self.rank)
        random.seed(cfg.seed * 1000 + self.rank)
        if cfg.train.compile != "off":
            # In place (nn.Module.compile), keeping parameter names and state-dict keys; before the strategy wraps the
            # model, so every strategy calls the compiled forward through `handle.module` (docs/profiles.md).
            self.model.compile(mode=None if cfg.train.compile == "default" else cfg.train.compile,
                               backend=cfg.train.compile_backend)
        self.sync = attach(self.model, cfg.sync)
        # GPU utilization, memory and power in rank 0's step records (off without a GPU); DTRAIN_PROFILE=START:COUNT
        # traces that window of steps on every rank into <run>/profile/.
        self.telemetry = Telemetry.for_device(device) if self.main else Telemetry.off("rank 0 writes the records")
        # the step's CPU time by thread: in rank 0's step records, and with train.record_ranks in each other rank's
        self.host_cpu = HostCpu(on=self.main or cfg.train.record_ranks)
        self.profiler = StepProfiler.from_env(self.run_dir, self.rank)
        o = cfg.optim
        # Over what the strategy says this rank updates: the model's parameters, or a sharded strategy's shards.
        self.optimizer = torch.optim.Adam(self.sync.optimizer_params(), lr=1.0, betas=o.betas, eps=o.eps)
        self.scheduler = make_scheduler(self.optimizer, cfg.model.d_model, o.warmup, o.lr_factor)
        self.criterion = LabelSmoothing(vocab, PAD, o.label_smoothing)
        self.step = 0
        self.facts: dict = {}  # more facts of the job for run.json (the tuner's search)
        # Called with each step's record by fit(); True stops the run after that step with a checkpoint, and fit()
        # returns {"retune": True} (the tuner's drift check: every rank must answer alike).
        self.watch: Callable[[StepRecord], bool] | None = None
        self.recomputed = 0  # steps recorded by an interrupted attempt and computed again after resuming
        # Tell the strategy after each update that the optimizer stepped (`stepped`), as a run alone does; not in
        # turns (`turn_step`), where a sharded strategy's all-gather launched then would run behind the other
        # configurations' turns instead of inside its own next step.
        self.publish = True

    # -- checkpoints ------------------------------------------------------------------------------------------

    def state(self) -> dict | None:
        """The checkpoint: every rank's RNG state and its state of the sync strategy (PowerSGD's error feedback) are
        gathered to rank 0, which alone holds the rest."""
        self.sync.wait_params()  # a sharded strategy's updated parameters, all-gathered
        model = self.sync.model_state()  # a collective for fsdp2
        optimizer = self.sync.optimizer_state(self.optimizer)  # a collective for a sharded strategy
        mine = (rng_state(), self.sync.state_dict())
        per_rank = [None] * self.world if self.main else None
        if self.world > 1:
            dist.gather_object(mine, per_rank, dst=0)
        else:
            per_rank = [mine]
        if not self.main:
            return None
        return {"step": self.step, "model": model, "optimizer": optimizer,
                "scheduler": self.scheduler.state_dict(), "data": self.stream.state_dict(),
                "rng": [r for r, _ in per_rank], "sync": [s for _, s in per_rank],
                "model_hash": self.cfg.model_hash(), "config_hash": self.cfg.config_hash(), "world_size": self.world,
                "config": self.cfg.to_dict()}

    def save(self) -> None:
        """Rank 0 writes the checkpoint; if that fails (a full disk), every rank stops with its one-line error."""
        state = self.state()
        problem = None
        if self.main:
            try:
                checkpoint.save(self.run_dir, self.step, state, self.cfg.train.keep_ckpts)
            except JobFailure as e:
                problem = str(e)
        # Also the barrier: nobody runs ahead of a checkpoint that a restart may need.
        problem = ddist.broadcast_object(problem)
        if problem is not None:
            raise JobFailure(problem)

    def resume(self, source: Path | None = None) -> None:
        """Continue from the latest complete checkpoint (of `source`, a run directory; default this run's own);
        rank 0 chooses and reads it, and sends every rank the state (with its own entries of the per-rank lists),
        so no other rank needs the file on its disk."""
        path, state = resume_state(source or self.run_dir)
        if path is None:  # an attempt that stopped before its first checkpoint: its records are computed again
            self.recomputed = self.writer.truncate_after(0)
            self._truncate_samples()
            if self.main:
                print(f"no complete checkpoint in {self.run_dir}; starting from step 0 ({self.recomputed} recorded "
                      "steps will be computed again)", flush=True)
            return
        # A checkpoint whose checksum matches but whose contents are not a training state (another object saved
        # under its name) is an error naming the file, like an unreadable one, not skipped like a torn write: the
        # file is exactly what was written, and falling back would drop the step records past the older checkpoint
        # and later overwrite the file, so a person should look at it first.
        if state.get("model_hash") != self.cfg.model_hash():
            raise UserError(f"{path}: checkpoint is of a different model shape than the profile "
                            f"(model hash {state.get('model_hash')} vs {self.cfg.model_hash()})")
        self.sync.load_model_state(state["model"])
        self.sync.load_optimizer_state(self.optimizer, state["optimizer"])  # whole-model: any world size
        self.scheduler.load_state_dict(state["scheduler"])
        # The position counts global batches, so the remaining batches of the epoch are dealt out to this job's ranks.
        written_by = int(state["world_size"])
        self.stream.load_state_dict(state["data"], written_by)
        rngs, syncs = state["rng"], state.get("sync") or []
        if self.rank < len(rngs):
            set_rng_state(rngs[self.rank])
        else:  # a rank the checkpoint has no state for (a larger job): a fresh seed of its own, as at a start
            torch.manual_seed(self.cfg.seed * 1000 + self.rank)
            random.seed(self.cfg.seed * 1000 + self.rank)
        if self.rank < len(syncs):
            self.sync.load_state_dict(syncs[self.rank])
        elif syncs:  # what every rank holds alike (PowerSGD's iteration and Q factors), without rank 0's own error
            self.sync.load_state_dict(syncs[0], own=False)
        self.step = state["step"]
        self.recomputed = self.writer.truncate_after(self.step)
        self._truncate_samples()
        if self.main:
            resharded = "" if written_by == self.world else (
                f"; written by {written_by} ranks, the data re-sharded over {self.world} from batch "
                f"{self.stream.consumed} of epoch {self.stream.epoch}")
            print(f"resumed from {path} at step {self.step} ({self.recomputed} recorded steps past it will be "
                  f"computed again{resharded})", flush=True)

    def _truncate_samples(self) -> None:
        """Drop sample records past the resumed step: each rank from its own file, rank 0 also from the files of
        ranks this job no longer has (where the run directory is shared)."""
        paths = [self.run_dir / samples_file(self.rank)]
        if self.main:
            gone = (re.fullmatch(r"samples\.rank(\d+)\.jsonl", p.name) for p in self.run_dir.glob(samples_file("*")))
            paths += [self.run_dir / m.group(0) for m in gone if m and int(m.group(1)) >= self.world]
        for path in paths:
            if path.exists():
                rewrite_jsonl(path, [r for r in read_jsonl(path) if isinstance(r.get("step"), int)
                                     and r["step"] <= self.step])

    # -- the step ---------------------------------------------------------------------------------------------

    def train_step(self) -> StepRecord:
        """One optimizer step over `accum_steps` micro-batches; returns the step record."""
        self.model.train()
        self.host_cpu.begin()
        t_step = time.perf_counter()  # a straggler's sleep (fault slow) is part of its step, as slow compute would be
        self.faults.step_start(self.step + 1)
        poison = self.faults.poison(self.step + 1, self.model)
        data_s, spans, loss_sum, ntokens = self._forward_backward()
        if poison is not None:
            poison.remove()
        self.phase = "gradient synchronization (wait)"
        w0 = stamp(self.device)
        self.sync.wait()
        w1 = stamp(self.device)  # on CUDA: the current stream has waited for every bucket by here
        self.phase = "optimizer step"
        lr = self.scheduler.get_last_lr()[0]
        o0 = stamp(self.device)
        grad_norm, finite, loss_sum = self._optimizer_step(loss_sum)
        o1 = stamp(self.device)
        if self.publish:  # a sharded strategy sends the updated shards now; `auto` may switch candidates here
            self.sync.stepped(self.optimizer, loss_sum / max(ntokens, 1))
        # The end of the step: on CUDA the first read of an event waits for the optimizer's kernels, then every
        # interval comes from the events without further synchronization.
        optimizer_ms = ms_between(o0, o1)
        t6 = time.perf_counter()
        self.step += 1
        self.bad_steps = 0 if finite else self.bad_steps + 1
        span_ms = lambda kind: round(sum(ms_between(a, b) for a, b in spans[kind]), 3)  # noqa: E731
        return StepRecord(self.step, self.stream.epoch, loss=loss_sum / max(ntokens, 1), tokens=ntokens, lr=lr,
                          grad_norm=grad_norm, skipped=not finite, data_ms=round(data_s * 1000, 3),
                          forward_ms=span_ms("forward"), backward_ms=span_ms("backward"),
                          comm_exposed_ms=round(ms_between(w0, w1), 3), optimizer_ms=round(optimizer_ms, 3),
                          step_ms=round((t6 - t_step) * 1000, 3), time=round(time.time(), 3))

    def _forward_backward(self) -> tuple[float, dict, torch.Tensor, int]:
        """The step's micro-batches: (data seconds, {"forward"|"backward": (start, end) stamps per micro-batch},
        summed loss as a float64 0-dim tensor on the device, target tokens). All but the last accumulate locally;
        the last one's backward communicates. Nothing here waits for the device: the stamps are read, and the loss
        copied to the host, once at the end of the step."""
        t = self.cfg.train
        data_s = 0.0
        spans = {"forward": [], "backward": []}  # read after the step (on CUDA, from events)
        # float64: the sum of the float32 per-micro-batch losses as exact as the host's float sum it replaces
        loss_sum, ntokens = torch.zeros((), dtype=torch.float64, device=self.device), 0
        amp = torch.autocast(self.device.type, dtype=torch.bfloat16) if self.amp["amp"] == "bf16" else nullcontext()
        for micro in range(t.accum_steps):
            t0 = time.perf_counter()
            batch = self.stream.next().to(self.device)
            t1 = time.perf_counter()
            f0 = stamp(self.device)
            if t.record_samples:
                self.samples.append({"step": self.step + 1, "epoch": self.stream.epoch, "pairs": self.stream.last})
            # All but the last micro-batch accumulate locally; the last one communicates.
            last = micro == t.accum_steps - 1
            self.phase = "backward (gradient all-reduce)" if last else "forward/backward"
            with self.sync.no_sync() if not last else nullcontext():
                with amp:
                    logits = self.sync.module(batch.src, batch.tgt_in)  # (B, T, vocab)
                    loss = self.criterion(logits, batch.tgt_out)  # summed over target tokens
                f1 = b0 = stamp(self.device)
                (loss / (batch.ntokens * t.accum_steps)).backward()
                b1 = stamp(self.device)  # on CUDA: behind the backward kernels, not behind the collectives
                # No device sync before wait(): it would also wait for the collectives and hide them in backward.
            data_s += t1 - t0
            spans["forward"].append((f0, f1))
            spans["backward"].append((b0, b1))
            loss_sum += loss.detach().to(torch.float64)
            ntokens += batch.ntokens  # counted on the host when the batch was collated
        return data_s, spans, loss_sum, ntokens

    def _optimizer_step(self, loss_sum: torch.Tensor) -> tuple[float, bool, float]:
        """Clip by the global norm and step, unless a gradient is not finite: (the norm, whether it stepped, the
        step's summed loss as a host float)."""
        # Of the synchronized gradients: equal on every rank. With clipping, the same float32 value however the
        # strategy splits the gradient over ranks, since it scales the update.
        grad_norm = self.sync.grad_norm(exact=self.cfg.optim.clip_norm is not None)
        # The step's one copy to the host before the update, which must know whether to skip: the norm and the
        # summed loss together (float64 holds the float32 norm exactly).
        loss_sum, norm = torch.stack([loss_sum, grad_norm.to(loss_sum.device, torch.float64)]).tolist()
        # A non-finite gradient reached every rank through the all-reduce, so all ranks skip this step alike.
        finite = math.isfinite(norm)
        if finite:
            if self.cfg.optim.clip_norm:
                # Takes the parameters and scales their .grad (given bare gradient tensors it scales nothing); one
                # kind of tensor per call, which its foreach path needs (fsdp2 with the split: DTensors and the
                # whole embedding)
                params = self.sync.optimizer_params()
                for kind in dict.fromkeys(type(p) for p in params):
                    torch.nn.utils.clip_grads_with_norm_([p for p in params if type(p) is kind],
                                                         self.cfg.optim.clip_norm, grad_norm)
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm, finite, loss_sum

    @torch.no_grad()
    def validate(self) -> ValRecord:
        """Label-free validation: per-token NLL and perplexity over the whole val split, summed across ranks."""
        self.sync.wait_params()
        self.model.eval()
        batcher = TokenBatcher(self.val_pairs.lengths(), self.cfg.data.max_tokens, 0, self.rank, self.world,
                               shuffle=False)
        # Summed on the device in float64 (as exact as a host float sum) and read once; tokens counted by collate.
        nll, ntokens = torch.zeros((), dtype=torch.float64, device=self.device), 0
        for indices in batcher.shard():
            b = collate(self.val_pairs, indices).to(self.device)
            logp = torch.log_softmax(self.model(b.src, b.tgt_in).float(), dim=-1)
            mask = b.tgt_out != PAD
            nll -= logp.gather(-1, b.tgt_out[..., None]).squeeze(-1)[mask].sum().to(torch.float64)
            ntokens += b.ntokens  # (b.tgt_out != PAD).sum(), on the host
        nll, ntokens = ddist.all_reduce_sum([nll.item(), ntokens], self.device)
        return ValRecord(self.step, nll / ntokens, math.exp(nll / ntokens))

    # -- the run ----------------------------------------------------------------------------------------------

    def write_header(self) -> None:
        """The run's config.yaml, run.json (facts of this job) and tokenizer model, before its first step."""
        if self.main:
            shutil.copyfile(self.tokenizer.model_file, self.run_dir / "bpe.model")
        self.writer.write_header(
            self.cfg, backend=self.backend, world_size=self.world, ranks_per_node=ddist.local_world_size(),
            device=str(self.device), **self.amp,
            parameters=count_parameters(self.model), vocab=self.tokenizer.vocab_size,
            train_pairs=len(self.train_pairs), data_dir=str(self.data_dir), sync=self.sync.stats(),
            torch_threads=torch.get_num_threads(), host_memory=self.host_memory, nccl=nccl.run_record(), **self.facts,
        )

    def recorded_step(self) -> StepRecord:
        """One training step, written to steps.jsonl and buckets.jsonl (with its host CPU time by thread, and GPU
        telemetry where there is some)."""
        rec = self._guarded(self.train_step)
        self.host_cpu.sample_into(rec.telemetry)
        self.telemetry.sample_into(rec.telemetry)
        self.writer.step(rec)
        self.writer.buckets(self.step, self.sync.step_records())
        if self.samples:
            self.run_dir.mkdir(parents=True, exist_ok=True)  # a node without a shared disk: its own copy of the run
            append_jsonl(self.run_dir / samples_file(self.rank), self.samples)
            self.samples = []
        self.profiler.step()
        return rec

    def close(self) -> None:
        """Release the synchronization's hooks, threads and process groups (`GradSync.close`); the trainer is not
        used again."""
        self.sync.close()

    def resync(self, sync_cfg: RunConfig) -> None:
        """Train on under another `sync` section (`auto`'s search again, in the middle of the run): the current
        handle closed after its parameters are current, the new one attached to the same model, the optimizer's
        state moved through its whole-model form (`move_optimizer`)."""
        self.sync.wait_params()
        state = self.sync.optimizer_state(self.optimizer)  # a collective for a sharded strategy
        self.optimizer.zero_grad(set_to_none=True)
        self.sync.close()
        self.cfg = sync_cfg
        self.sync = attach(self.model, sync_cfg.sync)
        move_optimizer(self.optimizer, state, self.sync)

    def turn_step(self) -> StepRecord:
        """`recorded_step` of one configuration among several trained in turn (`dtrain.analysis.interleave`, the tuner's
        race). The ranks meet first, outside the timed step: each configuration then starts aligned, as its own
        previous step leaves it in a run alone, instead of absorbing the previous configuration's imbalance between
        the ranks (after `noop`, whose ranks never wait for each other, that is a whole step's difference)."""
        self.phase = "the ranks' meeting before a configuration's turn"
        self._guarded(ddist.barrier)
        self.publish = False
        return self.recorded_step()

    def stop_agreed(self) -> str | None:
        """After a step: the name of the signal some rank was asked to stop by, or None. One all-reduce of one number
        per step (the largest signal number any rank holds, 0 for none), only while a handler is installed; every
        rank calls it after the same step, so all agree on the step they stop after and name the same signal, even
        when a signal forwarded to every worker has reached only some of them yet."""
        if self.stop is None:
            return None
        signum = self.stop.signum
        if self.world > 1:
            flag = torch.tensor([float(signum)], device=self.device)
            self.phase = "stop-request all-reduce"
            self._guarded(dist.all_reduce, flag, dist.ReduceOp.MAX)
            signum = int(flag.item())
        return signal.Signals(signum).name if signum else None

    def fit(self) -> dict:
        with sdpa_backend(self.cfg.train.sdpa_backend, self.device):
            # TensorBoard's scalars of this fit, flushed and closed however it ends (preempted, failed)
            self.board = Board(self.run_dir if self.main and self.cfg.train.tensorboard else None, self.step + 1)
            try:
                return self._fit()
            finally:
                self.board.close()

    def _fit(self) -> dict:
        cfg, t = self.cfg, self.cfg.train
        self.write_header()
        start_step, t_start = self.step, time.perf_counter()
        self.telemetry.start()
        self.profiler.start(self.step)
        # Under a wall-clock budget the step count is open, so progress counts steps without an ETA.
        desc = cfg.name if t.max_minutes is None else f"{cfg.name} (budget {t.max_minutes:g} min)"
        progress = Progress(desc, None if t.max_minutes else t.max_steps, self.step, enabled=self.main)
        window = [0.0, 0, 0.0]  # since the last log line: loss x tokens, tokens, seconds
        val, stopped = None, None
        while self.step < t.max_steps:
            rec = self.recorded_step()
            self.board.step(rec)
            if rec.skipped:
                progress.write(f"step {self.step}: non-finite gradients (norm {rec.grad_norm}); update skipped "
                               f"({self.bad_steps} in a row, limit {t.max_bad_steps})")
                if self.bad_steps > t.max_bad_steps:
                    raise JobFailure(f"stopping at step {self.step}: {self.bad_steps} consecutive steps with "
                                     f"non-finite gradients (train.max_bad_steps = {t.max_bad_steps})")
            window = [window[0] + rec.loss * rec.tokens, window[1] + rec.tokens, window[2] + rec.step_ms / 1000]
            progress.update(1)
            if self.step % t.log_every == 0 or self.step == t.max_steps:
                stop = self._log_window(progress, window, rec, t_start)
                window = [0.0, 0, 0.0]
                if stop:
                    break
            if t.val_every and self.step % t.val_every == 0:
                self.phase = "validation"
                val = self._guarded(self.validate)
                self._record_eval(val)
            stopped = self.stop_agreed()
            if not stopped and self.watch is not None and self.watch(rec):
                stopped = RETUNE
            if self.step % t.ckpt_every == 0 or stopped:
                self.phase = "checkpoint"
                self._guarded(self.save)
            if stopped:
                break
        progress.close()
        self.profiler.stop()
        self.telemetry.stop()
        if stopped == RETUNE:  # the caller searches again from the checkpoint just saved
            return {"steps": self.step, "steps_this_run": self.step - start_step, "recomputed": self.recomputed,
                    "retune": True}
        if stopped:
            if self.main:
                print(f"stopped by {stopped} after step {self.step}: checkpoint saved; exiting with status "
                      f"{PREEMPTED_EXIT} (continue with --resume)", flush=True)
            return {"steps": self.step, "steps_this_run": self.step - start_step, "recomputed": self.recomputed,
                    "preempted": stopped}
        return self._wrap_up(start_step, time.perf_counter() - t_start, val)

    def _log_window(self, progress: Progress, window: list, rec: StepRecord, t_start: float) -> bool:
        """One small all-reduce per log interval: the global loss and throughput, and the stop decision of the
        wall-clock budget, taken on rank 0 and shared so that every rank stops at the same step. True: stop."""
        t = self.cfg.train
        over = t.max_minutes is not None and (time.perf_counter() - t_start) / 60 >= t.max_minutes
        self.phase = "log all-reduce"
        loss_sum, toks, stop = self._guarded(ddist.all_reduce_sum, [window[0], window[1], float(over and self.main)],
                                             self.device)
        tokens_per_s = toks / max(window[2], 1e-9)  # all ranks' tokens over rank 0's time
        progress.log(self.step, loss_sum / max(toks, 1), rec.lr, rec.step_ms, tokens_per_s)
        self.board.interval(self.step, tokens_per_s)
        if stop and self.main:
            progress.write(f"wall-clock budget of {t.max_minutes} min reached at step {self.step}")
        return bool(stop)

    def _wrap_up(self, start_step: int, train_s: float, val: ValRecord | None) -> dict:
        """After the last step: the final checkpoint and validation, the NCCL check, averaging, the final BLEU."""
        cfg, t = self.cfg, self.cfg.train
        self.sync.wait_params()
        if self.step % t.ckpt_every != 0:  # the final state, unless the loop just saved it
            self.save()
        if val is None or val.step != self.step:
            val = self.validate()
            self._record_eval(val)
        summary = {"steps": self.step, "steps_this_run": self.step - start_step, "recomputed": self.recomputed,
                   "train_s": round(train_s, 1),
                   "val_nll": round(val.val_nll, 4)}
        if self.main and cfg.collectives.parse_log:
            # NCCL's own TUNING lines against the bucket plan: did each class's buckets get the requested choice?
            # writes <run>/nccl_check.txt; None without NCCL logs
            checked = nccl.verify_run(cfg.sync, cfg.collectives, self.run_dir)
            if checked is not None:
                summary["nccl_buckets_off_choice"] = len(checked["mismatches"])
        if t.average_last > 1:
            self._average()
        if cfg.eval.at_end and self.sync.communicates:
            self.phase = "final evaluation"
            summary.update(self._guarded(self.final_eval))
        return summary

    def _record_eval(self, val: ValRecord) -> None:
        """A validation record to eval.jsonl, and to TensorBoard with train.tensorboard."""
        self.writer.eval(val)
        self.board.eval(val)

    def _guarded(self, fn, *args):
        """Run `fn`; a failed or timed-out collective becomes a one-line JobFailure naming the phase and step."""
        t0 = time.perf_counter()
        try:
            return fn(*args)
        except RuntimeError as e:  # torch.distributed.DistError and gloo/NCCL errors derive from it
            text = str(e)
            if not (isinstance(e, dist.DistError) or any(w in text.lower() for w in ("gloo", "nccl", "timed out"))):
                raise
            first = next((line for line in text.splitlines() if line.strip()), type(e).__name__)
            raise JobFailure(
                f"rank {self.rank}: {self.phase} at step {self.step + 1} failed after "
                f"{time.perf_counter() - t0:.1f} s (collectives.timeout_s = {self.cfg.collectives.timeout_s:g}); "
                f"a peer may have stopped or died: {first[:200]}") from None

    def relocate(self, run_dir: Path) -> None:
        """Continue this run in `run_dir`, its per-step records so far appended to that directory's (the tuner's
        winner moves from its candidate folder to the run's own). Each rank moves the files it writes; the
        candidate folder keeps its copy."""
        old, self.run_dir = self.run_dir, Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        own = {rank_buckets_file(self.rank), rank_steps_file(self.rank), samples_file(self.rank)}
        for src in old.glob("*.jsonl"):
            # rank 0 writes the run's files, each rank its own per-rank ones (moved by that rank alone)
            if src.name in own or (self.main and ".rank" not in src.name):
                append_jsonl(self.run_dir / src.name, read_jsonl(src))
        self.writer = RunWriter(self.run_dir, self.main, self.rank, self.cfg.train.record_ranks)

    def _average(self) -> None:
        """Average the last k complete checkpoints into <run>/averaged.pt (rank 0, from its disk) and evaluate with
        it on every rank (sent through the process group)."""
        self.sync.load_model_state(checkpoint.average_on_main(self.run_dir, self.cfg.train.average_last))
        self.sync.wait_params()

    def final_eval(self) -> dict:
        record = score_split(self.model, self.tokenizer, self.cfg, self.cfg.eval, self.device)
        if record is None:
            return {}
        label = "averaged" if self.cfg.train.average_last > 1 else f"step-{self.step:07d}"
        record = write_score(self.run_dir, record, step=self.step, model=label)
        self.board.eval(record)
        return {"bleu": record["bleu"], "signature": record["signature"], "decode_s": record["decode_s"]}
