"""Magnitude pruning: exact per-layer densities, presets, and clear errors."""

import pytest
import torch

from tendril.sparse import DEEP_COMPRESSION, prune
from tests.sparse.models import alexnet_like, vgg_like


def test_uniform_density_keeps_the_largest_magnitudes():
    model = vgg_like()
    before = {n: m.weight.detach().clone() for n, m in model.named_modules() if hasattr(m, "weight")}
    report = prune(model, 0.25)
    assert len(report) == 9
    for layer in report:
        w = dict(model.named_modules())[layer.name].weight
        assert abs(layer.density - 0.25) < 1.0 / w.numel() + 1e-9
        kept = before[layer.name].abs()[w != 0]
        dropped = before[layer.name].abs()[w == 0]
        assert kept.min() >= dropped.max()


def test_alexnet_preset_matches_deep_compression_layer_by_layer():
    model = alexnet_like()
    report = prune(model, "alexnet")
    assert [r.target for r in report] == list(DEEP_COMPRESSION["alexnet"])
    assert [r.kind for r in report] == ["conv"] * 5 + ["linear"] * 3
    for r in report:
        assert abs(r.density - r.target) < 0.01


def test_mapping_prunes_only_the_named_layers():
    model = vgg_like()
    report = prune(model, {"features.0": 0.5})
    assert [r.name for r in report] == ["features.0"]
    assert bool((model.features[2].weight != 0).all())


def test_bad_densities_name_the_problem():
    with pytest.raises(ValueError, match="preset"):
        prune(vgg_like(), "resnet")
    with pytest.raises(ValueError, match="16 densities given for 9"):
        prune(vgg_like(), "vgg16")
    with pytest.raises(ValueError, match="no Conv2d or Linear layer named"):
        prune(vgg_like(), {"nope": 0.5})
    with pytest.raises(ValueError, match="not in"):
        prune(vgg_like(), 1.5)


def test_a_bad_density_for_a_later_layer_leaves_every_layer_untouched():
    model = vgg_like()
    before = [w.detach().clone() for w in model.parameters()]
    with pytest.raises(ValueError, match=r"density 2\.0 is not in"):
        prune(model, [0.5] * 8 + [2.0])
    assert all(torch.equal(w, b) for w, b in zip(model.parameters(), before, strict=True))


def test_density_zero_and_one():
    model = vgg_like()
    prune(model, {"features.0": 0.0, "features.2": 1.0})
    assert not bool(model.features[0].weight.any())
    assert bool((model.features[2].weight != 0).all())
    assert torch.isfinite(model.features[0].weight).all()
