"""Copies of column-contiguous weights (GPT-2's Conv1D): built K-contiguous, read by launches of few rows only (one;
up to four for small 16-bit projections), and written again by `refresh` at the start of the prompt pass of every
decode call whose rows read them."""

from __future__ import annotations

import pytest
import torch

from tendril import config, generate
from tendril.generation import decode_step
from tendril.generation.api import decode_loop
from tendril.generation.architectures.fused import FusedStep
from tendril.generation.kernels import Projection, layers
from tendril.generation.loop import Plan
from tendril.generation.processors import LogitsProcessing
from tendril.graphs.module_state import ModuleChangedWarning
from tests.generation.models import tiny_model


def _fused_step(model: torch.nn.Module, max_new_tokens: int = 4) -> FusedStep:
    plan = Plan.build(max_new_tokens=max_new_tokens, processing=LogitsProcessing(), eos=(), pad=0, step="fused")
    step = decode_loop(model, plan).step_forward
    assert isinstance(step, FusedStep)
    return step


def _copies_match(step: FusedStep) -> bool:
    return all(
        torch.equal(w, c)
        for projection in step.copied
        for w, c in zip(projection.weights, projection.copies or (), strict=True)
    )


def test_conv1d_projections_get_k_contiguous_copies_and_linear_ones_none():
    gpt2 = tiny_model("gpt2")
    projection = Projection.of(gpt2.transformer.h[0].attn.c_attn).with_copies()
    (copy,) = projection.copies or ()
    assert copy.stride(1) == 1 and copy.data_ptr() != gpt2.transformer.h[0].attn.c_attn.weight.data_ptr()
    assert torch.equal(copy, projection.weights[0])
    assert projection.copy_rows == 1  # float32: launches of several rows do not take deep tiles
    assert projection.weights_for(1) == (copy,) and projection.weights_for(2) == projection.weights
    half = Projection.of(gpt2.half().transformer.h[0].attn.c_attn).with_copies()
    assert half.copy_rows == layers.FEW_ROWS
    assert half.weights_for(layers.FEW_ROWS) == half.copies and half.weights_for(layers.FEW_ROWS + 1) == half.weights
    linear = Projection.of(tiny_model("llama").model.layers[0].self_attn.q_proj)
    assert linear.with_copies() is linear and linear.weights_for(1) == linear.weights and linear.copy_rows == 0


def test_only_small_16_bit_projections_read_copies_for_several_rows():
    assert layers.deep_rows(2304, 768, 2, 132) == layers.FEW_ROWS  # GPT-2's QKV: 3.5 MB
    assert layers.deep_rows(2304, 768, 2, 16) == 1  # the same on a GPU of 16 SMs: 221 KB per SM
    assert layers.deep_rows(2304, 768, 4, 132) == 1  # float32
    assert layers.deep_rows(3072, 2048, 2, 132) == 1  # Llama-1B's QKV: 12.6 MB


def test_copies_of_another_shape_or_layout_are_refused():
    weight = torch.randn(8, 4).t()
    with pytest.raises(ValueError, match="weight copies"):
        Projection((weight,), (None,), (torch.randn(4, 4),))
    with pytest.raises(ValueError, match="weight copies"):
        Projection((weight,), (None,), (torch.randn(8, 4).t(),))


def test_refresh_copies_every_weight_even_one_written_through_data():
    gpt2 = tiny_model("gpt2")
    module = gpt2.transformer.h[0].mlp.c_fc
    projection = Projection.of(module).with_copies()
    copy = (projection.copies or ())[0]
    copy.fill_(float("nan"))
    projection.refresh(rows=2)  # launches of two float32 rows read the model's layout: nothing to write
    assert copy.isnan().all()
    projection.refresh(rows=1)
    assert torch.equal(copy, projection.weights[0])
    module.weight.data.add_(1)  # `.data` writes move no version counter
    projection.refresh(rows=1)
    assert torch.equal(copy, projection.weights[0])


