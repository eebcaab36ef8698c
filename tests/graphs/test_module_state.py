"""Graphs read module tensors where they were at capture, in the modes the modules were in: `ModuleState` sees
replacements, moves and mode flips (and only those), and a graphed callable drops its graphs and captures again after
one. CPU, through the null backend."""

import gc
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from tendril.config import Config
from tendril.graphs.admission import GraphFallbackWarning
from tendril.graphs.backend import NullBackend
from tendril.graphs.callable import GraphedCallable, graphed
from tendril.graphs.module_state import ModuleChangedWarning, ModuleState


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.1), nn.Linear(8, 2))
    model.register_buffer("offset", torch.zeros(2))
    return model.eval()


def _graphed(model: nn.Module) -> tuple[GraphedCallable, NullBackend]:
    backend = NullBackend()
    return graphed(model, backend=backend, config=Config()), backend


def test_no_change_after_writes_into_the_same_memory():
    model = _model()
    watch = ModuleState([model])
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
        (lambda m: m.__setitem__(1, nn.GELU()), "a submodule was replaced"),
        (lambda m: m.train(), "Sequential switched to training mode"),
        (lambda m: m[1].train(), "1 switched to training mode"),
    ],
    ids=["setattr", "load_state_dict_assign", "submodule", "buffer", "cast", "data_assignment", "stateless_submodule",
         "train", "one_module_train"],
)
def test_replacements_and_moves_are_changes(change, expected):
    model = _model()
    watch = ModuleState([model])
    change(model)
    assert watch.changed() is not None and watch.changed().startswith(expected)
    watch.renew()
    assert watch.changed() is None  # the new tensors and modes are the record
    assert {id(t) for t in watch.tensors} == {id(t) for t in (*model.parameters(), *model.buffers())}


