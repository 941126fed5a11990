"""Checkpoints that cannot be half-written, the latest complete one, and the paper's checkpoint averaging.

`<run>/checkpoints/step-0001000.pt` is written to a temporary name, flushed and renamed; its sha256 goes into
`step-0001000.pt.sha256` only after that, so a checkpoint without a matching checksum file is incomplete or corrupt
and is skipped. Older checkpoints are pruned only once the new one is complete; a write that fails (a full disk)
removes what it wrote and is a one-line `JobFailure`, so the previous checkpoint stays the latest complete one.

A checkpoint is read with `torch.load(weights_only=True)`: tensors, dicts, lists, tuples, numbers and strings, which
is all a training state holds (model, optimizer and scheduler state, RNG states, data position, config). A file that
names anything else (a class, a function) is refused rather than unpickled, since unpickling it could run code.

No filesystem is assumed to be shared between nodes: only rank 0 reads the checkpoint to resume from and writes the
averaged model; `load_on_main` and `average_on_main` send what they hold to the other ranks through the process group.

    python -m dtrain.engine.checkpoint inspect <checkpoint>
    python -m dtrain.engine.checkpoint diff <run-or-checkpoint A> <run-or-checkpoint B>
"""

from __future__ import annotations

import argparse
import hashlib
import os
import pickle
import re
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from dtrain.collectives import dist as ddist
from dtrain.common.errors import JobFailure, UserError, exit_on_user_error
from dtrain.common.files import replace_atomically

CKPT_DIR = "checkpoints"
AVERAGED = "averaged.pt"  # in the run directory, written by `save_averaged`