def test_generate_brings_gpt2_copies_up_to_date_after_an_in_place_update():
    model, source = tiny_model("gpt2"), tiny_model("gpt2", seed=1)
    prompt = torch.tensor([[1, 2, 3]])
    generate(model, prompt, max_new_tokens=4, step="fused", eos_token_id=[], pad_token_id=0)
    step = _fused_step(model)
    assert len(step.copied) == 4 * len(model.transformer.h) and _copies_match(step)
    model.load_state_dict(source.state_dict())  # copies in place: the weights' version counters move
    assert not _copies_match(step)
    out = generate(model, prompt, max_new_tokens=4, step="fused", eos_token_id=[], pad_token_id=0)
    assert _copies_match(step)
    assert torch.equal(out, generate(source, prompt, max_new_tokens=4, step="fused", eos_token_id=[], pad_token_id=0))


def test_decode_step_brings_the_copies_up_to_date_at_restart():
    model, source = tiny_model("gpt2"), tiny_model("gpt2", seed=1)
    prompt = torch.tensor([[1, 2, 3]])
    stepper = decode_step(model, prompt, max_new_tokens=4, step="fused")
    step = _fused_step(model)
    model.load_state_dict(source.state_dict())
    stepper.restart(prompt)
    assert _copies_match(step)


def test_generate_sees_weights_written_through_data():
    model, source = tiny_model("gpt2"), tiny_model("gpt2", seed=1)
    prompt = torch.tensor([[1, 2, 3]])
    generate(model, prompt, max_new_tokens=4, step="fused", eos_token_id=[], pad_token_id=0)
    step = _fused_step(model)
    for weight, new in zip(model.parameters(), source.parameters(), strict=True):
        weight.data.copy_(new.data)
    generate(model, prompt, max_new_tokens=4, step="fused", eos_token_id=[], pad_token_id=0)
    assert _copies_match(step)


def test_only_calls_whose_rows_read_the_copies_write_them():
    model = tiny_model("gpt2")
    options = dict(max_new_tokens=4, step="fused", eos_token_id=[], pad_token_id=0)
    generate(model, torch.tensor([[1, 2, 3]]), **options)
    step = _fused_step(model)
    with torch.inference_mode():  # the copies were built inside `generate`: inference tensors
        for projection in step.copied:
            (projection.copies or ())[0].fill_(float("nan"))
    generate(model, torch.tensor([[1, 2, 3], [4, 5, 6]]), **options)
    generate(model, torch.tensor([[1, 2, 3]]), num_beams=2, **options)
    assert all((p.copies or ())[0].isnan().all() for p in step.copied)  # several rows: not read, not written
    generate(model, torch.tensor([[1, 2, 3]]), **options)
    assert _copies_match(step)
    half = _fused_step(tiny_model("gpt2").half())
    for projection in half.copied:
        projection.copies[0].fill_(float("nan"))  # type: ignore[index]
    half.refresh(layers.FEW_ROWS + 1)
    assert all((p.copies or ())[0].isnan().all() for p in half.copied)
    half.refresh(layers.FEW_ROWS)  # four 16-bit rows (beams) read the copies of small projections
    assert _copies_match(half)


def test_every_decode_loop_of_a_model_shares_one_set_of_copies():
    model = tiny_model("gpt2")
    first, second = _fused_step(model, 4), _fused_step(model, 6)
    assert first is not second and all(a is b for a, b in zip(first.copied, second.copied, strict=True))
    model.half()  # new weight storage: the decode path is built again, with new copies of the new dtype
    with pytest.warns(ModuleChangedWarning, match="moved"):
        cast = _fused_step(model, 5)
    assert all(p.copies is not None and p.copies[0].dtype == torch.float16 for p in cast.copied)
    assert not any(a is b for a, b in zip(first.copied, cast.copied, strict=True))


def test_copies_built_in_inference_mode_refresh_outside_it():
    gpt2 = tiny_model("gpt2")
    with torch.inference_mode():
        projection = Projection.of(gpt2.transformer.h[0].attn.c_attn).with_copies()
    with torch.no_grad():
        gpt2.transformer.h[0].attn.c_attn.weight.mul_(3)
    projection.refresh(rows=1)
    assert torch.equal((projection.copies or ())[0], projection.weights[0])


def test_no_copies_when_switched_off(monkeypatch):
    monkeypatch.setattr(config, "settings", config.Config(weight_copies=False))
    model = tiny_model("gpt2")
    assert _fused_step(model).copied == ()
    prompt = torch.tensor([[1, 2, 3]])
    options = dict(max_new_tokens=4, step="fused", eos_token_id=[], pad_token_id=0)
    assert torch.equal(generate(model, prompt, **options), generate(model, prompt, **{**options, "step": "eager"}))
