"""`generate`'s decoding options where the caller passes none: the model's `generation_config`, else HF's defaults.

HF's `model.generate` applies a model's `generation_config` to every call that does not override it: an instruct
model's `do_sample=True, temperature=0.6, top_p=0.9` makes it sample. `tendril.generate` takes the same values, so a
call ported from HF decodes the same way. A config that sets something tendril does not implement and that changes
tokens (`no_repeat_ngram_size`, `min_new_tokens`, ...) is refused rather than ignored; settings about outputs,
caches or speculative decoding do not change tokens and are ignored.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import fields
from typing import Any

from torch import nn

from tendril.generation.processors import LogitsProcessing

SEARCH_DEFAULTS: dict[str, Any] = {"num_beams": 1, "length_penalty": 1.0, "early_stopping": False,
                                   "num_return_sequences": 1}
"""HF's defaults of the search options; those of the logits processors are `LogitsProcessing`'s field defaults."""


def resolve(model: nn.Module, given: dict[str, Any]) -> dict[str, Any]:
    """Each decoding option of `given` (the caller's; None where not passed), else the model's `generation_config`,
    else HF's default. `given` holds `LogitsProcessing`'s options (but `min_tokens_to_keep`) and the search options."""
    defaults = {f.name: f.default for f in fields(LogitsProcessing) if f.name in given} | SEARCH_DEFAULTS
    if defaults.keys() != given.keys():
        raise ValueError(f"unknown decoding options {sorted(given.keys() - defaults.keys())}")
    settings = configured(model, defaults)
    return {name: given[name] if given[name] is not None else settings.get(name, default)
            for name, default in defaults.items()}


UNSUPPORTED = (
    "min_length", "min_new_tokens", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "force_words_ids", "constraints", "suppress_tokens", "begin_suppress_tokens", "forced_bos_token_id",
    "forced_eos_token_id", "forced_decoder_ids", "sequence_bias", "typical_p", "epsilon_cutoff", "eta_cutoff", "min_p",
    "diversity_penalty", "num_beam_groups", "encoder_repetition_penalty", "renormalize_logits",
    "exponential_decay_length_penalty", "guidance_scale", "penalty_alpha", "dola_layers", "watermarking_config",
    "stop_strings", "max_time", "remove_invalid_values",
)  # fmt: skip
"""`generation_config` settings that change the tokens `model.generate` returns and that tendril does not implement."""


def configured(model: nn.Module, names: Iterable[str]) -> dict[str, Any]:
    """Which of `names` the model's `generation_config` sets away from HF's defaults, and to what (none without a
    config). Attribute reads against a default config made once, since `GenerationConfig.to_diff_dict` serialises
    the whole config at every call."""
    config = getattr(model, "generation_config", None)
    if config is None:
        return {}
    defaults = _hf_defaults()
    values = {name: getattr(config, name, None) for name in names}
    return {name: value for name, value in values.items()
            if value is not None and value != getattr(defaults, name, None)}


def unsupported_settings(model: nn.Module) -> dict[str, Any]:
    """The settings of the model's `generation_config` that change tokens and that tendril does not implement."""
    return configured(model, UNSUPPORTED)


@functools.cache
def _hf_defaults() -> Any:
    from transformers import GenerationConfig

    return GenerationConfig()
