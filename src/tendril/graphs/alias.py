"""Zero-copy graph inputs: the op that produces a graph's input writes it straight into the placeholder.

Grape's alias predictor, made safe. A host loop around a graphed callable (a decode step) produces
the next call's inputs with ordinary ops (`index_select` on beam indices, `cat`, `add`) and the call
then copies them into the graph's placeholders. Under `with fast.zero_copy():` a `ZeroCopyMode`
(a `TorchFunctionMode`) sees every torch function and tensor method the program calls between two
calls and:

1. **learns**: each op output is tagged with a `ProducerKey`, the function and how many times it ran
   since the callable's last call (robust to unrelated ops inserted elsewhere; code positions would
   break under helper functions and loops, op streams do not care). When a call
   copies a tensor into its placeholder at argument leaf `position`, the tensor's producer is linked
   to that position, with the producer's *signature* (argument dtypes, devices and constants, which
   fix the output dtype). A link is confirmed when two consecutive calls agree on it, and dropped
   when its producer runs but the next call does not meet its output (a setup `clone` that fed the
   first call once must not start writing into placeholders). A tensor passed as a whole view of an
   op output (HF's `tokens[:, None]`: same dtype, start and elements, both contiguous) stands for that
   output, whose producer is linked instead (`ZeroCopyPredictor.observe`);
2. **redirects**: when a confirmed producer runs again with the same signature, it runs in its `out=`
   form (`out_call`: the `torch.<name>` binding of a function whose aten op has an `out=` overload, so
   never a view) into the placeholder buffer of that position, as a zero-length tensor at the buffer's start
   that the op resizes to its output shape. Buffers are shared by all shapes (`PlaceholderArena`), so
   one redirect serves whatever key the call turns out to have;
3. **verifies**: the call skips the copy only where the argument *is* its placeholder (same address
   and strides, checked at every call); anything else is copied as before and counted.

Placeholders in lanes. Redirecting into the placeholders the last call read would clobber tensors the
program still holds (`past = [p.index_select(0, beams) for p in present]` keeps the previous `past`
alive until the assignment). So redirected placeholders live in two extra *lanes* (1 and 2), with
their own buffers, and producers write into the lane the last call did not use. A call whose
arguments sit in lane L replays the graph captured for (key, L, generation) (`LaneKey`), captured on
first use; lane 0 is the classic one that calls copy into and that `static_inputs`/`inputs_for` expose.
Lane buffers grow (reallocate) when a longer input needs it, and a graph keeps reading the buffers it
was captured with, while redirects write into the current ones: so every reallocation of a redirect
target starts a new *generation* of its lane (`Lanes.generations`), and calls go to graphs of the
current generation (captured on first use, once per key and lane after each growth). Without that, a
cache that moves to a longer range would keep meeting graphs of the outgrown buffers and be copied.
A redirect is refused (and counted in `stats.mispredictions`) when:

- the target slot still holds a redirected tensor (or a view of one) the program references (the use count of
  the storage every redirect into the slot is made on, `Lanes.busy`);
- the op reads the buffer it would write (or an argument has no storage to check, a sparse tensor), or an
  argument requires grad;
- the signature differs from the learned one (the output dtype could differ);
- the output does not fit the buffer (the zero-length target's storage cannot grow, so the op raises
  before writing and runs normally instead; the buffer is then reallocated at twice the output's size,
  so the next redirect into this lane fits);
- a graph returns a view of that position's placeholder (the output would be clobbered), or the
  position is loop-carried state (`carry.py`).

A redirected tensor that the call then did not read (passed elsewhere, or not passed at all) or that
landed in another buffer than the call's graph reads is counted too, and the link is dropped until
the next copy relearns it. Results always equal eager: a wrong prediction costs one copy, never a
wrong value. Tensors written by redirects live in the callable's placeholder memory: they stay
valid while the program references them (no later redirect reuses their slot, and each holds its
buffer allocated, even once the buffer is outgrown or the callable is gone: `alias_storage`).

The per-op path (`ZeroCopyPredictor.dispatch`) does per run only what can change between runs. A producer
is found by two dict lookups on (id of the function, occurrence), no frame or code position is inspected,
and the link found is checked to be that function's (`link.op is op`). An op that is no linked producer
then only runs and leaves a record of its output (a weak reference, in a tuple made without the
`NamedTuple` constructor's Python frame). A linked producer describes its arguments once (`survey`: the
signature, and in the same pass the data pointers of plain tensor arguments); a confirmed one then checks
the position is neither pinned nor carried, the signature, autograd, that its slot is unreferenced (one
storage use-count read against the count the slot record holds itself) and that no argument starts in the
slot's bytes (those pointers; lists, keywords, subclasses and tensors without storage are walked by
`reads_range`, which refuses a tensor it cannot check). The slot record itself is cached on the link per
lane (`Link.aliases`) and reused while it is not retired (`Lanes` retires a record when its buffer is
reallocated) and holds twice the output, which is exactly when `Lanes.redirect_alias` would return it. At a
call, the lane is voted without a `Counter` and the `LaneKey` is the same object while key, lane and
generation are (`Lanes.lane_key`), with its hash computed once (hashing GPT-2's 26 tensor specs costs ~3 µs).

Costs, measured on the CPU by `benchmarks/tools/zero_copy_host_cost.py` (the `graphs-zero-copy` decode step's
host side with small tensors, so that host overhead is what is timed; `PYTHONPATH=src:. python3 -m
benchmarks.tools.zero_copy_host_cost`) on a 2-core host, torch 2.13: a bare `index_select` takes 1.6 µs;
torch's function-mode machinery adds ~0.95 µs to every op; an op that is no linked producer costs ~2.1 µs
more than bare in all; a redirected `index_select` ~3.9 µs more (5.7 µs before the fast path above). Per
step (24 cache `index_select`s and 2 other redirects, 38 ops) the producer ops take 194 µs under the mode
against 63 µs without it (246 µs before), and the whole step 322 µs against 178 µs plain and 192 µs with the
reordering written into the placeholders by hand (388 µs before). A function
mode sees the program's calls only, not the aten ops underneath them, and while a call of the
callable runs the mode is lifted off torch's mode stack (`enter_call`), so the call's own tensor
handling costs nothing extra. (A `TorchDispatchMode`, the first design, saw every aten op and cost
about 10 µs per op in torch's machinery alone: on the H200 the host then fell behind the GPU in the
`graphs-zero-copy` decode loop.) Host time is hidden while the GPU is the bottleneck, as in a decode
loop that does not synchronise. A key can have up to three graphs
(lanes 0, 1, 2), captured lazily as calls need them; they share the callable's pool, but each has its
own driver memory. Bucketed calls are padded into fresh tensors, so zero-copy helps unbucketed
callables only.
"""

