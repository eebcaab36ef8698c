"""`tendril.graphed(model, compile=...)` on real models, unchanged, against eager over random length orders (GPU):
Inductor's kernels captured into tendril's graphs, fp32 at a tight tolerance and fp16 at a loose one."""

from __future__ import annotations

import pytest
import torch

from tendril.config import Config
from tendril.graphs.callable import GraphedCallable, graphed
from tendril.graphs.options import CompileOptions
from tests.graphs.gpu_models import fp16_logits, gpt2, run_sequence, tight, wav2vec2

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fresh_dynamo")]


def compiled(model: torch.nn.Module, tmp_path, **options) -> GraphedCallable:
    return graphed(model, compile=CompileOptions(**options), config=Config(cache_dir=tmp_path))


def token_call(max_len: int, vocab: int = 1000):
    def make(rng):
        return (torch.randint(0, vocab, (1, rng.randint(1, max_len)), device="cuda"),), {}

    return make


def recompile_reasons() -> list[str]:
    """Dynamo's record of the guards that failed, by code object (for the message of a failed compile bound)."""
    from torch._dynamo.utils import guard_failures

    return [f"{code.co_name}: {reason}" for code, reasons in guard_failures.items() for reason in reasons]


def check_all_compiled(fast: GraphedCallable, calls: int) -> None:
    stats = fast.stats.compile
    assert stats is not None and stats.state == "ready", stats
    assert fast.stats.eager_calls == 0 and fast.stats.replays == calls
    assert stats.compiled_keys == fast.stats.captures and stats.compiles >= 1


def test_gpt2_fp32_matches_eager_and_compiles_once_for_all_lengths(tmp_path):
    model = gpt2()
    fast = compiled(model, tmp_path)
    with torch.inference_mode():
        for length in (17, 1):  # a general length, then the one dynamo specialises (its frames may compile anew)
            ids = torch.randint(0, 1000, (1, length), device="cuda")
            torch.testing.assert_close(fast(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)
    settled = fast.stats.compile.compiles
    run_sequence(fast, model, token_call(64, 1000), tight, calls=40, seed=11)
    assert fast.stats.compile.compiles == settled, f"a length other than 1 recompiled: {recompile_reasons()}"
    check_all_compiled(fast, 42)


def test_gpt2_fp16_close_logits(tmp_path):
    model = gpt2(torch.float16)
    fast = compiled(model, tmp_path)
    run_sequence(fast, model, token_call(64), fp16_logits, calls=40, seed=12)
    check_all_compiled(fast, 40)


def test_llama_fp32_and_fp16(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256,
                         use_cache=False)  # fmt: skip
    for dtype, compare, seed in ((torch.float32, tight, 13), (torch.float16, fp16_logits, 14)):
        torch._dynamo.reset()
        model = LlamaForCausalLM(config).to("cuda", dtype).eval()
        fast = compiled(model, tmp_path)
        run_sequence(fast, model, token_call(64), compare, calls=30, seed=seed)
        check_all_compiled(fast, 30)


def test_bert_with_attention_mask(tmp_path):
    from transformers import BertConfig, BertModel

    config = BertConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
                        vocab_size=1000, max_position_embeddings=256)  # fmt: skip
    model = BertModel(config).to("cuda").eval()
    fast = compiled(model, tmp_path)

    def make(rng):
        length = rng.randint(2, 64)
        mask = torch.ones(1, length, dtype=torch.long, device="cuda")
        mask[:, rng.randint(1, length) :] = 0
        return (torch.randint(0, 1000, (1, length), device="cuda"),), {"attention_mask": mask}

    run_sequence(fast, model, make, tight, calls=30, seed=15)
    check_all_compiled(fast, 30)


def test_wav2vec2_at_random_audio_lengths(tmp_path):
    model = wav2vec2()
    fast = compiled(model, tmp_path)

    def make(rng):
        return (torch.randn(1, 400 * rng.randint(1, 10), device="cuda"),), {}

    run_sequence(fast, model, make, tight, calls=30, seed=16)
    check_all_compiled(fast, 30)


def test_background_compile_switches_plain_graphs_to_compiled_ones(tmp_path):
    model = gpt2(torch.float16, layers=2)
    fast = compiled(model, tmp_path, background=True)
    lengths = (5, 12, 33)
    with torch.inference_mode():
        fast.capture([torch.randint(0, 1000, (1, n), device="cuda") for n in lengths], progress=False)
    run_sequence(fast, model, token_call(40), fp16_logits, calls=20, seed=17)
    assert fast.wait_compiled(timeout=300)
    run_sequence(fast, model, token_call(40), fp16_logits, calls=30, seed=18)
    for n in lengths:
        ids = torch.randint(0, 1000, (1, n), device="cuda")
        with torch.inference_mode():
            fp16_logits(fast(ids).logits, model(ids).logits)
    stats = fast.stats.compile
    assert stats.state == "ready" and stats.switched_at_call is not None and stats.recaptured_keys == len(lengths)
    assert all(entry.compiled for entry in fast._entries.values())


def test_max_autotune_mode_without_inductor_cudagraphs(tmp_path):
    model = gpt2(layers=1)
    fast = compiled(model, tmp_path, mode="max-autotune-no-cudagraphs")
    run_sequence(fast, model, token_call(32), tight, calls=15, seed=19)
    check_all_compiled(fast, 15)
