"""Layouts: round trips, checks of malformed data at construction, geometry errors, capacity bounds."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from tendril.sparse.activations import ActivationLayout, CompressedActivations
from tendril.sparse.format import ConvGeometry, CsrLinearWeights, SparseConvWeights, SparseLinearWeights
from tendril.sparse.ops.compress import cpu as compress_cpu
from tendril.sparse.ops.linear import cpu as linear_cpu
from tests.sparse.checks import CONV_CASES, poisoned, sparse_tensor


@pytest.mark.parametrize("case", CONV_CASES)
def test_conv_weights_round_trip_through_the_phase_layout(case):
    gen = torch.Generator().manual_seed(1)
    g = case.geometry
    dense = sparse_tensor((g.out_channels, g.in_channels // g.groups, *g.kernel), case.weight_density, gen)
    weights = SparseConvWeights.from_dense(dense, g)
    weights.validate()
    assert weights.nnz == int((dense != 0).sum())
    assert torch.equal(weights.to_dense(), dense)
    assert weights.nbytes == 8 * weights.nnz + 4 * (g.virtual_channels + 1)


def test_linear_weights_round_trip_through_csc():
    dense = sparse_tensor((7, 19), 0.3, torch.Generator().manual_seed(2))
    weights = SparseLinearWeights.from_dense(dense)
    weights.validate()
    assert torch.equal(weights.to_dense(), dense)


def _geometry(stride=1, groups=1):
    return ConvGeometry(2, 4, (3, 3), (stride, stride), (1, 1), groups, (5, 5))


def _conv_weights(stride=1, groups=1) -> SparseConvWeights:
    g = _geometry(stride, groups)
    return SparseConvWeights.from_dense(torch.ones(4, 2 // groups, 3, 3), g)


def _with(weights, **fields):
    """The same weights with some fields replaced: `dataclasses.replace` runs the construction checks."""
    return dataclasses.replace(weights, **fields)


def _changed(t: torch.Tensor, index: int, value) -> torch.Tensor:
    t = t.clone()
    t[index] = value
    return t


def _conv_malformations():
    w = _conv_weights()
    ptr, taps = w.channel_ptr, w.taps
    return [
        (
            "decreasing channel_ptr",
            {"channel_ptr": _changed(ptr, 1, 100)},
            ValueError,
            "channel_ptr must never decrease",
        ),
        ("channel_ptr not from 0", {"channel_ptr": _changed(ptr, 0, 1)}, ValueError, "channel_ptr must start at 0"),
        ("channel_ptr past nnz", {"channel_ptr": _changed(ptr, -1, w.nnz + 1)}, ValueError, "channel_ptr must end at"),
        ("channel_ptr length", {"channel_ptr": ptr[:-1].clone()}, ValueError, r"channel_ptr: expected shape \(3,\)"),
        ("taps length", {"taps": taps[:-1].clone()}, ValueError, "taps: expected shape"),
        ("values length", {"values": w.values[:-1].clone()}, ValueError, "taps: expected shape"),
        ("taps dtype", {"taps": taps.long()}, TypeError, "taps: expected dtype torch.int32"),
        ("values dtype", {"values": w.values.double()}, TypeError, "values: expected dtype one of torch.float32"),
        ("2-D values", {"values": w.values.view(1, -1)}, ValueError, "values: expected a 1-D tensor"),
        ("not a tensor", {"taps": taps.tolist()}, TypeError, "taps: expected a torch.Tensor"),
        ("strided taps", {"taps": torch.stack([taps, taps], 1)[:, 0]}, ValueError, "taps: expected a contiguous"),
        ("output channel", {"taps": _changed(taps, 0, 9 << 16)}, ValueError, r"output channel k\): an entry is out"),
        ("negative tap", {"taps": _changed(taps, 0, -1)}, ValueError, "out of range"),
        ("kernel row", {"taps": _changed(taps, 0, 3 << 8)}, ValueError, "kernel offset outside the 3×3 kernel"),
        ("repeated tap", {"taps": _changed(taps, 1, int(taps[0]))}, ValueError, "taps must strictly increase"),
        ("NaN value", {"values": _changed(w.values, 0, float("nan"))}, ValueError, "values holds NaN"),
        ("dense_numel", {"dense_numel": 7}, ValueError, "dense_numel=7"),
        ("geometry", {"geometry": "3x3"}, TypeError, "geometry: expected a ConvGeometry"),
        ("device", {"channel_ptr": torch.empty(3, dtype=torch.int32, device="meta")}, ValueError, "other fields"),
    ]


@pytest.mark.parametrize(
    ("fields", "error", "message"), [m[1:] for m in _conv_malformations()], ids=[m[0] for m in _conv_malformations()]
)
def test_malformed_conv_weights_raise_at_construction_naming_the_field(fields, error, message):
    with pytest.raises(error, match=message):
        _with(_conv_weights(), **fields)


def test_a_conv_tap_outside_the_kernel_for_its_stride_phase_is_rejected():
    """Stride 2: phase 1 holds kernel rows 1 only, so plane row 1 (kernel row 3) does not exist for it."""
    w = _conv_weights(stride=2)
    virtual = 2  # input channel 0, phase (py, px) = (1, 0): kernel rows r = 2 r' + 1
    begin = int(w.channel_ptr[virtual])
    assert int(w.channel_ptr[virtual + 1]) > begin
    taps = _changed(w.taps, begin, 1 << 8)  # k 0, r' 1 (inside the 2×2 plane kernel), s' 0: r = 3
    with pytest.raises(ValueError, match="kernel offset outside"):
        _with(w, taps=taps)


def test_a_conv_tap_in_another_group_is_rejected():
    w = _conv_weights(groups=2)
    taps = _changed(w.taps, 0, (3 << 16) | int(w.taps[0]) & 0xFFFF)  # channel 0 is group 0; k = 3 is group 1
    with pytest.raises(ValueError, match="outside its channel's group"):
        _with(w, taps=taps)


def test_validate_rechecks_weights_changed_in_place():
    w = _conv_weights()
    w.validate()
    w.taps[0] = 9 << 16
    with pytest.raises(ValueError, match="out of range"):
        w.validate()


def _linear_weights() -> SparseLinearWeights:
    return SparseLinearWeights.from_dense(torch.ones(4, 5))


def _linear_malformations():
    w = _linear_weights()
    return [
        ("row index", {"rows": _changed(w.rows, 0, 4)}, ValueError, r"rows: an entry is out of range \[0, 4\)"),
        ("negative row", {"rows": _changed(w.rows, 3, -1)}, ValueError, "rows: an entry is out of range"),
        (
            "repeated row",
            {"rows": _changed(w.rows, 1, 0)},
            ValueError,
            "rows must strictly increase within each column",
        ),
        ("decreasing col_ptr", {"col_ptr": _changed(w.col_ptr, 2, 0)}, ValueError, "col_ptr must never decrease"),
        ("col_ptr end", {"col_ptr": _changed(w.col_ptr, -1, 19)}, ValueError, "col_ptr must end at nnz = 20"),
        ("col_ptr length", {"col_ptr": w.col_ptr[:-1].clone()}, ValueError, r"col_ptr: expected shape \(6,\)"),
        ("rows length", {"rows": w.rows[:-1].clone()}, ValueError, r"rows: expected shape \(20,\)"),
        ("rows dtype", {"rows": w.rows.long()}, TypeError, "rows: expected dtype torch.int32"),
        ("no features", {"in_features": 0}, ValueError, "in_features=0: expected at least 1"),
        ("features type", {"out_features": 4.0}, TypeError, "out_features: expected an int"),
        ("infinite value", {"values": _changed(w.values, 0, float("inf"))}, ValueError, "values holds NaN or infinity"),
    ]


@pytest.mark.parametrize(
    ("fields", "error", "message"),
    [m[1:] for m in _linear_malformations()],
    ids=[m[0] for m in _linear_malformations()],
)
def test_malformed_linear_weights_raise_at_construction_naming_the_field(fields, error, message):
    with pytest.raises(error, match=message):
        _with(_linear_weights(), **fields)


def test_malformed_csr_weights_raise_at_construction_naming_the_field():
    csr = _linear_weights().to_csr()
    with pytest.raises(ValueError, match=r"cols: an entry is out of range \[0, 5\)"):
        _with(csr, cols=_changed(csr.cols, 0, 5))
    with pytest.raises(ValueError, match="cols must strictly increase within each row"):
        _with(csr, cols=_changed(csr.cols, 1, 0))
    with pytest.raises(ValueError, match="row_ptr must never decrease"):
        _with(csr, row_ptr=_changed(csr.row_ptr, 1, 12))
    with pytest.raises(ValueError, match=r"row_ptr: expected shape \(5,\)"):
        _with(csr, row_ptr=csr.row_ptr[:-1].clone())
    with pytest.raises(TypeError, match=r"cols: expected dtype torch\.int32"):
        _with(csr, cols=csr.cols.short())


def test_the_cpu_fc_kernel_cannot_be_reached_with_a_malformed_operand():
    """The compiled FC loop indexes without bounds checks: a row index far past the output wrote out of bounds and
    could crash the process. The weights now refuse it at construction, and the loop's other operands are checked
    before it runs."""
    weights = _linear_weights()
    x, bias, out = torch.ones(5), torch.zeros(4), torch.empty(4)
    with pytest.raises(ValueError, match="rows: an entry is out of range"):
        _with(weights, rows=_changed(weights.rows, 0, 1 << 30))
    with pytest.raises(ValueError, match="col_ptr must end at"):
        _with(weights, col_ptr=_changed(weights.col_ptr, -1, 1 << 30))
    with pytest.raises(ValueError, match=r"bias: expected a float32 CPU tensor of shape \(4,\)"):
        linear_cpu.linear_dense_input(x, weights, torch.zeros(2), out=out)
    with pytest.raises(ValueError, match="x: expected a float32"):
        linear_cpu.linear_dense_input(x.double(), weights, bias, out=out)
    linear_cpu.linear_dense_input(x, weights, bias, out=out)
    assert torch.equal(out, torch.full((4,), 5.0))


@settings(max_examples=40, deadline=None)
@given(
    out_features=st.integers(1, 12),
    in_features=st.integers(1, 12),
    density=st.floats(0.05, 1.0),
    seed=st.integers(0, 2**16),
    kind=st.sampled_from(["row", "pointer"]),
    where=st.floats(0.0, 1.0, exclude_max=True),
)
def test_any_corrupted_entry_of_a_valid_csc_matrix_is_refused(out_features, in_features, density, seed, kind, where):
    gen = torch.Generator().manual_seed(seed)
    weights = SparseLinearWeights.from_dense(sparse_tensor((out_features, in_features), density, gen))
    if kind == "row" and weights.nnz:
        index = int(where * weights.nnz)
        bad = out_features + index if index % 2 else -1 - index
        fields = {"rows": _changed(weights.rows, index, bad)}
    else:
        ptr = weights.col_ptr
        index = int(where * ptr.numel())
        bad = int(ptr[index + 1]) + 1 if index + 1 < ptr.numel() else weights.nnz + 1
        fields = {"col_ptr": _changed(ptr, index, bad)}
    with pytest.raises(ValueError, match=r"rows|col_ptr"):
        _with(weights, **fields)


@settings(max_examples=30, deadline=None)
@given(
    channels=st.integers(1, 4),
    groups=st.sampled_from([1, 2]),
    kernel=st.integers(1, 4),
    stride=st.integers(1, 3),
    padding=st.integers(0, 2),
    density=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
)
def test_weights_compressed_from_any_dense_convolution_pass_the_checks(
    channels, groups, kernel, stride, padding, density, seed
):
    g = ConvGeometry(
        channels * groups, 2 * groups, (kernel, kernel), (stride, stride), (padding, padding), groups, (7, 6)
    )
    dense = sparse_tensor((g.out_channels, channels, kernel, kernel), density, torch.Generator().manual_seed(seed))
    weights = SparseConvWeights.from_dense(dense, g)
    weights.validate()
    assert torch.equal(weights.to_dense(), dense)
    if weights.nnz:
        with pytest.raises(ValueError, match="taps"):
            _with(weights, taps=_changed(weights.taps, seed % weights.nnz, g.out_channels << 16))


def _activations() -> CompressedActivations:
    g = ConvGeometry(2, 3, (3, 3), (2, 2), (1, 1), 1, (6, 6))
    x = sparse_tensor((2, 6, 6), 0.5, torch.Generator().manual_seed(4), positive=True)
    return compress_cpu.compress(x, ActivationLayout.for_conv(g))


def test_compressed_activations_check_their_buffers_at_construction():
    acts = _activations()
    acts.validate()
    poisoned(acts).validate()  # slots past each count are never read, so anything there is fine
    with pytest.raises(ValueError, match=r"positions: expected shape \(8, 16\)"):
        _with(acts, positions=acts.positions[:, :-1].clone())
    with pytest.raises(TypeError, match=r"counts: expected dtype torch\.int32"):
        _with(acts, counts=acts.counts.long())
    with pytest.raises(ValueError, match=r"row_ptr: expected shape \(8, 5\)"):
        _with(acts, row_ptr=acts.row_ptr[:, :-1].clone())
    with pytest.raises(TypeError, match="layout: expected an ActivationLayout"):
        _with(acts, layout=None)
    CompressedActivations.empty(acts.layout, torch.device("cpu"))  # uninitialised buffers: structure only


def _first_stored(acts: CompressedActivations) -> int:
    return int(torch.nonzero(acts.counts > 1)[0])


@pytest.mark.parametrize(
    ("field", "corrupt", "message"),
    [
        ("counts", lambda a, c: _changed(a.counts, c, -1), "negative count"),
        ("row_ptr", lambda a, c: _with_row(a.row_ptr, c, 1, 99), "row_ptr must never decrease"),
        ("row_ptr", lambda a, c: _with_row(a.row_ptr, c, -1, int(a.counts[c]) + 1), "must end at the channel's count"),
        ("positions", lambda a, c: _with_row(a.positions, c, 0, 1 << 20), "outside the plane"),
        ("positions", lambda a, c: _with_row(a.positions, c, 1, int(a.positions[c, 0])), "strictly increase"),
    ],
)
def test_validate_names_malformed_activation_values(field, corrupt, message):
    acts = _activations()
    bad = _with(acts, **{field: corrupt(acts, _first_stored(acts))})
    with pytest.raises(ValueError, match=message):
        bad.validate()


def _with_row(t: torch.Tensor, channel: int, index: int, value: int) -> torch.Tensor:
    t = t.clone()
    t[channel, index] = value
    return t


def test_row_ptr_must_agree_with_the_rows_of_the_positions():
    """A monotone `row_ptr` that ends at the count but puts every nonzero in the last row, for a channel whose
    first nonzero lies in an earlier row."""
    acts = _activations()
    plane_h, plane_w = acts.layout.plane_hw
    earlier = (acts.counts > 0) & (acts.positions[:, 0] < (plane_h - 1) * plane_w)
    channel = int(torch.nonzero(earlier)[0])
    row_ptr = acts.row_ptr.clone()
    row_ptr[channel, :-1] = 0
    with pytest.raises(ValueError, match="row_ptr disagrees with the rows of the stored positions"):
        _with(acts, row_ptr=row_ptr).validate()


def test_unsupported_convolutions_name_the_problem():
    with pytest.raises(ValueError, match="dilation"):
        ConvGeometry.of(nn.Conv2d(2, 2, 3, dilation=2), (8, 8))
    with pytest.raises(ValueError, match="padding_mode"):
        ConvGeometry.of(nn.Conv2d(2, 2, 3, padding=1, padding_mode="reflect"), (8, 8))
    with pytest.raises(ValueError, match="groups"):
        ConvGeometry(3, 4, (3, 3), (1, 1), (0, 0), 2, (8, 8))
    with pytest.raises(ValueError, match="too small"):
        ConvGeometry(3, 4, (5, 5), (1, 1), (0, 0), 1, (3, 3))


def test_weights_must_be_finite_and_shaped_like_the_geometry():
    with pytest.raises(ValueError, match="shape"):
        SparseConvWeights.from_dense(torch.ones(4, 2, 5, 5), _geometry())
    with pytest.raises(ValueError, match="NaN"):
        SparseConvWeights.from_dense(torch.full((4, 2, 3, 3), float("nan")), _geometry())


def test_activation_capacity_is_a_fraction_of_the_plane():
    layout = ActivationLayout.for_conv(ConvGeometry(2, 3, (3, 3), (2, 2), (1, 1), 1, (9, 9)))
    assert layout.virtual_channels == 8 and layout.plane_hw == (5, 5) and layout.capacity == 25
    assert layout.with_capacity(0.5).capacity == 13
    with pytest.raises(ValueError, match="capacity"):
        layout.with_capacity(0.0)
    with pytest.raises(ValueError, match="capacity=26: exceeds the plane's 25 positions"):
        dataclasses.replace(layout, capacity=26)


@pytest.mark.parametrize("density", [0.0, 0.3, 1.0])
def test_linear_weights_in_csr_hold_the_same_matrix_row_by_row(density):
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(7, 11, generator=gen) * (torch.rand(7, 11, generator=gen) < density)
    csr = SparseLinearWeights.from_dense(weight).to_csr()
    assert isinstance(csr, CsrLinearWeights)
    assert csr.row_ptr.tolist()[-1] == int((weight != 0).sum()) and csr.cols.dtype == torch.int32
    rebuilt = torch.zeros(7, 11)
    for r in range(7):
        begin, end = csr.row_ptr[r].item(), csr.row_ptr[r + 1].item()
        cols = csr.cols[begin:end].long()
        assert (cols[1:] > cols[:-1]).all()  # increasing within a row
        rebuilt[r, cols] = csr.values[begin:end]
    assert torch.equal(rebuilt, weight)
    assert csr.nbytes == 4 * (2 * csr.values.numel() + 8)
