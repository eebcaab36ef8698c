"""fp16 and bf16 plumbing on the CPU: the formats' dtype checks, `convert` of half models, the CPU backend's
refusal, which kernels declare which dtypes, and `tune`'s admission limits (the kernels themselves run under the
Triton interpreter in test_triton_interpreted.py, and on the GPU in test_gpu_half.py)."""

import pytest
import torch

from tendril.sparse import convert, prune
from tendril.sparse.activations import ActivationLayout, CompressedActivations
from tendril.sparse.format import ConvGeometry, SparseConvWeights, SparseLinearWeights
from tendril.sparse.ops.conv import registry
from tendril.sparse.steps import SparseConvStep, SparseLinearStep
from tendril.sparse.tuning import AGREEMENT_RTOL, agreement_rtol
from tendril.sparse.validation import VALUE_DTYPES
from tests.sparse.models import Bottleneck, ResNetLike, randomize_batchnorm

HALF = (torch.float16, torch.bfloat16)
GEOMETRY = ConvGeometry(4, 6, (3, 3), (2, 2), (1, 1), 2, (7, 8))


@pytest.mark.parametrize("dtype", HALF)
def test_compressed_weights_keep_a_half_dtype_and_round_trip(dtype):
    weight = torch.randn(6, 2, 3, 3) * (torch.rand(6, 2, 3, 3) < 0.5)
    conv = SparseConvWeights.from_dense(weight.to(dtype), GEOMETRY)
    assert conv.values.dtype == dtype and conv.to_dense().dtype == dtype
    assert torch.equal(conv.to_dense(), weight.to(dtype))
    assert conv.nbytes == 6 * conv.nnz + 4 * conv.channel_ptr.numel()
    assert SparseConvWeights.from_dense(weight, GEOMETRY, dtype).values.dtype == dtype  # rounded on the way
    linear = SparseLinearWeights.from_dense(weight.view(6, -1), dtype)
    assert linear.values.dtype == dtype and torch.equal(linear.to_dense(), weight.view(6, -1).to(dtype))
    assert linear.to_csr().values.dtype == dtype


def test_compressed_values_of_another_dtype_raise_naming_the_field():
    weight = torch.randn(6, 2, 3, 3)
    with pytest.raises(TypeError, match=r"dtype torch\.float64: compressed values are one of"):
        SparseConvWeights.from_dense(weight.double(), GEOMETRY)
    with pytest.raises(TypeError, match=r"dtype torch\.int32: compressed values"):
        SparseLinearWeights.from_dense(weight.view(6, -1), torch.int32)
    layout = ActivationLayout(2, (4, 4), (1, 1), (0, 0), 16)
    acts = CompressedActivations.empty(layout, torch.device("cpu"), torch.bfloat16)
    assert acts.values.dtype == torch.bfloat16
    with pytest.raises(TypeError, match=r"CompressedActivations\.values: expected dtype one of torch\.float32"):
        CompressedActivations(layout, acts.values.double(), acts.positions, acts.row_ptr, acts.counts)


def _half_model(dtype):
    torch.manual_seed(0)
    model = randomize_batchnorm(ResNetLike(Bottleneck, (1, 1), width=4)).eval()
    prune(model, 0.3)
    return model.to(dtype)


@pytest.mark.parametrize("dtype", HALF)
def test_convert_builds_a_network_in_the_models_dtype(dtype):
    net = convert(_half_model(dtype), torch.randn(1, 3, 16, 16).to(dtype))
    assert net.dtype == dtype
    layers = [s for s in net.steps if isinstance(s, (SparseConvStep, SparseLinearStep))]
    assert layers and all(s.weights.values.dtype == dtype and s.bias.dtype == dtype for s in layers)
    assert net.backend == "triton"  # the CPU backend runs fp32 only
    with pytest.raises(ValueError, match="backend 'cpu': runs float32 networks only"):
        net.set_backend("cpu")
    with pytest.raises(ValueError, match=f"x: expected a {dtype} input"):
        net(torch.randn(1, 3, 16, 16))
    first = layers[0]
    assert net.layers()[0].dense_weight_bytes == 2 * (first.weights.dense_numel + first.bias.numel())


def test_convert_refuses_mismatched_or_unsupported_dtypes():
    model = _half_model(torch.float32)
    with pytest.raises(ValueError, match=r"example_input is torch.float16 but the model's .* is torch.float32"):
        convert(model, torch.randn(1, 3, 16, 16).half())
    with pytest.raises(ValueError, match="example_input: expected a float32, float16 or bfloat16"):
        convert(model.double(), torch.randn(1, 3, 16, 16).double())


def test_fp32_networks_keep_the_cpu_backend():
    net = convert(_half_model(torch.float32), torch.randn(1, 3, 16, 16))
    assert net.dtype == torch.float32 and net.backend == "cpu"


def test_kernels_declare_their_dtypes():
    by_name = {**registry.BY_NAME, "cpu": registry.BACKEND_KERNELS["cpu"]}
    for name in ("triton", *registry.DENSE_KERNELS):
        assert all(by_name[name].unsupported_dtype(d) is None for d in VALUE_DTYPES), name
    for name in ("cuda", "register", "cpu"):
        assert by_name[name].unsupported_dtype(torch.float32) is None
        why = by_name[name].unsupported_dtype(torch.float16)
        assert why == f"the {name} kernel runs float32 only, not float16"
    assert registry.HALF_DEFAULT_KERNEL.unsupported_dtype(torch.bfloat16) is None


def test_tune_admits_half_kernels_within_their_rounding():
    assert agreement_rtol(torch.float32) == AGREEMENT_RTOL
    assert 2.0**-11 < agreement_rtol(torch.float16) < 1e-2
    assert 2.0**-8 < agreement_rtol(torch.bfloat16) < 1e-1
