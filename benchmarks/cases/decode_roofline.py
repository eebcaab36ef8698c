"""Case `decode-roofline`: batch-1 decode against the memory-bandwidth roofline, tendril beside HF.

Models, built from configs with random weights (`decode_models`): Llama-3.2-1B's shape in bf16
(`llama1b_bf16`), the same with vocabulary 32000 in fp16 (`llama32k_fp16`), GPT-2 124M in fp16 (`gpt2_fp16`,
also with 4 beams). 16-token prompts, 128 new tokens, eos disabled (equal work), greedy. Variants, in one
process: `hf eager` (`model.generate`), `hf static+compile` (`cache_implementation="static"`, which HF
compiles; its first call, the compilation, is the reported warm-up), and `tendril <step>` for each
`step` of `tendril.generate`; then the targets' `tendril fastest` (the fastest step whose tokens agree
with HF eager's: identical, or for greedy within the teacher-forced near-tie rule of
`decode_models.tie_gap_ulps` in the model's dtype, for beams within `decode_models.beam_score_gap`'s) and
`tendril fastest identical` (HF-identical tokens).
Per variant: ms per call, us per token (the call over 128), tok/s, time to first token (a 1-token call; not
for compiled variants, which would compile again) and roofline fraction.

Roofline: a step must read every weight once (the LM head included; embedding tables are not counted, a
step reads one row of each, except where the LM head is the tied input embedding: then that matrix is
counted once, as the head) and the KV cache at the average length over the generated tokens (prompt +
(new - 1) / 2 positions). Bandwidth is measured in the same run: the best of several `torch.sum` over a
4 GiB float32 tensor (bytes read over time). Roofline time per token = bytes per step / bandwidth, and a
variant's fraction = roofline time / its time per token (the whole call over the new tokens, prefill
included: conservative). With 4 beams a step still reads the weights once; its fraction uses the greedy
bytes (the 4 beams' KV cache is a small share), and HF static+compile is not run (the beam target is
tendril's beam over greedy time).

`TENDRIL_DECODE_ROOFLINE_MODELS` (comma-separated keys of `MODELS`) runs part of the models;
`TENDRIL_DECODE_ROOFLINE_STEPS` (comma-separated) limits tendril's steps. `--quick`: tiny models of the
same structure, 16 new tokens, no compiled variants (each compilation takes tens of seconds).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from benchmarks.cases.decode_models import (
    TIE_ULPS,
    beam_score_gap,
    gpt2,
    llama,
    tie_gap_ulps,
    tiny_gpt2,
    tiny_llama,
)
from benchmarks.cases.generation import Generate, hf_eager, hf_static_compiled, measure, tendril_generate
from benchmarks.registry import Context, Goal, register
from tendril.generation import STEPS, Step
from tendril.generation.api import release_graphs
from tendril.utils.timing import time_callable

MODELS_ENV = "TENDRIL_DECODE_ROOFLINE_MODELS"
STEPS_ENV = "TENDRIL_DECODE_ROOFLINE_STEPS"
PROMPT_LEN = 16
NEW_TOKENS = 128
BANDWIDTH_BYTES = 4 << 30
AGREEMENTS = ("identical", "near tie", "differs")


@dataclass(frozen=True)
class ModelSpec:
    label: str
    build: Callable[[torch.device, bool], nn.Module]
    """(device, quick) -> the model (a tiny one of the same structure when quick)."""
    beams: tuple[int, ...] = (1,)


def _llama1b_bf16(device: torch.device, quick: bool) -> nn.Module:
    return tiny_llama(device, torch.bfloat16) if quick else llama(device, torch.bfloat16)


def _llama32k_fp16(device: torch.device, quick: bool) -> nn.Module:
    if quick:
        return tiny_llama(device, torch.float16, vocab_size=512)
    return llama(device, torch.float16, vocab_size=32000)


def _gpt2_fp16(device: torch.device, quick: bool) -> nn.Module:
    return tiny_gpt2(device, torch.float16) if quick else gpt2(device)


MODELS: dict[str, ModelSpec] = {
    "llama1b_bf16": ModelSpec("Llama-3.2-1B shape, bf16", _llama1b_bf16),
    "llama32k_fp16": ModelSpec("Llama-3.2-1B shape, vocab 32000, fp16", _llama32k_fp16),
    "gpt2_fp16": ModelSpec("GPT-2 124M, fp16", _gpt2_fp16, beams=(1, 4)),
}


def _chosen(env: str, known: tuple[str, ...]) -> tuple[str, ...]:
    """The comma-separated names in `env` (all of `known` when unset), refused by name when unknown."""
    text = os.environ.get(env, "").strip()
    if not text:
        return known
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise ValueError(f"{env}: unknown {', '.join(unknown)}; choose from {', '.join(known)}")
    return names


@dataclass(frozen=True)
class StepBytes:
    weights: int
    kv_cache: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache


def step_bytes(model: nn.Module, prompt_len: int, new_tokens: int) -> StepBytes:
    """What one decode step must read (see the module docstring): weights once each (tied ones once), embedding
    tables left out unless one is the LM head, and the KV cache at the average length."""
    head = model.get_output_embeddings().weight  # type: ignore[operator]
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding) and m.weight is not head}
    weights = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in tables)
    config = model.config  # type: ignore[attr-defined]
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    positions = prompt_len + (new_tokens - 1) / 2
    element = head.element_size()
    kv_cache = int(config.num_hidden_layers * 2 * kv_heads * head_dim * positions * element)
    return StepBytes(weights, kv_cache)


def read_bandwidth(device: torch.device, nbytes: int = BANDWIDTH_BYTES, reps: int = 10) -> float:
    """Bytes per second of the best of `reps` `torch.sum` over an `nbytes` float32 tensor on `device` (timed
    with CUDA events on a GPU, the host clock elsewhere)."""
    data = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    best = min(time_callable(torch.sum, [(data,)], device=device, warmup=int(i == 0), reps=1).median_ms
               for i in range(reps))
    return data.numel() * 4 / (best / 1e3)


def agreement(ctx: Context, model: nn.Module, label: str, ours: torch.Tensor, reference: torch.Tensor,
              greedy: bool) -> str:
    """One of `AGREEMENTS` for a variant's tokens against HF eager's, with a note."""
    if ours.shape == reference.shape and torch.equal(ours, reference):
        ctx.note(f"{label}: identical tokens")
        return "identical"
    if ours.shape != reference.shape:
        ctx.note(f"{label}: tokens DIFFER (shapes {tuple(ours.shape)}, {tuple(reference.shape)})")
        return "differs"
    first = int((ours[0] != reference[0]).nonzero()[0]) - PROMPT_LEN
    if not greedy:
        gap = beam_score_gap(model, ours, reference, PROMPT_LEN)
        eps = torch.finfo(next(model.parameters()).dtype).eps
        verdict = "near tie" if gap <= eps else "differs"
        side = f"{gap:.2e} below" if gap >= 0 else f"{-gap:.2e} above"
        ctx.note(f"{label}: parts from HF at new token {first}; scored by HF, its sequence's log-probability is "
                 f"{side} HF's own, relative ({verdict}: at most {eps:.2e} below, the dtype's precision, is a near "
                 "tie)")
        return verdict
    gap = tie_gap_ulps(model, ours, PROMPT_LEN)
    verdict = "near tie" if gap <= TIE_ULPS else "differs"
    ctx.note(f"{label}: parts from HF at new token {first}; teacher-forced by HF every token is within {gap:.2f} "
             f"ulps of HF's best logit ({verdict}: <= {TIE_ULPS:g} is a near tie)")
    return verdict


def fastest(times: dict[str, float], agreed: dict[str, str]) -> tuple[str | None, str | None]:
    """(the fastest tendril variant whose tokens agree with HF's, the fastest with identical tokens)."""
    agreeing = [name for name in agreed if agreed[name] != "differs" and name in times]
    identical = [name for name in agreeing if agreed[name] == "identical"]
    return (min(agreeing, key=times.__getitem__) if agreeing else None,
            min(identical, key=times.__getitem__) if identical else None)


@dataclass
class ModelResult:
    """Medians (ms per call) by (variant, beams), and the names the targets use by beams."""

    times: dict[tuple[str, int], float]
    best: dict[int, str | None]
    roofline_us: float


def _variants(model: nn.Module, beams: int, steps: tuple[Step, ...],
              quick: bool) -> list[tuple[str, Callable[[int], Generate]]]:
    variants: list[tuple[str, Callable[[int], Generate]]] = [("hf eager", lambda n: hf_eager(model, n, beams))]
    if not quick and beams == 1:
        variants.append(("hf static+compile", lambda n: hf_static_compiled(model, n, beams)))
    for step in steps:
        if quick and step == "compiled":
            continue
        variants.append((f"tendril {step}", lambda n, s=step: tendril_generate(model, n, beams, step=s)))
    return variants


def measure_model(ctx: Context, key: str, spec: ModelSpec, steps: tuple[Step, ...], bandwidth: float) -> ModelResult:
    """Every variant of one model: rows, notes, and what its targets need."""
    new_tokens = 16 if ctx.quick else NEW_TOKENS
    reps = 2 if ctx.quick else 10
    model = spec.build(ctx.device, ctx.quick)
    vocab = model.get_input_embeddings().num_embeddings  # type: ignore[operator]
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (1, PROMPT_LEN), generator=generator).to(ctx.device) for _ in range(4)]
    needed = step_bytes(model, PROMPT_LEN, new_tokens)
    roofline_us = needed.total / bandwidth * 1e6
    ctx.add_value(key, "weight_bytes_per_step", needed.weights)
    ctx.add_value(key, "kv_bytes_per_step", needed.kv_cache)
    ctx.add_value(key, "roofline_us_per_token", roofline_us)
    times: dict[tuple[str, int], float] = {}
    best: dict[int, str | None] = {}
    for beams in spec.beams:
        mode = "greedy" if beams == 1 else f"beam{beams}"
        for name, make in _variants(model, beams, steps, ctx.quick):
            label = f"{key} {mode} {name}"
            try:
                ms = measure(ctx, label, make, prompts, new_tokens, reps, ttft="compile" not in name)
            except Exception as error:  # a variant that cannot run is reported, not fatal
                ctx.note(f"{label} failed: {type(error).__name__}: {str(error).splitlines()[0][:200]}")
                continue
            times[(name, beams)] = ms
            ctx.add_value(label, "us_per_token", ms * 1e3 / new_tokens)
            ctx.add_value(label, "roofline_fraction", roofline_us / (ms * 1e3 / new_tokens))
        best[beams] = _pick_tendril(ctx, f"{key} {mode}", model, prompts[0], beams, steps,
                                    {name: ms for (name, b), ms in times.items() if b == beams},
                                    roofline_us, new_tokens)
    release_graphs(model)
    return ModelResult(times, best, roofline_us)