from __future__ import annotations

import functools
import types
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from tendril.graphs.key import Flattened, GraphKey, TensorSpec
from tendril.graphs.memory import PlaceholderArena
from tendril.graphs.stats import GraphStats, Misprediction

COPY_LANE = 0
"""The lane calls copy into; `static_inputs` and `inputs_for` return its placeholders."""
REDIRECT_LANES = (1, 2)


@dataclass(frozen=True)
class LaneKey(GraphKey):
    """A graph key plus the placeholder lane its graph reads (1 or 2; lane 0 graphs keep the plain key) and
    the lane's buffer generation at capture: a graph reads the buffers its lane had then (`Lanes.generations`)."""

    lane: int = COPY_LANE
    generation: int = 0

    def __hash__(self) -> int:
        """The fields' hash, computed once: a lane call looks its graph up by this key (`Lanes.key_for` returns the
        same object while the call's key and lane do not change), and hashing every tensor spec costs ~3 us per
        lookup with GPT-2's cache. Kept outside the dataclass fields (and out of pickles: it is per process)."""
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((self.structure, self.tensors, self.constants, self.lane, self.generation))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __getstate__(self) -> dict[str, Any]:
        return {name: value for name, value in self.__dict__.items() if name != "_hash"}

    def __str__(self) -> str:
        suffix = f"/buffers{self.generation}" if self.generation else ""
        return f"{super().__str__()}@lane{self.lane}{suffix}"


def lane_of(key: GraphKey) -> int:
    return key.lane if isinstance(key, LaneKey) else COPY_LANE


def partner(lane: int) -> int:
    """The lane producers (and carried outputs) write into after a call that read `lane`."""
    return REDIRECT_LANES[1] if lane == REDIRECT_LANES[0] else REDIRECT_LANES[0]


_PARTNER = {lane: partner(lane) for lane in (COPY_LANE, *REDIRECT_LANES)}
"""`partner` by lane, for the per-op path."""


@dataclass(frozen=True)
class ProducerKey:
    """Which op produced a tensor: the torch function (or, inside a capture, the aten overload) and its
    occurrence count since the callable's last call."""

    op: Any
    occurrence: int

    def __str__(self) -> str:
        return f"{op_name(self.op)}#{self.occurrence}"


def op_name(op: Any) -> str:
    """`index_select` for `torch.Tensor.index_select`, `aten.index_select.default` for an aten overload."""
    if isinstance(op, torch._ops.OpOverload):
        return str(op)
    return getattr(op, "__qualname__", None) or repr(op)


@dataclass(slots=True)
class Link:
    """A learned prediction: this producer's output is the argument at leaf `position`."""

    op: Callable[..., Any]
    out_op: Callable[..., Any]
    """How a redirect runs the op with `out=` (`out_call(op)`)."""
    position: int
    signature: tuple[Any, ...] | None
    """Argument dtypes/devices/constants of the run whose output the last call met (None: not seen yet, so the
    link does not redirect)."""
    dtype: torch.dtype
    device: torch.device
    numel: int
    confirmations: int = 1
    """Calls that met this producer's output at `position`; redirects start at `CONFIRMATIONS`."""
    aliases: list[SlotAlias | None] = field(default_factory=lambda: [None] * (1 + max(REDIRECT_LANES)))
    """Per lane, the slot record the last redirect into it wrote (`Lanes.redirect_alias`): reused while it is
    not `retired` and holds `2 * numel` elements, which is exactly when `redirect_alias` would return it."""


CONFIRMATIONS = 2
"""A link redirects once two calls agree on it, so an op that fed an argument once (a setup `clone`)
does not start writing into a placeholder the program then keeps elsewhere."""

_Slot = tuple[int, int]
"""A producer in the per-op path: (id of the op overload, occurrence); the link stores the op itself, and
a lookup checks it (`link.op is op`), so a reused id can never select another op's link."""


