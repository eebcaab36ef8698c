"""Zero-copy graph inputs: the op that produces a graph's input writes it straight into the placeholder.

Grape's alias predictor, made safe. A host loop around a graphed callable (a decode step) produces
the next call's inputs with ordinary ops (`index_select` on beam indices, `cat`, `add`) and the call
then copies them into the graph's placeholders. Under `with fast.zero_copy():` a `ZeroCopyMode`
(a `TorchDispatchMode`) sees every op between two calls and:

1. **learns**: each op output is tagged with a `ProducerKey`, the op overload and how many times that
   overload ran since the callable's last call (robust to unrelated ops inserted elsewhere; code
   positions would break under helper functions and loops, op streams do not care). When a call
   copies a tensor into its placeholder at argument leaf `position`, the tensor's producer is linked
   to that position, with the producer's *signature* (argument dtypes, devices and constants, which
   fix the output dtype). A link is confirmed when two consecutive calls agree on it, and dropped
   when its producer runs but the next call does not meet its output (a setup `clone` that fed the
   first call once must not start writing into placeholders);
2. **redirects**: when a confirmed producer runs again with the same signature, it runs in its `out=`
   form into the placeholder buffer of that position, as a zero-length tensor at the buffer's start
   that the op resizes to its output shape. Buffers are shared by all shapes (`PlaceholderArena`), so
   one redirect serves whatever key the call turns out to have;
3. **verifies**: the call skips the copy only where the argument *is* its placeholder (same address
   and strides, checked at every call); anything else is copied as before and counted.

Placeholders in lanes. Redirecting into the placeholders the last call read would clobber tensors the
program still holds (`past = [p.index_select(0, beams) for p in present]` keeps the previous `past`
alive until the assignment). So redirected placeholders live in two extra *lanes* (1 and 2), with
their own buffers, and producers write into the lane the last call did not use. A call whose
arguments sit in lane L replays the graph captured for (key, L) (`LaneKey`), captured on first use;
lane 0 is the classic one that calls copy into and that `static_inputs`/`inputs_for` expose. A redirect
is refused (and counted in `stats.mispredictions`) when:

- the target slot still holds a redirected tensor the program references (storage weak references);
- the op reads the buffer it would write, or an argument requires grad;
- the signature differs from the learned one (the output dtype could differ);
- the output does not fit the buffer (the zero-length target's storage cannot grow, so the op raises
  before writing and runs normally instead);
- a graph returns a view of that position's placeholder (the output would be clobbered), or the
  position is loop-carried state (`carry.py`).

A redirected tensor that the call then did not read (passed elsewhere, or not passed at all) or that
landed in another buffer than the call's graph reads is counted too, and the link is dropped until
the next copy relearns it. Results always equal eager: a wrong prediction costs one copy, never a
wrong value. Tensors written by redirects live in the callable's placeholder memory: they stay
valid while the program references them (no later redirect reuses their slot), and while the
callable is alive.

Costs. Every op inside the block passes through a Python dispatch mode (a few microseconds of host
time per op; hidden while the GPU is the bottleneck, as in a decode loop that does not synchronise).
A key can have up to three graphs (lanes 0, 1, 2), captured lazily as calls need them; they share
the callable's pool, but each has its own driver memory. Bucketed calls are padded into fresh
tensors, so zero-copy helps unbucketed callables only.
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from tendril.graphs.key import Flattened, GraphKey, TensorSpec
from tendril.graphs.memory import PlaceholderArena
from tendril.graphs.stats import GraphStats, Misprediction

COPY_LANE = 0
"""The lane calls copy into; `static_inputs` and `inputs_for` return its placeholders."""
REDIRECT_LANES = (1, 2)


@dataclass(frozen=True)
class LaneKey(GraphKey):
    """A graph key plus the placeholder lane its graph reads (1 or 2; lane 0 graphs keep the plain key)."""

    lane: int = COPY_LANE

    def __str__(self) -> str:
        return f"{super().__str__()}@lane{self.lane}"


def lane_of(key: GraphKey) -> int:
    return key.lane if isinstance(key, LaneKey) else COPY_LANE


def partner(lane: int) -> int:
    """The lane producers (and carried outputs) write into after a call that read `lane`."""
    return REDIRECT_LANES[1] if lane == REDIRECT_LANES[0] else REDIRECT_LANES[0]


@dataclass(frozen=True)
class ProducerKey:
    """Which op produced a tensor: the op overload and its occurrence count since the callable's last call."""

    op: torch._ops.OpOverload
    occurrence: int

    def __str__(self) -> str:
        return f"{self.op}#{self.occurrence}"


