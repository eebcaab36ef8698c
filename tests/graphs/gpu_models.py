"""Small random-weight models and a checker shared by the GPU tests of `tendril.graphed`."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from tendril.config import Config
from tendril.graphs.callable import GraphedCallable, graphed


def gpt2(dtype: torch.dtype = torch.float32, layers: int = 4, vocab: int = 1000) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=layers, n_embd=256, n_head=4, vocab_size=vocab, n_positions=512, use_cache=False)
    return GPT2LMHeadModel(config).to("cuda", dtype).eval()


def gptj(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from transformers import GPTJConfig, GPTJForCausalLM

    config = GPTJConfig(n_layer=2, n_embd=256, n_head=4, rotary_dim=16, vocab_size=1000, n_positions=512)
    config.use_cache = False
    return GPTJForCausalLM(config).to("cuda", dtype).eval()


def wav2vec2() -> torch.nn.Module:
    from transformers import Wav2Vec2Config, Wav2Vec2Model

    config = Wav2Vec2Config(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=256,
        conv_dim=(64, 64, 64),
        conv_stride=(5, 2, 2),
        conv_kernel=(10, 3, 3),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4,
    )
    return Wav2Vec2Model(config).to("cuda").eval()


def fast(fn: Callable[..., Any], **options: Any) -> GraphedCallable:
    return graphed(fn, config=options.pop("config", Config()), **options)


def tensors(tree: Any) -> list[torch.Tensor]:
    return [leaf for leaf in pytree.tree_leaves(tree) if isinstance(leaf, torch.Tensor)]


def run_sequence(
    graphed_fn: GraphedCallable,
    eager_fn: Callable[..., Any],
    make_call: Callable[[random.Random], tuple[tuple[Any, ...], dict[str, Any]]],
    compare: Callable[[torch.Tensor, torch.Tensor], None],
    calls: int = 50,
    seed: int = 0,
) -> None:
    """`calls` random calls, graphed against eager; every returned tensor is then poisoned with NaN so
    the next replay of the same graph must overwrite all of it."""
    rng = random.Random(seed)
    with torch.inference_mode():
        for _ in range(calls):
            args, kwargs = make_call(rng)
            expected = tensors(eager_fn(*args, **kwargs))
            got = tensors(graphed_fn(*args, **kwargs))
            assert len(got) == len(expected)
            for g, e in zip(got, expected, strict=True):
                assert g.shape == e.shape
                compare(g, e)
            for g in got:
                if g.is_floating_point():
                    g.fill_(float("nan"))


def tight(got: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def fp16_logits(got: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)
    if got.dim() >= 2 and got.shape[-1] > 1:
        top2 = expected.float().topk(2, dim=-1).values
        decided = (top2[..., 0] - top2[..., 1]) > 2e-2  # positions whose argmax is not a near tie
        assert torch.equal(got.argmax(-1)[decided], expected.argmax(-1)[decided])
