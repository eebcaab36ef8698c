"""The HF training steps written for graphs (`benchmarks.hf_training_steps`) make no host sync in HF's code or
their own, found on the CPU by `find_host_syncs` (a value read there is a sync once the same code runs on CUDA).

transformers skips its host-side mask checks while a CUDA stream captures (`is_tracing`); the tests make it believe
so, as it will inside tendril's capture."""

from __future__ import annotations

import pytest
import torch

import tendril
from benchmarks import hf_training_steps as hf
from tendril.config import Config
from tendril.graphs.backend import NullBackend
from tests.graphs.training.loops import assert_identical, padded, state_of, twins

pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def capturing(monkeypatch):
    from transformers.utils import import_utils

    monkeypatch.setattr(import_utils, "is_cuda_stream_capturing", lambda: True)


def syncs_outside_the_optimizer(step, batch):
    """The host syncs of one step, less the CPU optimizer's step counter (a capturable optimizer keeps it on the
    device)."""
    report = tendril.find_host_syncs(step, *batch)
    return [sync for sync in report.syncs if "torch/optim/" not in sync.via]


def test_the_wav2vec2_ctc_step_reads_nothing_on_the_host():
    model = hf.wav2vec2_model(tiny=True, device="cpu")
    step = hf.wav2vec2_step(model, torch.optim.AdamW(model.parameters()))
    batch = hf.wav2vec2_batch(6000, 2, 8, 32, torch.Generator().manual_seed(0), device="cpu")
    assert syncs_outside_the_optimizer(step, batch) == []


def test_the_gpt2_lm_step_reads_nothing_on_the_host():
    model = hf.gpt2_model(device="cpu")
    step = hf.gpt2_step(model, torch.optim.AdamW(model.parameters()))
    batch = hf.gpt2_batch(16, 2, 1000, torch.Generator().manual_seed(0), device="cpu")
    assert syncs_outside_the_optimizer(step, batch) == []


def test_hf_s_own_wav2vec2_loss_with_a_mask_does_sync():
    """The check is not blind: HF's loss from `labels`, with the attention mask, reads values on the host."""
    model = hf.wav2vec2_model(tiny=True, device="cpu")
    step = hf.wav2vec2_hf_loss_step(model, torch.optim.AdamW(model.parameters()))
    batch = hf.wav2vec2_batch(6000, 2, 8, 32, torch.Generator().manual_seed(0), device="cpu")
    places = [sync.where for sync in syncs_outside_the_optimizer(step, batch)]
    assert any("transformers" in place for place in places), places


def test_the_graphed_wav2vec2_ctc_step_equals_the_eager_one_through_the_null_backend():
    """Every replay's capture ran the step on the call's own values: the labels index the log-probabilities."""
    generator = torch.Generator().manual_seed(0)
    data = [hf.wav2vec2_batch(n, 2, 8, 32, generator, device="cpu") for n in [4000, 8000, 6000, 8000, 3000] * 4]
    buckets = hf.wav2vec2_buckets((4000, 8000))
    model, reference = twins(lambda: hf.wav2vec2_model(tiny=True, device="cpu"))
    optimizer, reference_optimizer = (
        torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True, capturable=True) for m in (model, reference)
    )
    eager = hf.wav2vec2_step(reference, reference_optimizer)
    for batch in padded(data, buckets, ("audio", "mask", "labels")):
        eager(*batch)
    step = tendril.graphed_step(
        hf.wav2vec2_step(model, optimizer), model=model, optimizer=optimizer, buckets=buckets, config=Config(),
        backend=NullBackend(),
    )  # fmt: skip
    for batch in data:
        step(*batch)
    assert step.stats.replays >= 10 and step.stats.eager_calls == 0, step.stats.table()
    assert_identical(state_of(model, optimizer), state_of(reference, reference_optimizer))


def test_the_comparisons_leave_out_exactly_the_key_biases_and_their_optimizer_state():
    model = hf.gpt2_model(device="cpu")
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 4, dtype=torch.long), labels=torch.zeros(1, 4, dtype=torch.long)).loss.backward()
    optimizer.step()
    bias = model.transformer.h[0].attn.c_attn.bias
    width = bias.numel() // 3
    compared = state_of(model, optimizer)
    for name in ("param transformer.h.0.attn.c_attn.bias", "state transformer.h.0.attn.c_attn.bias exp_avg_sq"):
        assert compared[name].numel() == 2 * width
    with torch.no_grad():
        bias[width : 2 * width] += 1.0  # the key third: left out
    assert_identical(state_of(model, optimizer), compared)
    with torch.no_grad():
        bias[2 * width] += 1.0  # the value third: compared
    assert not torch.equal(state_of(model, optimizer)["param transformer.h.0.attn.c_attn.bias"],
                           compared["param transformer.h.0.attn.c_attn.bias"])
    assert state_of(model, optimizer)["state transformer.h.0.attn.c_attn.bias step"].dim() == 0

    wav2vec2 = hf.wav2vec2_model(tiny=True, device="cpu")
    names = state_of(wav2vec2, torch.optim.AdamW(wav2vec2.parameters()))
    assert not any("k_proj.bias" in name for name in names) and any("q_proj.bias" in name for name in names)
