"""Tiny random-weight HF causal LMs, one per supported architecture family, and prompt helpers
(imported by the tests as `tests.generation.models`)."""

from __future__ import annotations

import torch
import transformers

VOCAB = 96


def tiny_model(family: str, device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.Module:
    """A 2-layer model of `family` with random weights (eos id 3, no pad id), in eval mode."""
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=3)
    llama_like = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, max_position_embeddings=128, **common)
    configs = {
        "gpt2": (transformers.GPT2Config, transformers.GPT2LMHeadModel,
                 dict(n_layer=2, n_embd=64, n_head=4, n_positions=128, **common)),
        "gptj": (transformers.GPTJConfig, transformers.GPTJForCausalLM,
                 dict(n_layer=2, n_embd=64, n_head=4, rotary_dim=8, n_positions=128, **common)),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, llama_like),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, llama_like),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, llama_like),
    }
    config_cls, model_cls, kwargs = configs[family]
    model = model_cls(config_cls(**kwargs))
    return model.to(device=device, dtype=dtype).eval()


def left_padded(lengths: list[int], seed: int = 0, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """A left-padded batch of random prompts (no eos inside) with the given real lengths, and its mask."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(4, VOCAB, (len(lengths), width), generator=generator)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, width - length :] = 1
        ids[row, : width - length] = 0
    return ids.to(device), mask.to(device)


def hf_generate(
    model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, eos: int | None, **options
) -> torch.Tensor:
    """HF's `generate` with eos `eos` (None: never stop early) and pad id 0."""
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = eos
    try:
        with torch.no_grad():
            return model.generate(ids, attention_mask=mask, eos_token_id=eos, pad_token_id=0, **options)
    finally:
        model.generation_config.eos_token_id = saved
