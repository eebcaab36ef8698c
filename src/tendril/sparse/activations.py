"""Compressed activations for the sparse×sparse (SCNN) dataflow: where a dense activation goes
(`ActivationLayout`: its phase planes, see `tendril.sparse.format`) and the buffers it is compressed into.

`CompressedActivations` (bytes per nonzero: 8, static capacity)
    `values[Cv, capacity]`, `positions[Cv, capacity]` (flat plane index `iy * plane_w + ix`, ascending),
    `row_ptr[Cv, plane_h + 1]` (how many nonzeros of the channel lie in the rows before each row, so a
    band of rows is one contiguous slice) and `counts[Cv]`, the *true* number of nonzeros of each
    virtual channel, kept on the device. The
    buffers are allocated at their static capacity so that compression needs no host sync and runs
    inside a CUDA graph. The default capacity is the whole plane, which cannot overflow. A smaller
    capacity saves memory; a channel with more nonzeros than that keeps its first `capacity` ones, its
    count records the true number, and the compressor raises the shared overflow flag: kernels read
    `min(count, capacity)` and `min(row_ptr, capacity)` (never past the buffer) and
    `SparseNetwork.check_overflow()` raises after the
    run instead of returning a silently wrong answer.

Construction checks structure (`tendril.sparse.validation`); `validate()` checks the values the compressor wrote
(one host sync).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tendril.sparse.validation import VALUE_DTYPES, ValueChecks, check_count, check_tensor

if TYPE_CHECKING:
    from tendril.sparse.format import ConvGeometry


@dataclass(frozen=True)
class ActivationLayout:
    """Where a dense `[C, H, W]` activation goes when compressed for one consumer."""

    channels: int
    in_hw: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]
    capacity: int
    """Nonzeros each virtual channel can hold (at most the plane size)."""

    def __post_init__(self) -> None:
        check_count("ActivationLayout", "channels", self.channels)
        if min(self.in_hw) < 1 or min(self.stride) < 1 or min(self.padding) < 0:
            raise ValueError(
                f"ActivationLayout: invalid in_hw {self.in_hw}, stride {self.stride} or padding {self.padding}"
            )
        check_count("ActivationLayout", "capacity", self.capacity)
        if self.capacity > self.plane_size:
            raise ValueError(
                f"ActivationLayout.capacity={self.capacity}: exceeds the plane's {self.plane_size} positions"
            )

    @property
    def phases(self) -> int:
        return self.stride[0] * self.stride[1]

    @property
    def virtual_channels(self) -> int:
        return self.channels * self.phases

    @property
    def plane_hw(self) -> tuple[int, int]:
        return tuple((p + n - 1) // s + 1 for n, p, s in zip(self.in_hw, self.padding, self.stride, strict=True))  # type: ignore[return-value]

    @property
    def plane_size(self) -> int:
        return self.plane_hw[0] * self.plane_hw[1]

    @classmethod
    def for_conv(cls, geometry: ConvGeometry, capacity_fraction: float = 1.0) -> ActivationLayout:
        base = cls(geometry.in_channels, geometry.in_hw, geometry.stride, geometry.padding, 1)
        return base.with_capacity(capacity_fraction)

    @classmethod
    def for_vector(cls, features: int, capacity_fraction: float = 1.0) -> ActivationLayout:
        return cls(1, (1, features), (1, 1), (0, 0), 1).with_capacity(capacity_fraction)

    def with_capacity(self, fraction: float) -> ActivationLayout:
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"activation capacity fraction {fraction}: expected a value in (0, 1]")
        capacity = max(1, min(self.plane_size, int(-(-fraction * self.plane_size // 1))))
        return ActivationLayout(self.channels, self.in_hw, self.stride, self.padding, capacity)


@dataclass(frozen=True)
class CompressedActivations:
    """One sample's compressed activations (see the module docstring). Its buffers are allocated before the
    compressor fills them, on the device and inside a CUDA graph, so construction checks their structure only
    (types, dtypes, the layout's shapes, one device); `validate()` checks the values the compressor wrote."""

    layout: ActivationLayout
    values: torch.Tensor
    positions: torch.Tensor
    row_ptr: torch.Tensor
    counts: torch.Tensor

    def __post_init__(self) -> None:
        owner, layout = "CompressedActivations", self.layout
        if not isinstance(layout, ActivationLayout):
            raise TypeError(f"{owner}.layout: expected an ActivationLayout, got {type(layout).__name__}")
        shape = (layout.virtual_channels, layout.capacity)
        values = check_tensor(owner, "values", self.values, VALUE_DTYPES, shape)
        check_tensor(owner, "positions", self.positions, torch.int32, shape, device=values.device)
        row_ptr_shape = (layout.virtual_channels, layout.plane_hw[0] + 1)
        check_tensor(owner, "row_ptr", self.row_ptr, torch.int32, row_ptr_shape, device=values.device)
        check_tensor(owner, "counts", self.counts, torch.int32, (layout.virtual_channels,), device=values.device)

    def validate(self) -> None:
        """Check the values (one host sync): counts not negative; each channel's `row_ptr` from 0 to its count and
        never decreasing; its stored positions inside the plane, strictly increasing and in the rows `row_ptr`
        gives them."""
        layout = self.layout
        checks = ValueChecks("CompressedActivations")
        checks.add((self.counts < 0).any(), "counts: a channel has a negative count")
        checks.pointer("row_ptr", self.row_ptr, self.counts.long(), "the channel's count")
        slots = torch.arange(layout.capacity, device=self.values.device)
        stored = slots[None, :] < self.stored_counts[:, None]
        positions = self.positions.long().where(stored, 0)
        checks.add(
            ((positions < 0) | (positions >= layout.plane_size)).any(), "positions: an entry is outside the plane"
        )
        rising = (positions[:, 1:] > positions[:, :-1]) | ~stored[:, 1:]
        checks.add(~rising.all(), "positions must strictly increase within a channel")
        rows = (positions // layout.plane_hw[1]).clamp(0, layout.plane_hw[0] - 1)
        ptr = self.row_ptr.long()
        begin, end = ptr.gather(1, rows), ptr.gather(1, rows + 1)
        misplaced = stored & ((slots[None, :] < begin) | (slots[None, :] >= end))
        checks.add(misplaced.any(), "row_ptr disagrees with the rows of the stored positions")
        checks.raise_first()

    @classmethod
    def empty(
        cls, layout: ActivationLayout, device: torch.device, dtype: torch.dtype = torch.float32
    ) -> CompressedActivations:
        """Buffers for `layout` on `device`, the values in `dtype` (the activation's own)."""
        shape = (layout.virtual_channels, layout.capacity)
        return cls(
            layout,
            torch.empty(shape, dtype=dtype, device=device),
            torch.empty(shape, dtype=torch.int32, device=device),
            torch.empty(layout.virtual_channels, layout.plane_hw[0] + 1, dtype=torch.int32, device=device),
            torch.empty(layout.virtual_channels, dtype=torch.int32, device=device),
        )

    @property
    def stored_counts(self) -> torch.Tensor:
        """Per virtual channel, how many entries of the buffers are valid (true count, capped)."""
        return self.counts.clamp(max=self.layout.capacity)

    def overflowed(self) -> bool:
        """Whether any channel held more nonzeros than the capacity (host sync)."""
        return bool((self.counts > self.layout.capacity).any())
