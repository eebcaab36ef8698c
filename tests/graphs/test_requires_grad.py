"""Calls in grad mode keep autograd: a graphed callable whose arguments, or whose own parameters or buffers,
require grad runs eagerly (`Fallback.REQUIRES_GRAD`, warned once) and its outputs backpropagate as eager ones do;
under `torch.no_grad()`/`inference_mode()` the same calls graph. CPU, through the null backend."""

import functools

import pytest
import torch
from torch import nn

from tendril.config import Config
from tendril.graphs.admission import GraphFallbackWarning
from tendril.graphs.backend import NullBackend
from tendril.graphs.callable import graphed
from tendril.graphs.stats import Fallback
from tendril.graphs.trainable import modules_of

GLOBAL_MODEL = nn.Linear(4, 3)


def through_global_model(x: torch.Tensor) -> torch.Tensor:
    return GLOBAL_MODEL(x).relu()


def make(fn):
    backend = NullBackend()
    return graphed(fn, backend=backend, config=Config()), backend


def eager_and_graphed_grads(model: nn.Module, fn, x: torch.Tensor):
    """Gradients of the parameters after backward through `fn(x)` called eagerly, then through graphed `fn`."""
    fn(x).square().sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    fast, backend = make(fn)
    with pytest.warns(GraphFallbackWarning, match="requires_grad|requires grad"):
        out = fast(x)
    assert out.grad_fn is not None
    out.square().sum().backward()
    return expected, [p.grad for p in model.parameters()], fast, backend


def test_a_module_with_trainable_parameters_on_plain_inputs_runs_eagerly_with_autograd():
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    expected, got, fast, backend = eager_and_graphed_grads(model, model, x)
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(g, e)
    assert fast.stats.fallbacks[Fallback.REQUIRES_GRAD] == 1
    assert backend.captures == 0 and fast.stats.replays == 0


@pytest.mark.parametrize(
    "wrap",
    [
        pytest.param(lambda model: (lambda x: model(x) * 2), id="closure"),
        pytest.param(lambda model: model.forward, id="bound-method"),
        pytest.param(lambda model: functools.partial(lambda m, x: m(x) * 2, model), id="partial"),
        pytest.param(lambda model: (lambda x, m=model: m(x)), id="default-argument"),
    ],
)
def test_functions_reaching_a_trainable_module_run_eagerly_with_the_eager_gradients(wrap):
    model = nn.Linear(4, 3)
    x = torch.randn(5, 4)
    fn = wrap(model)
    expected, got, fast, _ = eager_and_graphed_grads(model, fn, x)
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(g, e)
    assert fast.stats.fallbacks[Fallback.REQUIRES_GRAD] == 1


def test_a_function_naming_a_global_module_is_seen():
    assert modules_of(through_global_model) == [GLOBAL_MODEL]
    fast, backend = make(through_global_model)
    with pytest.warns(GraphFallbackWarning):
        out = fast(torch.randn(2, 4))
    assert out.requires_grad and backend.captures == 0


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
def test_the_same_calls_graph_without_grad_mode(context):
    model = nn.Linear(4, 3)
    fast, backend = make(lambda x: model(x).relu())
    with context():
        for _ in range(3):
            x = torch.randn(2, 4)
            torch.testing.assert_close(fast(x), model(x).relu())
    assert backend.captures == 1 and fast.stats.replays == 3
    assert Fallback.REQUIRES_GRAD not in fast.stats.fallbacks


def test_frozen_parameters_graph_in_grad_mode_and_unfreezing_is_seen_at_the_next_call():
    model = nn.Linear(4, 3).requires_grad_(False)
    fast, backend = make(model)
    x = torch.randn(2, 4)
    torch.testing.assert_close(fast(x), model(x))
    assert backend.captures == 1 and fast.stats.eager_calls == 0
    model.weight.requires_grad_(True)
    with pytest.warns(GraphFallbackWarning):
        out = fast(x)
    assert out.grad_fn is not None and fast.stats.fallbacks[Fallback.REQUIRES_GRAD] == 1


def test_a_buffer_requiring_grad_counts_and_the_warning_is_issued_once():
    model = nn.Linear(4, 3).requires_grad_(False)
    model.register_buffer("offset", torch.zeros(3, requires_grad=True))
    fast, _ = make(lambda x: model(x) + model.offset)
    with pytest.warns(GraphFallbackWarning) as record:
        fast(torch.randn(2, 4))
        fast(torch.randn(2, 4))
    assert len(record) == 1 and fast.stats.fallbacks[Fallback.REQUIRES_GRAD] == 2


def test_an_argument_requiring_grad_still_runs_eagerly():
    fast, backend = make(lambda x: x.tanh())
    x = torch.randn(3, requires_grad=True)
    with pytest.warns(GraphFallbackWarning):
        fast(x).sum().backward()
    torch.testing.assert_close(x.grad, 1 - x.detach().tanh() ** 2)
    assert backend.captures == 0


@pytest.mark.gpu
def test_on_the_gpu_trainable_modules_keep_autograd_and_inference_calls_graph():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)).cuda()
    fast = graphed(model, config=Config())
    x = torch.randn(4, 16, device="cuda")
    model(x).square().sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    with pytest.warns(GraphFallbackWarning):
        fast(x).square().sum().backward()
    for e, p in zip(expected, model.parameters(), strict=True):
        torch.testing.assert_close(p.grad, e)
    assert fast.stats.fallbacks[Fallback.REQUIRES_GRAD] == 1 and fast.stats.captures == 0
    with torch.inference_mode():
        for _ in range(3):
            x = torch.randn(4, 16, device="cuda")
            torch.testing.assert_close(fast(x), model(x))
    assert fast.stats.captures == 1 and fast.stats.replays == 3
