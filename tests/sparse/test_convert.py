"""Whole networks on the CPU backend against dense PyTorch on the same pruned weights; conversion errors."""

import pytest
import torch
from torch import nn

from tendril.sparse import ActivationOverflowError, UnsupportedLayerError, convert, prune
from tendril.sparse.steps import DenseStep, SparseConvStep, SparseLinearStep
from tendril.sparse.tuning import KernelTuner
from tests.sparse.checks import REL_TOL, relative_error
from tests.sparse.models import BasicBlock, Bottleneck, ResNetLike, alexnet_like, randomize_batchnorm, vgg_like

NETWORKS = {
    "alexnet": (lambda: alexnet_like(), "alexnet", 67),
    "vgg_bn": (lambda: vgg_like(batch_norm=True), 0.4, 32),
    "resnet_basic": (lambda: ResNetLike(BasicBlock, (2, 2, 2)), 0.3, 40),
    "resnet_bottleneck": (lambda: ResNetLike(Bottleneck, (1, 2, 1)), 0.2, 40),
}


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("name", list(NETWORKS))
def test_cpu_network_matches_dense_pytorch(name, threads):
    build, densities, size = NETWORKS[name]
    torch.manual_seed(0)
    model = randomize_batchnorm(build()).eval()
    prune(model, densities)
    net = convert(model, torch.randn(1, 3, size, size)).set_backend("cpu", threads)
    for _ in range(2):
        x = torch.randn(2, 3, size, size)
        with torch.no_grad():
            assert relative_error(net(x), model(x)) <= REL_TOL
    net.check_overflow()
    net.count_activations = True  # layers that read their input itself (CPU 1×1) count only when asked
    with torch.no_grad():
        net(x)
    layers = net.layers()
    assert all(0.0 <= r.activation_density <= 1.0 for r in layers)
    assert layers[0].activation_density == 1.0
    compressed, dense = net.weight_bytes()
    assert 0 < compressed < dense


def test_a_cpu_forward_runs_torch_on_one_thread_and_restores_the_callers_counts(monkeypatch):
    import numba

    from tendril.sparse.ops import cpu_threads

    torch.manual_seed(0)
    model = alexnet_like().eval()
    prune(model, "alexnet")
    net = convert(model, torch.randn(1, 3, 67, 67)).set_backend("cpu", 2)
    seen = []
    step = next(s for s in net.steps if isinstance(s, SparseConvStep))
    run = step.run
    record = lambda *a: seen.append((torch.get_num_threads(), numba.get_num_threads())) or run(*a)  # noqa: E731
    monkeypatch.setattr(step, "run", record)
    previous = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        with torch.no_grad():
            net(torch.randn(1, 3, 67, 67))
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(previous)
    assert seen == [(1, min(2, numba.config.NUMBA_NUM_THREADS))]
    assert cpu_threads.threading_layer() in ("omp", "tbb", "workqueue")


def test_fusions_fold_batchnorm_relu_and_residual_adds_into_the_sparse_layers():
    model = randomize_batchnorm(ResNetLike(Bottleneck, (1, 1))).eval()
    net = convert(model, torch.randn(1, 3, 32, 32))
    convs = [s for s in net.steps if isinstance(s, SparseConvStep)]
    assert len(convs) == sum(isinstance(m, nn.Conv2d) for m in model.modules())
    assert sum(s.residual for s in convs) == 2
    assert sum(isinstance(s, DenseStep) for s in net.steps) == 3  # maxpool, avgpool, flatten
    assert isinstance(net.steps[-1], SparseLinearStep)


def test_the_network_holds_no_autograd_history_of_the_models_parameters():
    """Folding BatchNorm multiplies by its (grad-requiring) gains: the folded weights and biases must be plain tensors,
    not nodes of an autograd graph holding the model's parameters."""
    model = randomize_batchnorm(ResNetLike(Bottleneck, (1, 1))).eval()
    net = convert(model, torch.randn(1, 3, 16, 16), tune=False)
    steps = [s for s in net.steps if isinstance(s, (SparseConvStep, SparseLinearStep))]
    assert steps and all(s.bias.grad_fn is None and s.weights.values.grad_fn is None for s in steps)


def test_step_calls_rerun_each_step_on_the_activations_of_one_forward():
    torch.manual_seed(0)
    model = randomize_batchnorm(ResNetLike(BasicBlock, (1, 1))).eval()
    prune(model, 0.4)
    x = torch.randn(1, 3, 16, 16)
    net = convert(model, x)
    calls = net.step_calls(x)
    assert [c.name for c in calls] == [s.name for s in net.steps]
    kernels = {c.kernel for c in calls}
    assert kernels == {"dense op", "cpu"}
    assert torch.equal(calls[-1].run(), net(x))


def test_unsupported_layers_are_named():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.GELU()).eval()
    with pytest.raises(UnsupportedLayerError, match=r"'1' \(GELU\)"):
        convert(model, torch.randn(1, 3, 8, 8))
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.BatchNorm2d(4)).eval()
    with pytest.raises(UnsupportedLayerError, match="BatchNorm2d 2"):
        convert(model, torch.randn(1, 3, 8, 8))
    with pytest.raises(ValueError, match="dilation"):
        convert(nn.Sequential(nn.Conv2d(3, 4, 3, dilation=2)).eval(), torch.randn(1, 3, 8, 8))
    with pytest.raises(ValueError, match="eval-mode"):
        convert(nn.Sequential(nn.Conv2d(3, 4, 3)), torch.randn(1, 3, 8, 8))