def ckpt_dir(run_dir: Path) -> Path:
    return Path(run_dir) / CKPT_DIR


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def checksum_file(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def save(run_dir: Path, step: int, state: dict, keep: int) -> Path:
    """Write `state` as the checkpoint of `step` atomically, then prune all but the newest `keep`.

    If any write fails (no space, I/O error), nothing of this checkpoint stays behind and a one-line JobFailure names
    the file: the newest complete checkpoint is still the previous one, which is what `latest` and `--resume` take.
    """
    directory = ckpt_dir(run_dir)
    path = directory / f"step-{step:07d}.pt"
    tmp = directory / f".{path.name}.tmp"
    renamed = False  # once True, `path` holds this write's bytes, complete only when its checksum file is written
    try:
        directory.mkdir(parents=True, exist_ok=True)
        _save_synced(state, tmp)
        digest = sha256_file(tmp)
        os.replace(tmp, path)
        renamed = True
        replace_atomically(checksum_file(path), f"{digest}  {path.name}\n")
    except Exception as e:
        tmp.unlink(missing_ok=True)
        if renamed:  # a step file without its checksum would only be skipped later: remove it and free the space
            path.unlink(missing_ok=True)
            checksum_file(path).unlink(missing_ok=True)
        failure = _disk_failure(e, path, "checkpoint", "the earlier checkpoints are untouched")
        if failure is None:
            raise  # not the disk: a bug (say, an unpicklable state), with its traceback
        raise failure from None
    for old in list_checkpoints(run_dir)[:-keep]:
        old.unlink(missing_ok=True)
        checksum_file(old).unlink(missing_ok=True)
    return path


def save_averaged(run_dir: Path, model: dict[str, torch.Tensor], sources: list[Path]) -> Path:
    """`<run>/averaged.pt`: the mean of the models in `sources` (see `average`), written whole or not at all; a
    failed write is a one-line JobFailure like a checkpoint's."""
    path = Path(run_dir) / AVERAGED
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        _save_synced({"model": model, "averaged": [p.name for p in sources]}, tmp)
        os.replace(tmp, path)
    except Exception as e:
        tmp.unlink(missing_ok=True)
        failure = _disk_failure(e, path, "averaged model", "the checkpoints it averages are untouched")
        if failure is None:
            raise
        raise failure from None
    return path


def _save_synced(state, tmp: Path) -> None:
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def _disk_failure(e: Exception, path: Path, what: str, untouched: str) -> JobFailure | None:
    """The one-line error for a write of `path` that the disk refused (no space, I/O error); None if `e` is not that."""
    os_error = _os_error(e)
    if os_error is None:
        return None
    reason = os_error.strerror or str(os_error)
    return JobFailure(f"{path}: {what} not written ({reason[:1].lower() + reason[1:]}); {untouched}")


def _os_error(e: BaseException) -> OSError | None:
    """The OSError behind `e`: torch.save reports a failed write of its file object as a RuntimeError ("unexpected
    pos ...") raised while handling the OSError that the file raised."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoint files of a run, oldest first (complete or not)."""
    directory = ckpt_dir(run_dir)
    return sorted(directory.glob("step-*.pt")) if directory.is_dir() else []


def verify(path: Path) -> str | None:
    """None if the checkpoint's checksum file exists and matches, else what is wrong."""
    side = checksum_file(path)
    if not side.is_file():
        return "no checksum file (incomplete write?)"
    expected = side.read_text().split()[0] if side.read_text().split() else ""
    actual = sha256_file(path)
    return None if actual == expected else f"checksum mismatch ({actual[:12]}… on disk, {expected[:12]}… recorded)"


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoints whose checksum matches, oldest first; a bad one is skipped with a warning."""
    good = []
    for path in list_checkpoints(run_dir):
        problem = verify(path)
        if problem:
            warnings.warn(f"skipping checkpoint {path}: {problem}", stacklevel=2)
        else:
            good.append(path)
    return good


def latest(run_dir: Path) -> Path | None:
    good = complete_checkpoints(run_dir)
    return good[-1] if good else None


# Besides "model": what `Trainer.state` writes and `Trainer.resume` reads back (an averaged.pt holds only "model").
TRAINING_KEYS = ("step", "optimizer", "scheduler", "data", "rng", "model_hash", "world_size")


def load(path: Path, map_location="cpu", keys=()) -> dict:
    """The checkpoint's state dict, which must hold "model" (parameter name → tensor) and `keys`.

    A matching checksum only says the file is what was written, not that dtrain wrote it (a `torch.save` of some
    other object, a checkpoint of another tool), so the contents are checked too before any caller indexes them.
    Only tensors and plain data are unpickled (`weights_only=True`); a file naming any other global is refused, since
    unpickling it could run code (see "torch.load" and "weights_only" in the PyTorch serialization docs).
    """
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise UserError(f"{path}: checkpoint not found") from None
    except pickle.UnpicklingError as e:  # the weights-only unpickler meeting anything it does not allow
        named = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        said = re.search(r"WeightsUnpickler error: ([^\n]{1,120})", str(e))
        detail = f"it names {named.group(1)}" if named else said.group(1).rstrip(". ") if said else "unpickling failed"
        raise UserError(f"{path}: refused: holds more than tensors and plain data ({detail}); loading it could run "
                        "code from the file") from None
    except Exception as e:  # truncated zip, wrong format: the user's file, not dtrain's bug
        raise UserError(f"{path}: not a readable checkpoint ({e.__class__.__name__})") from None
    if not isinstance(state, dict):
        raise UserError(f"{path}: not a dtrain checkpoint (holds a {type(state).__name__}, not a dict)")
    missing = [k for k in ("model", *keys) if k not in state]
    if missing:
        raise UserError(f"{path}: not a dtrain checkpoint (no {', '.join(repr(k) for k in missing)})")
    model = state["model"]
    if not (isinstance(model, dict) and model and all(isinstance(v, torch.Tensor) for v in model.values())):
        raise UserError(f"{path}: not a dtrain checkpoint ('model' is not a mapping of parameter names to tensors)")
    return state


def average(paths: list[Path]) -> dict[str, torch.Tensor]:
    """The element-wise mean of the models' parameters in `paths` (section 6.1: the last 5 checkpoints)."""
    avg: dict[str, torch.Tensor] = {}
    for path in paths:
        model = load(path)["model"]
        for k, v in model.items():
            if k in avg:
                avg[k] += v.double()
            else:
                avg[k] = v.double().clone()
    return {k: (v / len(paths)).to(torch.float32) for k, v in avg.items()}


# ---------------------------------------------------------------------------------------------------------------
# Without a shared filesystem: rank 0 reads or writes, the process group carries the result


PER_RANK_KEYS = ("rng", "sync")  # lists in a training state with one entry per rank that wrote it


def load_on_main(path: Path, keys=(), per_rank=PER_RANK_KEYS) -> dict:
    """`load(path, keys=keys)` on rank 0, its state dict sent to every rank through the process group: the other
    ranks never open `path`, which need exist only on rank 0's disk. A refused or unreadable file is the same
    one-line UserError on every rank.

    Of each list under `per_rank`, rank r receives only entries 0 and r (the others are None, the length is kept),
    so what a rank receives does not grow with the number of ranks that wrote the checkpoint."""
    lists: dict[str, list] = {}  # filled on rank 0 only

    def read() -> tuple[dict, dict]:
        state = load(path, keys=keys)
        for k in per_rank:
            if isinstance(state.get(k), list):
                lists[k] = state.pop(k)
        return state, {k: (len(v), v[0] if v else None) for k, v in lists.items()}

    state, heads = _main_does(read)
    if ddist.is_main():
        state.update(lists)
    own = {}
    if ddist.world_size() > 1:
        # One object per rank: its own entries, through torch.distributed.scatter_object_list.
        box = [None]
        dist.scatter_object_list(box, [{k: v[r] if r < len(v) else None for k, v in lists.items()}
                                       for r in range(ddist.world_size())] if ddist.is_main() else None, src=0)
        own = box[0]
    if not ddist.is_main():
        r = ddist.rank()
        for k, (n, head) in heads.items():
            entries = [None] * n
            if n:
                entries[0] = head
            if r < n:
                entries[r] = own[k]
            state[k] = entries
    return state


def average_on_main(run_dir: Path, last: int) -> dict[str, torch.Tensor]:
    """Rank 0 averages its last `last` complete checkpoints into `<run>/averaged.pt` (see `save_averaged`); every rank
    gets the averaged model (parameter name → float32 tensor, on the CPU) from rank 0, not from the file. A failed
    write is the same JobFailure on every rank."""

    def averaged() -> dict[str, torch.Tensor]:
        paths = complete_checkpoints(run_dir)[-last:]
        if not paths:
            raise JobFailure(f"{ckpt_dir(run_dir)}: no complete checkpoint to average")
        model = average(paths)
        save_averaged(run_dir, model, paths)
        return model

    return _main_does(averaged)


def _main_does(fn):
    """`fn()` on rank 0, its result broadcast to every rank (a pickle of CPU tensors, through
    `torch.distributed.broadcast_object_list`). A UserError or JobFailure on rank 0 is raised on every rank with the
    same message and type, so every rank exits with the same status; anything else is a bug: rank 0 raises it with
    its traceback, the others a JobFailure naming it."""
    result, failure = None, None
    if ddist.is_main():
        try:
            result = fn()
        except (UserError, JobFailure) as e:
            failure = (type(e).__name__, str(e))
        except Exception as e:
            failure = ("bug", f"rank 0 failed: {type(e).__name__}: {e}")
            ddist.broadcast_object((None, failure))
            raise
    result, failure = ddist.broadcast_object((result, failure))
    if failure is not None:
        kind, message = failure
        raise (UserError if kind == "UserError" else JobFailure)(message)
    return result


# ---------------------------------------------------------------------------------------------------------------
# Command line


def _resolve(target: str) -> tuple[Path, dict]:
    path = Path(target)
    if path.is_dir():
        found = latest(path)
        if found is None:
            raise UserError(f"{path}: no complete checkpoint in {ckpt_dir(path)}")
        path = found
    return path, load(path)


def _cmd_inspect(args) -> int:
    path = Path(args.checkpoint)
    if not path.is_file():
        raise UserError(f"{path}: checkpoint not found")
    problem = verify(path)
    print(f"checkpoint  {path}")
    try:
        state = load(path)
    except UserError as e:  # a truncated file still gets its checksum status reported
        print(f"checksum    {'ok' if problem is None else problem}")
        print(f"contents    unreadable: {str(e).split(': ', 1)[-1]}")
        return 1
    n = sum(v.numel() for v in state["model"].values())
    data = state.get("data") if isinstance(state.get("data"), dict) else {}  # absent from an averaged.pt
    print(f"step        {state.get('step')}")
    print(f"config hash {state.get('config_hash')}")
    print(f"model hash  {state.get('model_hash')}")
    print(f"parameters  {n:,}")
    print(f"data        epoch {data.get('epoch')}, step {data.get('step')}")
    print(f"world size  {state.get('world_size')}")
    print(f"checksum    {'ok' if problem is None else problem}")
    return 0 if problem is None else 1


def _cmd_diff(args) -> None:
    (pa, a), (pb, b) = _resolve(args.a), _resolve(args.b)
    ma, mb = a["model"], b["model"]
    if ma.keys() != mb.keys() or any(ma[k].shape != mb[k].shape for k in ma):
        raise UserError(f"{pa} and {pb} hold models of different shapes")
    diffs = {k: (ma[k].double() - mb[k].double()).abs().max().item() if ma[k].numel() else 0.0 for k in ma}
    where = max(diffs, key=diffs.get)
    print(f"max |A - B| over parameters: {diffs[where]:.6g} (largest in {where})")
    oa, ob = a.get("optimizer"), b.get("optimizer")
    if isinstance(oa, dict) and isinstance(ob, dict) and "state" in oa and "state" in ob:
        same = _states_equal(oa["state"], ob["state"])
        print(f"optimizer states: {'identical' if same else 'differ'}")


def _states_equal(x, y) -> bool:
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and x.shape == y.shape and torch.equal(x, y)
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(_states_equal(x[k], y[k]) for k in x)
    return x == y


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m dtrain.engine.checkpoint")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("inspect", help="a checkpoint's step, model hash and checksum status")
    p.add_argument("checkpoint")
    p = sub.add_parser("diff", help="largest parameter difference between two runs or checkpoints")
    p.add_argument("a")
    p.add_argument("b")
    args = ap.parse_args(argv)
    with exit_on_user_error("dtrain.engine.checkpoint"):
        return {"inspect": _cmd_inspect, "diff": _cmd_diff}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