def _pick_tendril(ctx: Context, label: str, model: nn.Module, prompt: torch.Tensor, beams: int, steps: tuple[Step, ...],
                  times: dict[str, float], roofline_us: float, new_tokens: int) -> str | None:
    """Judge each measured tendril step's tokens against HF eager's, report `tendril fastest` (agreeing) and
    `tendril fastest identical`, and return the former's variant name (None if none agrees)."""
    reference = hf_eager(model, new_tokens, beams)(prompt)
    agreed = {}
    for step in steps:
        name = f"tendril {step}"
        if name in times:
            ours = tendril_generate(model, new_tokens, beams, step=step)(prompt)
            agreed[name] = agreement(ctx, model, f"{label}: {name} vs hf eager", ours, reference, beams == 1)
    best, identical = fastest(times, agreed)
    for role, name in (("tendril fastest", best), ("tendril fastest identical", identical)):
        if name is None:
            ctx.note(f"{label}: no tendril variant for '{role}'")
            continue
        ctx.add_value(f"{label} {role}", "tok_per_s", new_tokens / (times[name] / 1e3))
        ctx.add_value(f"{label} {role}", "roofline_fraction", roofline_us / (times[name] * 1e3 / new_tokens))
        ctx.note(f"{label}: {role} is '{name}' ({agreed[name]} tokens)")
    return best


