"""Nonzero counts passed between CPU layers (`ops/conv/cpu/prepared.py`): a layer that reads its input directly takes
the counts the direct kernel that wrote it kept, and counts with a pass of its own whenever they may not describe
its input; either way the outputs, counts and overflow flags are the unprepared path's, bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tendril.sparse import convert, prune
from tendril.sparse.network import SparseNetwork
from tendril.sparse.ops.conv.cpu import kernel as cpu_kernel
from tendril.sparse.steps import SparseConvStep
from tests.sparse.cpu_checks import assert_same_run, count_kernel_calls, unprepared_forward
from tests.sparse.models import Bottleneck, ResNetLike, randomize_batchnorm

SIZE = 40
COUNTING = ("count_channels", "sum_band_counts", "fill_planes")


def _resnet(capacity: float = 1.0) -> SparseNetwork:
    torch.manual_seed(0)
    model = randomize_batchnorm(ResNetLike(Bottleneck, (1, 2, 1))).eval()
    prune(model, 0.3)
    return convert(model, torch.randn(1, 3, SIZE, SIZE), activation_capacity=capacity)


def _direct_readers(net: SparseNetwork) -> tuple[int, int]:
    """The convolutions that read their input directly: those whose input a convolution writes, and the others."""
    convolutions = [s for s in net.steps if isinstance(s, SparseConvStep)]
    written = {s.output for s in convolutions}
    readers = [s for s in convolutions if cpu_kernel.reads_input(s.weights.geometry)]
    after_convolution = sum(s.inputs[0] in written for s in readers)
    return after_convolution, len(readers) - after_convolution


@pytest.mark.parametrize("batch", [1, 2])
def test_layers_reading_a_convolutions_output_directly_take_its_counts(batch, monkeypatch):
    net = _resnet(capacity=0.5).set_backend("cpu", 2)
    after_convolution, others = _direct_readers(net)
    assert after_convolution > 0 and others > 0  # the ResNet's first block reads the max pool's output
    assert net.state.counted_outputs <= net.state.reused_outputs and net.state.counted_outputs
    calls = count_kernel_calls(monkeypatch, COUNTING)
    for _ in range(2):
        x = torch.randn(batch, 3, SIZE, SIZE)
        calls.clear()
        net(x)
        landed = len(net.state.planes_readers) if batch == 1 else 0  # their readers take the counts too
        assert calls["sum_band_counts"] == batch * after_convolution + landed
        assert calls["count_channels"] == batch * others
        assert_same_run(net, x)


def test_a_layer_counts_itself_when_the_writer_of_its_input_kept_no_counts(monkeypatch):
    """The first layer goes cartesian on a very sparse input (its direct kernel does not run, so it keeps no counts):
    the next layer, which reads its output directly, must count it (not take the counts of the call before)."""
    model = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 8, 1)).eval()
    net = convert(model, torch.randn(1, 8, 24, 24)).set_backend("cpu", 2)
    first = net.steps[0]
    assert isinstance(first, SparseConvStep) and net.state.counted_outputs == frozenset({first.name})
    calls = count_kernel_calls(monkeypatch, COUNTING)
    dense, sparse = torch.randn(1, 8, 24, 24), torch.randn(1, 8, 24, 24) * (torch.rand(1, 8, 24, 24) < 0.002)
    for x, counted in ((dense, "sum_band_counts"), (sparse, "count_channels"), (dense, "sum_band_counts")):
        calls.clear()
        net(x)
        assert calls[counted] == 1 and calls["sum_band_counts"] + calls["count_channels"] == 1
        assert_same_run(net, x)


def test_a_layer_handed_another_tensor_counts_it_itself(monkeypatch):
    """The published counts describe the tensor their writer last wrote, not whatever a later call passes."""
    net = _resnet().set_backend("cpu", 2)
    x = torch.randn(1, 3, SIZE, SIZE)
    net(x)
    _, state = unprepared_forward(net, x)
    written = {s.output for s in net.steps if s.name in net.state.counted_outputs}
    reader = next(s for s in net.steps if isinstance(s, SparseConvStep) and s.inputs[0] in written and not s.residual)
    other = net.state.output_counts[reader.inputs[0]][0].clone()
    other[:, ::2] = 0
    calls = count_kernel_calls(monkeypatch, COUNTING)
    reader.run([other], net.state)
    assert calls["count_channels"] == 1 and calls["sum_band_counts"] == 0
    expected = (other[0] != 0).sum((1, 2)).to(torch.int32)
    assert torch.equal(net.state.last_counts[reader.name], expected)
    assert not torch.equal(expected, state.last_counts[reader.name])
