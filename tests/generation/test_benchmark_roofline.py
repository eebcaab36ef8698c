"""The `decode-roofline` benchmark case: registered for the GPU, targets named as the issue says, the bytes a step
must read, the model and step choice from the environment, and the whole quick case on the CPU (GPT-2 only)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.cases import decode_models
from benchmarks.cases import decode_roofline as case
from benchmarks.registry import CASES, Context

CPU = torch.device("cpu")


def test_case_is_registered_for_the_gpu():
    assert CASES["decode-roofline"].needs_gpu


def test_step_bytes_count_the_head_once_and_leave_out_embedding_tables():
    gpt2 = decode_models.tiny_gpt2(CPU, torch.float16)  # tied head; a position table that is left out
    every = sum(p.numel() for p in gpt2.parameters())
    positions = gpt2.transformer.wpe.weight.numel()
    needed = case.step_bytes(gpt2, prompt_len=16, new_tokens=129)
    assert needed.weights == 2 * (every - positions)
    assert needed.kv_cache == 2 * (2 * 2 * 128 * (16 + 64))  # layers, K and V, hidden, average positions; fp16
    untied = decode_models.tiny_llama(CPU, torch.bfloat16, tie_word_embeddings=False)
    table = untied.get_input_embeddings().weight.numel()
    needed = case.step_bytes(untied, prompt_len=16, new_tokens=1)
    assert needed.weights == 2 * (sum(p.numel() for p in untied.parameters()) - table)
    assert needed.kv_cache == 2 * (2 * 2 * 2 * 32 * 16)  # 2 KV heads of 32
    assert needed.total == needed.weights + needed.kv_cache


def test_targets_follow_the_issue_contract():
    ctx = Context(device=CPU, quick=True)
    results = {
        "llama1b_bf16": case.ModelResult({("hf static+compile", 1): 300.0, ("tendril fused", 1): 100.0},
                                         {1: "tendril fused"}, roofline_us=600.0),
        "gpt2_fp16": case.ModelResult({("tendril fused", 1): 12.8, ("tendril eager", 4): 19.2},
                                      {1: "tendril fused", 4: "tendril eager"}, roofline_us=50.0),
    }
    case.report_targets(ctx, results, new_tokens=128)
    assert ctx.targets == pytest.approx({"llama1b_bf16_roofline_fraction": 600.0 / (100e3 / 128),
                                         "llama1b_bf16_speedup_vs_hf_static_compile": 3.0,
                                         "gpt2_fp16_us_per_token": 100.0, "gpt2_beam4_step_over_greedy_step": 1.5})
    assert {name: goal.met(ctx.targets[name]) for name, goal in ctx.goals.items()} == {
        "llama1b_bf16_roofline_fraction": True, "llama1b_bf16_speedup_vs_hf_static_compile": True,
        "gpt2_fp16_us_per_token": True, "gpt2_beam4_step_over_greedy_step": False}


def test_fastest_picks_among_agreeing_variants():
    times = {"tendril eager": 3.0, "tendril compiled": 2.0, "tendril fused": 1.0}
    agreed = {"tendril eager": "identical", "tendril compiled": "differs", "tendril fused": "near tie"}
    assert case.fastest(times, agreed) == ("tendril fused", "tendril eager")
    assert case.fastest(times, {"tendril compiled": "differs"}) == (None, None)


def test_models_and_steps_come_from_the_environment(monkeypatch):
    monkeypatch.setenv(case.MODELS_ENV, "gpt2_fp16, llama1b_bf16")
    assert case._chosen(case.MODELS_ENV, tuple(case.MODELS)) == ("gpt2_fp16", "llama1b_bf16")
    monkeypatch.setenv(case.MODELS_ENV, "gpt3")
    with pytest.raises(ValueError, match="unknown gpt3"):
        case._chosen(case.MODELS_ENV, tuple(case.MODELS))
    monkeypatch.delenv(case.MODELS_ENV)
    assert case._chosen(case.MODELS_ENV, ("a", "b")) == ("a", "b")


def test_near_ties_count_in_ulps_of_the_models_dtype():
    model = decode_models.tiny_llama(CPU, torch.bfloat16)
    prompt = torch.randint(0, 1024, (1, 5), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        reference = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False)
    assert decode_models.tie_gap_ulps(model, reference, 5) <= 1.0
    with torch.inference_mode():
        worst = int(model(reference[:, :6]).logits[0, -1].argmin())
    swapped = reference.clone()
    swapped[0, 6] = worst
    assert decode_models.tie_gap_ulps(model, swapped, 5) > decode_models.TIE_ULPS


def test_beam_near_ties_compare_hfs_scores_of_the_two_sequences(monkeypatch):
    model = decode_models.tiny_llama(CPU, torch.bfloat16)
    prompt = torch.randint(0, 1024, (1, 5), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        reference = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, num_beams=4,
                                   do_sample=False)
    assert decode_models.beam_score_gap(model, reference, reference, 5) == 0.0
    with torch.inference_mode():
        worst = int(model(reference[:, :6]).logits[0, -1].argmin())
    swapped = reference.clone()
    swapped[0, 6] = worst
    gap = decode_models.beam_score_gap(model, swapped, reference, 5)
    assert gap > torch.finfo(torch.bfloat16).eps
    assert decode_models.beam_score_gap(model, reference, swapped, 5) < 0  # the better sequence scores below 0
    ctx = Context(device=CPU, quick=True)
    monkeypatch.setattr(case, "PROMPT_LEN", 5)
    assert case.agreement(ctx, model, "beam4", swapped, reference, greedy=False) == "differs"
    assert "parts from HF at new token 1" in ctx.notes[-1]
    # a sequence HF scores within the dtype's precision of its own is a near tie, whichever scores higher
    eps = torch.finfo(torch.bfloat16).eps
    for gap in (eps, -1.0):
        monkeypatch.setattr(case, "beam_score_gap", lambda *_, gap=gap: gap)
        assert case.agreement(ctx, model, "beam4", swapped, reference, greedy=False) == "near tie"
    monkeypatch.setattr(case, "beam_score_gap", lambda *_: 2 * eps)
    assert case.agreement(ctx, model, "beam4", swapped, reference, greedy=False) == "differs"


def test_quick_case_runs_on_the_cpu(monkeypatch):
    monkeypatch.setenv(case.MODELS_ENV, "gpt2_fp16")
    monkeypatch.setenv(case.STEPS_ENV, "eager,fused")
    monkeypatch.setattr(case, "PROMPT_LEN", 4)
    ctx = Context(device=CPU, quick=True)
    case.run(ctx)
    assert set(ctx.targets) == {"gpt2_fp16_us_per_token", "gpt2_beam4_step_over_greedy_step"}
    metrics = {(row.variant, row.metric) for row in ctx.rows}
    for variant in ("gpt2_fp16 greedy hf eager", "gpt2_fp16 greedy tendril fused", "gpt2_fp16 beam4 tendril eager"):
        assert {(variant, "tok_per_s"), (variant, "ttft_ms"), (variant, "roofline_fraction")} <= metrics
    assert ("gpt2_fp16 greedy tendril fastest", "roofline_fraction") in metrics
    assert any(note.startswith("gpt2_fp16 beam4: tendril fastest is") for note in ctx.notes)
