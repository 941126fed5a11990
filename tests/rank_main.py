"""A rank of tests/conftest.py's `launch_ranks`, in a process forked from `dtrain.collectives.dist.spawn`'s server
(torch already imported): it runs `python ARGS` as a new interpreter would, with torchrun's variables for its rank.
A module of its own, so that the forked process imports only this, not the test session's conftest."""

import atexit
import faulthandler
import os
import runpy
import signal
import sys
import traceback

import torch


def run(rank: int, args: list[str], cwd: str, port: int, nproc: int, out: str) -> None:
    """Rank `rank` of `nproc`: `python ARGS` in `cwd`, its output to files in `out` (stdout<rank>, stderr<rank>)."""
    os.environ.update(OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0")
    torch.set_num_threads(1)  # what OMP_NUM_THREADS=1 gives a new interpreter: the server's torch read it already
    os.chdir(cwd)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        f = os.open(_path(out, rank, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `launch_ranks` asks a rank that hangs for its stacks
    try:
        if args[0] == "-m":  # as `python -m`: the folder it runs in first on the path
            sys.argv = args[1:]
            sys.path.insert(0, cwd)
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:  # as `python script`: the script's folder first on the path
            sys.argv = args
            sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()  # as the interpreter prints an uncaught error, with its status
        raise SystemExit(1)
    finally:
        atexit._run_exitfuncs()  # a forked process ends without the interpreter's exit, where these run
        sys.stdout.flush()
        sys.stderr.flush()


def output(out: str, rank: int, name: str) -> str:
    """What rank `rank` wrote to its `name` ("stdout" or "stderr"); empty where it ended before opening it."""
    path = _path(out, rank, name)
    if not os.path.exists(path):
        return ""
    with open(path, errors="replace") as f:
        return f.read()


def _path(out: str, rank: int, name: str) -> str:
    return os.path.join(out, f"{name}{rank}")
