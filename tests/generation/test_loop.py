"""The loop bodies are capturable in form: run under predication (bounded unrolling with device predicates,
the fallback lowering of `while_loop` inside a graph), they give exactly the eager results, even though the
body is then also evaluated on finished states."""

from __future__ import annotations

import pytest
import torch

from tendril.generation.architectures import decoder_for
from tendril.generation.beam import BeamSearch, beam_result
from tendril.generation.greedy import TokenSearch, greedy_result
from tendril.generation.loop import DecodeLoop, Plan
from tendril.generation.noise import draw_key
from tendril.generation.processors import LogitsProcessing
from tendril.generation.state import Decoder
from tendril.graphs.control import while_loop
from tests.generation.models import hf_generate, left_padded

NEW = 8


def _decoder(model, ids, mask, eos: list[int], processing: LogitsProcessing) -> Decoder:
    return Decoder.build(decoder_for(model), ids, mask, NEW, processing, torch.tensor(eos, dtype=torch.long),
                         draw_key(torch.device("cpu"), 0), torch.float32)


def _run(search, decoder, lowering: str) -> tuple[torch.Tensor, ...]:
    with torch.inference_mode():
        start = search.start(decoder.prefill())
        return while_loop(search.cond, search.body, start, max_iterations=NEW, lowering=lowering)


@pytest.mark.parametrize("sample", [False, True])
def test_greedy_and_sampling_bodies_are_predication_safe(gpt2, sample):
    ids, mask = left_padded([5, 2, 4])
    eos = int(hf_generate(gpt2, ids, mask, None, max_new_tokens=NEW)[1, ids.shape[1] + 2])
    processing = LogitsProcessing(do_sample=sample, repetition_penalty=1.2)
    results = []
    for lowering in ("auto", "predication"):
        decoder = _decoder(gpt2, ids, mask, [eos], processing)
        results.append(greedy_result(_run(TokenSearch(decoder, 0), decoder, lowering), ids.shape[1]))
    assert torch.equal(results[0], results[1])


@pytest.mark.parametrize("early_stopping", [True, False])
def test_beam_body_is_predication_safe(gpt2, early_stopping):
    ids, mask = left_padded([5, 3])
    eos = int(hf_generate(gpt2, ids, mask, None, max_new_tokens=NEW)[0, ids.shape[1] + 1])
    prompt, beam_mask = ids.repeat_interleave(3, 0), mask.repeat_interleave(3, 0)
    results = []
    for lowering in ("auto", "predication"):
        decoder = _decoder(gpt2, prompt, beam_mask, [eos], LogitsProcessing(min_tokens_to_keep=2))
        search = BeamSearch(decoder, 2, 3, 1.0, early_stopping, 0)
        results.append(beam_result(_run(search, decoder, lowering), 2, ids.shape[1], 2))
    assert torch.equal(results[0], results[1])
    expected = hf_generate(gpt2, ids, mask, eos, max_new_tokens=NEW, num_beams=3, num_return_sequences=2,
                           early_stopping=early_stopping)
    assert torch.equal(results[0], expected)


def test_decode_loop_is_a_function_of_its_tensor_inputs(gpt2):
    """What `tendril.graphed` captures: (prompt, mask, key) -> final state, with no state kept between calls."""
    plan = Plan(max_new_tokens=NEW, processing=LogitsProcessing(), eos=(), pad_token_id=0, beam_fill_token_id=0,
                num_beams=1, length_penalty=1.0, early_stopping=False)
    loop = DecodeLoop(gpt2, decoder_for(gpt2), plan)
    key = draw_key(torch.device("cpu"), 0)
    a_ids, a_mask = left_padded([4, 2], seed=1)
    b_ids, b_mask = left_padded([3, 4], seed=2)
    with torch.inference_mode():
        first = loop(a_ids, a_mask, key)
        loop(b_ids, b_mask, key)
        again = loop(a_ids, a_mask, key)
    assert all(torch.equal(x, y) for x, y in zip(first, again, strict=True))
