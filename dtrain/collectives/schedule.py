"""A strategy's schedule: the collectives it issues in one synchronized step, decided once, by the strategy.

Every registered strategy answers `schedule(sync, model, world, ...)` (`dtrain.collectives.registry.schedule_for`)
with a `Schedule`: for each collective its kind, bytes, dtype and process group, the event that makes it ready, what
waits for it and whether its result is the exact mean; what the optimizer step updates on each rank; and the host
work the strategy adds on the computing thread. The step-time predictor (`dtrain.collectives.step_time`), `auto`'s
pruning, the simulator, `--dry-run` and `describe` read it from there; none of them asks which strategy it is.

Planning is pure, as the bucket plan's is: `model` may hold meta tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtrain.collectives.timeline import through
from dtrain.common.errors import UserError

# The collectives' kinds, as torch.distributed names them; EXCHANGE: a whole bucket sent to every peer (point to
# point), summed on arrival
ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER, EXCHANGE = "all_reduce", "reduce_scatter", "all_gather", "exchange"

# What makes a collective ready
GRADIENT = "gradient"  # its bucket's last gradient, in backward (`Collective.after`: elements ready by then)
PROJECTION = "projection"  # a split tied embedding's projection part: the first gradient backward makes
LOOKUP = "lookup"  # each lookup's backward end: one per lookup, its rows' bytes known only as the step runs
BACKWARD_END = "backward end"  # all of backward: a plan without overlap launches at `wait()`
PREFETCH = "prefetch"  # the unit after it starting its backward (`after`: elements ready by then; FSDP2's prefetch)
STEP = "optimizer step"  # the optimizer step: the updated shards, gathered for the next forward
FORWARD_START = "forward start"  # the next forward starting

# What waits for it
WAIT = "wait()"  # the handle's `wait()`, before the optimizer step
IN_BACKWARD = "backward()"  # the backward call itself, at its end: what it does not hide shows in backward time
FORWARD = "forward"  # the next forward, at the first module that reads its parameters
BACKWARD = "backward"  # its unit's backward

# How it moves
RING = "ring"  # the backend's own collective (an all-reduce: a ring or a tree)
P2P = "p2p"  # point-to-point sends to each peer (`dtrain.collectives.p2p`)
TORCH = "torch"  # torch's own reduce-scatter or all-gather (FSDP2's)
HIERARCHICAL = "hierarchical"  # reduce-scatter inside the node, all-reduce between nodes, all-gather inside again

LOOKUP_GROUP = "tied_split lookups"  # the process group of a split embedding's lookups' rows


@dataclass(frozen=True)
class Collective:
    kind: str
    nbytes: int  # the bucket's bytes as they travel, every element counted once (`Bucket.nbytes`); LOOKUP: 0
    dtype: str  # on the wire: "fp32", "bf16", "fp16", or "mixed" (narrowed members beside fp32 ones)
    bucket: int  # index into `Schedule.buckets`
    ready: str
    waits: str
    exact: bool  # the result is the exact mean of the gradients (an all-gather: the parameters as updated)
    group: str | None = None  # its process group: a tensor class's own, LOOKUP_GROUP; None: the strategy's
    after: int = 0  # GRADIENT, PREFETCH: gradient elements, in ready order, ready when it is
    path: str = RING
    per_node: int | None = None  # HIERARCHICAL: ranks per node
    # waited for at once on the thread that issued it, where the device has no streams to run it beside the
    # computation (stock FSDP2 on a CPU device): nothing overlaps it
    blocking: bool = False


@dataclass(frozen=True)
class HostWork:
    """Work a strategy adds on the computing thread, per step, as the benchmark times it (`--host-work`)."""

    # "cast" (to 16 bits and back), "dtensor_step" (per tensor), "fsdp2_unit" and "fsdp2_unit_resharded" (FSDP2's
    # work for one unit's forward and backward, per tensor)
    what: str
    nbytes: int  # bytes read, in all
    when: str  # "backward", "forward", "forward and backward", "optimizer"
    count: int = 1  # operations (dtensor_step, fsdp2_unit*: tensors)


@dataclass(frozen=True)
class Schedule:
    strategy: str
    buckets: tuple  # `dtrain.collectives.plan.Bucket`s, in launch order
    collectives: tuple[Collective, ...]
    world: int
    overlap: bool = True  # launched from the gradient hooks (else all at `wait()`)
    class_groups: bool = False  # each tensor class on its own process group
    updated: float = 1.0  # the share of the parameters' elements each rank's optimizer step updates
    host: tuple[HostWork, ...] = ()
    communicates: bool = True
    split: bool = False  # a tied embedding's gradient split (`tied_split`)
    label: str = ""  # what sets this configuration apart beyond its strategy and cap: "+split+rows+bf16" ...

    @property
    def exact(self) -> bool:
        """The synchronized gradients (and the parameters the next forward reads) are the exact mean's."""
        return self.communicates and all(c.exact for c in self.collectives)

    def lines(self) -> list[str]:
        """The schedule as `describe` and `--dry-run` print it: its collectives grouped by what they are and when
        they run (count, bytes), whether the result is exact, what each rank's optimizer updates, its host work."""
        if not self.communicates:
            return [f"schedule of {self.strategy}: no communication (a headroom baseline, not training)"]
        out = [f"schedule of {self.strategy}{self.label} on {self.world} ranks: {len(self.buckets)} buckets, "
               f"{'the exact mean' if self.exact else 'NOT the exact mean'}; each rank's optimizer updates "
               f"{self.updated:.0%} of the parameters"]
        rows: dict = {}
        for c in self.collectives:
            key = (c.kind, c.dtype, c.path, c.ready, c.waits, c.blocking, c.group is not None)
            count, nbytes = rows.get(key, (0, 0))
            rows[key] = (count + 1, nbytes + c.nbytes)
        for (kind, dtype, path, ready, waits, blocking, grouped), (count, nbytes) in rows.items():
            size = "its rows" if ready == LOOKUP else f"{nbytes / 2**20:.2f} MiB"
            out.append(f"  {count:>3} x {kind:<14} {size:>13} {dtype:<5} {path:<12} ready: {ready:<14} waited by: "
                       f"{waits}" + (" (blocking without device streams)" if blocking else "")
                       + (", own group" if grouped else ""))
        for work in sorted({w.what for w in self.host}):
            nbytes = sum(w.nbytes for w in self.host if w.what == work)
            out.append(f"  host work: {work} of {nbytes / 2**20:.2f} MiB a step on the computing thread")
        return out


