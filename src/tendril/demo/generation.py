"""Demo: text generation with HF's `generate` against `tendril.generate` (greedy and 4-beam).

On a GPU: GPT-2 124M (fp16, random weights), 16-token prompt, 64 new tokens (eos disabled so both
do the same work); tendril runs the prompt and the whole decode loop as one graph launch. On the CPU:
a tiny GPT-2, tendril's eager loop (the same code, no graphs). Each row checks tendril's tokens
against HF's.
"""

from __future__ import annotations

from typing import Any

import torch

from tendril.demo import DemoSection, Row, SectionResult
from tendril.generation import generate
from tendril.utils.timing import time_callable


def _model(device: torch.device) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    tiny: dict[str, Any] = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=128, bos_token_id=0,
                                eos_token_id=1)
    model: Any = GPT2LMHeadModel(GPT2Config() if device.type == "cuda" else GPT2Config(**tiny))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.to(device=device, dtype=torch.float16 if device.type == "cuda" else torch.float32).eval()


def run(device: torch.device, quick: bool) -> SectionResult:
    model = _model(device)
    new_tokens = 16 if quick else 64
    ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0)).to(device)
    reps = 2 if quick else 10
    rows = []
    for beams in (1, 4):
        label = "greedy" if beams == 1 else "4-beam"

        def hf(b: int = beams) -> torch.Tensor:
            with torch.inference_mode():
                return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                      num_beams=b, do_sample=False)

        def ours(b: int = beams) -> torch.Tensor:
            return generate(model, ids, max_new_tokens=new_tokens, num_beams=b, eos_token_id=[])

        same = torch.equal(hf(), ours())
        hf_ms = time_callable(hf, device=device, warmup=1, reps=reps).median_ms
        ours_ms = time_callable(ours, device=device, warmup=1, reps=reps).median_ms
        detail = f"{new_tokens} new tokens, batch 1"
        rows.append(Row(f"HF generate, {label}", detail, hf_ms, baseline=beams == 1))
        where = "one graph launch" if device.type == "cuda" else "eager loop on the CPU"
        check = f"{'tokens identical to HF' if same else 'tokens DIFFER from HF'}; {hf_ms / ours_ms:.1f}x vs HF {label}"
        rows.append(Row(f"tendril.generate, {label}", f"{detail}, {where}", ours_ms, check=check))
    notes = [] if device.type == "cuda" else [
        "The whole-loop CUDA graph needs an NVIDIA GPU: on the CPU tendril runs the same loop eagerly."]
    return SectionResult("Generation: the whole decode loop in one graph launch", rows, notes)


SECTION = DemoSection(order=50, title="Generation: the whole decode loop in one graph launch", run=run)
