"""The CPU backend's prepared layer calls (`ops/conv/cpu/prepared.py`, `linear_cpu.PreparedLinear`): bit-identical to
the unprepared path, whatever the thread count and backend changes before; outputs the next call does not
overwrite; the same errors on bad inputs; and a bound on the Python-level work per layer of a forward."""

from __future__ import annotations

import collections
import sys

import pytest
import torch
from torch import nn

from tendril.sparse import convert, prune
from tendril.sparse import network as network_module
from tendril.sparse.network import SparseNetwork
from tendril.sparse.steps import DenseStep, SparseConvStep, SparseLinearStep
from tests.sparse.cpu_checks import assert_same_run
from tests.sparse.models import Bottleneck, ResNetLike, randomize_batchnorm

SIZE = 40


def _network(capacity: float = 1.0) -> SparseNetwork:
    """A bottleneck ResNet: unpadded 1×1 layers (`spmm` on one thread with `cpu_library`), strided 1×1 downsamples,
    3×3 and strided 3×3 layers (the compiled dataflows), fused residual adds, max pooling and an FC layer."""
    torch.manual_seed(0)
    model = randomize_batchnorm(ResNetLike(Bottleneck, (1, 2, 1))).eval()
    prune(model, 0.3)
    return convert(model, torch.randn(1, 3, SIZE, SIZE), activation_capacity=capacity)


@pytest.mark.parametrize("library", [True, False])
def test_prepared_calls_match_the_unprepared_path_across_thread_and_backend_changes(library):
    net = _network()
    net.cpu_library = library
    inputs = [torch.randn(1, 3, SIZE, SIZE) for _ in range(2)]
    first: dict[int, list[torch.Tensor]] = {}
    for backend, threads in (("cpu", 1), ("cpu", 2), ("cpu", 1), ("triton", 1), ("cpu", 3), ("cpu", 2)):
        net.set_backend(backend, threads)
        assert not net.state.prepared  # a new setting prepares anew
        if backend != "cpu":
            continue
        for x in inputs:
            for _ in range(2):
                y = assert_same_run(net, x)
            first.setdefault(threads, []).append(y)
    assert all(torch.equal(a, b) for a, b in zip(first[1][:2], first[1][2:], strict=True))


@pytest.mark.parametrize(("threads", "library"), [(1, True), (1, False), (2, True)])
def test_prepared_calls_count_and_flag_overflow_as_the_unprepared_path(threads, library):
    """Counting forwards (every layer counts, strided 1×1 layers through their phase planes), a reduced capacity
    that overflows, a batch of two, then a batch of one again."""
    net = _network(capacity=0.5).set_backend("cpu", threads)
    net.cpu_library = library
    for batch, count in ((1, False), (1, True), (2, True), (2, False), (1, True)):
        net.count_activations = count
        net.reset_overflow()
        assert_same_run(net, torch.randn(batch, 3, SIZE, SIZE).relu() + 0.1)
    assert bool(net.state.overflow.item())


def test_the_cartesian_dataflow_runs_prepared_on_very_sparse_inputs():
    model = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 8, 3, padding=1)).eval()
    net = convert(model, torch.randn(1, 8, 24, 24)).set_backend("cpu", 2)
    x = torch.randn(1, 8, 24, 24) * (torch.rand(1, 8, 24, 24) < 0.002)
    step = net.steps[0]
    assert isinstance(step, SparseConvStep)
    assert_same_run(net, x)
    assert step.cpu_plan is not None and step.cpu_plan.choose(net.state.last_counts[step.name]) == "cartesian"
    assert_same_run(net, x)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_returned_output_is_never_overwritten_by_a_later_call(threads):
    net = _network().set_backend("cpu", threads)
    x1, x2 = torch.randn(1, 3, SIZE, SIZE), torch.randn(1, 3, SIZE, SIZE)
    y1 = net(x1)
    kept = y1.clone()
    y2 = net(x2)
    assert torch.equal(y1, kept) and not torch.equal(y1, y2)
    assert y1.untyped_storage().data_ptr() != y2.untyped_storage().data_ptr()


