"""Layouts: round trips, validation of malformed data, geometry errors, capacity bounds."""

import pytest
import torch
from torch import nn

from tendril.sparse.format import ActivationLayout, ConvGeometry, SparseConvWeights, SparseLinearWeights
from tests.sparse.checks import CONV_CASES, sparse_tensor


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


def _geometry():
    return ConvGeometry(2, 3, (3, 3), (1, 1), (1, 1), 1, (5, 5))


def test_malformed_conv_weights_are_rejected_with_a_reason():
    weights = SparseConvWeights.from_dense(torch.ones(3, 2, 3, 3), _geometry())
    bad_ptr = weights.channel_ptr.clone()
    bad_ptr[1] = 100
    with pytest.raises(ValueError, match="channel_ptr"):
        SparseConvWeights(weights.geometry, weights.values, weights.taps, bad_ptr, weights.dense_numel).validate()
    bad_taps = weights.taps.clone()
    bad_taps[0] = 9 << 16
    with pytest.raises(ValueError, match="out of range"):
        SparseConvWeights(
            weights.geometry, weights.values, bad_taps, weights.channel_ptr, weights.dense_numel
        ).validate()
    with pytest.raises(ValueError, match=r"1-D torch\.int32"):
        SparseConvWeights(
            weights.geometry, weights.values, weights.taps.long(), weights.channel_ptr, weights.dense_numel
        ).validate()


def test_malformed_linear_weights_are_rejected():
    weights = SparseLinearWeights.from_dense(torch.ones(4, 5))
    rows = weights.rows.clone()
    rows[0] = 4
    with pytest.raises(ValueError, match="row index"):
        SparseLinearWeights(5, 4, weights.values, rows, weights.col_ptr).validate()


def test_weights_must_be_finite_and_shaped_like_the_geometry():
    with pytest.raises(ValueError, match="shape"):
        SparseConvWeights.from_dense(torch.ones(3, 2, 5, 5), _geometry())
    with pytest.raises(ValueError, match="NaN"):
        SparseConvWeights.from_dense(torch.full((3, 2, 3, 3), float("nan")), _geometry())


def test_unsupported_convolutions_name_the_problem():
    with pytest.raises(ValueError, match="dilation"):
        ConvGeometry.of(nn.Conv2d(2, 2, 3, dilation=2), (8, 8))
    with pytest.raises(ValueError, match="padding_mode"):
        ConvGeometry.of(nn.Conv2d(2, 2, 3, padding=1, padding_mode="reflect"), (8, 8))
    with pytest.raises(ValueError, match="groups"):
        ConvGeometry(3, 4, (3, 3), (1, 1), (0, 0), 2, (8, 8))
    with pytest.raises(ValueError, match="too small"):
        ConvGeometry(3, 4, (5, 5), (1, 1), (0, 0), 1, (3, 3))


def test_activation_capacity_is_a_fraction_of_the_plane():
    layout = ActivationLayout.for_conv(ConvGeometry(2, 3, (3, 3), (2, 2), (1, 1), 1, (9, 9)))
    assert layout.virtual_channels == 8 and layout.plane_hw == (5, 5) and layout.capacity == 25
    assert layout.with_capacity(0.5).capacity == 13
    with pytest.raises(ValueError, match="capacity"):
        layout.with_capacity(0.0)


@pytest.mark.parametrize("density", [0.0, 0.3, 1.0])
def test_linear_weights_in_csr_hold_the_same_matrix_row_by_row(density):
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(7, 11, generator=gen) * (torch.rand(7, 11, generator=gen) < density)
    csr = SparseLinearWeights.from_dense(weight).to_csr()
    assert csr.row_ptr.tolist()[-1] == int((weight != 0).sum()) and csr.cols.dtype == torch.int32
    rebuilt = torch.zeros(7, 11)
    for r in range(7):
        begin, end = csr.row_ptr[r].item(), csr.row_ptr[r + 1].item()
        cols = csr.cols[begin:end].long()
        assert (cols[1:] > cols[:-1]).all()  # increasing within a row
        rebuilt[r, cols] = csr.values[begin:end]
    assert torch.equal(rebuilt, weight)
    assert csr.nbytes == 4 * (2 * csr.values.numel() + 8)
