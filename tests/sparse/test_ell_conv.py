"""The `"ell"` convolution kernel on the CPU: its packing (every nonzero once, in its channel's tile, channels
sorted by count, padding bounded), the packed layout's validation, its PyTorch emulation and its Triton kernel
under the interpreter against the float64 reference (fp32, fp16, bf16; 1×1, strided, padded, grouped,
residual and ReLU, empty channels), and the kernel as `tune` admits it on converted networks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tendril.sparse import convert, prune
from tendril.sparse.format import ConvGeometry
from tendril.sparse.ops.conv.ell import dataflow as ell_dataflow
from tendril.sparse.ops.conv.ell import kernel as ell_kernel
from tendril.sparse.ops.conv.ell.packing import EllConfig, EllConvWeights, pack
from tendril.sparse.ops.conv.ell.planes import POINTWISE, SHIFTED, input_planes, plane_hw, virtual_width
from tendril.sparse.steps import RunState, SparseConvStep
from tendril.sparse.tuning import KernelTuner
from tests.sparse.ell_checks import CASES, SMALL_CONFIGS, EllCase, check_case, operands
from tests.sparse.models import Bottleneck, ResNetLike, randomize_batchnorm, vgg_like
from tests.utils.interpreter import run_interpreted

CPU = torch.device("cpu")


def unpacked(packed: EllConvWeights) -> torch.Tensor:
    """The dense `[K, C/groups, R, S]` weight the packed entries encode (padding entries add zeros)."""
    g, cfg = packed.geometry, packed.config
    per_chunk = cfg.depth * cfg.channels
    chunks = int(packed.chunk_ptr[-1])
    entry = torch.arange(chunks * per_chunk)
    tile = torch.searchsorted(packed.chunk_ptr.long(), entry // per_chunk, right=True) - 1
    k = packed.channels.long()[tile * cfg.channels + entry % cfg.channels]
    offset, value = packed.offsets[: entry.numel()].long(), packed.values[: entry.numel()]
    real = k >= 0
    assert (value[~real] == 0).all() and (packed.values[entry.numel() :] == 0).all()
    k, offset, value = k[real], offset[real], value[real]
    if packed.mode == POINTWISE:
        c, r, s = offset, torch.zeros_like(offset), torch.zeros_like(offset)
    else:
        (rows, cols), (sh, sw) = plane_hw(g), g.stride
        plane, inside = offset // (rows * cols), offset % (rows * cols)
        c, phase = plane // (sh * sw), plane % (sh * sw)
        r, s = inside // cols * sh + phase // sw, inside % cols * sw + phase % sw
    dense = torch.zeros(g.out_channels, g.in_channels // g.groups, *g.kernel, dtype=torch.float64)
    dense.index_put_((k, c % (g.in_channels // g.groups), r, s), value.double(), accumulate=True)
    return dense


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("config", [*SMALL_CONFIGS, EllConfig(16, 4, 64), EllConfig(2, 4, 512)])
def test_packing_holds_every_nonzero_once_in_sorted_tiles(case, config):
    weights = operands(case, torch.float32, CPU)[0]
    packed = pack(weights, config)
    assert torch.equal(unpacked(packed), weights.to_dense().double())
    g = case.geometry
    lanes = packed.channels.tolist()
    assert sorted(c for c in lanes if c >= 0) == list(range(g.out_channels)) and lanes.count(-1) < config.channels
    counts = (weights.to_dense() != 0).flatten(1).sum(1)
    lane_counts = [int(counts[c]) if c >= 0 else 0 for c in lanes]
    assert lane_counts == sorted(lane_counts, reverse=True)  # channels sorted by nonzero count, most first
    for t in range(packed.tiles):  # each tile padded only up to its longest channel, rounded up to the depth
        longest = max(lane_counts[t * config.channels : (t + 1) * config.channels])
        assert int(packed.chunk_ptr[t + 1] - packed.chunk_ptr[t]) == -(-longest // config.depth)
    if packed.mode == SHIFTED:  # the last pixel block's virtual pixels read inside the planes' slack
        rows, cols = plane_hw(g)
        blocks = -(-g.out_hw[0] * virtual_width(g) // config.pixels)
        last_read = int(packed.offsets.max()) + blocks * config.pixels - 1
        assert last_read < g.in_channels * g.phases * rows * cols
        assert tuple(input_planes(torch.zeros(1, g.in_channels, *g.in_hw), g).shape[1:]) == (
            g.in_channels * g.phases,
            rows,
            cols,
        )


def test_the_packed_layout_is_validated_at_construction():
    weights = operands(CASES[2], torch.float32, CPU)[0]
    packed = pack(weights, EllConfig(4, 2, 16))
    fields = {f.name: getattr(packed, f.name) for f in dataclasses.fields(packed)}

    def rebuilt(**changes):
        return EllConvWeights(**{**fields, **changes})

    far = packed.offsets.clone()
    far[0] = 10**6
    with pytest.raises(ValueError, match="offsets"):
        rebuilt(offsets=far)
    cols = plane_hw(weights.geometry)[1]
    off_kernel = packed.offsets.clone()
    off_kernel[0] = 3 * cols  # row 3 of a 3×3 kernel
    with pytest.raises(ValueError, match="kernel tap outside"):
        rebuilt(offsets=off_kernel)
    backwards = packed.chunk_ptr.clone()
    backwards[1] = backwards[2] + 1
    with pytest.raises(ValueError, match="chunk_ptr"):
        rebuilt(chunk_ptr=backwards)
    lanes = packed.channels.clone()
    lanes[0] = weights.geometry.out_channels
    with pytest.raises(ValueError, match="channels"):
        rebuilt(channels=lanes)
    with pytest.raises(TypeError, match="values"):
        rebuilt(values=packed.values.double())
    with pytest.raises(ValueError, match="offsets"):
        rebuilt(offsets=packed.offsets[:-1].contiguous())
    with pytest.raises(ValueError, match=r"EllConfig\.channels"):
        EllConfig(3, 2, 16)
    with pytest.raises(ValueError, match=r"EllConfig\.run=32: at most pixels \(16\)"):
        EllConfig(4, 2, 16, run=32)
    with pytest.raises(ValueError, match=r"EllConfig\.run=64: at most pixels \(128\) and a warp \(32\)"):
        EllConfig(4, 2, 128, run=64)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_emulation_matches_the_float64_reference(case, dtype):
    check_case(case, SMALL_CONFIGS[0], dtype, CPU)


def test_the_triton_kernel_matches_the_float64_reference_under_the_interpreter():
    run_interpreted("tests.sparse.interpreted_ell", "interpreted ell checks passed")


def test_bad_arguments_are_rejected_by_name():
    weights, x, bias, _, _ = operands(CASES[2], torch.float32, CPU)
    packed = pack(weights, SMALL_CONFIGS[0])
    with pytest.raises(ValueError, match="x: expected"):
        ell_kernel.conv(x[:, :-1], packed, bias)
    with pytest.raises(TypeError, match="x: expected float32"):
        ell_kernel.conv(x.double(), packed, bias)
    with pytest.raises(ValueError, match="bias"):
        ell_kernel.conv(x, packed, bias[:-1])
    with pytest.raises(ValueError, match="residual"):
        ell_kernel.conv(x, packed, bias, residual=x)
    with pytest.raises(ValueError, match="out"):
        ell_kernel.conv(x, packed, bias, out=torch.empty(1))


def test_configs_suit_the_layer_and_huge_inputs_are_unsupported():
    case = EllCase(64, 32, (7, 7), (3, 3), 1, 1, 0.1)
    step = SimpleStep(operands(case, torch.float32, CPU)[0])
    configs = ell_dataflow.configs_for(step)  # type: ignore[arg-type]
    assert configs and all(c.pixels <= 64 for c in configs)
    tiny = SimpleStep(operands(EllCase(2, 4, (3, 3), (1, 1), 1, 0, 0.5), torch.float32, CPU)[0])
    shortest = min(c.pixels for c in ell_dataflow.CONFIGS)
    assert ell_dataflow.configs_for(tiny) == [  # type: ignore[arg-type]
        c for c in ell_dataflow.CONFIGS if c.pixels == shortest and c.depth == 4 and c.splits == 1
    ]
    deep = SimpleStep(operands(EllCase(512, 64, (7, 7), (3, 3), 1, 1, 0.1), torch.float32, CPU)[0])
    assert any(c.splits > 1 for c in ell_dataflow.configs_for(deep))  # type: ignore[arg-type]
    assert ell_dataflow.unsupported_reason(case.geometry) is None
    huge = ConvGeometry(1 << 12, 8, (3, 3), (1, 1), (1, 1), 1, (1 << 10, 1 << 10))
    assert "int32" in str(ell_dataflow.unsupported_reason(huge))


@dataclasses.dataclass
class SimpleStep:
    weights: object


@pytest.mark.parametrize(
    ("build", "residual"),
    [(lambda: vgg_like(width=4), False), (lambda: ResNetLike(Bottleneck, (1, 1), width=4), True)],
)
@torch.no_grad()
def test_tune_admits_the_kernel_on_every_layer_of_a_converted_network(build, residual):
    """Every conv layer of a converted network, packed for each config `tune` would time, agrees with the layer's
    float64 reference (`KernelTuner.rejection`), fused residuals and ReLUs included; unprepared, it refuses."""
    torch.manual_seed(0)
    model = randomize_batchnorm(build()).eval()
    prune(model, 0.3)
    x = torch.randn(1, 3, 16, 16)
    net = convert(model, x)
    values = {net.input_name: x}
    steps = []
    for step in net.steps:
        args = [values[name] for name in step.inputs]
        if isinstance(step, SparseConvStep):
            steps.append((step, args))
        values[step.output] = step.run(args, net.state)
    net.state = RunState("cuda", 1, net.state.overflow)
    assert steps and any(s.residual for s, _ in steps) == residual
    for step, args in steps:
        with pytest.raises(ValueError, match="not prepared"):
            ell_dataflow.ELL.run(step, args[0], None, net.state)
        for config in ell_dataflow.configs_for(step):
            step.ell = pack(step.weights, config)
            assert KernelTuner(net).rejection(step, args, "ell") is None, (step.name, config)
