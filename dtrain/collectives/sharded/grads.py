"""Stand-ins for the `.grad` of parameters whose averaged gradient a sharding strategy holds only in shards.

After `sharded`'s `wait()` each rank holds the mean of just its shard of each bucket (`ShardedReducer`'s `shard.grad`,
(s,)); the model's parameters' own `.grad` are views of the local, zeroed bucket buffer. A loop that reads them, as
`torch.nn.utils.clip_grad_norm_(model.parameters(), c)` does, would get a norm of zeros and clip nothing. A
`HiddenGrad` stands in for each such `.grad` until the next forward: any torch call that reads it raises a one-line
`UserError` naming the call and what to use instead. It holds no memory of its own (a zero expanded to the
parameter's shape, stride 0).
"""

from __future__ import annotations

import os
import traceback

import torch

from dtrain.common.errors import UserError


class HiddenGrad(torch.Tensor):
    """A `.grad` that must not be read: see the module's docstring. `strategy` names the strategy in the error."""

    strategy = "sharded"  # the only strategy that hides gradients

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise UserError(f"{_caller()} read the gradients of the model's parameters, but under sync.strategy "
                        f"'{cls.strategy}' each rank holds only its shard of the averaged gradient: clip with "
                        "model.clip_grad_norm_(max_norm) (dtrain.collectives.wrap) or handle.grad_norm(), and read "
                        "gradients from the optimizer's parameters")


def hidden_grad(param: torch.Tensor) -> HiddenGrad:
    """A `HiddenGrad` of `param`'s shape and dtype (assignable to `param.grad`)."""
    zero = torch.zeros((), dtype=param.dtype, device=param.device)
    return torch.Tensor._make_subclass(HiddenGrad, zero.expand(param.shape))


def _caller() -> str:
    """The call that reached a `HiddenGrad`, named as the loop wrote it: the outermost public torch function below
    the loop's own frame, with the loop's file and line (e.g. "clip_grad_norm_ (train.py:42)")."""
    torch_dir = os.path.dirname(torch.__file__)
    own_dir = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))  # dtrain/
    frames = traceback.extract_stack()[:-2]
    inside: list[traceback.FrameSummary] = []  # torch's frames below the loop's, innermost first
    for frame in reversed(frames):
        if frame.filename.startswith(torch_dir):
            inside.append(frame)
        elif not frame.filename.startswith(own_dir):
            public = [f.name for f in inside if not f.name.startswith("_")]
            name = public[-1] if public else (inside[-1].name if inside else "a call")
            return f"{name} ({os.path.basename(frame.filename)}:{frame.lineno})"
    return "a call"
