"""`tendril.generation.decode_step`: the loop body `generate` runs, stepped one token at a time from fixed buffers,
outside inference mode as a profiling loop calls it; `reset` and `restart` give the state after the prompt pass."""

from __future__ import annotations

import pytest
import torch

from tendril.generation import decode_step, generate
from tendril.generation.api import release_graphs
from tests.generation.models import left_padded, tiny_model

NEW = 6


def _prompt(seed: int) -> torch.Tensor:
    return torch.randint(4, 96, (1, 5), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("step", ["eager", "fused"])
def test_decode_step_steps_and_resets_like_generate(step):
    model = tiny_model("gpt2")
    prompt = _prompt(3)
    expected = generate(model, prompt, max_new_tokens=NEW, eos_token_id=[], pad_token_id=0, step=step)
    state = decode_step(model, prompt, max_new_tokens=NEW, step=step)
    assert torch.is_inference(state.buffers[0]) and not torch.is_inference_mode_enabled()
    for _ in range(2):  # the second round starts from `reset`, which must undo the first round's steps
        for _ in range(NEW - 1):  # the state after prefill holds the first token: NEW - 1 steps remain
            state.step()
        step_count, sequences, unfinished, running = state.buffers
        assert int(step_count) == NEW and bool(unfinished.all()) and not bool(running)
        assert torch.equal(sequences, expected)
        state.reset()
        for buffer, start in zip(state.buffers, state.start, strict=True):
            assert torch.equal(buffer, start) and buffer.data_ptr() != start.data_ptr()
    release_graphs(model)


def test_restart_runs_the_prompt_pass_of_another_prompt_for_beams():
    model = tiny_model("gpt2")
    first, second = _prompt(3), _prompt(4)
    state = decode_step(model, first, max_new_tokens=NEW, num_beams=3)
    fresh = decode_step(model, second, max_new_tokens=NEW, num_beams=3)
    state.step()
    state.restart(second)
    assert all(torch.equal(a, b) for a, b in zip(state.buffers, fresh.start, strict=True))
    for _ in range(NEW - 1):
        state.step()
        fresh.step()
    assert all(torch.equal(a, b) for a, b in zip(state.buffers, fresh.buffers, strict=True))


def test_decode_step_refuses_an_unknown_step():
    with pytest.raises(ValueError, match="step must be one of"):
        decode_step(tiny_model("gpt2"), _prompt(3), max_new_tokens=NEW, step="inductor")


@pytest.mark.parametrize(
    ("prompt", "options", "named"),
    [
        ("ids", dict(max_new_tokens=0), "max_new_tokens must be an int >= 1"),
        ("ids", dict(max_new_tokens=4, num_beams=0), "num_beams must be >= 1"),
        ("ids", dict(max_new_tokens=4, num_beams=2.0), "num_beams must be an integer"),
        ("outside", dict(max_new_tokens=4), "the model's vocabulary"),
        ("ids", dict(max_new_tokens=1000), "exceeds the model's 128 positions"),
    ],
)
def test_decode_step_checks_its_prompt_and_options_as_generate_does(prompt, options, named):
    """Ids outside the vocabulary would index the embedding (on CUDA a device-side assert that ends the context), and a
    cache past the model's positions would read position embeddings that do not exist."""
    model = tiny_model("gpt2")
    ids, _ = left_padded([5])
    with pytest.raises(ValueError, match=named):
        decode_step(model, ids + 1000 if prompt == "outside" else ids, **options)