class _Produced(NamedTuple):
    """What the mode recorded about one op output (keyed by the tensor's id, checked through `ref`)."""

    ref: weakref.ref[torch.Tensor]
    slot: _Slot
    op: Callable[..., Any]
    signature: tuple[Any, ...] | None
    """Only computed for linked producers (the only ones a call can confirm or a redirect can check)."""
    viewed: _Produced | _Redirected | None = None
    """The record of the op output this output is a whole view of (`tokens[:, None]`; `ZeroCopyPredictor.observe`)."""


class _Redirected(NamedTuple):
    ref: weakref.ref[torch.Tensor]
    slot: _Slot
    op: Callable[..., Any]
    position: int


_new_record = tuple.__new__
"""`_new_record(_Produced, (...))` makes a record without the Python-level `NamedTuple.__new__` (half the cost,
on the path every op takes); the fields are all given, in order."""


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


def out_call(func: Callable[..., Any]) -> Callable[..., Any] | None:
    """How to run torch function or tensor method `func` with `out=`: the `torch.<name>` binding, or None.

    Only a public builtin `torch.<name>`, called directly or as the tensor method of that name, whose aten
    op has an `out=` overload: aten ops with an `out=` form compute new values (views and in-place ops
    have none), and the binding takes the method's receiver as its first argument. Python functions
    of the same name (`torch.nn.functional.relu`, `torch.split`) are not used; a binding that then
    rejects the arguments raises `TypeError` before anything runs, and the producer is unlinked.
    """
    call = _OUT_CALLS.get(func, _UNKNOWN)
    if call is not _UNKNOWN:
        return call
    name = getattr(func, "__name__", None)
    call = None
    if isinstance(name, str) and not name.startswith("_"):
        binding = getattr(torch, name, None)
        packet = getattr(torch.ops.aten, name, None) if isinstance(binding, types.BuiltinFunctionType) else None
        is_it = func is binding or func is getattr(torch._C.TensorBase, name, None)
        if is_it and isinstance(packet, torch._ops.OpOverloadPacket) and _has_out_overload(packet):
            call = binding
    _OUT_CALLS[func] = call
    return call


def _has_out_overload(packet: torch._ops.OpOverloadPacket) -> bool:
    for name in packet.overloads():
        outs = [argument for argument in getattr(packet, name)._schema.arguments if argument.is_out]
        if len(outs) == 1 and outs[0].name == "out":
            return True
    return False


_OUT_CALLS: dict[Any, Callable[..., Any] | None] = {}
_UNKNOWN: Any = object()


def signature(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """What fixes an op's output dtype and device: argument dtypes/devices and non-tensor constants.

    Aten op arguments are tensors, scalars, or lists of them, so one level of nesting is enough (and
    much cheaper than pytree on the per-op path).
    """
    return survey(args, kwargs)[0]


def survey(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], list[int] | None]:
    """`signature(args, kwargs)`, and the data pointers of the tensor arguments when all of them are plain
    tensors at the top level with storage (else None: a list, a keyword, a subclass or a sparse tensor, for
    `reads_range` to walk), in one pass: the per-op path of a linked producer needs both. Plain tensors and
    scalars, the common arguments, are described inline (as `_describe` would describe them, without its call)."""
    described: list[Any] = []
    pointers: list[int] | None = []
    for value in args:
        kind = type(value)
        if kind is _Tensor:
            described.append((value.dtype, value.device, value.dim() == 0))
            if pointers is not None:
                try:
                    pointers.append(value.data_ptr())
                except RuntimeError:  # no storage (sparse): `reads_range` refuses it
                    pointers = None
        elif kind in _SCALARS:
            described.append((kind, value))
        else:
            described.append(_describe(value))
            pointers = None
    if kwargs:
        described += kwargs
        described += map(_describe, kwargs.values())
        pointers = None
    return tuple(described), pointers


def tensor_arguments(args: Sequence[Any], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(item for item in value if isinstance(item, torch.Tensor))
    return found


def _reads(pointers: list[int] | None, args: Sequence[Any], kwargs: dict[str, Any], start: int, end: int) -> bool:
    """`reads_range`, from `survey`'s pointers when it has them."""
    if pointers is None:
        return reads_range(args, kwargs, start, end)
    for pointer in pointers:  # noqa: SIM110 (a loop: `any()` of a generator costs more than the check)
        if start <= pointer < end:
            return True
    return False


def reads_range(args: Sequence[Any], kwargs: dict[str, Any], start: int, end: int) -> bool:
    """Whether a tensor argument (or one in a list argument) may read [start, end): it starts there, or it has
    no data pointer to check (a sparse tensor, whose values could live anywhere). `tensor_arguments`' tensors,
    checked as they are met, without building the list."""
    for value in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(value, _Tensor):
            if _may_read(value, start, end):
                return True
        elif isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, _Tensor) and _may_read(item, start, end):
                    return True
    return False


def _may_read(tensor: torch.Tensor, start: int, end: int) -> bool:
    try:
        pointer = tensor.data_ptr()
    except RuntimeError:
        return True
    return start <= pointer < end


def _describe(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.device, value.dim() == 0)
    kind = type(value)
    if kind in _SCALARS:
        return (kind, value)  # 1, 1.0 and True are equal but promote differently
    if isinstance(value, (list, tuple)):
        return tuple(map(_describe, value))
    try:
        hash(value)
    except TypeError:
        return kind
    return (kind, value)


