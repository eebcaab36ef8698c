"""Checks of the compressed layouts in `tendril.sparse.format`, run when one is constructed.

Malformed compressed data does not fail loudly in the kernels: an index past its array is read or written
unchecked (the numba CPU loops can crash the process, the GPU kernels read or write stray memory) and a
pointer array that decreases or disagrees with the values silently drops or repeats products. So every layout
checks itself at construction and raises `TypeError` (wrong type or dtype) or `ValueError` (anything else),
naming the layout and the field.

Two kinds of check, and what each costs:
- structure (types, dtypes, shapes, lengths, devices, contiguity): metadata only, always;
- values (index ranges, monotone pointers, order within a segment, counts consistent with the values):
  vectorised over the data and gathered into one host sync. They are skipped while the current CUDA stream is
  capturing a graph, where a sync is an error (the layouts are built by `convert`, `to_csr` and `tune`
  outside any capture; a capture only ever builds activation buffers, whose values are not checked at
  construction, see `CompressedActivations`).
"""

from __future__ import annotations

import torch

VALUE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""The dtypes of stored values (weights and activations): a layout's values are in its network's dtype; kernels
accumulate in fp32 whatever it is."""


def value_dtype(dtype: torch.dtype | None, weight: torch.Tensor) -> torch.dtype:
    """The dtype compressed values are stored in: `dtype`, or the weight's own; one of `VALUE_DTYPES`."""
    chosen = weight.dtype if dtype is None else dtype
    if chosen not in VALUE_DTYPES:
        raise TypeError(f"dtype {chosen}: compressed values are one of {', '.join(map(str, VALUE_DTYPES))}")
    return chosen


def capturing(t: torch.Tensor) -> bool:
    """Whether `t`'s device is a GPU whose current stream is capturing a CUDA graph (value checks must not sync)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def check_tensor(
    owner: str,
    name: str,
    t: object,
    dtype: torch.dtype | tuple[torch.dtype, ...],
    shape: tuple[int, ...] | None = None,
    *,
    device: torch.device | None = None,
) -> torch.Tensor:
    """`t` must be a contiguous tensor of `dtype` (one of them, for a tuple; and `shape`, where given; else 1-D) on
    `device` (where given)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{owner}.{name}: expected a torch.Tensor, got {type(t).__name__}")
    allowed = dtype if isinstance(dtype, tuple) else (dtype,)
    if t.dtype not in allowed:
        expected = allowed[0] if len(allowed) == 1 else f"one of {', '.join(map(str, allowed))}"
        raise TypeError(f"{owner}.{name}: expected dtype {expected}, got {t.dtype}")
    if shape is None and t.dim() != 1:
        raise ValueError(f"{owner}.{name}: expected a 1-D tensor, got shape {tuple(t.shape)}")
    if shape is not None and tuple(t.shape) != shape:
        raise ValueError(f"{owner}.{name}: expected shape {shape}, got {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{owner}.{name}: expected a contiguous tensor")
    if device is not None and t.device != device:
        raise ValueError(f"{owner}.{name}: on {t.device}, but the other fields are on {device}")
    return t


def check_count(owner: str, name: str, value: object, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{owner}.{name}: expected an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{owner}.{name}={value}: expected at least {minimum}")


class ValueChecks:
    """Conditions on a layout's values, each a boolean tensor that is true when broken, collected and then
    resolved with one host sync (`raise_first`)."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.broken: list[tuple[torch.Tensor, str]] = []

    def add(self, broken: torch.Tensor, message: str) -> None:
        self.broken.append((broken.reshape(()), message))

    def pointer(self, name: str, ptr: torch.Tensor, total: int | torch.Tensor, what: str) -> None:
        """`ptr` (along its last dimension) starts at 0, never decreases and ends at `total` (`what` it counts)."""
        p = ptr.long()
        self.add((p[..., 0] != 0).any(), f"{name} must start at 0")
        self.add((p[..., 1:] < p[..., :-1]).any(), f"{name} must never decrease")
        self.add((p[..., -1] != total).any(), f"{name} must end at {what}")

    def in_range(self, name: str, index: torch.Tensor, stop: int, what: str) -> None:
        """Every entry of `index` lies in [0, stop)."""
        self.add(((index < 0) | (index >= stop)).any(), f"{name}: an entry is out of range [0, {stop}) ({what})")

    def increasing_within(self, name: str, keys: torch.Tensor, ptr: torch.Tensor, segment: str) -> None:
        """`keys` strictly increase within each segment `ptr[i]:ptr[i + 1]` (no repeats, sorted)."""
        n = keys.numel()
        if n < 2:
            return
        first = torch.zeros(n + 1, dtype=torch.bool, device=keys.device)
        first.scatter_(0, ptr.long().clamp(0, n), True)  # index n is a spare slot for empty trailing segments
        keys = keys.long()
        self.add(((keys[1:] <= keys[:-1]) & ~first[1:n]).any(), f"{name} must strictly increase within each {segment}")

    def raise_first(self) -> None:
        if not self.broken:
            return
        flags = torch.stack([flag for flag, _ in self.broken]).tolist()  # one host read, at construction only
        for flag, (_, message) in zip(flags, self.broken, strict=True):
            if flag:
                raise ValueError(f"{self.owner}: {message}")


def segment_of(ptr: torch.Tensor, count: int) -> torch.Tensor:
    """The segment of each of `count` entries under the pointer array `ptr` (no host sync; meaningful only
    when `ptr` is a valid pointer array, which the caller checks alongside)."""
    entries = torch.arange(count, device=ptr.device)
    return torch.searchsorted(ptr.long(), entries, right=True) - 1
