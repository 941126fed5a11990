"""The `dtrain` command: one entry point for the tools, `dtrain <command> [args]`.

Each command is a module that `python -m` also runs (`dtrain train` is `python -m dtrain.engine.train`), so a command
has one implementation and one `--help`. Under torchrun: `torchrun --nproc_per_node=2 -m dtrain train --profile
smoke`. The command table names modules rather than importing them, so that `dtrain --help` starts without torch and
a command loads only its own layer.
"""

from __future__ import annotations

import runpy
import sys

from dtrain import __version__
from dtrain.common.errors import unknown

# command: (module, one line of what it does), in the order a newcomer meets them
COMMANDS = {
    "train": ("dtrain.engine.train", "train from a profile (under torchrun for several ranks)"),
    "evaluate": ("dtrain.engine.evaluate", "decode a run's split and score it with sacreBLEU"),
    "verify": ("dtrain.engine.verify", "check every sync strategy against DDP on real ranks"),
    "describe": ("dtrain.engine.describe", "show how a profile's tensor classes split the model"),
    "checkpoint": ("dtrain.engine.checkpoint", "inspect a checkpoint, or diff two runs' parameters"),
    "corpus": ("dtrain.engine.corpus", "fetch and assemble corpora beyond Multi30k (WMT14)"),
    "model": ("dtrain.engine.model", "count a model preset's parameters"),
    "bench": ("dtrain.collectives.bench", "benchmark collectives, in nccl-tests' output format"),
    "costmodel": ("dtrain.collectives.costmodel", "NCCL's cost model: predictions, fits to benchmark logs (MODELED)"),
    "nccl": ("dtrain.collectives.tools.nccl", "per-class NCCL settings: plan, tuner plugin, checks"),
    "tune": ("dtrain.analysis.tune", "what sync.strategy: auto would pick here, and its table"),
    "sweep": ("dtrain.analysis.sweep", "run a matrix of configurations, one run each"),
    "interleave": ("dtrain.analysis.interleave", "run every configuration in one job, step by step"),
    "paired": ("dtrain.analysis.paired", "compare interleaved jobs step by step against a baseline"),
    "compare": ("dtrain.analysis.compare", "compare strategies, one run each on the same batches"),
    "simulate": ("dtrain.analysis.simulate", "predict step time per strategy and bucket size (MODELED)"),
    "replay": ("dtrain.analysis.replay", "replay a recorded step's collectives on the network, without compute"),
    "recommend": ("dtrain.analysis.recommend", "per-class bucket sizes and NCCL settings for a topology (MODELED)"),
    "significance": ("dtrain.analysis.significance", "BLEU differences with paired bootstrap intervals"),
    "report": ("dtrain.analysis.report", "write the trade-off report of a set of runs"),
    "testbed": ("dtrain.analysis.testbed", "an emulated cluster: network namespaces and shaped links"),
}

# A module a command needs that only an extra installs: the extra to name in the error.
EXTRAS = {"pandas": "analysis", "matplotlib": "analysis", "sacremoses": "wmt", "pynvml": "gpu",
          "tensorboard": "tensorboard"}


def usage() -> str:
    width = max(map(len, COMMANDS))
    rows = "\n".join(f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items())
    return (f"usage: dtrain <command> [args]    (dtrain <command> --help for its own)\n\n"
            f"Data-parallel training of the Transformer and the tools to tune its gradient communication.\n\n"
            f"commands:\n{rows}\n\nprofiles shipped with dtrain can be named without a path: --profile smoke")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if argv else 2
    if argv[0] == "--version":
        print(f"dtrain {__version__}")
        return 0
    name = argv[0]
    if name not in COMMANDS:
        print(f"dtrain: error: {unknown('command', name, COMMANDS)}", file=sys.stderr)
        return 2
    module = COMMANDS[name][0]
    sys.argv = [f"dtrain {name}", *argv[1:]]  # argparse's prog, in usage lines and errors
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except ModuleNotFoundError as e:
        if e.name not in EXTRAS:
            raise
        print(f"dtrain: error: 'dtrain {name}' needs {e.name}: pip install 'dtrain[{EXTRAS[e.name]}]'",
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
