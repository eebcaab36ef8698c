"""Every documented fallback happens on the GPU, for the documented reason, with eager's answer."""

import pytest
import torch

from tendril.config import Config
from tendril.graphs.admission import GraphFallbackWarning
from tendril.graphs.outputs import StaleOutputError
from tendril.graphs.stats import Fallback
from tests.graphs.gpu_models import fast

pytestmark = pytest.mark.gpu


def check(graphed_fn, fn, *args, reason=None, **kwargs):
    expected = fn(*args, **kwargs)
    if reason is None:
        got = graphed_fn(*args, **kwargs)
    else:
        with pytest.warns(GraphFallbackWarning):
            got = graphed_fn(*args, **kwargs)
        assert graphed_fn.stats.fallbacks[reason] >= 1, graphed_fn.stats.table()
    torch.testing.assert_close(got, expected)


def test_host_sync_falls_back_and_other_shapes_still_graph():
    def fn(x):
        if x.shape[0] == 3:
            return x * x.max().item()
        return x * 2

    graphed_fn = fast(fn)
    with torch.inference_mode():
        check(graphed_fn, fn, torch.randn(3, 8, device="cuda"), reason=Fallback.HOST_SYNC)
        check(graphed_fn, fn, torch.randn(3, 8, device="cuda"))
        check(graphed_fn, fn, torch.randn(4, 8, device="cuda"))
    assert graphed_fn.stats.captures == 1 and graphed_fn.stats.fallbacks[Fallback.HOST_SYNC] == 2


def test_data_dependent_shapes_fall_back():
    def fn(x):
        return x[x > 0].sum() + torch.nonzero(x).shape[0]

    graphed_fn = fast(fn)
    with torch.inference_mode():
        x = torch.randn(64, device="cuda")
        with pytest.warns(GraphFallbackWarning):
            got = graphed_fn(x)
    torch.testing.assert_close(got, fn(x))
    reasons = set(graphed_fn.stats.fallbacks)
    assert reasons & {Fallback.HOST_SYNC, Fallback.CAPTURE_ERROR}, graphed_fn.stats.table()


def test_an_operation_that_cannot_be_captured_falls_back():
    def fn(x):
        torch.cuda.synchronize()
        return x + 1

    graphed_fn = fast(fn)
    with torch.inference_mode():
        x = torch.randn(8, device="cuda")
        with pytest.warns(GraphFallbackWarning):
            got = graphed_fn(x)
    torch.testing.assert_close(got, x + 1)
    assert graphed_fn.stats.failed_keys, graphed_fn.stats.table()


def test_cpu_tensors_fall_back():
    graphed_fn = fast(lambda x: x.sin())
    with torch.inference_mode():
        check(graphed_fn, torch.sin, torch.randn(8), reason=Fallback.CPU_TENSOR)


def test_limit_mutation_and_grad_fall_back():
    graphed_fn = fast(lambda x: x.cos(), max_graphs=1)
    with torch.inference_mode():
        check(graphed_fn, torch.cos, torch.randn(4, device="cuda"))
        check(graphed_fn, torch.cos, torch.randn(5, device="cuda"), reason=Fallback.LIMIT)

    def bump(x):
        return x.mul_(2)

    mutating = fast(bump)
    x = torch.ones(4, device="cuda")
    with torch.no_grad(), pytest.warns(GraphFallbackWarning):
        out = mutating(x)
    assert x.tolist() == [2, 2, 2, 2] and out.tolist() == [2, 2, 2, 2]
    assert mutating.stats.fallbacks[Fallback.MUTATES_INPUTS] == 1

    linear = torch.nn.Linear(4, 4).cuda()
    graphed_linear = fast(linear)
    w = torch.randn(2, 4, device="cuda", requires_grad=True)
    with pytest.warns(GraphFallbackWarning):
        out = graphed_linear(w)
    out.sum().backward()
    assert w.grad is not None and graphed_linear.stats.fallbacks[Fallback.REQUIRES_GRAD] == 1


def test_debug_mode_and_clone_outputs_on_the_gpu():
    model = torch.nn.Linear(16, 16).cuda().eval()
    debug = fast(model, config=Config(debug=True))
    with torch.inference_mode():
        a, b = torch.randn(2, 16, device="cuda"), torch.randn(2, 16, device="cuda")
        first = debug(a)
        torch.testing.assert_close(first, model(a))
        debug(b)
        with pytest.raises(StaleOutputError):
            first.sum()
        cloned = fast(model, clone_outputs=True)
        kept = cloned(a)
        cloned(b)
        torch.testing.assert_close(kept, model(a))


def test_static_inputs_skip_the_copy():
    model = torch.nn.Linear(16, 16).cuda().eval()
    graphed_model = fast(model)
    with torch.inference_mode():
        (placeholder,), _ = graphed_model.static_inputs(torch.randn(4, 16, device="cuda"))
        copies = graphed_model.stats.input_copies
        x = torch.randn(4, 16, device="cuda")
        placeholder.copy_(x)
        torch.testing.assert_close(graphed_model(placeholder), model(x))
        assert graphed_model.stats.input_copies == copies