def test_a_submodule_left_in_training_mode_is_refused_by_name():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).eval()
    model[1].train()  # would normalize by batch statistics, which the folded network cannot
    with pytest.raises(ValueError, match=r"training mode: 1 \(call model.eval\(\)\)"):
        convert(model, torch.randn(1, 3, 8, 8))


class _TwiceRead(nn.Module):
    """A conv output added to itself, then a functional ReLU (with its `inplace` keyword) on it and on the input."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Conv2d(3, 4, 3, padding=1)
        self.second = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.first(nn.functional.relu(x))
        z = self.second(y)
        return nn.functional.relu(z + z, inplace=True)


def test_a_layer_output_added_to_itself_and_functional_relus_match_the_model():
    torch.manual_seed(0)
    model = _TwiceRead().eval()
    x = torch.randn(2, 3, 8, 8)
    net = convert(model, x)
    assert not any(isinstance(s, SparseConvStep) and s.residual for s in net.steps)  # `z + z` stays a dense add
    with torch.no_grad():
        expected = model(x)
    assert relative_error(net(x), expected) < REL_TOL


def test_overflow_of_a_reduced_capacity_is_reported_not_silent():
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3)).eval()
    net = convert(model, torch.randn(1, 3, 8, 8), activation_capacity=0.1)
    net(torch.rand(1, 3, 8, 8) + 0.1)
    with pytest.raises(ActivationOverflowError, match="activation_capacity"):
        net.check_overflow()
    net.check_overflow()  # the flag was reset


def test_wrong_input_shape_is_rejected():
    model = nn.Sequential(nn.Conv2d(3, 4, 3)).eval()
    net = convert(model, torch.randn(1, 3, 8, 8))
    with pytest.raises(ValueError, match="layout expects"):
        net(torch.randn(1, 3, 9, 9))


@pytest.mark.parametrize("pixel_runs", [False, True])
def test_pixel_run_plans_are_timed_unless_left_out(monkeypatch, pixel_runs):
    """`tune` times the 1×1 pixel-run plans by default and leaves them out with `pixel_runs=False`."""
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))
    model = ResNetLike(Bottleneck, (1, 1)).eval()
    options = {} if pixel_runs else {"pixel_runs": False}
    net = convert(model, torch.randn(1, 3, 16, 16), **options)
    one_by_one = [s for s in net.steps if isinstance(s, SparseConvStep) and s.weights.geometry.kernel == (1, 1)]
    plans = [plan for step in one_by_one for plan in KernelTuner(net).plans_for(step)]
    assert one_by_one and plans
    assert any(plan.pixel_run for plan in plans) == pixel_runs


def test_dense_fallback_convolutions_and_products_never_use_tf32():
    from tendril.sparse.ops.conv.dense.dataflow import fp32_dense_math

    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    previous = cudnn.allow_tf32, matmul.allow_tf32
    cudnn.allow_tf32 = matmul.allow_tf32 = True
    try:
        with fp32_dense_math():
            assert not cudnn.allow_tf32 and not cudnn.benchmark and not matmul.allow_tf32
        with fp32_dense_math(benchmark=True):
            assert not cudnn.allow_tf32 and cudnn.benchmark and not matmul.allow_tf32
        assert cudnn.allow_tf32 and not cudnn.benchmark and matmul.allow_tf32
    finally:
        cudnn.allow_tf32, matmul.allow_tf32 = previous


def test_held_bytes_count_every_kernel_copy_and_release_keeps_what_the_chosen_kernel_reads():
    model = vgg_like(width=4).eval()
    prune(model, 0.3)
    x = torch.randn(1, 3, 16, 16)
    net = convert(model, x)
    conv = next(s for s in net.steps if isinstance(s, SparseConvStep))
    linear = next(s for s in net.steps if isinstance(s, SparseLinearStep))
    compressed = conv.weights.nbytes + conv.bias.nbytes
    assert conv.held_bytes() == compressed
    conv.dense_weight = conv.weights.to_dense()
    linear.csr = linear.weights.to_csr()
    assert conv.held_bytes() == compressed + conv.dense_weight.nbytes
    assert linear.held_bytes() > linear.weights.nbytes + linear.bias.nbytes
    conv.conv_kernel, linear.fc_kernel = "dense", "spmspv"
    in_use = net.weight_bytes(in_use_only=True)
    assert in_use[0] < net.weight_bytes()[0]
    net.release_unused_kernels()
    assert net.weight_bytes() == in_use
    assert conv.dense_weight is not None and linear.csr is None
    assert conv.held_bytes() == compressed + conv.dense_weight.nbytes
    assert linear.held_bytes() == linear.weights.nbytes + linear.bias.nbytes
    with torch.no_grad():
        assert relative_error(net(x), model(x)) <= REL_TOL
    with pytest.raises(ValueError, match="convert again"):
        net.tune(x)
