"""The graph key: which captured graph serves a call.

A call `fn(*args, **kwargs)` is flattened with `torch.utils._pytree` (tuples, lists, dicts and
registered containers such as HF `ModelOutput`); every tensor leaf contributes its shape, dtype and
device, every other leaf its value. Two calls with equal keys run the same graph: the tensors'
contents may differ, their metadata may not, and the non-tensor leaves are baked into the graph.
Strides are not part of the key: inputs are copied into contiguous placeholders.

The key is a plain, frozen, hashable value computed in pure Python, so dispatch (a dict lookup) is
tested without a GPU. Calls that cannot be keyed (an unhashable non-tensor argument) get a
`Unkeyable` with the reason instead, and run eagerly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.utils import _pytree as pytree


@dataclass(frozen=True)
class TensorSpec:
    """The metadata of one tensor argument that a graph is specialised on."""

    shape: tuple[int, ...]
    """Sizes of every dimension."""
    dtype: torch.dtype
    """Element type; a graph reads its placeholder with exactly this dtype."""
    device: torch.device
    """Where the tensor lives; graphs only take CUDA tensors (CPU tensors run eagerly)."""

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorSpec:
        return cls(tuple(tensor.shape), tensor.dtype, tensor.device)

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def __str__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{dtype}[{', '.join(map(str, self.shape))}]@{self.device}"


@dataclass(frozen=True)
class GraphKey:
    """Identity of one captured graph: the structure and metadata of the arguments it was captured for."""

    structure: Hashable
    """The structure of `(args, kwargs)`: positional count and keyword names, or a pytree `TreeSpec` if nested."""
    tensors: tuple[TensorSpec, ...]
    """One spec per tensor leaf, in flattening order."""
    constants: tuple[tuple[int, type, Hashable], ...]
    """`(leaf index, type, value)` of every non-tensor leaf (ints, floats, strings, None, flags), baked into the
    graph; the type keeps `1`, `1.0` and `True` apart."""

    @property
    def nbytes(self) -> int:
        """Total size of the tensor arguments: the order in which keys are captured (largest first)."""
        return sum(spec.nbytes for spec in self.tensors)

    def devices(self) -> frozenset[torch.device]:
        return frozenset(spec.device for spec in self.tensors)

    def __str__(self) -> str:
        parts = [str(spec) for spec in self.tensors]
        parts += [f"#{index}={value!r}" for index, _, value in self.constants]
        return "(" + ", ".join(parts) + ")"


@dataclass(frozen=True)
class Unkeyable:
    """A call that has no graph key, and why (it runs eagerly)."""

    reason: str


_SIMPLE = (int, float, bool, str, type(None), torch.dtype, torch.device)


@dataclass(frozen=True)
class Flattened:
    """A call's leaves and structure, kept so placeholders can be put back into the same structure.

    Calls whose arguments are all tensors or simple scalars (the common case) skip pytree, whose
    flattening costs several times more than the rest of dispatch.
    """

    leaves: list[Any]
    structure: Hashable

    def unflatten(self, leaves: list[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if isinstance(self.structure, pytree.TreeSpec):
            args, kwargs = pytree.tree_unflatten(leaves, self.structure)
            return tuple(args), dict(kwargs)
        _, count, names = cast(tuple[str, int, tuple[str, ...]], self.structure)
        return tuple(leaves[:count]), dict(zip(names, leaves[count:], strict=True))

    def tensor_indices(self) -> list[int]:
        """Positions of the tensor leaves."""
        return [i for i, leaf in enumerate(self.leaves) if isinstance(leaf, torch.Tensor)]


def flatten_call(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Flattened:
    leaves = [*args, *kwargs.values()]
    if all(isinstance(leaf, (torch.Tensor, *_SIMPLE)) for leaf in leaves):
        return Flattened(leaves, ("flat", len(args), tuple(kwargs)))
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    return Flattened(leaves, spec)


def key_of(flat: Flattened) -> GraphKey | Unkeyable:
    """The key of a flattened call, or why it has none."""
    tensors = []
    constants = []
    for index, leaf in enumerate(flat.leaves):
        if isinstance(leaf, torch.Tensor):
            tensors.append(TensorSpec.of(leaf))
            continue
        try:
            hash(leaf)
        except TypeError:
            return Unkeyable(f"argument leaf {index} of type {type(leaf).__name__} is not hashable")
        constants.append((index, type(leaf), leaf))
    return GraphKey(flat.structure, tuple(tensors), tuple(constants))


def key_for(*args: Any, **kwargs: Any) -> GraphKey | Unkeyable:
    """The key a call `fn(*args, **kwargs)` dispatches on."""
    return key_of(flatten_call(args, kwargs))


Step = tuple[tuple[int, ...], ...]
"""Per tensor leaf, per dimension: how much one key's shapes differ from another's."""


def step_between(earlier: Hashable, later: Hashable) -> Step | None:
    """How `later`'s tensor shapes differ from `earlier`'s, if the two keys differ in shapes only (same key type,
    structure, constants, dtypes, devices and ranks; a `LaneKey`'s lane and generation too); else None."""
    if not isinstance(earlier, GraphKey) or type(earlier) is not type(later):
        return None
    assert isinstance(later, GraphKey)
    if len(earlier.tensors) != len(later.tensors):
        return None
    if any(getattr(earlier, name) != getattr(later, name) for name in _fields_besides_tensors(type(earlier))):
        return None
    step = []
    for a, b in zip(earlier.tensors, later.tensors, strict=True):
        if a.dtype != b.dtype or a.device != b.device or len(a.shape) != len(b.shape):
            return None
        step.append(tuple(y - x for x, y in zip(a.shape, b.shape, strict=True)))
    return tuple(step)


_FIELDS_BESIDES_TENSORS: dict[type, tuple[str, ...]] = {}


def _fields_besides_tensors(cls: type) -> tuple[str, ...]:
    """The fields of a `GraphKey` (sub)class other than `tensors` (a `LaneKey`'s lane and generation too)."""
    names = _FIELDS_BESIDES_TENSORS.get(cls)
    if names is None:
        names = _FIELDS_BESIDES_TENSORS[cls] = tuple(f.name for f in dataclasses.fields(cls) if f.name != "tensors")
    return names


def next_in_step(before: Hashable, previous: Hashable, current: Hashable) -> GraphKey | None:
    """The key after `current` if calls keep stepping shapes as the last two transitions did (e.g. length n-1 to n
    after n-2 to n-1 predicts n+1); None when the steps differ, are zero, or the keys differ in more than shapes.

    What a graph-memory cache prefetches the executable of (`tendril.graphs.executables`)."""
    step = step_between(previous, current)
    if step is None or not any(any(dims) for dims in step) or step_between(before, previous) != step:
        return None
    assert isinstance(current, GraphKey)
    tensors = []
    for spec, dims in zip(current.tensors, step, strict=True):
        shape = tuple(size + delta for size, delta in zip(spec.shape, dims, strict=True))
        if min(shape, default=0) < 0:
            return None
        tensors.append(TensorSpec(shape, spec.dtype, spec.device))
    return dataclasses.replace(current, tensors=tuple(tensors))
