"""Outputs written straight into the next layer's phase planes (`ops/conv/cpu/prepared.py`, `PlanesOutput`): a layer
whose input a convolution wrote there at batch 1 neither fills its planes nor counts with a pass, and every other
input (a batch of two, a strided reader, another tensor, a writer on the library product) fills as before; either way
the outputs, counts and overflow flags are the unprepared path's, bit for bit."""

from __future__ import annotations

import torch
from torch import nn

from tendril.sparse import convert
from tendril.sparse.network import SparseNetwork
from tendril.sparse.ops.conv.cpu import kernel as cpu_kernel
from tendril.sparse.steps import SparseConvStep
from tests.sparse.cpu_checks import assert_same_run, count_kernel_calls, unprepared_forward

SIZE = 20
KERNELS = ("fill_planes", "count_channels", "sum_band_counts", "conv_direct", "conv_cartesian")


def _chain(*layers: nn.Module, channels: int = 8) -> SparseNetwork:
    """`layers`, each convolution followed by a ReLU, then a head that returns a pooled output."""
    torch.manual_seed(0)
    modules: list[nn.Module] = []
    for layer in layers:
        modules += [layer, nn.ReLU()]
    model = nn.Sequential(*modules, nn.AdaptiveAvgPool2d(1), nn.Flatten()).eval()
    return convert(model, torch.randn(1, channels, SIZE, SIZE))


def _vgg_like() -> SparseNetwork:
    """Three 3×3 layers: the second and third read what the one before wrote."""
    return _chain(nn.Conv2d(8, 16, 3, padding=1), nn.Conv2d(16, 16, 3, padding=1), nn.Conv2d(16, 8, 3, padding=1))


def _convolutions(net: SparseNetwork) -> list[SparseConvStep]:
    return [s for s in net.steps if isinstance(s, SparseConvStep)]


def test_a_chain_of_convolutions_writes_into_the_next_layers_planes(monkeypatch):
    net = _vgg_like().set_backend("cpu", 2)
    first, second, third = _convolutions(net)
    assert net.state.planes_readers == {first.name: second, second.name: third}
    calls = count_kernel_calls(monkeypatch, KERNELS)
    for _ in range(3):
        x = torch.randn(1, 8, SIZE, SIZE)
        calls.clear()
        assert_same_run(net, x)  # the unprepared forward fills its planes (one fill per layer) after net(x)
        assert calls["fill_planes"] == 1 + 3 and calls["sum_band_counts"] == 2 and calls["count_channels"] == 0
    planes = net.state.output_planes[first.output]
    assert not planes.tensor.is_contiguous()
    g = second.weights.geometry
    assert second.cpu_plan is not None and planes.rows.shape == tuple(second.cpu_plan.planes.shape)
    at, row = second.cpu_plan.input_grid()
    padding = torch.ones(planes.rows.shape, dtype=torch.bool)
    padding.view(g.in_channels, -1)[:, at : at + SIZE * row].view(g.in_channels, SIZE, row)[:, :, :SIZE] = False
    assert not torch.from_numpy(planes.rows)[padding].any()  # the writer wrote the interior only


def test_a_pointwise_writer_lands_on_its_compiled_path_only(monkeypatch):
    """A 1×1 writer on the library product (on one thread, with `cpu_library`) writes a dense buffer: its reader fills
    there."""
    net = _chain(nn.Conv2d(8, 16, 1), nn.Conv2d(16, 8, 3, padding=1))
    first, second = _convolutions(net)
    for threads, library, fills in ((1, True, 1), (1, False, 0), (2, True, 0)):
        net.set_backend("cpu", threads)
        net.cpu_library = library
        assert net.state.planes_readers == {first.name: second}
        calls = count_kernel_calls(monkeypatch, KERNELS)
        net(torch.randn(1, 8, SIZE, SIZE))
        assert calls["fill_planes"] == fills
        monkeypatch.undo()
        assert_same_run(net, torch.randn(1, 8, SIZE, SIZE))


