"""Checks shared by the CPU, Triton-interpreter and GPU tests: each op against its plain-PyTorch
reference, with unwritten buffer slots poisoned so that reading past a count is caught."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tendril.sparse.activations import ActivationLayout, CompressedActivations
from tendril.sparse.format import ConvGeometry, SparseConvWeights, SparseLinearWeights
from tendril.sparse.ops.compress import reference as compress_reference

if TYPE_CHECKING:
    from tendril.sparse.ops.linear.triton import RowsConfig

REL_TOL = 1e-4


@dataclass(frozen=True)
class ConvCase:
    channels: int
    out_channels: int
    size: tuple[int, int]
    kernel: int
    stride: int
    padding: int
    groups: int
    weight_density: float
    act_density: float
    seed: int = 0

    @property
    def geometry(self) -> ConvGeometry:
        k, s, p = self.kernel, self.stride, self.padding
        return ConvGeometry(self.channels, self.out_channels, (k, k), (s, s), (p, p), self.groups, self.size)


CONV_CASES = [
    ConvCase(3, 4, (9, 11), 3, 1, 1, 1, 0.4, 0.5),
    ConvCase(4, 6, (13, 12), 5, 2, 2, 2, 0.3, 0.6),
    ConvCase(3, 5, (23, 23), 11, 4, 2, 1, 0.8, 1.0),
    ConvCase(4, 4, (8, 8), 1, 2, 0, 4, 0.5, 0.5),
    ConvCase(3, 5, (10, 9), 7, 3, 3, 1, 0.5, 0.4),
    ConvCase(6, 6, (7, 7), 3, 1, 0, 3, 1.0, 0.3),
    ConvCase(2, 3, (6, 5), 3, 1, 1, 1, 0.0, 0.5),
    ConvCase(2, 3, (6, 5), 5, 1, 2, 1, 0.5, 0.0),
    ConvCase(2, 3, (5, 5), 7, 2, 3, 1, 0.5, 0.5),
]


def sparse_tensor(shape: tuple[int, ...], density: float, gen: torch.Generator, positive: bool = False) -> torch.Tensor:
    x = torch.randn(shape, generator=gen)
    if positive:
        x = x.abs() + 0.1
    return x * (torch.rand(shape, generator=gen) < density)


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref.double()).abs().max() / ref.double().abs().max().clamp(min=1e-6))


def poisoned(acts: CompressedActivations) -> CompressedActivations:
    """A copy whose slots past each count hold NaN values and out-of-range positions."""
    slots = torch.arange(acts.layout.capacity, device=acts.values.device)
    unused = slots[None, :] >= acts.stored_counts[:, None]
    values = acts.values.masked_fill(unused, float("nan"))
    positions = acts.positions.masked_fill(unused, 1 << 30)
    return CompressedActivations(acts.layout, values, positions, acts.row_ptr.clone(), acts.counts.clone())


def assert_same_compression(acts: CompressedActivations, expected: CompressedActivations) -> None:
    assert torch.equal(acts.counts.cpu(), expected.counts.cpu())
    assert torch.equal(acts.row_ptr.cpu(), expected.row_ptr.cpu())
    stored = torch.arange(expected.layout.capacity)[None, :] < expected.stored_counts.cpu()[:, None]
    assert torch.equal(acts.values.cpu()[stored], expected.values.cpu()[stored])
    assert torch.equal(acts.positions.cpu()[stored], expected.positions.cpu()[stored])


def conv_operands(case: ConvCase, device: torch.device):
    gen = torch.Generator().manual_seed(case.seed)
    g = case.geometry
    weight = sparse_tensor((g.out_channels, g.in_channels // g.groups, *g.kernel), case.weight_density, gen)
    x = sparse_tensor((g.in_channels, *g.in_hw), case.act_density, gen, positive=True)
    bias = torch.randn(g.out_channels, generator=gen)
    ref = F.conv2d(x[None].double(), weight.double(), bias.double(), g.stride, g.padding, groups=g.groups)[0]
    weights = SparseConvWeights.from_dense(weight.to(device), g)
    weights.validate()
    init = bias.view(-1, 1, 1).expand(g.out_channels, *g.out_hw).contiguous().to(device)
    return weights, x.to(device), init, ref


def check_conv(case: ConvCase, compress, conv, device: torch.device) -> None:
    """`compress(x, layout)` and `conv(acts, weights, init)` must match the dense convolution."""
    weights, x, init, ref = conv_operands(case, device)
    layout = ActivationLayout.for_conv(weights.geometry)
    acts = compress(x, layout)
    assert_same_compression(acts, compress_reference.compress(x.cpu(), layout))
    y = conv(poisoned(acts), weights, init)
    assert y.shape == ref.shape
    if ref.abs().max() == 0:
        assert torch.equal(y.cpu(), torch.zeros_like(y.cpu()))
    else:
        assert relative_error(y.cpu(), ref) <= REL_TOL, case


GEMM_CASES = [c for c in CONV_CASES if c.groups == 1] + [
    ConvCase(8, 5, (7, 6), 1, 1, 0, 1, 0.3, 0.6),
    ConvCase(6, 4, (9, 9), 1, 2, 0, 1, 0.5, 0.5),
    ConvCase(5, 7, (6, 6), 1, 1, 1, 1, 0.5, 0.5),
]
"""Convolutions for the GEMM kernel (no groups), with the 1×1 cases that take its no-copy and subsampled paths."""


def check_conv_gemm(case: ConvCase, device: torch.device, batch: int = 2, residual: bool = True, relu: bool = True):
    """`conv_gemm.conv` with bias, a residual and ReLU against float64 `F.conv2d`, on a batch."""
    from tendril.sparse.ops.conv.gemm import kernel as conv_gemm

    gen = torch.Generator().manual_seed(case.seed + 7)
    g = case.geometry
    weight = sparse_tensor((g.out_channels, g.in_channels, *g.kernel), case.weight_density, gen)
    x = sparse_tensor((batch, g.in_channels, *g.in_hw), case.act_density, gen, positive=True)
    bias = torch.randn(g.out_channels, generator=gen)
    resid = torch.randn(batch, g.out_channels, *g.out_hw, generator=gen) if residual else None
    ref = F.conv2d(x.double(), weight.double(), bias.double(), g.stride, g.padding)
    ref = ref + resid.double() if residual else ref
    ref = ref.relu() if relu else ref
    on = (lambda t: t.to(device)) if device.type != "cpu" else (lambda t: t)
    y = conv_gemm.conv(on(x), on(weight), on(bias), g, residual=None if resid is None else on(resid), relu=relu)
    assert y.shape == ref.shape
    assert relative_error(y.cpu(), ref) <= REL_TOL, case


def check_linear(
    features: int,
    outputs: int,
    weight_density: float,
    act_density: float,
    compress,
    linear,
    device: torch.device,
    seed: int = 0,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    weight = sparse_tensor((outputs, features), weight_density, gen)
    x = sparse_tensor((features,), act_density, gen, positive=True)
    bias = torch.randn(outputs, generator=gen)
    ref = weight.double() @ x.double() + bias.double()
    weights = SparseLinearWeights.from_dense(weight.to(device))
    weights.validate()
    layout = ActivationLayout.for_vector(features)
    acts = compress(x.to(device).view(1, 1, features), layout)
    y = linear(poisoned(acts), weights, bias.to(device).clone())
    assert relative_error(y.cpu(), ref) <= REL_TOL


def check_linear_rows(
    features: int,
    outputs: int,
    weight_density: float,
    act_density: float,
    relu: bool,
    device: torch.device,
    config: RowsConfig | None = None,
) -> None:
    """`linear_triton.linear_rows` on a CSR copy (`SparseLinearWeights.to_csr`) against float64 dense math, with
    launch `config` (default: small blocks, for the interpreter); the output is written over NaN-poisoned memory,
    so an unwritten row shows."""
    from tendril.sparse.ops.linear import triton as linear_triton

    gen = torch.Generator().manual_seed(features + outputs)
    weight = sparse_tensor((outputs, features), weight_density, gen)
    x = sparse_tensor((features,), act_density, gen, positive=True)
    bias = torch.randn(outputs, generator=gen)
    ref = weight.double() @ x.double() + bias.double()
    ref = ref.relu() if relu else ref
    csr = SparseLinearWeights.from_dense(weight.to(device)).to_csr()
    torch.empty(outputs, device=device).fill_(float("nan"))  # leaves NaN in the allocator's next block
    config = config or linear_triton.RowsConfig(block_r=4, block_k=16)
    y = linear_triton.linear_rows(x.to(device), csr, bias.to(device), relu=relu, config=config)
    assert relative_error(y.cpu(), ref) <= REL_TOL


def graph_replays(net, placeholder: torch.Tensor, replays: int):
    """`net` captured in a CUDA graph reading `placeholder` (after a warm-up on a side stream), replayed on
    `replays` fresh random inputs with its output poisoned (NaN) before each replay: yields `(input, output)`."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        net(placeholder)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = net(placeholder)
    for _ in range(replays):
        x = torch.randn_like(placeholder)
        placeholder.copy_(x)
        out.fill_(float("nan"))
        graph.replay()
        yield x, out


def assert_network_matches_dense(net, model: torch.nn.Module, placeholder: torch.Tensor, replays: int) -> None:
    """`net` agrees with `model` eagerly on `placeholder` and, captured in a CUDA graph reading `placeholder`,
    on `replays` fresh random inputs, with the graph's output poisoned (NaN) before each replay."""
    with torch.no_grad():
        assert relative_error(net(placeholder), model(placeholder)) <= REL_TOL
        for x, out in graph_replays(net, placeholder, replays):
            assert relative_error(out, model(x)) <= REL_TOL
