"""The `generation` benchmark case: registered, its targets named as the issue says, and its variants'
CPU-runnable parts (HF eager, tendril, measurement, early-eos check) working on a tiny model."""

from __future__ import annotations

import pytest
import torch

from benchmarks.cases import generation as case
from benchmarks.registry import CASES, Context


def _tiny() -> torch.nn.Module:
    return case.gpt2(torch.device("cpu"), torch.float32, n_layer=2, n_embd=64, n_head=4, vocab_size=96,
                     n_positions=64)


def test_case_is_registered_for_the_gpu():
    assert CASES["generation"].needs_gpu


def test_targets_follow_the_issue_contract():
    ctx = Context(device=torch.device("cpu"), quick=True)
    times = {("hf eager", 1): 1600.0, ("tendril", 1): 64.0, ("hf eager", 4): 2000.0, ("tendril", 4): 250.0}
    case.report_targets(ctx, times, case.Workload())
    assert ctx.targets == pytest.approx({"greedy_tok_per_s": 2000.0, "greedy_speedup_vs_hf_eager": 25.0,
                                         "beam4_speedup_vs_hf_eager": 8.0})
    assert {name: goal.met(ctx.targets[name]) for name, goal in ctx.goals.items()} == {
        "greedy_tok_per_s": False, "greedy_speedup_vs_hf_eager": True, "beam4_speedup_vs_hf_eager": False}
    compiled = Context(device=torch.device("cpu"), quick=True)
    case.report_targets(compiled, {**times, ("tendril compiled step", 1): 32.0}, case.Workload())
    assert compiled.targets["greedy_tok_per_s"] == pytest.approx(4000.0)
    assert "targets for greedy use 'tendril compiled step' (identical tokens)" in compiled.notes
    fused = {**times, ("tendril compiled step", 1): 32.0, ("tendril fused step", 1): 16.0}
    judged = {}
    for level in ("differs", "near tie"):
        judged[level] = Context(device=torch.device("cpu"), quick=True)
        agreed = {("tendril", 1): "identical", ("tendril compiled step", 1): "identical",
                  ("tendril fused step", 1): level}
        case.report_targets(judged[level], fused, case.Workload(), agreed)
        identical = [row for row in judged[level].rows if row.variant == "greedy fastest with identical tokens"]
        assert len(identical) == 1 and identical[0].median == pytest.approx(4000.0)
    assert judged["differs"].targets["greedy_tok_per_s"] == pytest.approx(4000.0)
    assert ("greedy: 'tendril fused step' is left out of the targets: its tokens differ from HF eager's"
            in judged["differs"].notes)
    assert judged["near tie"].targets["greedy_tok_per_s"] == pytest.approx(8000.0)
    assert "targets for greedy use 'tendril fused step' (near tie tokens)" in judged["near tie"].notes
    partial = Context(device=torch.device("cpu"), quick=True)
    case.report_targets(partial, {("tendril", 1): 64.0}, case.Workload())
    assert set(partial.targets) == {"greedy_tok_per_s"}


@pytest.mark.parametrize("beams", [1, 4])
def test_variants_measure_and_agree_on_the_cpu(beams):
    model = _tiny()
    ctx = Context(device=torch.device("cpu"), quick=True)
    prompts = [torch.randint(0, 96, (1, 5), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    for name, make in (("hf eager", lambda n: case.hf_eager(model, n, beams)),
                       ("tendril", lambda n: case.tendril_generate(model, n, beams))):
        ms = case.measure(ctx, name, make, prompts, new_tokens=4, reps=1)
        assert ms > 0
    metrics = {(row.variant, row.metric) for row in ctx.rows}
    for name in ("hf eager", "tendril"):
        assert {(name, "warmup_s"), (name, "ms_per_call"), (name, "tok_per_s"), (name, "ttft_ms")} <= metrics
    reference = case.hf_eager(model, 6, beams)(prompts[0])
    case._check_same(ctx, "check", case.tendril_generate(model, 6, beams)(prompts[0]), reference)
    assert ctx.notes[-1].startswith("check: identical tokens")


def test_early_eos_run_stops_both_sides_at_the_same_token():
    model = _tiny()
    ctx = Context(device=torch.device("cpu"), quick=True)
    prompts = [torch.randint(0, 96, (1, 5), generator=torch.Generator().manual_seed(0))]
    work = case.Workload(prompt_len=5, new_tokens=12, early_eos_step=3)
    case._early_eos(ctx, model, prompts, work, reps=1)
    assert "identical tokens" in ctx.notes[0]
    (new_tokens,) = [row.median for row in ctx.rows if row.metric == "new_tokens"]
    assert 1 <= new_tokens <= 4


def test_near_ties_are_told_from_real_differences():
    """HF's own greedy tokens are within a fraction of an ulp of HF's best logit (teacher-forced); a sequence
    with one token swapped for a clearly worse one is not."""
    model = _tiny()
    prompt = torch.randint(0, 96, (1, 5), generator=torch.Generator().manual_seed(3))
    reference = case.hf_eager(model, 8, 1)(prompt)
    assert case.tie_gap_ulps(model, reference, 5) <= 1.0
    ctx = Context(device=torch.device("cpu"), quick=True)
    assert case.agreement(ctx, model, "same", reference, reference, 5, greedy=True) == "identical"
    with torch.inference_mode():
        logits = model(reference[:, :6]).logits[0, -1]
    swapped = reference.clone()
    swapped[0, 6] = int(logits.argmin())  # the worst token at the second new position
    assert case.tie_gap_ulps(model, swapped, 5) > case.TIE_ULPS
    assert case.agreement(ctx, model, "swapped", swapped, reference, 5, greedy=True) == "differs"
    assert "swapped: parts from HF at new token 1" in ctx.notes[-1]
    assert case.agreement(ctx, model, "beams", swapped, reference, 5, greedy=False) == "differs"