def report_targets(ctx: Context, results: dict[str, ModelResult], new_tokens: int) -> None:
    """The issue's targets from the models that ran."""
    llama = results.get("llama1b_bf16")
    if llama is not None and llama.best.get(1):
        ms = llama.times[(llama.best[1], 1)]  # type: ignore[index]
        ctx.target("llama1b_bf16_roofline_fraction", llama.roofline_us / (ms * 1e3 / new_tokens), Goal(">=", 0.70))
        peer = llama.times.get(("hf static+compile", 1))
        if peer is not None:
            ctx.target("llama1b_bf16_speedup_vs_hf_static_compile", peer / ms, Goal(">=", 3))
    small = results.get("gpt2_fp16")
    if small is not None and small.best.get(1):
        greedy = small.times[(small.best[1], 1)]  # type: ignore[index]
        ctx.target("gpt2_fp16_us_per_token", greedy * 1e3 / new_tokens, Goal("<=", 120))
        if small.best.get(4):
            beam = small.times[(small.best[4], 4)]  # type: ignore[index]
            ctx.target("gpt2_beam4_step_over_greedy_step", beam / greedy, Goal("<=", 1.3))


@register("decode-roofline", "batch-1 decode against the HBM roofline: Llama-1B shape bf16, its 32k-vocab fp16 "
          "twin, GPT-2 fp16 (and 4 beams); HF eager / HF static+compile / tendril's steps")
def run(ctx: Context) -> None:
    models = _chosen(MODELS_ENV, tuple(MODELS))
    steps: tuple[Step, ...] = _chosen(STEPS_ENV, STEPS)  # type: ignore[assignment]
    bandwidth = read_bandwidth(ctx.device, (256 << 20) if ctx.quick else BANDWIDTH_BYTES)
    ctx.add_value("device", "read_bandwidth_gb_per_s", bandwidth / 1e9)
    ctx.note(f"models: {', '.join(models)}; tendril steps: {', '.join(steps)}")
    results = {}
    for key in models:
        results[key] = measure_model(ctx, key, MODELS[key], steps, bandwidth)
        torch._dynamo.reset()  # compiled forwards hold the model's weights
        torch.cuda.empty_cache()
    if ctx.quick:
        ctx.note("--quick: tiny models, 16 new tokens, no compiled variants; the targets' numbers mean nothing")
    report_targets(ctx, results, 16 if ctx.quick else NEW_TOKENS)