def test_no_planes_for_strided_readers_returned_outputs_or_outputs_read_twice():
    strided = _chain(nn.Conv2d(8, 16, 3, padding=1), nn.Conv2d(16, 8, 3, stride=2, padding=1))
    pointwise = _chain(nn.Conv2d(8, 16, 3, padding=1), nn.Conv2d(16, 8, 1))  # reads its input itself
    two = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.Conv2d(16, 8, 3)).eval()
    returned = convert(two, torch.randn(1, 8, 9, 9))
    for net in (strided, pointwise):
        assert net.state.planes_readers == {}
        for threads in (1, 2):
            net.set_backend("cpu", threads)
            assert_same_run(net, torch.randn(1, 8, SIZE, SIZE))
    assert list(returned.state.planes_readers) == [_convolutions(returned)[0].name]  # the last one's is returned
    assert not cpu_kernel.holds_input(_convolutions(strided)[1].weights.geometry)


def test_a_batch_of_two_fills_as_before_and_batches_of_one_land_again(monkeypatch):
    net = _vgg_like().set_backend("cpu", 2)
    calls = count_kernel_calls(monkeypatch, KERNELS)
    for batch, fills in ((1, 1), (2, 6), (1, 1), (2, 6)):
        calls.clear()
        net(torch.randn(batch, 8, SIZE, SIZE))
        assert calls["fill_planes"] == fills
    monkeypatch.undo()
    for batch in (1, 2, 1):
        assert_same_run(net, torch.randn(batch, 8, SIZE, SIZE))


def test_a_reader_handed_another_tensor_fills_its_own_planes(monkeypatch):
    """Only the very tensor the writer returned is read from the writer's planes: a copy of it, or another tensor,
    fills the reader's own planes, and leaves the writer's output as it was."""
    net = _vgg_like().set_backend("cpu", 2)
    first, second, _ = _convolutions(net)
    x = torch.randn(1, 8, SIZE, SIZE)
    net(x)
    written = net.state.output_planes[first.output].tensor
    kept = written.clone()
    expected = second.reference([written])
    calls = count_kernel_calls(monkeypatch, KERNELS)
    landed = second.run([written], net.state).clone()  # its buffer is rewritten by the next call
    assert calls["fill_planes"] == 0
    other = written.clone()
    other[:, ::2] = 0
    for given in (written.clone(), other):
        calls.clear()
        y = second.run([given], net.state)
        assert calls["fill_planes"] == 1 and calls["sum_band_counts"] == 0
        assert torch.allclose(y.double(), second.reference([given]), rtol=1e-4, atol=1e-4)
        assert torch.equal(net.state.last_counts[second.name], (given[0] != 0).sum((1, 2)).to(torch.int32))
    assert torch.equal(written, kept)
    assert torch.allclose(landed.double(), expected, rtol=1e-4, atol=1e-4)
    monkeypatch.undo()
    assert_same_run(net, x)


def test_a_writer_that_goes_cartesian_writes_the_planes_and_its_reader_counts_them(monkeypatch):
    """On a very sparse input the first layer takes the cartesian dataflow: it still writes the reader's planes (not
    their padding), keeps no band counts, and the reader counts its input over those planes instead."""
    net = _chain(nn.Conv2d(8, 16, 3, padding=1, bias=False), nn.Conv2d(16, 8, 3, padding=1)).set_backend("cpu", 2)
    dense = torch.randn(1, 8, SIZE, SIZE)
    sparse = torch.randn(1, 8, SIZE, SIZE) * (torch.rand(1, 8, SIZE, SIZE) < 0.002)
    calls = count_kernel_calls(monkeypatch, KERNELS)
    for x, cartesian in ((dense, False), (sparse, True), (dense, False), (sparse, True)):
        calls.clear()
        net(x)
        assert (calls["conv_cartesian"] > 0) is cartesian and calls["fill_planes"] == 1  # the first layer's
        assert calls["count_channels" if cartesian else "sum_band_counts"] == 1
        monkeypatch.undo()
        y, state = unprepared_forward(net, x)
        assert torch.equal(net(x), y)
        assert all(torch.equal(net.state.last_counts[k], v) for k, v in state.last_counts.items())
        calls = count_kernel_calls(monkeypatch, KERNELS)
