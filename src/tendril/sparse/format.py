"""Compressed weight layouts for the sparse×sparse (SCNN) dataflow, and the phase planes both operands use.

Strided convolutions are rewritten as stride-1 ones over *phase planes*: input channel `c` of a
convolution with stride (sh, sw) and padding (ph, pw) becomes `sh*sw` virtual channels
`v = c*sh*sw + py*sw + px`, each the plane of padded positions `(ip, jp)` with `ip % sh == py` and
`jp % sw == px`, at plane coordinates `(ip // sh, jp // sw)`. A weight tap `(r, s)` belongs to the
virtual channel of phase `(r % sh, s % sw)` and, in plane coordinates, sits at `(r // sh, s // sw)`.
Every product of a weight and an activation of the same virtual channel is then useful (nothing is
computed and discarded, unlike masking stride² of the products) and lands at output
`(k, iy - r', ix - s')`, a sum of a weight-only and an activation-only address: SCNN's Cartesian
product. Padding costs nothing: padded positions are zeros and are never stored.

Layouts (all on one device; int32 indices; values in one of `VALUE_DTYPES`, the network's dtype: fp32, fp16 or
bf16; the byte counts below are for fp32, a half value takes 2 of the 4 bytes):

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

Activations are compressed into `CompressedActivations` (`tendril.sparse.activations`).

Every layout checks itself at construction (`tendril.sparse.validation`): structure always, values (index
ranges, pointer arrays, order, counts) with one host sync, except inside a CUDA graph capture. Its
`validate()` runs the same checks again, e.g. after the tensors were changed in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from tendril.sparse.validation import (
    VALUE_DTYPES,
    ValueChecks,
    capturing,
    check_count,
    check_tensor,
    segment_of,
    value_dtype,
)

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


@dataclass(frozen=True)
class SparseConvWeights:
    """A convolution's nonzero weights in CSR over virtual channels (see the module docstring); checked at
    construction: lengths, dtypes, one device, `channel_ptr` from 0 to nnz and never decreasing, each tap's
    output channel in the virtual channel's group and its kernel position inside the kernel, taps strictly
    increasing within a channel, finite values."""

    geometry: ConvGeometry
    values: torch.Tensor
    taps: torch.Tensor
    channel_ptr: torch.Tensor
    dense_numel: int

    def __post_init__(self) -> None:
        self._check_structure()
        if not capturing(self.values):
            self._check_values()

    @property
    def nnz(self) -> int:
        return int(self.values.numel())

    @property
    def density(self) -> float:
        return self.nnz / self.dense_numel if self.dense_numel else 0.0

    @property
    def nbytes(self) -> int:
        return (self.values.element_size() + 4) * self.nnz + 4 * self.channel_ptr.numel()

    @classmethod
    def from_dense(
        cls, weight: torch.Tensor, geometry: ConvGeometry, dtype: torch.dtype | None = None
    ) -> SparseConvWeights:
        """Compress a dense `[K, C/groups, R, S]` weight (zeros are dropped) into the CSR layout, its values in
        `dtype` (default: the weight's; rounded first, so a value that rounds to zero is dropped too)."""
        g = geometry
        expected = (g.out_channels, g.in_channels // g.groups, *g.kernel)
        if tuple(weight.shape) != expected:
            raise ValueError(f"weight shape {tuple(weight.shape)} does not match the geometry's {expected}")
        if not torch.isfinite(weight).all():
            raise ValueError("weight holds NaN or infinity; compress finite weights only")
        w = weight.detach().to(value_dtype(dtype, weight))
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
        shape = (g.out_channels, g.in_channels // g.groups, *g.kernel)
        dense = torch.zeros(shape, dtype=self.values.dtype, device=self.values.device)
        dense[k, c % (g.in_channels // g.groups), r, s] = self.values
        return dense

    def validate(self) -> None:
        """The construction checks again, values included (one host sync), e.g. after in-place changes."""
        self._check_structure()
        self._check_values()

    def _check_structure(self) -> None:
        owner, g = "SparseConvWeights", self.geometry
        if not isinstance(g, ConvGeometry):
            raise TypeError(f"{owner}.geometry: expected a ConvGeometry, got {type(g).__name__}")
        values = check_tensor(owner, "values", self.values, VALUE_DTYPES)
        check_tensor(owner, "taps", self.taps, torch.int32, (values.numel(),), device=values.device)
        check_tensor(
            owner, "channel_ptr", self.channel_ptr, torch.int32, (g.virtual_channels + 1,), device=values.device
        )
        dense = g.out_channels * (g.in_channels // g.groups) * g.kernel[0] * g.kernel[1]
        check_count(owner, "dense_numel", self.dense_numel)
        if self.dense_numel != dense:
            raise ValueError(f"{owner}.dense_numel={self.dense_numel}: the geometry's dense weight has {dense}")

    def _check_values(self) -> None:
        g = self.geometry
        checks = ValueChecks("SparseConvWeights")
        checks.pointer("channel_ptr", self.channel_ptr, self.nnz, f"nnz = {self.nnz}")
        taps = self.taps.long()
        k, rp, sp = taps >> 16, (taps >> 8) & 0xFF, taps & 0xFF
        checks.in_range("taps (output channel k)", k, g.out_channels, "out_channels")
        virtual = segment_of(self.channel_ptr, self.nnz)
        channel, phase = virtual // g.phases, virtual % g.phases
        group_in, group_out = g.in_channels // g.groups, g.out_channels // g.groups
        checks.add((k // group_out != channel // group_in).any(), "taps: an output channel outside its channel's group")
        (sh, sw), (r, s) = g.stride, g.kernel
        outside = (rp * sh + phase // sw >= r) | (sp * sw + phase % sw >= s)
        checks.add(outside.any(), f"taps: a kernel offset outside the {r}×{s} kernel for its stride phase")
        checks.increasing_within("taps", taps, self.channel_ptr, "virtual channel")
        checks.add(~torch.isfinite(self.values).all(), "values holds NaN or infinity")
        checks.raise_first()


class _CompressedMatrix:
    """What the two linear layouts share: their checks at construction and in `validate` (`_check_compressed_matrix`),
    told apart by `_fields`: the index array's name, the pointer array's name and what one segment is."""

    _fields: ClassVar[tuple[str, str, str]]
    in_features: int
    out_features: int
    values: torch.Tensor

    def __post_init__(self) -> None:
        self._check(values_too=not capturing(self.values))

    def validate(self) -> None:
        """The construction checks again, values included (one host sync), e.g. after in-place changes."""
        self._check(values_too=True)

    def _check(self, values_too: bool) -> None:
        index, ptr, segment = self._fields
        _check_compressed_matrix(
            type(self).__name__, (self.in_features, self.out_features), self.values, getattr(self, index), index,
            getattr(self, ptr), ptr, segment, values_too=values_too,
        )  # fmt: skip


@dataclass(frozen=True)
class CsrLinearWeights(_CompressedMatrix):
    """A linear layer's weights row by row (CSR): the stored values of row `r` are
    `values[row_ptr[r]:row_ptr[r + 1]]`, at input features `cols[...]` (increasing). 8 bytes per nonzero
    (fp32 value, int32 column; 6 for a half value) plus 4 per row; made from `SparseLinearWeights.to_csr`. Checked at
    construction like `SparseLinearWeights`, rows for columns."""

    in_features: int
    out_features: int
    values: torch.Tensor
    cols: torch.Tensor
    row_ptr: torch.Tensor

    _fields = ("cols", "row_ptr", "row")

    @property
    def nbytes(self) -> int:
        return (self.values.element_size() + 4) * self.values.numel() + 4 * self.row_ptr.numel()


@dataclass(frozen=True)
class SparseLinearWeights(_CompressedMatrix):
    """A linear layer's nonzero weights column by column (CSC, see the module docstring); checked at
    construction: positive feature counts, lengths, dtypes, one device, `col_ptr` from 0 to nnz and never
    decreasing, row indices in range and strictly increasing within a column, finite values."""

    in_features: int
    out_features: int
    values: torch.Tensor
    rows: torch.Tensor
    col_ptr: torch.Tensor

    _fields = ("rows", "col_ptr", "column")

    @property
    def nnz(self) -> int:
        return int(self.values.numel())

    @property
    def density(self) -> float:
        return self.nnz / (self.in_features * self.out_features)

    @property
    def nbytes(self) -> int:
        return (self.values.element_size() + 4) * self.nnz + 4 * self.col_ptr.numel()

    @classmethod
    def from_dense(cls, weight: torch.Tensor, dtype: torch.dtype | None = None) -> SparseLinearWeights:
        """Compress a dense `[out_features, in_features]` weight into CSC (zeros are dropped), its values in
        `dtype` (default: the weight's)."""
        if weight.dim() != 2:
            raise ValueError(f"expected a 2-D linear weight, got shape {tuple(weight.shape)}")
        if not torch.isfinite(weight).all():
            raise ValueError("weight holds NaN or infinity; compress finite weights only")
        w_t = weight.detach().to(value_dtype(dtype, weight)).t()
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
        dense = torch.zeros(self.out_features, self.in_features, dtype=self.values.dtype, device=self.values.device)
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


def _check_compressed_matrix(
    owner: str,
    features: tuple[int, int],
    values: torch.Tensor,
    index: torch.Tensor,
    index_name: str,
    ptr: torch.Tensor,
    ptr_name: str,
    segment: str,
    *,
    values_too: bool,
) -> None:
    """A compressed `[out_features, in_features]` matrix (`segment` "column": CSC, "row": CSR): positive feature
    counts, values (one of `VALUE_DTYPES`) with one int32 index each, `ptr` one entry per segment plus one, all on
    one device; with `values_too`, `ptr` from 0 to nnz and never decreasing, `index` inside the matrix and strictly
    increasing within a segment, finite values."""
    in_features, out_features = features
    check_count(owner, "in_features", in_features)
    check_count(owner, "out_features", out_features)
    check_tensor(owner, "values", values, VALUE_DTYPES)
    check_tensor(owner, index_name, index, torch.int32, (values.numel(),), device=values.device)
    segments, bound = (in_features, out_features) if segment == "column" else (out_features, in_features)
    check_tensor(owner, ptr_name, ptr, torch.int32, (segments + 1,), device=values.device)
    if not values_too:
        return
    checks = ValueChecks(owner)
    checks.pointer(ptr_name, ptr, values.numel(), f"nnz = {values.numel()}")
    checks.in_range(index_name, index, bound, "out_features" if segment == "column" else "in_features")
    checks.increasing_within(index_name, index, ptr, segment)
    checks.add(~torch.isfinite(values).all(), "values holds NaN or infinity")
    checks.raise_first()
