"""The models the differential fuzzer draws from: tiny random-weight HF models, torchvision CNNs and random
MLP/conv stacks with data-dependent branches, each with a maker of its inputs at a given length.

Everything is built in-process from configs (no downloads). Weights depend only on the model's name and
structure (a fixed seed per build), so a seed reproduces the same numbers on any machine; built models are
cached per (name, structure, dtype, device) so that many seeds share one build.
"""

from __future__ import annotations

import copy
import functools
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import tendril

VOCAB = 128
TOKEN_MODELS = ("gpt2", "gptj", "llama", "qwen2", "opt", "gpt_neox", "bert", "t5_encoder")
AUDIO_MODELS = ("wav2vec2",)
VISION_MODELS = ("resnet18", "mobilenet_v3_small")
RANDOM_MODELS = ("mlp_branches", "conv_branches")
ALL_MODELS = TOKEN_MODELS + AUDIO_MODELS + VISION_MODELS + RANDOM_MODELS


class ModelUnavailable(Exception):
    """The model's library is not installed here (torchvision): the case is skipped, not failed."""


@dataclass(frozen=True)
class Structure:
    """What a model's build depends on besides its name: a hidden size and, for random stacks, a layout."""

    hidden: int = 32
    depth: int = 2
    activation: str = "gelu"


def _hf(name: str, hidden: int) -> nn.Module:
    import transformers as tf

    heads = 4
    common: dict[str, Any] = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2)
    llama_like = dict(num_hidden_layers=2, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=2,
                      intermediate_size=2 * hidden, max_position_embeddings=256, **common)
    builders: dict[str, Callable[[], nn.Module]] = {
        "gpt2": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=hidden, n_head=heads, n_positions=256,
                                                         use_cache=False, **common)),
        "gptj": lambda: tf.GPTJForCausalLM(tf.GPTJConfig(n_layer=2, n_embd=hidden, n_head=heads, rotary_dim=4,
                                                         n_positions=256, use_cache=False, **common)),
        "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(use_cache=False, **llama_like)),
        "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(use_cache=False, **llama_like)),
        "opt": lambda: tf.OPTForCausalLM(tf.OPTConfig(num_hidden_layers=2, hidden_size=hidden, ffn_dim=2 * hidden,
                                                      num_attention_heads=heads, word_embed_proj_dim=hidden,
                                                      max_position_embeddings=256, use_cache=False, **common)),
        "gpt_neox": lambda: tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(num_hidden_layers=2, hidden_size=hidden,
                                                                   num_attention_heads=heads,
                                                                   intermediate_size=2 * hidden,
                                                                   max_position_embeddings=256, use_cache=False,
                                                                   **common)),
        "bert": lambda: tf.BertModel(tf.BertConfig(num_hidden_layers=2, hidden_size=hidden, num_attention_heads=heads,
                                                   intermediate_size=2 * hidden, max_position_embeddings=256,
                                                   **common)),
        "t5_encoder": lambda: tf.T5EncoderModel(tf.T5Config(num_layers=2, d_model=hidden, d_kv=hidden // heads,
                                                            num_heads=heads, d_ff=2 * hidden, **common)),
        "wav2vec2": lambda: tf.Wav2Vec2Model(tf.Wav2Vec2Config(
            hidden_size=hidden, num_hidden_layers=2, num_attention_heads=heads, intermediate_size=2 * hidden,
            conv_dim=(32, 32, 32), conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3), num_conv_pos_embeddings=16,
            num_conv_pos_embedding_groups=4)),
    }
    return builders[name]()


def _torchvision(name: str) -> nn.Module:
    try:
        import torchvision
    except ImportError as error:
        raise ModelUnavailable(f"{name} needs torchvision: {error}") from None
    return getattr(torchvision.models, name)(weights=None)


class BranchingMLP(nn.Module):
    """A random MLP whose path depends on its input: on the row count (a Python branch, so each shape's graph
    records one path) and on the values (`tendril.cond`, decided on the device when captured)."""

    def __init__(self, structure: Structure) -> None:
        super().__init__()
        width = structure.hidden
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(structure.depth))
        self.norm = nn.LayerNorm(width)
        self.act = {"gelu": nn.GELU(), "relu": nn.ReLU(), "tanh": nn.Tanh()}[structure.activation]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for i, layer in enumerate(self.layers):
            x = self.act(layer(x))
            if x.shape[0] % 2 == i % 2:
                x = self.norm(x)
        y = tendril.cond(x.mean() > 0, lambda v: v * 2 + 1, lambda v: v.flip(-1) - 1, x)
        return y, y.softmax(-1).sum(0)


class BranchingConv(nn.Module):
    """A random conv stack that pools only inputs wider than 16 pixels and branches on its values through
    `tendril.cond`."""

    def __init__(self, structure: Structure) -> None:
        super().__init__()
        channels = max(4, structure.hidden // 4)
        blocks: list[nn.Module] = [nn.Conv2d(3, channels, 3, padding=1)]
        for _ in range(structure.depth - 1):
            blocks += [nn.BatchNorm2d(channels), nn.ReLU(), nn.Conv2d(channels, channels, 3, padding=1)]
        self.body = nn.Sequential(*blocks)
        self.head = nn.Linear(channels, 10)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.body(x)
        if y.shape[-1] > 16:
            y = nn.functional.max_pool2d(y, 2)
        pooled = tendril.cond(y.amax() > 0, lambda v: v.mean((-2, -1)), lambda v: v.amin((-2, -1)), y)
        return self.head(pooled), y


def _build(name: str, structure: Structure) -> nn.Module:
    if name in TOKEN_MODELS or name in AUDIO_MODELS:
        return _hf(name, structure.hidden)
    if name in VISION_MODELS:
        return _torchvision(name)
    return BranchingMLP(structure) if name == "mlp_branches" else BranchingConv(structure)


@functools.lru_cache(maxsize=64)
def _reference(name: str, structure: Structure) -> nn.Module:
    """The fp32 CPU model with weights fixed by its name and structure (built once: HF's initialisation is slow)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(random.Random(f"{name}/{structure}").randrange(2**31))
        return _build(name, structure).eval()


@functools.lru_cache(maxsize=128)
def build(name: str, structure: Structure, dtype: torch.dtype, device: str) -> nn.Module:
    """The model `name` with random weights fixed by its name and structure, in eval mode (cached)."""
    return copy.deepcopy(_reference(name, structure)).to(device=device, dtype=dtype).eval()


def make_input(name: str, structure: Structure, length: int, batch: int, dtype: torch.dtype, device: str,
               generator: torch.Generator) -> torch.Tensor:
    """The model's input at `length` (tokens, audio frames of 80 samples, pixels per side or rows)."""
    if name in TOKEN_MODELS:
        return torch.randint(0, VOCAB, (batch, length), generator=generator).to(device)
    if name in AUDIO_MODELS:
        return torch.randn(batch, 80 * length, generator=generator).to(device, dtype)
    if name in VISION_MODELS or name == "conv_branches":
        return torch.randn(batch, 3, length, length + 8, generator=generator).to(device, dtype)
    return torch.randn(length, structure.hidden, generator=generator).to(device, dtype)


def lengths_for(name: str) -> tuple[int, int]:
    """The range of lengths a call order of this model draws from."""
    if name in TOKEN_MODELS:
        return 1, 40
    if name in AUDIO_MODELS:
        return 5, 30
    if name in VISION_MODELS:
        return 32, 72
    if name == "conv_branches":
        return 8, 28
    return 1, 24


def clear_cache() -> None:
    """Drop the cached models."""
    build.cache_clear()
    _reference.cache_clear()
