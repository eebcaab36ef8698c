"""`tendril.generate`: Hugging Face `generate` semantics, decoded by a device-side loop.

The prompt runs once through the architecture's graph-safe forward, filling tendril's static KV cache;
then token choice and, for beams, all bookkeeping run as `while_loop(cond, body, carried)` (loop.py),
one iteration per new token, ending as soon as every sequence is done. Options follow HF's meaning and
defaults; options tendril does not implement are refused by name, never ignored.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from tendril.generation.architectures import UnsupportedModelError, decoder_for
from tendril.generation.beam import BeamSearch
from tendril.generation.cache import StaticKVCache
from tendril.generation.greedy import TokenSearch
from tendril.generation.loop import while_loop
from tendril.generation.noise import draw_key
from tendril.generation.processors import LogitsProcessing
from tendril.generation.state import Decoder

_SUPPORTED = (
    "attention_mask, max_new_tokens, eos_token_id, pad_token_id, do_sample, temperature, top_k, top_p, "
    "repetition_penalty, num_beams, length_penalty, early_stopping, num_return_sequences, seed"
)


def _eos_ids(model: nn.Module, eos_token_id: int | Sequence[int] | None) -> list[int]:
    if eos_token_id is None:
        eos_token_id = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        if eos_token_id is None:
            return []
    return [int(eos_token_id)] if isinstance(eos_token_id, int) else [int(t) for t in eos_token_id]


def _pad_id(model: nn.Module, pad_token_id: int | None, eos: list[int]) -> int | None:
    if pad_token_id is None:
        pad_token_id = getattr(getattr(model, "generation_config", None), "pad_token_id", None)
    if pad_token_id is None and eos:
        pad_token_id = eos[0]
    return pad_token_id


def _check_inputs(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, max_new_tokens: int) -> None:
    if input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise ValueError(f"input_ids must be a [batch, length] int64 tensor, got {input_ids.dtype} "
                         f"{tuple(input_ids.shape)}")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} differs from input_ids "
                         f"{tuple(input_ids.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")


def generate(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    max_new_tokens: int,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int = 50,
    top_p: float = 1.0,
    repetition_penalty: float = 1.0,
    num_beams: int = 1,
    length_penalty: float = 1.0,
    early_stopping: bool | str = False,
    num_return_sequences: int = 1,
    seed: int | None = None,
    unsupported: str = "raise",
    **other: Any,
) -> torch.Tensor:
    """Generate like `model.generate(...)` and return the same [batch * num_return_sequences, length] ids.

    Defaults are HF's. `eos_token_id=None` takes the model's `generation_config` (as HF does); pass `[]`
    to disable stopping on eos. `seed` makes sampling reproducible (torch's default generator otherwise).
    `unsupported='hf'` runs HF's own `generate` eagerly for models tendril has no decode path for.
    """
    if other:
        raise ValueError(f"tendril.generate does not support {', '.join(sorted(other))}; supported options: "
                         f"{_SUPPORTED}. Use model.generate for the others.")
    if unsupported not in ("raise", "hf"):
        raise ValueError(f"unsupported must be 'raise' or 'hf', got {unsupported!r}")
    _check_inputs(input_ids, attention_mask, max_new_tokens)
    if num_beams < 1 or num_return_sequences < 1:
        raise ValueError("num_beams and num_return_sequences must be >= 1")
    if num_beams == 1 and not do_sample and num_return_sequences != 1:
        raise ValueError("greedy decoding returns one sequence per prompt; use do_sample=True or num_beams > 1 "
                         "for num_return_sequences > 1")
    if num_beams > 1 and num_return_sequences > num_beams:
        raise ValueError(f"num_return_sequences ({num_return_sequences}) must be <= num_beams ({num_beams})")
    eos = _eos_ids(model, eos_token_id)
    pad = _pad_id(model, pad_token_id, eos)
    try:
        arch = decoder_for(model)
    except UnsupportedModelError:
        if unsupported != "hf":
            raise
        return model.generate(  # type: ignore[operator]
            input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens, eos_token_id=eos or None,
            pad_token_id=pad, do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
            repetition_penalty=repetition_penalty, num_beams=num_beams, length_penalty=length_penalty,
            early_stopping=early_stopping, num_return_sequences=num_return_sequences,
        )
    processing = LogitsProcessing(
        do_sample=do_sample, temperature=float(temperature), top_k=int(top_k), top_p=float(top_p),
        repetition_penalty=float(repetition_penalty),
        min_tokens_to_keep=len(eos) + 1 if num_beams > 1 else 1,
    )
    with torch.inference_mode():
        return _run(model, arch, input_ids, attention_mask, max_new_tokens, eos, pad, processing, num_beams,
                    length_penalty, early_stopping, num_return_sequences, seed)


def _run(
    model: nn.Module,
    arch: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    max_new_tokens: int,
    eos: list[int],
    pad: int | None,
    processing: LogitsProcessing,
    num_beams: int,
    length_penalty: float,
    early_stopping: bool | str,
    num_return_sequences: int,
    seed: int | None,
) -> torch.Tensor:
    device = input_ids.device
    batch, prompt_len = input_ids.shape
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(device=device, dtype=torch.long)
    copies = num_beams if num_beams > 1 else num_return_sequences
    prompt = input_ids.repeat_interleave(copies, dim=0)
    mask = mask.repeat_interleave(copies, dim=0)
    rows, max_len = prompt.shape[0], prompt_len + max_new_tokens
    arch.check_length(max_len)

    layout = arch.layout()
    weight = next(model.parameters())
    key_valid = torch.cat([mask.bool(), torch.ones(rows, max_new_tokens, dtype=torch.bool, device=device)], dim=1)
    cache = StaticKVCache(layout.num_layers, rows, layout.kv_heads, max_len, layout.head_dim, weight.dtype, device,
                          key_valid)
    real_lengths = mask.sum(-1)
    decoder = Decoder(
        arch=arch, cache=cache, prompt_len=prompt_len, max_new_tokens=max_new_tokens, real_lengths=real_lengths,
        pad_lengths=(mask != 0).int().argmax(dim=1).long(), processing=processing,
        eos=torch.tensor(eos, dtype=torch.long, device=device), noise_key=draw_key(device, seed),
    )
    logits = decoder.prefill(prompt, mask)
    loop = while_loop()
    if num_beams == 1:
        search = TokenSearch(decoder, pad if pad is not None else 0)
        return search.result(loop(search.cond, search.body, search.start(prompt, logits)))
    # HF's fill value for beam outputs: `pad_token_id or eos_token_id[0]` (so a pad id of 0 falls through to eos)
    fill = pad if pad else (eos[0] if eos else -1)
    beams = BeamSearch(decoder, batch, num_beams, length_penalty, early_stopping, fill)
    return beams.result(loop(beams.cond, beams.body, beams.start(prompt, logits)), num_return_sequences)
