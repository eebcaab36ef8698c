"""LayerDrop on the device (`tendril.graphs.training.layerdrop`): layers are kept with probability `1 - p` in training,
a dropped layer passes its input through and gets zero gradients, evaluation is untouched, names and the model's
config stay as they were, and `graphed_step` warns of a model that still draws LayerDrop on the host."""

from __future__ import annotations

import math
import warnings
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import tendril
from tendril.config import Config
from tendril.graphs.backend import NullBackend
from tendril.graphs.training import HostLayerDropWarning, host_layerdrop, layerdrop_on_device

WIDTH = 8


class ConfigEncoder(nn.Module):
    """LayerDrop as HF's Wav2Vec2 encoder decides it: a host draw per layer against `config.layerdrop`."""

    def __init__(self, config: SimpleNamespace, layers: int = 4) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(layers))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            skip = self.training and torch.rand([]) < self.config.layerdrop
            if not skip:
                hidden = layer(hidden)
        return hidden


class TupleLinear(nn.Linear):
    """A layer that returns a tuple, as HF's encoder layers may (hidden states first)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return super().forward(x), None


class AttributeEncoder(nn.Module):
    """LayerDrop as HF's BART encoder decides it: against the module's own `layerdrop`; its layers return tuples."""

    def __init__(self, p: float, layers: int = 4) -> None:
        super().__init__()
        self.layerdrop = p
        self.layers = nn.ModuleList(TupleLinear(WIDTH, WIDTH) for _ in range(layers))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.training and torch.rand([]) < self.layerdrop:
                continue
            hidden = layer(hidden)[0]
        return hidden


class Model(nn.Module):
    def __init__(self, p: float = 0.5, attribute: bool = False) -> None:
        super().__init__()
        self.config = SimpleNamespace(layerdrop=p)
        self.encoder = AttributeEncoder(p) if attribute else ConfigEncoder(self.config)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x)).sum()


def kept_layers(model: Model) -> list[bool]:
    """Which encoder layers the last backward reached (a dropped layer's gradients are zero)."""
    return [bool(layer.weight.grad.abs().sum() > 0) for layer in model.encoder.layers]


@pytest.mark.parametrize("attribute", [False, True], ids=["config", "attribute"])
def test_layers_are_kept_with_probability_one_minus_p_and_dropped_ones_pass_through(attribute):
    torch.manual_seed(0)
    model = Model(0.3, attribute)
    names = [name for name, _ in model.named_parameters()]
    moved = layerdrop_on_device(model)
    assert moved.probabilities == {"encoder": 0.3} and moved.layers == 4 and host_layerdrop(model) == []
    assert [name for name, _ in model.named_parameters()] == names
    calls, kept_total = 300, 0
    x = torch.randn(3, WIDTH)
    for _ in range(calls):
        model.zero_grad(set_to_none=False)
        loss = model(x)
        loss.backward()
        kept = kept_layers(model)
        kept_total += sum(kept)
        expected = x
        for layer, keep in zip(model.encoder.layers, kept, strict=True):
            out = layer.forward(expected) if keep else expected  # forward itself: no hook, no draw
            expected = out[0] if isinstance(out, tuple) else out
        torch.testing.assert_close(loss, model.head(expected).sum(), rtol=0, atol=0)
    draws = calls * len(model.encoder.layers)
    sigma = math.sqrt(draws * 0.3 * 0.7)
    assert abs(kept_total - 0.7 * draws) < 4 * sigma, kept_total


def test_evaluation_runs_every_layer_and_draws_nothing():
    torch.manual_seed(0)
    model = Model(0.5).eval()
    x = torch.randn(2, WIDTH)
    before = model(x)
    layerdrop_on_device(model)
    state = torch.get_rng_state()
    torch.testing.assert_close(model(x), before, rtol=0, atol=0)
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("attribute", [False, True], ids=["config", "attribute"])
def test_the_model_config_keeps_its_probability_and_remove_restores_the_host_draws(attribute):
    model = Model(0.25, attribute)
    moved = layerdrop_on_device(model)
    assert model.config.layerdrop == 0.25  # the model's own config (what a checkpoint saves) is untouched
    assert layerdrop_on_device(model).layers == 0  # idempotent: nothing left on the host
    moved.remove()
    assert host_layerdrop(model) == ["encoder"] and moved.layers == 0
    assert all(not layer._forward_hooks for layer in model.encoder.layers)


def test_a_layer_that_changes_the_shape_cannot_be_dropped():
    model = Model(0.5)
    model.encoder.layers[1] = nn.Linear(WIDTH, 2 * WIDTH)
    layerdrop_on_device(model)
    with pytest.raises(ValueError, match="keep the shape"):
        model(torch.randn(2, WIDTH))


def test_hf_wav2vec2_draws_layerdrop_on_the_device():
    pytest.importorskip("transformers")
    from benchmarks.hf_training_steps import wav2vec2_model

    model = wav2vec2_model(device="cpu")
    model.config.layerdrop = 0.5
    assert host_layerdrop(model) == ["wav2vec2.encoder"]
    names = list(model.state_dict())
    moved = layerdrop_on_device(model)
    assert moved.layers == model.config.num_hidden_layers and model.config.layerdrop == 0.5
    assert list(model.state_dict()) == names
    torch.manual_seed(0)
    audio = torch.randn(2, 4000)
    with torch.no_grad():
        losses = {float(model(audio).logits.sum()) for _ in range(12)}
    assert len(losses) > 1  # layers dropped differently from call to call


def test_graphed_step_warns_of_layerdrop_drawn_on_the_host():
    model = Model(0.5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=False, capturable=True)

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = model(x)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        return loss.detach()

    with pytest.warns(HostLayerDropWarning, match="layerdrop_on_device"):
        graphed = tendril.graphed_step(step, model=model, optimizer=optimizer, backend=NullBackend(), config=Config())
    assert graphed.stats.host_layerdrop == ["encoder"]
    layerdrop_on_device(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", HostLayerDropWarning)
        again = tendril.graphed_step(step, model=model, optimizer=optimizer, backend=NullBackend(), config=Config())
    assert again.stats.host_layerdrop == []
