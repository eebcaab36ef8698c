"""Placeholder lanes: where redirected inputs are written, and which graph reads them.

Redirecting into the placeholders the last call read would clobber tensors the program still holds
(`past = [p.index_select(0, beams) for p in present]` keeps the previous `past` alive until the
assignment). So redirected placeholders live in two extra *lanes* (1 and 2), with their own buffers,
and producers write into the lane the last call did not use (`partner`). A call whose arguments sit
in lane L replays the graph captured for (key, L, generation) (`LaneKey`), captured on first use;
lane 0 is the classic one that calls copy into and that `static_inputs`/`inputs_for` expose.

Lane buffers grow (reallocate) when a longer input needs it, and a graph keeps reading the buffers it
was captured with while redirects write into the current ones: so every reallocation of a redirect
target starts a new *generation* of its lane (`Lanes.generations`), and calls go to graphs of the
current generation. Without that, a cache that moves to a longer range would keep meeting graphs of
the outgrown buffers and be copied.

Tensors written by redirects stay valid while the program references them: each is made on a storage
that aliases its slot's buffer and keeps it allocated (`alias_storage`), and a slot whose storage the
program still uses is never written (`SlotAlias.referenced`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
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
        same object while the call's key and lane do not change), and hashing every tensor spec of a large cache
        at each lookup would cost more than the rest of it. Kept outside the dataclass fields (and out of
        pickles: it is per process)."""
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
    """The lane whose placeholders the graph of `key` reads."""
    return key.lane if isinstance(key, LaneKey) else COPY_LANE


def partner(lane: int) -> int:
    """The lane producers (and carried outputs) write into after a call that read `lane`."""
    return REDIRECT_LANES[1] if lane == REDIRECT_LANES[0] else REDIRECT_LANES[0]


PARTNER = {lane: partner(lane) for lane in (COPY_LANE, *REDIRECT_LANES)}
"""`partner` by lane, for the per-op path."""


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
    return int(use_count(storage._cdata))


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
        return use_count(self.cdata) > self.own

    def target(self) -> torch.Tensor:
        """A zero-length tensor at the buffer's start for an `out=` op to write into (`empty_at`), made under the
        caller's inference mode."""
        inference = torch.is_inference_mode_enabled()
        template = self.templates.get(inference)
        if template is None:
            template = self.templates[inference] = empty_at(self.buffer, self.storage)
            self.own = 1 + len(self.templates)
        return template.detach()


use_count = torch._C._storage_Use_Count
"""References to a storage's memory, by its `_cdata` (read on the per-op path, so bound once)."""


@dataclass
class Lanes:
    """Placeholder arenas per lane, and which redirected tensors occupy which lane slots."""

    copy_arena: PlaceholderArena
    arenas: dict[int, PlaceholderArena] = field(default_factory=dict)
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