_SCALARS = frozenset({int, float, bool, complex, str, type(None)})
_Tensor = torch.Tensor


def memory_range(tensor: torch.Tensor) -> tuple[int, int]:
    """[start, end) byte addresses a tensor's storage spans (a superset of the elements it reads)."""
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


def overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def alias_storage(buffer: torch.Tensor) -> torch.UntypedStorage:
    """A storage over `buffer`'s memory that cannot grow and keeps `buffer` alive: DLPack's import wraps foreign
    memory in a storage with no allocator whose deleter drops the exporter's reference. So a tensor redirected
    into a buffer stays valid after the buffer is outgrown and retired, like any tensor the program holds."""
    return torch.from_dlpack(buffer).untyped_storage()


def empty_at(buffer: torch.Tensor, alias: torch.UntypedStorage | None = None) -> torch.Tensor:
    """A zero-length tensor at `buffer`'s start over `alias` (`alias_storage(buffer)` when None).

    An `out=` op resizes it in place to its output shape while that fits; a larger output makes the op
    raise before writing anything (the storage cannot grow), never move the buffer. Every tensor made on
    one alias, and every view of them, holds a reference to its storage: `storage_users` tells whether the
    program still holds any. It is made under the caller's grad and inference mode, so what an op writes
    into it is the same kind of tensor (inference or not) as the op's eager output.
    """
    return buffer.new_empty(0).set_(alias_storage(buffer) if alias is None else alias, 0, (0,), (1,))


def storage_users(storage: torch.UntypedStorage) -> int:
    """How many references the storage's memory has: tensors (views included) and storage objects such as
    `storage` itself."""
    return int(torch._C._storage_Use_Count(storage._cdata))


@dataclass(slots=True)
class SlotAlias:
    """A redirect-lane slot's current buffer as redirects write it: the storage aliasing it that every tensor
    redirected into the slot is made on, its byte range, and per inference mode a zero-length template on that
    storage whose `detach()`es are the redirect targets (a fifth of the cost of making one). The slot is
    referenced while anything but this record (the storage object and its templates) uses the storage.

    What a redirect reads of it is kept as plain fields (`capacity`, `cdata`, `own`), so the per-op path
    reads attributes instead of calling tensor methods; `retired` is set when `Lanes` forgets the record
    (its buffer was reallocated), which is how a `Link`'s cached record knows it is outgrown."""

    buffer: torch.Tensor
    storage: torch.UntypedStorage
    start: int
    end: int
    templates: dict[bool, torch.Tensor] = field(default_factory=dict)
    capacity: int = 0
    """Elements of `buffer`."""
    cdata: int = 0
    """`storage._cdata`, for `torch._C._storage_Use_Count` (valid while `storage` is held, which is for life)."""
    own: int = 1
    """References this record holds on the storage: the storage object and each template."""
    retired: bool = False

    @classmethod
    def over(cls, buffer: torch.Tensor) -> SlotAlias:
        storage = alias_storage(buffer)
        start = buffer.data_ptr()
        return cls(buffer, storage, start, start + storage.nbytes(), {}, buffer.numel(), storage._cdata)

    def referenced(self) -> bool:
        return _use_count(self.cdata) > self.own

    def target(self) -> torch.Tensor:
        """A zero-length tensor at the buffer's start for an `out=` op to write into (`empty_at`), made under the
        caller's inference mode."""
        inference = torch.is_inference_mode_enabled()
        template = self.templates.get(inference)
        if template is None:
            template = self.templates[inference] = empty_at(self.buffer, self.storage)
            self.own = 1 + len(self.templates)
        return template.detach()


_use_count = torch._C._storage_Use_Count


