"""The `generation-streaming` benchmark case: registered for the GPU, and its CPU-runnable parts (the stamping
streamer, the interleaved timing, the step choice) working on a tiny model; its clock mapping needs a GPU."""

from __future__ import annotations

import pytest
import torch

from benchmarks.cases import decode_models
from benchmarks.cases import generation_streaming as case
from benchmarks.registry import CASES, Context

CPU = torch.device("cpu")


def test_case_is_registered_for_the_gpu():
    assert CASES["generation-streaming"].needs_gpu


def test_plain_and_streamed_calls_agree_and_are_timed_interleaved():
    model = decode_models.tiny_gpt2(CPU, torch.float32)
    ctx = Context(device=CPU, quick=True)
    prompt = torch.randint(0, 1024, (1, 5), generator=torch.Generator().manual_seed(0))
    step = decode_models.fastest_step(ctx, "tiny", model, prompt)
    assert step == "fused" and not ctx.notes
    plain, streamed = case.calls(model, step, new_tokens=6)
    streamer = case.StampingStreamer()
    out = streamed(prompt, streamer)
    assert torch.equal(out, plain(prompt)) and streamer.ended
    assert streamer.tokens[1:] == out[0, 5:].tolist() and len(streamer.arrivals) == 7
    assert streamer.arrivals == sorted(streamer.arrivals)
    without, with_streamer = case.overhead(plain, streamed, [prompt], reps=2)
    assert len(without) == len(with_streamer) == 2 and min(without + with_streamer) > 0


def test_fastest_step_reports_the_steps_that_do_not_run(monkeypatch):
    model = decode_models.tiny_gpt2(CPU, torch.float32)
    ctx = Context(device=CPU, quick=True)
    monkeypatch.setattr(decode_models, "STEP_PREFERENCE", ("unknown", "eager"))
    assert decode_models.fastest_step(ctx, "tiny", model, torch.ones(1, 3, dtype=torch.long)) == "eager"
    assert ctx.notes[0].startswith("tiny: step='unknown' does not run: ValueError")
    monkeypatch.setattr(decode_models, "STEP_PREFERENCE", ("unknown",))
    with pytest.raises(RuntimeError, match="no tendril step"):
        decode_models.fastest_step(ctx, "tiny", model, torch.ones(1, 3, dtype=torch.long))


def test_tiny_llama_has_the_1b_structure():
    model = decode_models.tiny_llama(CPU, torch.float32)
    config = model.config
    assert config.tie_word_embeddings and config.num_key_value_heads < config.num_attention_heads
    assert model.lm_head.weight is model.get_input_embeddings().weight


@pytest.mark.gpu
def test_device_clock_maps_the_rings_stamps_onto_the_host_clock():
    cuda = torch.device("cuda")
    clock = case.DeviceClock(cuda)
    (first, offset, uncertainty), (later, offset_again, _) = clock.offset(), clock.offset()
    assert first < later and uncertainty < 100e3  # ns
    assert abs(offset_again - offset) < 100e3
    model = decode_models.tiny_gpt2(cuda, torch.float16)
    prompts = [torch.randint(0, 1024, (1, 8), device=cuda)]
    _, streamed = case.calls(model, "fused", new_tokens=32)
    streamed(prompts[0], case.StampingStreamer())  # capture
    result = case.delivery(model, streamed, prompts, reps=2, clock=clock)
    assert len(result.latencies_us) == 64 and result.uncertainty_us < 100
    assert min(result.latencies_us) > -result.uncertainty_us - 5 and max(result.latencies_us) < 1e6
    assert min(result.first_visible_ms) > 0 and max(result.first_visible_ms) <= max(result.call_ms)