def all_reduce_schedule(strategy: str, buckets: list, named_params, world: int, overlap: bool,
                        class_groups: bool, split: set[str] = frozenset(), per_node: int | None = None) -> Schedule:
    """The schedule of a strategy that all-reduces each bucket (the planned strategies, DDP and its hooks):
    bucket i when its last gradient is ready (with `overlap`; else at `wait()`), on its class's group where classes
    have their own, in its class's wire dtype. `split`: the parameters whose tied embedding is split (`tied_split`):
    a bucket of theirs alone is ready with the projection part, and each lookup's rows are all-reduced as that
    lookup's backward ends. `per_node`: the hierarchical plan's ranks per node."""
    after = through(buckets, named_params, split)
    out = []
    for b, x in zip(buckets, after):
        wire = b.settings.wire_dtype
        # A bucket of the split's parameters alone is ready with the projection part; one that also holds others
        # waits for the last of those (`through`: a cap above the model's size gives one bucket, at backward's end).
        split_only = bool(b.names) and set(b.names) <= split
        ready = (PROJECTION if split_only else GRADIENT) if overlap else BACKWARD_END
        out.append(Collective(ALL_REDUCE, b.nbytes, wire, b.index, ready, WAIT, wire == "fp32",
                              b.tensor_class if class_groups else None, x,
                              HIERARCHICAL if per_node else RING, per_node))
    if split:
        out.append(lookup_rows(ALL_REDUCE))
    return Schedule(strategy, tuple(buckets), tuple(out), world, overlap, class_groups, split=bool(split),
                    label=("+split" if split else "") + ("+hier" if per_node else ""))


def lookup_rows(kind: str, path: str = RING) -> Collective:
    """A split tied embedding's lookups' rows: one collective per lookup as its backward ends, on the split's own
    group, of the rows its tokens touched."""
    return Collective(kind, 0, "fp32", 0, LOOKUP, WAIT, True, LOOKUP_GROUP, 0, path)


def split_first(named_params, split: set[str]) -> list:
    """`named_params` in the order the first backward makes their gradients under the split: a split embedding's
    first (its projection part is the first gradient computed), the others in their expected order. A planned
    strategy re-plans in that observed order after its first step (`PlannedSync._replan`)."""
    return ([(n, p) for n, p in named_params if n in split] + [(n, p) for n, p in named_params if n not in split])


def nodes_of(per_node: int | None, world: int | None, what: str) -> int:
    """R, the ranks per node of a hierarchical schedule (`sync.ranks_per_node`, else the job's layout), checked
    against the world it is for."""
    if not world or not per_node:
        raise UserError(f"{what}: the hierarchical plan needs the ranks per node ('sync.ranks_per_node' or "
                        "--ranks-per-node) and a cost model of the job's world (a benchmark fit on the same shape)")
    if world % per_node or not 1 < per_node < world:
        raise UserError(f"{per_node} ranks per node ('sync.ranks_per_node' or --ranks-per-node) do not split the "
                        f"cost model's {world} ranks into nodes of several ranks")
    return per_node