@dataclass(frozen=True)
class Link:
    """A learned prediction: this producer's output is the argument at leaf `position`."""

    position: int
    signature: tuple[Any, ...]
    dtype: torch.dtype
    device: torch.device
    numel: int
    confirmations: int = 1
    """Calls that met this producer's output at `position`; redirects start at `CONFIRMATIONS`."""


CONFIRMATIONS = 2
"""A link redirects once two calls agree on it, so an op that fed an argument once (a setup `clone`)
does not start writing into a placeholder the program then keeps elsewhere."""


@functools.cache
def out_form(op: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """The `out=` overload of a functional op with one tensor output, or None."""
    if len(op._schema.returns) != 1 or op._schema.is_mutable:
        return None
    wanted = [(argument.name, str(argument.type)) for argument in op._schema.arguments]
    for name in op.overloadpacket.overloads():
        candidate = getattr(op.overloadpacket, name)
        outs = [argument for argument in candidate._schema.arguments if argument.is_out]
        inputs = [
            (argument.name, str(argument.type)) for argument in candidate._schema.arguments if not argument.is_out
        ]
        if len(outs) == 1 and outs[0].name == "out" and inputs == wanted:
            return candidate
    return None


def signature(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """What fixes an op's output dtype and device: argument dtypes/devices and non-tensor constants.

    Aten op arguments are tensors, scalars, or lists of them, so one level of nesting is enough (and
    much cheaper than pytree on the per-op path).
    """
    return (*map(_describe, args), *kwargs, *map(_describe, kwargs.values()))


def tensor_arguments(args: Sequence[Any], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(item for item in value if isinstance(item, torch.Tensor))
    return found


def _describe(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.device, value.dim() == 0)
    if isinstance(value, (list, tuple)):
        return tuple(map(_describe, value))
    try:
        hash(value)
    except TypeError:
        return type(value)
    return value


def memory_range(tensor: torch.Tensor) -> tuple[int, int]:
    """[start, end) byte addresses a tensor's storage spans (a superset of the elements it reads)."""
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


def overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def empty_at(buffer: torch.Tensor) -> torch.Tensor:
    """A zero-length tensor at `buffer`'s start over a storage that aliases it but cannot grow.

    An `out=` op resizes it in place to its output shape while that fits; a larger output makes the op
    raise before writing anything (the storage has no allocator), never move the buffer. Tensors made
    from it share one storage object, whose weak reference tells whether the program still holds any.
    """
    alias = torch._C._construct_storage_from_data_pointer(
        buffer.data_ptr(), buffer.device, buffer.numel() * buffer.element_size()
    )
    with torch.inference_mode(False), torch.no_grad():
        out = torch.empty(0, dtype=buffer.dtype, device=buffer.device)
        out.set_(alias, 0, (0,), (1,))
    return out


@dataclass
class Lanes:
    """Placeholder arenas per lane, and which redirected tensors occupy which lane slots."""

    copy_arena: PlaceholderArena
    arenas: dict[int, PlaceholderArena] = field(default_factory=dict)
    active: bool = False
    """Set once zero-copy or carried state is in use; until then calls never look at lanes."""
    last_lane: int = COPY_LANE
    occupants: dict[tuple[int, int], StorageWeakRef] = field(default_factory=dict)
    pinned: set[int] = field(default_factory=set)
    """Positions never redirected: a graph returns a view of their placeholder."""
    carried: set[int] = field(default_factory=set)
    """Positions written by carried outputs (`carry.py`), not by automatic redirects."""

    def arena(self, lane: int) -> PlaceholderArena:
        if lane == COPY_LANE:
            return self.copy_arena
        return self.arenas.setdefault(lane, PlaceholderArena())

    def buffer(self, lane: int, position: int, dtype: torch.dtype, device: torch.device, numel: int) -> torch.Tensor:
        """The lane's buffer for `position`, with room for at least `numel` elements (grown as arenas grow)."""
        arena = self.arena(lane)
        buffer = arena.buffers.get((position, dtype, device))
        if buffer is None or buffer.numel() < numel:
            arena.placeholder(position, TensorSpec((numel,), dtype, device))
            buffer = arena.buffers[(position, dtype, device)]
        return buffer

    def busy(self, lane: int, position: int, keep: torch.Tensor | None = None) -> bool:
        """Whether the slot holds a redirected tensor the program still references (other than `keep`)."""
        occupant = self.occupants.get((lane, position))
        if occupant is None or occupant.expired():
            return False
        return keep is None or StorageWeakRef(keep.untyped_storage()) != occupant

    def occupy(self, lane: int, position: int, tensor: torch.Tensor) -> None:
        self.occupants[(lane, position)] = StorageWeakRef(tensor.untyped_storage())

    def key_for(self, key: GraphKey, flat: Flattened, stats: GraphStats) -> GraphKey:
        """The key of the graph that reads this call's arguments where they are (see the module docstring)."""
        votes: Counter[int] = Counter()
        lane_of_leaf: dict[int, int] = {}
        for index in flat.tensor_indices():
            leaf = flat.leaves[index]
            for lane in REDIRECT_LANES:
                arena = self.arenas.get(lane)
                buffer = arena.buffers.get((index, leaf.dtype, leaf.device)) if arena is not None else None
                if buffer is not None and buffer.data_ptr() == leaf.data_ptr():
                    votes[lane] += 1
                    lane_of_leaf[index] = lane
        lane = votes.most_common(1)[0][0] if votes else COPY_LANE
        for index in flat.tensor_indices():
            if lane != COPY_LANE and lane_of_leaf.get(index) != lane and self.busy(lane, index):
                stats.record_misprediction(
                    Misprediction.REFERENCED,
                    f"argument leaf {index} would be copied into lane {lane}, whose slot holds a referenced tensor",
                )
                lane = COPY_LANE
        self.last_lane = lane
        if lane == COPY_LANE:
            return key
        return LaneKey(key.structure, key.tensors, key.constants, lane)

    def pin_aliased_outputs(self, positions: Sequence[int], placeholders: Sequence[torch.Tensor], outputs: Any) -> None:
        """Never redirect into a position whose placeholder a graph returns (a view of it)."""
        ranges = [memory_range(output) for output in pytree.tree_leaves(outputs) if isinstance(output, torch.Tensor)]
        for position, placeholder in zip(positions, placeholders, strict=True):
            start = placeholder.data_ptr()
            span = (start, start + placeholder.numel() * placeholder.element_size())
            if any(overlaps(span, output) for output in ranges):
                self.pinned.add(position)


def stage_inputs(
    positions: Sequence[int],
    placeholders: Sequence[torch.Tensor],
    leaves: Sequence[Any],
    stats: GraphStats,
    predictor: ZeroCopyPredictor | None,
) -> None:
    """Copy a call's tensor arguments into the placeholders they are not already in, in one batch.

    A source that lives in another argument's placeholder (or partly in its own) would be overwritten
    by the batch before it is read, so it is cloned first: the answer stays the eager one.
    """
    targets: list[torch.Tensor] = []
    sources: list[torch.Tensor] = []
    for position, placeholder in zip(positions, placeholders, strict=True):
        source = leaves[position]
        in_place = source.data_ptr() == placeholder.data_ptr() and source.stride() == placeholder.stride()
        if predictor is not None:
            predictor.observe(position, source, in_place)
        if in_place:
            stats.input_copies_avoided += 1
            stats.input_bytes_avoided += source.numel() * source.element_size()
            continue
        targets.append(placeholder)
        sources.append(source)
    if not targets:
        return
    written = {target.untyped_storage().data_ptr() for target in targets}
    sources = [source.clone() if source.untyped_storage().data_ptr() in written else source for source in sources]
    torch._foreach_copy_(targets, sources)
    stats.input_copies += len(targets)
    stats.input_bytes_copied += sum(source.numel() * source.element_size() for source in sources)


class ZeroCopyPredictor:
    """Learns producers of one callable's inputs and redirects them; driven by `ZeroCopyMode`."""

    def __init__(self, lanes: Lanes, stats: GraphStats) -> None:
        self.lanes = lanes
        self.stats = stats
        self.links: dict[ProducerKey, Link] = {}
        self.occurrences: Counter[torch._ops.OpOverload] = Counter()
        self.produced: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.redirected: WeakIdKeyDictionary = WeakIdKeyDictionary()
        """Tensors written by redirects since the last call -> (producer, position)."""
        self.ran: set[ProducerKey] = set()
        """Linked producers that ran since the last call; those whose output the call did not meet are unlinked."""
        self.met: set[ProducerKey] = set()
        self.suspended = 0
        self.active = 0
        """Open `zero_copy()` blocks."""

    # -- between calls -------------------------------------------------------------------------------

    def dispatch(self, op: torch._ops.OpOverload, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        if self.suspended:
            return op(*args, **kwargs)
        producer = ProducerKey(op, self.occurrences[op])
        self.occurrences[op] += 1
        link = self.links.get(producer)
        confirmed = link is not None and link.confirmations >= CONFIRMATIONS
        if link is not None:
            self.ran.add(producer)
        result = self._redirect(producer, link, args, kwargs) if link is not None and confirmed else None
        if result is None:
            result = op(*args, **kwargs)
        if isinstance(result, torch.Tensor) and out_form(op) is not None:
            self.produced[result] = (producer, signature(args, kwargs))
        elif isinstance(result, torch.Tensor):
            self.produced[result] = (producer, None)
        return result

    def _redirect(
        self, producer: ProducerKey, link: Link, args: Sequence[Any], kwargs: dict[str, Any]
    ) -> torch.Tensor | None:
        out_op = out_form(producer.op)
        if out_op is None:
            return None
        if link.position in self.lanes.pinned or link.position in self.lanes.carried:
            return None
        if signature(args, kwargs) != link.signature:
            self._miss(Misprediction.SIGNATURE, f"{producer} ran with other argument dtypes or constants")
            return None
        tensors = tensor_arguments(args, kwargs)
        if any(tensor.requires_grad for tensor in tensors):
            return None
        lane = partner(self.lanes.last_lane)
        if self.lanes.busy(lane, link.position):
            self._miss(Misprediction.REFERENCED, f"{producer}: lane {lane} slot {link.position} is still referenced")
            return None
        buffer = self.lanes.buffer(lane, link.position, link.dtype, link.device, 2 * max(link.numel, 1))
        span = memory_range(buffer)
        if any(overlaps(span, memory_range(tensor)) for tensor in tensors):
            self._miss(Misprediction.READS_PLACEHOLDER, f"{producer} reads the buffer it would write")
            return None
        target = empty_at(buffer)
        try:
            result = out_op(*args, **kwargs, out=target)
        except RuntimeError as error:  # raised before writing: the output does not fit the buffer
            self._miss(Misprediction.TOO_LARGE, f"{producer}: {str(error).splitlines()[0]}")
            self.lanes.buffer(lane, link.position, link.dtype, link.device, 2 * buffer.numel())
            return None
        self.lanes.occupy(lane, link.position, result)
        self.redirected[result] = (producer, link.position)
        self.stats.redirects += 1
        return result

    def _miss(self, reason: Misprediction, detail: str) -> None:
        self.stats.record_misprediction(reason, detail)

    # -- at a call -----------------------------------------------------------------------------------

    def observe(self, position: int, source: torch.Tensor, in_place: bool) -> None:
        """A call met `source` at argument leaf `position`; `in_place`: it already was the placeholder."""
        redirected = self.redirected.pop(source, None)
        if redirected is not None:
            producer, predicted = redirected
            self.met.add(producer)
            if in_place:
                return
            if predicted != position:
                detail = f"{producer} was predicted for leaf {predicted}, passed at {position}"
                self._miss(Misprediction.NOT_PASSED, detail)
            else:
                self._miss(Misprediction.MOVED, f"{producer}: the call's graph reads another buffer or layout")
            self.links.pop(producer, None)
            return
        if in_place:
            return
        produced = self.produced.get(source)
        if produced is not None:
            self.met.add(produced[0])
        if produced is None or position in self.lanes.carried or position in self.lanes.pinned:
            return
        producer, learned = produced
        if learned is None:
            self._miss(Misprediction.NO_OUT_FORM, f"leaf {position} comes from {producer.op}, which has no out= form")
            return
        known = self.links.get(producer)
        same = known is not None and (known.position, known.signature) == (position, learned)
        confirmations = known.confirmations + 1 if known is not None and same else 1
        self.links[producer] = Link(position, learned, source.dtype, source.device, source.numel(), confirmations)

    def end_interval(self, *, count: bool = True) -> None:
        """The call has read its arguments: redirected tensors it did not read were wasted predictions.

        `count=False` at the end of a `zero_copy()` block: the last producers' outputs had no call to go to.
        """
        for producer, position in list(self.redirected.values()):
            if count:
                self._miss(Misprediction.NOT_PASSED, f"{producer} was predicted for leaf {position}, not passed")
                self.links.pop(producer, None)
        self.redirected = WeakIdKeyDictionary()
        if count:
            for producer in self.ran - self.met:
                self.links.pop(producer, None)
        self.ran.clear()
        self.met.clear()
        self.occurrences.clear()

    @contextlib.contextmanager
    def calling(self) -> Iterator[None]:
        """Around a call of the callable: its own ops are not producers, and the next interval starts after it."""
        self.suspended += 1
        try:
            yield
        finally:
            self.suspended -= 1
            self.end_interval()


class ZeroCopyMode(TorchDispatchMode):
    """Routes every op between calls through a `ZeroCopyPredictor`."""

    def __init__(self, predictor: ZeroCopyPredictor) -> None:
        super().__init__()
        self.predictor = predictor

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        return self.predictor.dispatch(func, args, kwargs or {})