class _LazyScale(nn.Module):
    """Makes its buffer at its first call (lazy initialisation)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if "scale" not in self._buffers:
            self.register_buffer("scale", torch.full((x.shape[-1],), 2.0))
        return x * self.scale


def test_tensors_a_capture_made_are_recorded_with_its_graph():
    model = _LazyScale()
    fast, backend = _graphed(model)
    x = torch.randn(3, 4)
    with torch.no_grad():
        fast(x)
        fast(x)
    assert (backend.captures, fast.stats.module_changes) == (1, 0)


def test_eager_training_calls_between_graphed_evaluations_keep_the_graphs():
    model = _model()
    fast, backend = _graphed(model)
    x = torch.randn(3, 4)
    with torch.no_grad():
        fast(x)
    model.train()
    with pytest.warns(GraphFallbackWarning, match="requires grad"):
        fast(x).sum().backward()
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x))
    assert (backend.captures, fast.stats.module_changes) == (1, 0)


def test_monte_carlo_dropout_is_captured_in_training_mode():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5)).eval()
    fast, _ = _graphed(model)
    x = torch.randn(4, 16)
    with torch.no_grad():
        fast(x)
        assert torch.equal(fast(x), model(x))
        model[1].train()
        with pytest.warns(ModuleChangedWarning, match="1 switched to training mode"):
            first = fast(x).clone()  # graph outputs are overwritten by the next call
        assert not torch.equal(first, fast(x)) and (first == 0).any()


def test_a_check_without_a_change_reads_no_tensor_list(monkeypatch):
    watch = ModuleState([_model()])
    monkeypatch.setattr(watch, "_walk", lambda: pytest.fail("walked the modules without a signal"))
    assert watch.changed() is None


def test_a_whole_model_move_is_seen_where_its_old_memory_lives_on():
    model, source = _model(), _model()
    model.load_state_dict(source.state_dict(), assign=True)  # model's tensors share source's memory
    watch = ModuleState([model])
    model.double()
    assert watch.changed() == "the memory of parameter 0.weight moved"


def test_the_record_keeps_no_replaced_tensor_alive():
    model = _model()
    watch = ModuleState([model])
    old = weakref.ref(model[0].weight)
    model[0].weight = nn.Parameter(torch.randn(8, 4))
    gc.collect()
    assert old() is None and watch.changed() is not None


def test_an_assignment_to_another_module_is_not_seen():
    model, other = _model(), _model()
    watch = ModuleState([model])
    other[0].weight = nn.Parameter(torch.randn(8, 4))
    assert watch.assigned is None and watch.changed() is None


def test_a_graphed_module_captures_again_after_its_weights_change():
    model = _model()
    fast, backend = _graphed(model)
    x = torch.randn(3, 4)
    with torch.no_grad():
        fast(x)
        fast(x)
        assert (backend.captures, fast.stats.module_changes) == (1, 0)
        model.load_state_dict(_model().state_dict(), assign=True)
        with pytest.warns(ModuleChangedWarning, match=r"buffer offset was replaced \(Sequential.offset was assigned\)"):
            out = fast(x)
        torch.testing.assert_close(out, model(x))
        assert (backend.captures, fast.stats.module_changes, backend.forgotten) == (2, 1, 1)  # a fresh pool next
        fast(x)
        assert backend.captures == 2
        model.double()
        with pytest.warns(ModuleChangedWarning, match="moved"):
            fast(x.double())
    assert fast.stats.module_changes == backend.forgotten == 2 and "moved" in fast.stats.module_change_detail
    assert "graphs dropped x2" in fast.stats.table()


def test_a_change_before_any_capture_drops_nothing():
    model = _model()
    fast, _ = _graphed(model)
    with torch.no_grad():
        model.double()
        fast(torch.randn(3, 4, dtype=torch.float64))
        model.float()  # renewed at the first call, so this is a change with a graph captured
        with pytest.warns(ModuleChangedWarning):
            fast(torch.randn(3, 4))
    assert fast.stats.module_changes == 1


def test_requires_grad_of_a_replaced_parameter_is_seen():
    model = _model().requires_grad_(False)
    fast, _ = _graphed(model)
    x = torch.randn(3, 4)
    fast(x)
    model[0].weight = nn.Parameter(torch.randn(8, 4))  # requires grad
    with pytest.warns(UserWarning):
        out = fast(x)
    assert out.grad_fn is not None


def _param(model: nn.Module) -> nn.Parameter:
    return model[2].weight


UNCHANGING = {
    "write_in_place": lambda m: _param(m).detach().mul_(2),
    "write_through_data": lambda m: _param(m).data.add_(1),
    "assign_the_same_tensor": lambda m: setattr(m[2], "weight", _param(m)),
    "set_the_same_mode": lambda m: m[1].train(m[1].training),
}
CHANGING = {
    "assign_a_parameter": lambda m: setattr(m[2], "weight", nn.Parameter(torch.randn_like(_param(m)))),
    "swap_data": lambda m: setattr(_param(m), "data", torch.randn_like(_param(m))),
    "load_assigning": lambda m: m.load_state_dict({k: v.clone() for k, v in m.state_dict().items()}, assign=True),
    "cast": lambda m: m.to(torch.float64 if _param(m).dtype == torch.float32 else torch.float32),
    "flip_the_mode": lambda m: m.train(not m.training),
    "flip_a_dropout": lambda m: m[1].train(not m[1].training),
    "swap_a_submodule": lambda m: m.__setitem__(0, nn.Linear(4, 8, dtype=_param(m).dtype)),
    "assign_keeping_the_old": lambda m: _KEPT.append(_param(m)) or CHANGING["assign_a_parameter"](m),
    "swap_keeping_the_old": lambda m: _KEPT.append(m[0]) or CHANGING["swap_a_submodule"](m),
}
_KEPT: list[object] = []
"""What the `*_keeping_the_old` operations hold alive, as user code holding a reference would."""


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(sorted([*UNCHANGING, *CHANGING])), min_size=1, max_size=12))
def test_every_change_in_a_random_sequence_is_seen_and_nothing_else(operations):
    model = _model()
    watch = ModuleState([model])
    for operation in operations:
        (UNCHANGING | CHANGING)[operation](model)  # freed at once by reference counting: no collection needed
        change = watch.changed()
        assert (change is not None) == (operation in CHANGING), (operation, change)
        watch.renew()
    _KEPT.clear()