def test_a_sparse_layer_whose_output_a_dense_op_returns_writes_a_new_tensor():
    """The last convolution's output reaches the caller through `flatten` (a view): that layer must not reuse a
    buffer, while the first one does."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 1), nn.Flatten()).eval()
    x = torch.randn(1, 3, 8, 8)
    net = convert(model, x).set_backend("cpu", 1)
    first, _ = (s for s in net.steps if isinstance(s, SparseConvStep))
    assert net.state.reused_outputs == frozenset({first.name})
    y1 = net(x)
    kept = y1.clone()
    net(torch.randn(1, 3, 8, 8))
    assert torch.equal(y1, kept)


def test_bad_inputs_raise_the_unprepared_paths_errors_after_a_prepared_call():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 36, 5)).eval()
    x = torch.randn(1, 3, 8, 8)
    net = convert(model, x).set_backend("cpu", 1)
    net(x)
    with pytest.raises(ValueError, match="layout expects"):
        net(torch.randn(1, 3, 9, 9))
    conv, fc = net.steps[0], net.steps[-1]
    assert isinstance(conv, SparseConvStep) and isinstance(fc, SparseLinearStep)
    with pytest.raises(ValueError, match="layout expects"):
        conv.run([torch.randn(3, 8, 8)], net.state)
    with pytest.raises(ValueError, match=r"expected input \[N, 144\]"):
        fc.run([torch.randn(1, 145)], net.state)
    with pytest.raises(ValueError, match="float32 networks only"):
        fc.run([torch.randn(1, 144, dtype=torch.float64)], net.state)
    with pytest.raises(ValueError, match=r"x: expected a torch\.float32 input"):
        net(x.double())
    wide = torch.randn(1, 3, 8, 16)[..., ::2]  # not contiguous: copied, same result
    assert torch.equal(net(wide), net(wide.contiguous()))


def _python_work(net: SparseNetwork, x: torch.Tensor, monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """One forward's Python-level calls (`sys.setprofile` call events: Python functions, the compiled kernels'
    dispatch and C functions) and its `torch.empty` and `Tensor.numpy` calls, counted after two forwards."""
    with torch.no_grad():
        net(x), net(x)
        counted: collections.Counter[str] = collections.Counter()
        for name, owner in (("empty", torch), ("numpy", torch.Tensor)):
            original = getattr(owner, name)

            def counting(*args: object, name: str = name, original: object = original, **kwargs: object) -> object:
                counted[name] += 1
                return original(*args, **kwargs)  # type: ignore[operator]

            monkeypatch.setattr(owner, name, counting)

        def profile(frame: object, event: str, arg: object) -> None:
            if event in ("call", "c_call"):
                counted["calls"] += 1

        sys.setprofile(profile)
        try:
            net(x)
        finally:
            sys.setprofile(None)
        monkeypatch.undo()
    return dict(counted)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_python_work_of_a_forward_stays_bounded_per_layer(threads, monkeypatch):
    """A guard against the per-layer host work growing back: a prepared forward makes at most `CALLS_PER_LAYER`
    Python-level calls per sparse layer (the unprepared path made about 80), no tensor conversions or allocations
    per layer (only around dense ops and for the returned output), whatever the thread count."""
    calls_per_layer = 32
    net = _network().set_backend("cpu", threads)
    work = _python_work(net, torch.randn(1, 3, SIZE, SIZE), monkeypatch)
    sparse = sum(not isinstance(s, DenseStep) for s in net.steps)
    dense = len(net.steps) - sparse
    assert work["calls"] <= calls_per_layer * sparse, work
    assert work.get("numpy", 0) <= 2 * dense + 2, work
    assert work.get("empty", 0) <= dense + 1, work


class _Clock:
    """A `perf_counter` under which every forward of `net` on the library product takes `library_s`, every other one
    a second: `tune`'s choice by forward times, without timing anything."""

    def __init__(self, net: SparseNetwork, library_s: float) -> None:
        self.net, self.library_s, self.now = net, library_s, 0.0

    def perf_counter(self) -> float:
        self.now += self.library_s if self.net.state.library else 1.0
        return self.now


