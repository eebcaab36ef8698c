"""The decode benchmarks' models, built from configs with random weights (no download), and their steps.

Shared by `decode-roofline` and `generation-streaming` (this module registers no case).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from benchmarks.cases.generation import gpt2
from benchmarks.registry import Context
from tendril.generation import Step, generate

LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, max_position_embeddings=4096,
                rope_theta=500000.0)
"""Llama-3.2-1B's shape (its rope scaling left out: it changes the frequencies, not the work)."""


def llama(device: torch.device, dtype: torch.dtype, **overrides: Any) -> nn.Module:
    """A Llama-3.2-1B-shaped model (`LLAMA_1B` with `overrides`), random weights, made on `device` directly."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**{**LLAMA_1B, **overrides}))
    model.generation_config.eos_token_id = None  # equal work: nothing stops a sequence early
    model.generation_config.pad_token_id = 0
    return model.to(dtype=dtype).eval()


def tiny_llama(device: torch.device, dtype: torch.dtype, **overrides: Any) -> nn.Module:
    """The quick runs' Llama: `LLAMA_1B`'s structure (GQA, tied embeddings) at a tiny size."""
    return llama(device, dtype, **{"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
                                   "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024,
                                   **overrides})


def tiny_gpt2(device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The quick runs' GPT-2: two small layers."""
    return gpt2(device, dtype, n_layer=2, n_embd=128, n_head=4, vocab_size=1024, n_positions=512,
                bos_token_id=1, eos_token_id=1)


STEP_PREFERENCE: tuple[Step, ...] = ("fused", "compiled", "eager")
"""tendril's steps, fastest first."""


def fastest_step(ctx: Context, label: str, model: nn.Module, prompt: torch.Tensor) -> Step:
    """The first of `STEP_PREFERENCE` that runs `model` (a 2-token call); why each one before it did not, in a note."""
    for step in STEP_PREFERENCE:
        try:
            generate(model, prompt, max_new_tokens=2, eos_token_id=[], pad_token_id=0, step=step)
        except Exception as error:  # a step that cannot run this model is reported, and the next one tried
            ctx.note(f"{label}: step={step!r} does not run: {type(error).__name__}: {str(error).splitlines()[0][:200]}")
            continue
        return step
    raise RuntimeError(f"{label}: no tendril step runs this model")


TIE_ULPS = 8.0
"""How far below HF's best logit (in ulps of the model's dtype at that logit) a greedy token may be and still
count as a near tie (the rule of `benchmarks.cases.generation`, there in fp16 ulps)."""


def sequence_log_prob(model: nn.Module, tokens: torch.Tensor, prompt_len: int) -> float:
    """HF's log-probability of the generated part of `tokens` [1, L], teacher-forced: one HF forward over the
    sequence, its logits' float32 log-softmax at each chosen token, summed."""
    with torch.inference_mode():
        logits = model(tokens[:, :-1]).logits[0, prompt_len - 1:].float()  # type: ignore[operator]
    return float(logits.log_softmax(-1).gather(1, tokens[0, prompt_len:, None]).sum())


def beam_score_gap(model: nn.Module, ours: torch.Tensor, reference: torch.Tensor, prompt_len: int) -> float:
    """How far the sequence of a beam search (`ours`, [1, L]) scores below HF's own (`reference`, same shape), both
    scored by HF (`sequence_log_prob`: with equal lengths and length penalty 1, the order beam search ranks
    sequences by), relative to HF's score: at most 0 where ours scores as well or better. Within the model dtype's
    relative precision (`torch.finfo(dtype).eps`), the two searches found equally good sequences up to the
    rounding of the logits they were ranked by: a near tie."""
    theirs = sequence_log_prob(model, reference, prompt_len)
    return (theirs - sequence_log_prob(model, ours, prompt_len)) / abs(theirs)


def tie_gap_ulps(model: nn.Module, tokens: torch.Tensor, prompt_len: int) -> float:
    """The largest gap over the generated steps of greedy `tokens` [1, L] between HF's best logit and HF's logit of
    the chosen token, teacher-forced (one HF forward over the sequence), in ulps of the model's dtype at the best
    logit (fp16: 2**-10 relative, bf16: 2**-7; float32 counts in fp32 ulps)."""
    dtype = next(model.parameters()).dtype
    with torch.inference_mode():
        logits = model(tokens[:, :-1]).logits[0, prompt_len - 1:].float()  # type: ignore[operator]
    best = logits.max(-1).values
    gap = best - logits.gather(1, tokens[0, prompt_len:, None]).squeeze(1)
    _, exponent = torch.frexp(best.abs())
    ulp = torch.ldexp(torch.full_like(best, torch.finfo(dtype).eps), exponent - 1)
    return float((gap / ulp).max())
