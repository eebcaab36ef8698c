"""`generate`'s decoding options where the caller passes none: the model's `generation_config`, else HF's defaults.

HF's `model.generate` applies a model's `generation_config` to every call that does not override it: an instruct
model's `do_sample=True, temperature=0.6, top_p=0.9` makes it sample. `tendril.generate` takes the same values, so a
call ported from HF decodes the same way. A config that sets something tendril does not implement and that changes
tokens (`no_repeat_ngram_size`, `min_new_tokens`, ...) is refused rather than ignored; settings about outputs,
caches or speculative decoding do not change tokens and are ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from torch import nn


@dataclass(frozen=True)
class Decoding:
    """The decoding options of one `generate` call, HF's defaults as field defaults."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    num_return_sequences: int = 1

    @classmethod
    def resolve(cls, model: nn.Module, given: dict[str, Any]) -> Decoding:
        """Each option from `given` (the caller's; None where not passed), else the model's `generation_config`,
        else HF's default."""
        settings = config_settings(model)
        values = {}
        for option in fields(cls):
            value, configured = given[option.name], settings.get(option.name)
            if value is None:
                value = configured if configured is not None else option.default
            values[option.name] = value
        return cls(**values)


UNSUPPORTED = (
    "min_length", "min_new_tokens", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "force_words_ids", "constraints", "suppress_tokens", "begin_suppress_tokens", "forced_bos_token_id",
    "forced_eos_token_id", "forced_decoder_ids", "sequence_bias", "typical_p", "epsilon_cutoff", "eta_cutoff", "min_p",
    "diversity_penalty", "num_beam_groups", "encoder_repetition_penalty", "renormalize_logits",
    "exponential_decay_length_penalty", "guidance_scale", "penalty_alpha", "dola_layers", "watermarking_config",
    "stop_strings", "max_time", "remove_invalid_values",
)  # fmt: skip
"""`generation_config` settings that change the tokens `model.generate` returns and that tendril does not implement."""


def config_settings(model: nn.Module) -> dict[str, Any]:
    """What the model's `generation_config` sets away from HF's defaults (none without a config)."""
    config = getattr(model, "generation_config", None)
    return dict(config.to_diff_dict()) if config is not None and hasattr(config, "to_diff_dict") else {}


def unsupported_settings(model: nn.Module) -> dict[str, Any]:
    """The settings of the model's `generation_config` that change tokens and that tendril does not implement."""
    settings = config_settings(model)
    return {name: settings[name] for name in UNSUPPORTED if settings.get(name) is not None}