@pytest.mark.parametrize(("library_s", "chosen"), [(3.0, False), (0.5, True)])
def test_tune_on_one_thread_keeps_the_faster_forward_of_the_library_product_and_the_compiled_loops(
    monkeypatch, library_s, chosen
):
    net = _network()
    clock = _Clock(net, library_s)
    monkeypatch.setattr(network_module, "time", clock)
    pointwise = {s.name for s in net.steps if isinstance(s, SparseConvStep) and s.weights.geometry.kernel == (1, 1)}
    strided = {s.name for s in net.steps if isinstance(s, SparseConvStep) and s.weights.geometry.stride != (1, 1)}
    choice = net.tune(torch.randn(1, 3, SIZE, SIZE), reps=3)
    assert choice == dict.fromkeys(pointwise, "spmm" if chosen else "compiled") and pointwise & strided
    assert net.cpu_library is chosen and net.state.library is chosen
    assert net.cpu_library_ms == {"library": library_s * 1e3, "compiled": 1e3}
    assert net.state.prepared  # the faster way's prepared calls are kept
    assert_same_run(net, torch.randn(1, 3, SIZE, SIZE))


def test_tune_has_nothing_to_choose_on_several_threads_or_without_pointwise_layers():
    net = _network().set_backend("cpu", 2)
    before = (net.cpu_library, dict(net.cpu_library_ms))
    assert net.tune(torch.randn(1, 3, SIZE, SIZE)) == {} and (net.cpu_library, net.cpu_library_ms) == before
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3)).eval()
    assert convert(model, torch.randn(1, 3, 12, 12)).tune(torch.randn(1, 3, 12, 12)) == {}


def test_convert_on_the_cpu_tunes_the_library_choice():
    net = _network()
    assert net.cpu_library_ms.keys() == {"library", "compiled"}
    assert net.cpu_library is (net.cpu_library_ms["library"] <= net.cpu_library_ms["compiled"])


@pytest.mark.parametrize("bad", [0, 2.5, True])
def test_thread_counts_and_tune_repetitions_must_be_positive_integers(bad):
    net = _network()
    with pytest.raises(ValueError, match=rf"threads={bad!r}: expected an integer"):
        net.set_backend("cpu", bad)
    with pytest.raises(ValueError, match=rf"reps={bad!r}: expected an integer"):
        net.tune(torch.randn(1, 3, SIZE, SIZE), reps=bad)


def test_forwards_from_several_threads_take_turns_and_each_gets_its_own_output():
    """The CPU layers write reused buffers: overlapping forwards of one network would read each other's."""
    import threading

    net = _network()
    inputs = [torch.randn(1, 3, SIZE, SIZE) for _ in range(4)]
    expected = [net(x).clone() for x in inputs]
    wrong: list[int] = []

    def work(index: int) -> None:
        for _ in range(10):
            if not torch.equal(net(inputs[index]), expected[index]):
                wrong.append(index)

    threads = [threading.Thread(target=work, args=(index,)) for index in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == []


def test_a_network_copied_before_its_first_forward_runs_on_its_own():
    import copy

    torch.manual_seed(0)
    model = randomize_batchnorm(ResNetLike(Bottleneck, (1, 1))).eval()
    net = convert(model, torch.randn(1, 3, SIZE, SIZE), tune=False)  # tune runs forwards
    twin = copy.deepcopy(net)
    x = torch.randn(1, 3, SIZE, SIZE)
    assert torch.equal(twin(x), net(x)) and twin._turn is not net._turn
