"""Graphs read module tensors where they were at capture: `ModuleTensors` sees replacements and moves (and only
those), and a graphed callable drops its graphs and captures again after one. CPU, through the null backend."""

import pytest
import torch
from torch import nn

from tendril.config import Config
from tendril.graphs.backend import NullBackend
from tendril.graphs.callable import graphed
from tendril.graphs.weights import GraphWeightsWarning, ModuleTensors


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model.register_buffer("offset", torch.zeros(2))
    return model


def test_no_change_after_writes_into_the_same_memory():
    model = _model()
    watch = ModuleTensors([model])
    assert len(watch.tensors) == 5
    with torch.no_grad():
        model[0].weight.mul_(2)
    model[2].bias.data.add_(1)
    model[0].weight.data.copy_(torch.randn(8, 4))
    model[2].weight = model[2].weight  # assigned again, the same tensor
    assert watch.changed() is None


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda m: setattr(m[0], "weight", nn.Parameter(torch.randn(8, 4))), "parameter 0.weight was replaced"),
        (lambda m: m.load_state_dict(_model().state_dict(), assign=True), "buffer offset was replaced"),
        (lambda m: m.__setitem__(2, nn.Linear(8, 2)), "parameter 2.weight was replaced"),
        (lambda m: setattr(m, "offset", torch.ones(2)), "buffer offset was replaced"),
        (lambda m: m.double(), "the memory of parameter 0.weight moved"),
        (lambda m: setattr(m[2].bias, "data", torch.zeros(2)), "the memory of parameter 2.bias moved"),
    ],
    ids=["setattr", "load_state_dict_assign", "submodule", "buffer", "cast", "data_assignment"],
)
def test_replacements_and_moves_are_changes(change, expected):
    model = _model()
    watch = ModuleTensors([model])
    change(model)
    assert watch.changed() is not None and watch.changed().startswith(expected)
    assert watch.update() is not None and watch.changed() is None  # renewed: the new tensors are the record
    assert {id(t) for t in watch.tensors} == {id(t) for t in (*model.parameters(), *model.buffers())}


def test_an_assignment_to_another_module_is_not_seen():
    model, other = _model(), _model()
    watch = ModuleTensors([model])
    other[0].weight = nn.Parameter(torch.randn(8, 4))
    assert watch.assigned is None and watch.changed() is None


def test_a_graphed_module_captures_again_after_its_weights_change():
    model = _model()
    backend = NullBackend()
    fast = graphed(model, backend=backend, config=Config())
    x = torch.randn(3, 4)
    with torch.no_grad():
        fast(x)
        fast(x)
        assert (backend.captures, fast.stats.weight_changes) == (1, 0)
        model.load_state_dict(_model().state_dict(), assign=True)
        with pytest.warns(GraphWeightsWarning, match=r"buffer offset was replaced \(Sequential.offset was assigned\)"):
            out = fast(x)
        torch.testing.assert_close(out, model(x))
        assert (backend.captures, fast.stats.weight_changes) == (2, 1)
        fast(x)
        assert backend.captures == 2
        model.double()
        with pytest.warns(GraphWeightsWarning, match="moved"):
            fast(x.double())
    assert fast.stats.weight_changes == 2 and "moved" in fast.stats.weight_change_detail
    assert "graphs dropped x2" in fast.stats.table()


def test_a_change_before_any_capture_drops_nothing():
    model = _model()
    backend = NullBackend()
    fast = graphed(model, backend=backend, config=Config())
    with torch.no_grad():
        model.double()
        fast(torch.randn(3, 4, dtype=torch.float64))
        model.float()  # renewed at the first call, so this is a change with a graph captured
        with pytest.warns(GraphWeightsWarning):
            fast(torch.randn(3, 4))
    assert fast.stats.weight_changes == 1


def test_requires_grad_of_a_replaced_parameter_is_seen():
    model = _model().requires_grad_(False)
    fast = graphed(model, backend=NullBackend(), config=Config())
    x = torch.randn(3, 4)
    fast(x)
    model[0].weight = nn.Parameter(torch.randn(8, 4))  # requires grad
    with pytest.warns(UserWarning):
        out = fast(x)
    assert out.grad_fn is not None