@dataclass
class Lanes:
    """Placeholder arenas per lane, and which redirected tensors occupy which lane slots."""

    copy_arena: PlaceholderArena
    arenas: dict[int, PlaceholderArena] = field(default_factory=dict)
    active: bool = False
    """Set once zero-copy or carried state is in use; until then calls never look at lanes."""
    last_lane: int = COPY_LANE
    aliases: dict[tuple[int, int, torch.dtype, torch.device], SlotAlias] = field(default_factory=dict)
    """Per redirect-lane slot (lane, position, dtype, device): its current buffer as redirects write it
    (`redirect_alias`); forgotten when the buffer is reallocated (nothing writes the outgrown one any more)."""
    pinned: set[int] = field(default_factory=set)
    """Positions never redirected: a graph returns a view of their placeholder."""
    carried: set[int] = field(default_factory=set)
    """Positions written by carried outputs (`carry.py`), not by automatic redirects."""
    owners: dict[int, tuple[int, int, torch.dtype, torch.device]] = field(default_factory=dict)
    """Start address of each current redirect-lane buffer -> (lane, position, dtype, device): how a call
    finds, in one lookup per argument, which lane an argument sits in."""
    generations: dict[int, int] = field(default_factory=lambda: dict.fromkeys(REDIRECT_LANES, 0))
    """Per redirect lane, how many times one of its redirect targets' buffers was reallocated (grown). Lane
    graphs are keyed by it (`LaneKey.generation`): a graph captured before a reallocation reads the outgrown
    buffer, where no redirect writes any more, so calls go to a graph captured against the current buffers.
    Carried positions do not count: a carried output is written into the buffer bound when the writing graph
    was captured, which is the one the next graph in the chain was captured reading (`carry.py`)."""
    _slot_address: dict[tuple[int, int, torch.dtype, torch.device], int] = field(default_factory=dict)
    _lane_keys: dict[tuple[int, int, int], tuple[GraphKey, LaneKey]] = field(default_factory=dict)
    """(id of a call's key, lane, generation) -> (that key, its `LaneKey`): holding the key keeps its id unique."""

    def arena(self, lane: int) -> PlaceholderArena:
        if lane == COPY_LANE:
            return self.copy_arena
        arena = self.arenas.get(lane)
        if arena is None:
            arena = self.arenas[lane] = PlaceholderArena()
        return arena

    def placeholder(
        self, lane: int, position: int, spec: TensorSpec, example: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The lane's placeholder for `position` shaped as `spec` (see `PlaceholderArena.placeholder`)."""
        view = self.arena(lane).placeholder(position, spec, example)
        if lane != COPY_LANE:
            self._track(lane, position, spec.dtype, spec.device)
        return view

    def buffer(self, lane: int, position: int, dtype: torch.dtype, device: torch.device, numel: int) -> torch.Tensor:
        """The lane's buffer for `position`, with room for at least `numel` elements (grown as arenas grow)."""
        arena = self.arena(lane)
        buffer = arena.buffers.get((position, dtype, device))
        if buffer is None or buffer.numel() < numel:
            self.placeholder(lane, position, TensorSpec((numel,), dtype, device))
            buffer = arena.buffers[(position, dtype, device)]
        return buffer

    def _track(self, lane: int, position: int, dtype: torch.dtype, device: torch.device) -> None:
        slot = (lane, position, dtype, device)
        address = self.arenas[lane].buffers[(position, dtype, device)].data_ptr()
        previous = self._slot_address.get(slot)
        if previous == address:
            return
        if previous is not None:
            self.owners.pop(previous, None)
            retired = self.aliases.pop(slot, None)
            if retired is not None:
                retired.retired = True
            if position not in self.carried:
                self.generations[lane] += 1
        self._slot_address[slot] = address
        self.owners[address] = slot

    def busy(self, lane: int, position: int, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether the slot holds a redirected tensor (or a view of one) the program still references."""
        alias = self.aliases.get((lane, position, dtype, device))
        return alias is not None and alias.referenced()

    def redirect_alias(
        self, lane: int, position: int, dtype: torch.dtype, device: torch.device, numel: int
    ) -> SlotAlias:
        """The slot's current buffer, with room for at least `numel` elements, as redirects write it."""
        slot = (lane, position, dtype, device)
        alias = self.aliases.get(slot)
        if alias is None or alias.buffer.numel() < numel:
            buffer = self.buffer(lane, position, dtype, device, numel)  # growing it forgets the old alias
            alias = self.aliases.get(slot)
            if alias is None:
                alias = self.aliases[slot] = SlotAlias.over(buffer)
        return alias

    def key_for(self, key: GraphKey, flat: Flattened, indices: Sequence[int], stats: GraphStats) -> GraphKey:
        """The key of the graph that reads this call's arguments where they are (see the module docstring).

        `indices` are the tensor leaves of `flat`. The lane is the one most arguments sit in (the first met on a
        tie)."""
        owners = self.owners
        leaves = flat.leaves
        votes = [0] * (1 + max(REDIRECT_LANES))
        lanes = []  # per index in `indices`, the lane its argument sits in (COPY_LANE: none)
        for index in indices:
            leaf = leaves[index]
            owner = owners.get(leaf.data_ptr())
            if owner is not None and owner[1] == index and owner[2] == leaf.dtype and owner[3] == leaf.device:
                votes[owner[0]] += 1
                lanes.append(owner[0])
            else:
                lanes.append(COPY_LANE)
        first, second = REDIRECT_LANES
        if votes[first] == votes[second]:
            lane = next((lane for lane in lanes if lane != COPY_LANE), COPY_LANE)
        else:
            lane = first if votes[first] > votes[second] else second
        if lane != COPY_LANE:
            for index, sits in zip(indices, lanes, strict=True):
                if sits == lane:
                    continue
                leaf = leaves[index]
                if self.busy(lane, index, leaf.dtype, leaf.device):
                    stats.record_misprediction(
                        Misprediction.REFERENCED,
                        f"argument leaf {index} would be copied into lane {lane}, whose slot holds a referenced tensor",
                    )
                    lane = COPY_LANE
                    break
        self.last_lane = lane
        if lane == COPY_LANE:
            return key
        return self.lane_key(key, lane)

    def lane_key(self, key: GraphKey, lane: int) -> LaneKey:
        """`key` at `lane` and the lane's current generation, the same object at every call (its hash is cached)."""
        generation = self.generations[lane]
        cached = self._lane_keys.get((id(key), lane, generation))
        if cached is not None and cached[0] is key:
            return cached[1]
        if len(self._lane_keys) >= _LANE_KEY_CACHE_SIZE:
            self._lane_keys.clear()
        made = LaneKey(key.structure, key.tensors, key.constants, lane, generation)
        self._lane_keys[(id(key), lane, generation)] = (key, made)
        return made

    def current(self, key: GraphKey) -> GraphKey:
        """`key` with its lane's generation as it is now (making a graph's placeholders may have grown a buffer)."""
        if isinstance(key, LaneKey) and key.generation != self.generations[key.lane]:
            return LaneKey(key.structure, key.tensors, key.constants, key.lane, self.generations[key.lane])
        return key

    def pin_aliased_outputs(self, positions: Sequence[int], placeholders: Sequence[torch.Tensor], outputs: Any) -> None:
        """Never redirect into a position whose placeholder a graph returns (a view of it)."""
        ranges = [memory_range(output) for output in pytree.tree_leaves(outputs) if isinstance(output, torch.Tensor)]
        for position, placeholder in zip(positions, placeholders, strict=True):
            start = placeholder.data_ptr()
            span = (start, start + placeholder.numel() * placeholder.element_size())
            if any(overlaps(span, output) for output in ranges):
                self.pinned.add(position)


_LANE_KEY_CACHE_SIZE = 1024
"""`Lanes.lane_key` forgets its keys when it holds this many (as the callable's key cache does)."""


@dataclass(frozen=True)
class Staging:
    """What staging a graph's inputs needs about its placeholders, computed once per graph."""

    positions: list[int]
    placeholders: list[torch.Tensor]
    addresses: list[int]
    strides: list[tuple[int, ...]]
    storages: list[int]
    """Start address of each placeholder's storage (a source in one of them may need a clone first)."""
    nbytes: list[int]

    @classmethod
    def of(cls, positions: Sequence[int], placeholders: Sequence[torch.Tensor]) -> Staging:
        return cls(
            list(positions),
            list(placeholders),
            [placeholder.data_ptr() for placeholder in placeholders],
            [placeholder.stride() for placeholder in placeholders],
            [placeholder.untyped_storage().data_ptr() for placeholder in placeholders],
            [placeholder.numel() * placeholder.element_size() for placeholder in placeholders],
        )


def stage_inputs(
    staging: Staging, leaves: Sequence[Any], stats: GraphStats, predictor: ZeroCopyPredictor | None
) -> None:
    """Copy a call's tensor arguments into the placeholders they are not already in, in one batch.

    An argument is in place when it starts at its placeholder's address with its strides (the key already
    fixed shape, dtype and device). A source that lives in another argument's placeholder (or partly in
    its own) would be overwritten by the batch before it is read, so it is cloned first: the answer stays
    the eager one.
    """
    targets: list[torch.Tensor] = []
    sources: list[torch.Tensor] = []
    written: set[int] = set()
    copied = avoided = 0
    for i, position in enumerate(staging.positions):
        source = leaves[position]
        in_place = source.data_ptr() == staging.addresses[i] and source.stride() == staging.strides[i]
        if predictor is not None:
            predictor.observe(position, source, in_place)
        if in_place:
            avoided += staging.nbytes[i]
            continue
        targets.append(staging.placeholders[i])
        sources.append(source)
        written.add(staging.storages[i])
        copied += staging.nbytes[i]
    stats.input_copies_avoided += len(staging.positions) - len(targets)
    stats.input_bytes_avoided += avoided
    if not targets:
        return
    sources = [source.clone() if source.untyped_storage().data_ptr() in written else source for source in sources]
    torch._foreach_copy_(targets, sources)
    stats.input_copies += len(targets)
    stats.input_bytes_copied += copied


class ZeroCopyPredictor:
    """Learns producers of one callable's inputs and redirects them; driven by `ZeroCopyMode`.

    The per-op path (`dispatch`) is what every op inside a `zero_copy()` block pays for, so it does the
    least it can: an op that is no linked producer costs a counter update, a dict lookup and a record of
    its output (a weak reference); only linked producers describe their arguments (`survey`), and only
    confirmed ones try a redirect, which checks what can change between runs and caches the rest on the
    link (see the module docstring).
    """

    def __init__(self, lanes: Lanes, stats: GraphStats) -> None:
        self.lanes = lanes
        self.stats = stats
        self.links: dict[_Slot, Link] = {}
        self.occurrences: dict[int, int] = {}
        """Runs of each op overload (by id) since the callable's last call."""
        self.produced: dict[int, _Produced] = {}
        """id of an op output -> its record; entries whose tensor died are pruned as the table grows."""
        self._prune_at = _PRUNE_MIN
        self.redirected: dict[int, _Redirected] = {}
        """Tensors written by redirects since the last call."""
        self.ran: set[_Slot] = set()
        """Linked producers that ran since the last call; those whose output the call did not meet are unlinked."""
        self.met: set[_Slot] = set()
        self.suspended = 0
        self.active = 0
        """Open `zero_copy()` blocks."""

    # -- between calls -------------------------------------------------------------------------------

    def dispatch(self, op: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        if self.suspended:
            return op(*args, **kwargs)
        op_id = id(op)
        occurrences = self.occurrences
        occurrence = occurrences.get(op_id, 0)
        occurrences[op_id] = occurrence + 1
        slot = (op_id, occurrence)
        link = self.links.get(slot)
        if link is None or link.op is not op:
            result = op(*args, **kwargs)
            if isinstance(result, _Tensor):
                self._record(result, slot, op, None, args)
            return result
        self.ran.add(slot)
        learned, pointers = survey(args, kwargs)
        if link.confirmations >= CONFIRMATIONS and link.signature is not None:
            result = self._redirect(slot, link, learned, pointers, args, kwargs)
            if result is not _REFUSED:
                return result  # a redirected tensor, met by `observe` in `redirected`; or recorded eagerly
        result = op(*args, **kwargs)
        if isinstance(result, _Tensor):
            self._record(result, slot, op, learned, args)
        return result

    def _record(
        self, result: torch.Tensor, slot: _Slot, op: Callable[..., Any], learned: Any, args: Sequence[Any]
    ) -> None:
        produced = self.produced
        first = args[0] if args else None
        viewed = None
        if type(first) is _Tensor and first is not result and out_call(op) is None:  # a view, maybe
            viewed = self._viewed(first, result)
        produced[id(result)] = _new_record(_Produced, (weakref.ref(result), slot, op, learned, viewed))
        if len(produced) >= self._prune_at:
            for key in [key for key, record in produced.items() if record.ref() is None]:
                del produced[key]
            self._prune_at = max(_PRUNE_MIN, 2 * len(produced))

    def _viewed(self, first: torch.Tensor, result: torch.Tensor) -> _Produced | _Redirected | None:
        """The record of the op output `result` is a whole view of (see `observe`), when it views all of `first`,
        the op's first argument; a view of a view resolves to the first op output that has an out= form."""
        if first.data_ptr() != result.data_ptr() or first.numel() != result.numel():
            return None
        if first.dtype != result.dtype:
            return None  # `view(dtype)` reinterprets: the producer's out= form would convert instead
        if not (first.is_contiguous() and result.is_contiguous()):
            return None
        record: _Produced | _Redirected | None = self.redirected.get(id(first)) or self.produced.get(id(first))
        if record is None or record.ref() is not first:
            return None
        if isinstance(record, _Produced) and record.viewed is not None and out_call(record.op) is None:
            return record.viewed
        return record

    def _redirect(
        self,
        slot: _Slot,
        link: Link,
        learned: tuple[Any, ...],
        pointers: list[int] | None,
        args: Sequence[Any],
        kwargs: dict[str, Any],
    ) -> Any:
        """Run a confirmed producer into its placeholder slot, or return `_REFUSED` (the caller runs it eagerly).

        Checks what can change from one run to the next: the position's standing (pinned, carried), the
        signature, autograd, the slot's buffer (cached in `link.aliases` while current and large enough),
        whether the program still references the slot, whether the op reads it; the op itself checks the
        output fits."""
        position = link.position
        lanes = self.lanes
        if position in lanes.pinned or position in lanes.carried:
            return _REFUSED
        if learned != link.signature:
            self._miss(Misprediction.SIGNATURE, f"{_name(link, slot)} ran with other argument dtypes or constants")
            return _REFUSED
        if torch.is_grad_enabled() and any(tensor.requires_grad for tensor in tensor_arguments(args, kwargs)):
            return _REFUSED  # out= ops do not record autograd history
        lane = _PARTNER[lanes.last_lane]
        alias = link.aliases[lane]
        if alias is None or alias.retired or alias.capacity < 2 * max(link.numel, 1):
            alias = lanes.redirect_alias(lane, position, link.dtype, link.device, 2 * max(link.numel, 1))
            link.aliases[lane] = alias
        if _use_count(alias.cdata) > alias.own:  # `alias.referenced()`
            detail = f"{_name(link, slot)}: lane {lane} slot {position} is still referenced"
            self._miss(Misprediction.REFERENCED, detail)
            return _REFUSED
        if _reads(pointers, args, kwargs, alias.start, alias.end):
            self._miss(
                Misprediction.READS_PLACEHOLDER, f"{_name(link, slot)} reads (or may read) the buffer it would write"
            )
            return _REFUSED
        template = alias.templates.get(torch.is_inference_mode_enabled())  # `alias.target()`, inline
        target = alias.target() if template is None else template.detach()
        try:
            result = link.out_op(*args, **kwargs, out=target)
        except (RuntimeError, TypeError) as error:  # raised before writing: the output does not fit, or out= refused
            first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
            if "not resizable" not in first_line:
                self.links.pop(slot, None)
                self._miss(Misprediction.NO_OUT_FORM, f"{_name(link, slot)}: its out= form raised {first_line}")
                return _REFUSED
            self._miss(Misprediction.TOO_LARGE, f"{_name(link, slot)}: {first_line}")
            result = self._outgrown(lane, link, link.op(*args, **kwargs))
            if isinstance(result, _Tensor):
                self._record(result, slot, link.op, learned, args)
            return result
        self.redirected[id(result)] = _new_record(_Redirected, (weakref.ref(result), slot, link.op, position))
        self.stats.redirects += 1
        return result

    def _outgrown(self, lane: int, link: Link, result: Any) -> Any:
        """The eager `result` of a producer too large for its lane buffer; the buffer is sized for it now.

        Sized as the next redirect will ask (twice the output), so this lane's buffer is reallocated once,
        here, before any graph reads it at the new size; the other lane grows at its next redirect. Every
        call after the reallocation goes to graphs captured against the new buffers (`Lanes.generations`).
        """
        if isinstance(result, torch.Tensor):
            link.numel = result.numel()
            self.lanes.buffer(lane, link.position, link.dtype, link.device, 2 * max(link.numel, 1))
        return result

    def _miss(self, reason: Misprediction, detail: str) -> None:
        self.stats.record_misprediction(reason, detail)

    # -- at a call -----------------------------------------------------------------------------------

    def observe(self, position: int, source: torch.Tensor, in_place: bool) -> None:
        """A call met `source` at argument leaf `position`; `in_place`: it already was the placeholder.

        A source that is a whole view of an op output (`tokens[:, None]`: same start and elements, both laid
        out contiguously; `_Produced.viewed`) stands for that output, which may be dead by now (inference-mode
        views keep only the storage): its producer is the one linked and redirected, and the view the program
        makes of the redirected output is then in place (checked at every call, as always)."""
        redirected: _Redirected | None = self.redirected.pop(id(source), None)
        if redirected is not None and redirected.ref() is not source:
            redirected = None
        produced = None
        if redirected is None:
            produced = self.produced.get(id(source))
            if produced is not None and produced.ref() is not source:
                produced = None
            if produced is not None and produced.viewed is not None and out_call(produced.op) is None:
                if isinstance(produced.viewed, _Redirected):
                    redirected = produced.viewed
                    self._forget_redirect(redirected)
                else:
                    produced = produced.viewed
        if redirected is not None:
            self.met.add(redirected.slot)
            if in_place:
                return
            name = ProducerKey(redirected.op, redirected.slot[1])
            if redirected.position != position:
                detail = f"{name} was predicted for leaf {redirected.position}, passed at {position}"
                self._miss(Misprediction.NOT_PASSED, detail)
            else:
                self._miss(Misprediction.MOVED, f"{name}: the call's graph reads another buffer or layout")
            self.links.pop(redirected.slot, None)
            return
        if in_place or produced is None:
            return
        self.met.add(produced.slot)
        if position in self.lanes.carried or position in self.lanes.pinned:
            return
        out_op = out_call(produced.op)
        if out_op is None:
            detail = f"leaf {position} comes from {op_name(produced.op)}, which has no out= form"
            self._miss(Misprediction.NO_OUT_FORM, detail)
            return
        known = self.links.get(produced.slot)
        agrees = (
            known is not None
            and known.op is produced.op
            and known.position == position
            and (known.signature is None or known.signature == produced.signature)
        )
        confirmations = known.confirmations + 1 if known is not None and agrees else 1
        self.links[produced.slot] = Link(
            produced.op,
            out_op,
            position,
            produced.signature,
            source.dtype,
            source.device,
            source.numel(),
            confirmations,
        )

    def _forget_redirect(self, record: _Redirected) -> None:
        """Drop `record` from this interval's redirects (met through a view, so under another tensor's id)."""
        for key, value in self.redirected.items():
            if value is record:
                del self.redirected[key]
                return

    def end_interval(self, *, count: bool = True) -> None:
        """The call has read its arguments: redirected tensors it did not read were wasted predictions.

        `count=False` at the end of a `zero_copy()` block: the last producers' outputs had no call to go to.
        """
        if count:
            for record in self.redirected.values():
                if record.ref() is None:
                    continue  # dropped by the program before the call: nothing was wasted but the write
                name = ProducerKey(record.op, record.slot[1])
                self._miss(Misprediction.NOT_PASSED, f"{name} was predicted for leaf {record.position}, not passed")
                self.links.pop(record.slot, None)
            for slot in self.ran - self.met:
                self.links.pop(slot, None)
        self.redirected.clear()
        self.ran.clear()
        self.met.clear()
        self.occurrences.clear()

    def enter_call(self) -> ZeroCopyMode | None:
        """A call of the callable starts: its own ops are not producers. Returns the mode it lifted off
        torch's mode stack for the call (`lift_mode`), to give back to `exit_call`."""
        self.suspended += 1
        return lift_mode(self)

    def exit_call(self, lifted: ZeroCopyMode | None) -> None:
        """The call is over: the next interval starts."""
        restore_mode(lifted)
        self.suspended -= 1
        self.end_interval()


_REFUSED: Any = object()
"""What `ZeroCopyPredictor._redirect` returns when it did not run the op."""

_PRUNE_MIN = 256
"""`ZeroCopyPredictor.produced` is pruned of dead tensors when it reaches this size or twice its size after
the last pruning (amortised O(1) per op, even when the program keeps many op outputs alive)."""


def _name(link: Link, slot: _Slot) -> ProducerKey:
    return ProducerKey(link.op, slot[1])


class ZeroCopyMode(TorchFunctionMode):
    """Routes every torch call between calls of the callable through a `ZeroCopyPredictor`."""

    def __init__(self, predictor: ZeroCopyPredictor) -> None:
        super().__init__()
        self.predictor = predictor

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        return self.predictor.dispatch(func, args, kwargs or {})


def lift_mode(predictor: ZeroCopyPredictor) -> ZeroCopyMode | None:
    """Take `predictor`'s mode off torch's function-mode stack if it is on top (else None): a call of the
    callable then runs without the mode's per-call cost. `restore_mode` puts it back."""
    depth = torch._C._len_torch_function_stack()
    if depth == 0:
        return None
    top = torch._C._get_function_stack_at(depth - 1)
    if not isinstance(top, ZeroCopyMode) or top.predictor is not predictor:
        return None
    return torch._C._pop_torch_function_stack()


def restore_mode(mode: ZeroCopyMode | None) -> None:
    if mode is not None:
        torch._C._push_on_torch_function_stack(mode)
