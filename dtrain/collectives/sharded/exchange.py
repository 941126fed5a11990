"""Each bucket's exchange plan: how `sharded` moves it, decided once from the model (meta tensors do) and read both by
the reducer that runs it and by the simulator that predicts it.

A bucket has one of three layouts:

- `shards`: reduce-scattered in backward into `world` chunks of `padded / world` elements, each rank updating its
  own chunk, and all-gathered in the next forward;
- `replicated`: a split tied embedding (`tied_split`), all-reduced whole and updated on every rank. The next
  forward's first lookups need the whole matrix, so an all-gather there would hold up the first layer;
- `rows`: the same embedding with `shard_tied_split`, sharded by whole rows of `row_size` elements. Each lookup of
  the next forward fetches the rows of its tokens from their owners.

With `gather_dtype` (bf16, for training under bf16 autocast), a `shards` bucket's members that only `nn.Linear`
modules read are `narrowed`. They go through the all-gather in that dtype: the Linear casts them to it before any
use, so the forward reads the same values. Their gradients go through a step's reduce-scatter in that dtype too when
the step is one backward of one micro-batch: each is then a bf16 product widened to fp32, which bf16 holds exactly.
The members read elsewhere (LayerNorm, an embedding) travel in fp32 in the same message.

A replicated embedding whose only holders besides its lookups are `nn.Linear` modules (the pre-softmax projection)
gets its bucket's gradient from them alone, the lookups' rows going apart: a bf16 value under autocast. It is then
exchanged `whole` in bf16 with every peer instead of all-reduced in fp32. Each rank sends (world - 1) x 2 bytes an
element, a ring all-reduce 2 (world - 1) / world x 4: fewer bytes up to 3 ranks, which is where the plan chooses it.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from dtrain.collectives import tensor_classes
from dtrain.collectives.plan import Bucket, ready_order
from dtrain.collectives.tensor_classes import WIRE_DTYPES

SHARDS, REPLICATED, ROWS = "shards", "replicated", "rows"
WHOLE_UP_TO = 3  # ranks up to which a whole narrowed exchange sends fewer bytes than an fp32 ring all-reduce


@dataclass(frozen=True)
class Exchange:
    """How one bucket travels under `sharded`."""

    bucket: Bucket
    layout: str  # SHARDS, REPLICATED or ROWS
    world: int
    padded: int  # elements of the bucket's flat buffers: its numel padded so that every rank's chunk is as long
    row_size: int = 0  # ROWS: elements of a row
    narrowed: frozenset[str] = frozenset()  # members that travel in `wire` (the others in the bucket's own dtype)
    wire: str | None = None  # the narrowed members' dtype ("bf16")
    narrowed_nbytes: int = 0  # the bucket's bytes with its narrowed members in `wire`

    @property
    def chunk(self) -> int:
        """Elements of each rank's chunk (SHARDS, ROWS; a replicated bucket's whole numel)."""
        return self.padded if self.layout == REPLICATED else self.padded // self.world

    @property
    def split(self) -> bool:
        """A split tied embedding's bucket (replicated, or by rows): complete at the start of backward, with the
        pre-softmax projection's gradient, the first computed (its lookups' rows go apart)."""
        return self.layout != SHARDS

    @property
    def gathered(self) -> bool:
        """Sharded (by chunks or rows): all-gathered in the next forward. A replicated bucket is updated whole."""
        return self.layout != REPLICATED

    @property
    def whole(self) -> bool:
        """A replicated bucket exchanged whole in `wire` (when its step is one backward's) instead of all-reduced."""
        return self.layout == REPLICATED and bool(self.narrowed)

    def nbytes(self, part: str, accumulated: bool = False) -> int:
        """The bucket's bytes as its `part` moves them ("reduce_scatter": the reduce-scatter, or a replicated
        bucket's all-reduce or whole exchange; "all_gather": 0 for a replicated bucket), counted as `Bucket.nbytes`
        counts them: every element once. A step whose gradients are sums of micro-batches (`accumulated`) is no
        longer exact in `wire`: its reduce-scatter goes in the bucket's own dtype."""
        if part == "all_gather":
            return 0 if self.layout == REPLICATED else self.narrowed_nbytes
        return self.bucket.nbytes if accumulated else self.narrowed_nbytes


def exchange_plan(sync, model: nn.Module, buckets: list[Bucket], world: int) -> list[Exchange]:
    """One `Exchange` per bucket of `sharded`'s plan `buckets` for `model` (real or meta tensors) under `sync` (a
    `SyncConfig`: its classes say which parameter is split, `shard_tied_split` and `gather_dtype` the rest) on
    `world` ranks."""
    params = dict(model.named_parameters())
    classes = tensor_classes.from_config(sync)
    split = {n for n, c in classes.assign(ready_order(model)).items() if classes.setting(c).tied_split}
    low = sync.gather_dtype
    read_whole = read_outside_linear(model) if low else set()
    out = []
    for b in buckets:
        name = b.names[0]
        row, narrowed = 0, frozenset()
        if name in split and sync.shard_tied_split:
            layout, row = ROWS, params[name].shape[-1]
        elif name in split:
            layout = REPLICATED
            if low and world <= WHOLE_UP_TO and _linear_only_besides_lookups(model, params[name]):
                narrowed = frozenset({name})
        else:
            layout = SHARDS
            if low:
                narrowed = frozenset(n for n in b.names if n not in read_whole)
        unit = (row or 1) * (1 if layout == REPLICATED else world)
        padded = -(-b.numel // unit) * unit
        own = b.settings.torch_wire_dtype.itemsize
        nbytes = sum(params[n].numel() * (WIRE_DTYPES[low].itemsize if n in narrowed else own) for n in b.names)
        out.append(Exchange(b, layout, world, padded, row, narrowed, low if narrowed else None, nbytes))
    return out


def read_outside_linear(model: nn.Module) -> set[str]:
    """The parameters some module other than an `nn.Linear` holds: those the forward may read in their own dtype.
    An `nn.Linear` calls `F.linear`, which autocast runs in its lower dtype, casting the weight and bias first."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    out = set()
    for module in model.modules():
        if not isinstance(module, nn.Linear):
            out |= {name_of[id(p)] for p in module.parameters(recurse=False)}
    return out


def _linear_only_besides_lookups(model: nn.Module, param: nn.Parameter) -> bool:
    """`param` is held by `nn.Linear` modules (at least one) and otherwise only by `nn.Embedding` lookups."""
    holders = [m for m in model.modules() if any(p is param for p in m.parameters(recurse=False))]
    return (any(isinstance(m, nn.Linear) for m in holders)
            and all(isinstance(m, (nn.Linear, nn.Embedding)) for m in holders))


def member_offsets(params) -> list[int]:
    """Where each member starts in its bucket's flat buffers."""
    out, off = [], 0
    for p in params:
        out.append(off)
        off += p.numel()
    return out
