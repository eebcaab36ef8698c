"""Compressed layouts of weights and activations for the sparse×sparse (SCNN) dataflow.

Strided convolutions are rewritten as stride-1 ones over *phase planes*: input channel `c` of a
convolution with stride (sh, sw) and padding (ph, pw) becomes `sh*sw` virtual channels
`v = c*sh*sw + py*sw + px`, each the plane of padded positions `(ip, jp)` with `ip % sh == py` and
`jp % sw == px`, at plane coordinates `(ip // sh, jp // sw)`. A weight tap `(r, s)` belongs to the
virtual channel of phase `(r % sh, s % sw)` and, in plane coordinates, sits at `(r // sh, s // sw)`.
Every product of a weight and an activation of the same virtual channel is then useful (nothing is
computed and discarded, unlike masking stride² of the products) and lands at output
`(k, iy - r', ix - s')`, a sum of a weight-only and an activation-only address: SCNN's Cartesian
product. Padding costs nothing: padded positions are zeros and are never stored.

Layouts (all on one device; int32 indices, fp32 values):

`SparseConvWeights` (bytes per nonzero: 8, plus 4 per virtual channel)
    `values[nnz]`, `taps[nnz]` = `k << 16 | r' << 8 | s'`, and `channel_ptr[Cv + 1]`: the nonzeros of
    virtual channel `v` are `values[channel_ptr[v]:channel_ptr[v + 1]]` (CSR over virtual channels,
    sorted by `k, r', s'` within a channel). Limits: K < 32768, r', s' < 256.

`SparseLinearWeights` (bytes per nonzero: 8, plus 4 per input feature)
    CSC: `values[nnz]`, `rows[nnz]` (output feature), `col_ptr[in_features + 1]`; input feature `j`'s
    column is `col_ptr[j]:col_ptr[j + 1]`, so one nonzero activation meets exactly its column.

`CsrLinearWeights` (bytes per nonzero: 8, plus 4 per output feature)
    The same matrix row by row: `values[nnz]`, `cols[nnz]` (input feature, increasing within a row),
    `row_ptr[out_features + 1]`; made on a GPU by `tune` for the row-gather kernel where it is faster.

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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_OUT_CHANNELS = 1 << 15
MAX_PLANE_TAPS = 1 << 8


def _pair(value: int | tuple[int, ...], name: str) -> tuple[int, int]:
    if isinstance(value, int):
        return value, value
    if isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, int) for v in value):
        return value[0], value[1]
    raise ValueError(f"{name}={value!r}: expected an int or a pair of ints")


@dataclass(frozen=True)
class ConvGeometry:
    """Shape of one batch-1 convolution and of its input's phase planes."""

    in_channels: int
    out_channels: int
    kernel: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]
    groups: int
    in_hw: tuple[int, int]

    def __post_init__(self) -> None:
        if self.groups < 1 or self.in_channels % self.groups or self.out_channels % self.groups:
            raise ValueError(
                f"groups={self.groups} must divide in_channels={self.in_channels} and out_channels={self.out_channels}"
            )
        if min(self.stride) < 1 or min(self.padding) < 0 or min(self.kernel) < 1:
            raise ValueError(f"invalid stride {self.stride}, padding {self.padding} or kernel {self.kernel}")
        if self.out_channels >= MAX_OUT_CHANNELS:
            raise ValueError(f"out_channels={self.out_channels}: the tap layout holds at most {MAX_OUT_CHANNELS - 1}")
        if max(self.plane_kernel) > MAX_PLANE_TAPS:
            raise ValueError(f"kernel {self.kernel} with stride {self.stride} exceeds {MAX_PLANE_TAPS} plane taps")
        if min(self.out_hw) < 1:
            raise ValueError(f"input {self.in_hw} is too small for kernel {self.kernel}, padding {self.padding}")

    @property
    def phases(self) -> int:
        return self.stride[0] * self.stride[1]

    @property
    def virtual_channels(self) -> int:
        return self.in_channels * self.phases

    @property
    def out_hw(self) -> tuple[int, int]:
        return tuple(  # type: ignore[return-value]
            (n + 2 * p - k) // s + 1
            for n, p, k, s in zip(self.in_hw, self.padding, self.kernel, self.stride, strict=True)
        )

    @property
    def plane_hw(self) -> tuple[int, int]:
        """Rows and columns of a phase plane: enough to hold every padded position that holds data."""
        return tuple((p + n - 1) // s + 1 for n, p, s in zip(self.in_hw, self.padding, self.stride, strict=True))  # type: ignore[return-value]

    @property
    def plane_kernel(self) -> tuple[int, int]:
        return tuple(-(-k // s) for k, s in zip(self.kernel, self.stride, strict=True))  # type: ignore[return-value]

    @classmethod
    def of(cls, conv: torch.nn.Conv2d, in_hw: tuple[int, int]) -> ConvGeometry:
        if conv.dilation not in (1, (1, 1)):
            raise ValueError(f"{conv}: dilation {conv.dilation} is not supported; use dilation 1")
        if conv.padding_mode != "zeros":
            raise ValueError(f"{conv}: padding_mode {conv.padding_mode!r} is not supported; use 'zeros'")
        if isinstance(conv.padding, str):
            raise ValueError(f"{conv}: padding {conv.padding!r} is not supported; give explicit integer padding")
        return cls(
            in_channels=conv.in_channels,
            out_channels=conv.out_channels,
            kernel=_pair(conv.kernel_size, "kernel_size"),
            stride=_pair(conv.stride, "stride"),
            padding=_pair(conv.padding, "padding"),
            groups=conv.groups,
            in_hw=in_hw,
        )


def _check_vector(t: torch.Tensor, dtype: torch.dtype, name: str) -> None:
    if t.dim() != 1 or t.dtype != dtype:
        raise ValueError(f"{name}: expected a 1-D {dtype} tensor, got {t.dim()}-D {t.dtype}")


@dataclass(frozen=True)
class SparseConvWeights:
    geometry: ConvGeometry
    values: torch.Tensor
    taps: torch.Tensor
    channel_ptr: torch.Tensor
    dense_numel: int

    @property
    def nnz(self) -> int:
        return int(self.values.numel())

    @property
    def density(self) -> float:
        return self.nnz / self.dense_numel if self.dense_numel else 0.0

    @property
    def nbytes(self) -> int:
        return 4 * (2 * self.nnz + self.channel_ptr.numel())

    @classmethod
    def from_dense(cls, weight: torch.Tensor, geometry: ConvGeometry) -> SparseConvWeights:
        """Compress a dense `[K, C/groups, R, S]` weight (zeros are dropped) into the CSR layout."""
        g = geometry
        expected = (g.out_channels, g.in_channels // g.groups, *g.kernel)
        if tuple(weight.shape) != expected:
            raise ValueError(f"weight shape {tuple(weight.shape)} does not match the geometry's {expected}")
        if not torch.isfinite(weight).all():
            raise ValueError("weight holds NaN or infinity; compress finite weights only")
        w = weight.detach().float()
        k, c_local, r, s = w.nonzero(as_tuple=True)
        values = w[k, c_local, r, s]
        group = k // (g.out_channels // g.groups)
        c = group * (g.in_channels // g.groups) + c_local
        (sh, sw) = g.stride
        virtual = c * g.phases + (r % sh) * sw + (s % sw)
        taps = (k << 16) | ((r // sh) << 8) | (s // sw)
        order = torch.argsort(virtual.to(torch.int64) * (1 << 31) + taps.to(torch.int64))
        counts = torch.bincount(virtual, minlength=g.virtual_channels)
        channel_ptr = torch.zeros(g.virtual_channels + 1, dtype=torch.int32, device=w.device)
        channel_ptr[1:] = torch.cumsum(counts, 0).to(torch.int32)
        return cls(g, values[order].contiguous(), taps[order].to(torch.int32).contiguous(), channel_ptr, w.numel())

    def to_dense(self) -> torch.Tensor:
        """The dense `[K, C/groups, R, S]` weight these nonzeros encode (the inverse of `from_dense`)."""
        g = self.geometry
        counts = self.channel_ptr[1:] - self.channel_ptr[:-1]
        virtual = torch.repeat_interleave(torch.arange(g.virtual_channels, device=counts.device), counts.long())
        c, phase = virtual // g.phases, virtual % g.phases
        (sh, sw) = g.stride
        taps = self.taps.long()
        k, rp, sp = taps >> 16, (taps >> 8) & 0xFF, taps & 0xFF
        r, s = rp * sh + phase // sw, sp * sw + phase % sw
        dense = torch.zeros(g.out_channels, g.in_channels // g.groups, *g.kernel, device=self.values.device)
        dense[k, c % (g.in_channels // g.groups), r, s] = self.values
        return dense

    def validate(self) -> None:
        """Check index ranges and the pointer array (one host sync; call it on data you did not build)."""
        g = self.geometry
        _check_vector(self.values, torch.float32, "values")
        _check_vector(self.taps, torch.int32, "taps")
        _check_vector(self.channel_ptr, torch.int32, "channel_ptr")
        if self.channel_ptr.numel() != g.virtual_channels + 1:
            raise ValueError(f"channel_ptr has {self.channel_ptr.numel()} entries, expected {g.virtual_channels + 1}")
        if self.taps.numel() != self.values.numel():
            raise ValueError("taps and values differ in length")
        ptr = self.channel_ptr.long()
        if ptr[0] != 0 or ptr[-1] != self.nnz or (ptr[1:] < ptr[:-1]).any():
            raise ValueError("channel_ptr must start at 0, end at nnz and never decrease")
        taps = self.taps.long()
        k, rp, sp = taps >> 16, (taps >> 8) & 0xFF, taps & 0xFF
        ph, pw = g.plane_kernel
        if self.nnz and ((k < 0) | (k >= g.out_channels) | (rp >= ph) | (sp >= pw)).any():
            raise ValueError("a tap's output channel or kernel offset is out of range for the geometry")


@dataclass
class CsrLinearWeights:
    """A linear layer's weights row by row (CSR): the stored values of row `r` are
    `values[row_ptr[r]:row_ptr[r + 1]]`, at input features `cols[...]` (increasing). 8 bytes per nonzero
    (fp32 value, int32 column) plus 4 per row; made from `SparseLinearWeights.to_csr`."""

    in_features: int
    out_features: int
    values: torch.Tensor
    cols: torch.Tensor
    row_ptr: torch.Tensor

    @property
    def nbytes(self) -> int:
        return 4 * (2 * self.values.numel() + self.row_ptr.numel())


@dataclass(frozen=True)
class SparseLinearWeights:
    in_features: int
    out_features: int
    values: torch.Tensor
    rows: torch.Tensor
    col_ptr: torch.Tensor

    @property
    def nnz(self) -> int:
        return int(self.values.numel())

    @property
    def density(self) -> float:
        return self.nnz / (self.in_features * self.out_features)

    @property
    def nbytes(self) -> int:
        return 4 * (2 * self.nnz + self.col_ptr.numel())

    @classmethod
    def from_dense(cls, weight: torch.Tensor) -> SparseLinearWeights:
        """Compress a dense `[out_features, in_features]` weight into CSC (zeros are dropped)."""
        if weight.dim() != 2:
            raise ValueError(f"expected a 2-D linear weight, got shape {tuple(weight.shape)}")
        if not torch.isfinite(weight).all():
            raise ValueError("weight holds NaN or infinity; compress finite weights only")
        w_t = weight.detach().float().t()
        cols, rows = w_t.nonzero(as_tuple=True)
        counts = torch.bincount(cols, minlength=w_t.shape[0])
        col_ptr = torch.zeros(w_t.shape[0] + 1, dtype=torch.int32, device=w_t.device)
        col_ptr[1:] = torch.cumsum(counts, 0).to(torch.int32)
        return cls(w_t.shape[0], w_t.shape[1], w_t[cols, rows].contiguous(), rows.to(torch.int32), col_ptr)

    def _columns(self) -> torch.Tensor:
        """The input feature (column) of every stored value."""
        counts = (self.col_ptr[1:] - self.col_ptr[:-1]).long()
        return torch.repeat_interleave(torch.arange(self.in_features, device=counts.device), counts)

    def to_dense(self) -> torch.Tensor:
        dense = torch.zeros(self.out_features, self.in_features, device=self.values.device)
        dense[self.rows.long(), self._columns()] = self.values
        return dense

    def to_csr(self) -> CsrLinearWeights:
        """The same weights row by row (`CsrLinearWeights`), for the row-gather kernel."""
        cols = self._columns()
        order = torch.argsort(self.rows.long() * self.in_features + cols)  # by row, then column
        row_counts = torch.bincount(self.rows.long(), minlength=self.out_features)
        row_ptr = torch.zeros(self.out_features + 1, dtype=torch.int32, device=self.values.device)
        row_ptr[1:] = torch.cumsum(row_counts, 0).to(torch.int32)
        values = self.values[order].contiguous()
        return CsrLinearWeights(self.in_features, self.out_features, values, cols[order].to(torch.int32), row_ptr)

    def validate(self) -> None:
        _check_vector(self.values, torch.float32, "values")
        _check_vector(self.rows, torch.int32, "rows")
        _check_vector(self.col_ptr, torch.int32, "col_ptr")
        if self.col_ptr.numel() != self.in_features + 1 or self.rows.numel() != self.values.numel():
            raise ValueError("col_ptr must hold in_features + 1 entries and rows one per value")
        ptr = self.col_ptr.long()
        if ptr[0] != 0 or ptr[-1] != self.nnz or (ptr[1:] < ptr[:-1]).any():
            raise ValueError("col_ptr must start at 0, end at nnz and never decrease")
        if self.nnz and ((self.rows < 0) | (self.rows >= self.out_features)).any():
            raise ValueError("a row index is out of range [0, out_features)")


@dataclass(frozen=True)
class ActivationLayout:
    """Where a dense `[C, H, W]` activation goes when compressed for one consumer."""

    channels: int
    in_hw: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]
    capacity: int
    """Nonzeros each virtual channel can hold (at most the plane size)."""

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
    layout: ActivationLayout
    values: torch.Tensor
    positions: torch.Tensor
    row_ptr: torch.Tensor
    counts: torch.Tensor

    @classmethod
    def empty(cls, layout: ActivationLayout, device: torch.device) -> CompressedActivations:
        shape = (layout.virtual_channels, layout.capacity)
        return cls(
            layout,
            torch.empty(shape, dtype=torch.float32, device=device),
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
