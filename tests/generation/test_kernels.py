"""The fused decode kernels' references against HF's modules and tendril's unfused path (CPU, float32), the
fused step of every architecture against its forward, and the Triton kernels under the interpreter."""

from __future__ import annotations

import pytest
import torch

from tendril.generation import UnsupportedModelError, decode_step, generate
from tendril.generation.api import _architecture
from tendril.generation.cache import StaticKVCache
from tendril.generation.kernels import Norm, Projection, reference
from tendril.generation.loop import FUSED_PROMPT_TOKENS, DecodeLoop, Plan
from tendril.generation.processors import LogitsProcessing
from tendril.generation.state import Decoder
from tests.generation.models import hf_generate, left_padded, tiny_model
from tests.utils.interpreter import run_interpreted

FAMILIES = ["gpt2", "gptj", "llama", "mistral", "qwen2"]


def test_reference_linear_reproduces_hf_modules():
    gpt2, llama = tiny_model("gpt2"), tiny_model("llama")
    torch.manual_seed(0)
    x = torch.randn(3, 64)
    with torch.no_grad():
        block = gpt2.transformer.h[0]
        got = reference.fused_linear(x, Projection.of(block.mlp.c_fc), norm=Norm.of(block.ln_2), activation="gelu_tanh")
        torch.testing.assert_close(got, block.mlp.act(block.mlp.c_fc(block.ln_2(x))), rtol=1e-5, atol=1e-5)
        got = reference.fused_linear(x, Projection.of(block.attn.c_proj), addends=(x,))
        torch.testing.assert_close(got, x + block.attn.c_proj(x), rtol=1e-5, atol=1e-5)
        layer = llama.model.layers[1]
        mlp = layer.mlp
        gated = reference.fused_linear(x, Projection.of(mlp.gate_proj, mlp.up_proj),
                                       norm=Norm.of(layer.post_attention_layernorm), activation="silu", gated=True)
        got = reference.fused_linear(gated, Projection.of(mlp.down_proj), addends=(x,))
        torch.testing.assert_close(got, x + mlp(layer.post_attention_layernorm(x)), rtol=1e-5, atol=1e-5)
        attn = layer.self_attn
        qkv = reference.fused_linear(x, Projection.of(attn.q_proj, attn.k_proj, attn.v_proj),
                                     norm=Norm.of(layer.input_layernorm))
        normed = layer.input_layernorm(x)
        expected = torch.cat([attn.q_proj(normed), attn.k_proj(normed), attn.v_proj(normed)], dim=-1)
        torch.testing.assert_close(qkv, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2)])
def test_reference_attention_matches_the_unfused_cache(heads, kv_heads):
    torch.manual_seed(1)
    rows, max_len, head_dim, slot = 3, 12, 8, 7
    key_valid = torch.rand(rows, max_len) > 0.3
    unfused = StaticKVCache(1, rows, kv_heads, max_len, head_dim, torch.float32, torch.device("cpu"), key_valid)
    fused = StaticKVCache(1, rows, kv_heads, max_len, head_dim, torch.float32, torch.device("cpu"), key_valid)
    for cache in (unfused, fused):
        torch.manual_seed(2)
        cache.keys[0].normal_()
        cache.values[0].normal_()
    q = torch.randn(rows, heads * head_dim)
    k, v = torch.randn(rows, kv_heads * head_dim), torch.randn(rows, kv_heads * head_dim)
    slots = torch.tensor([slot])

    def heads_of(t: torch.Tensor) -> torch.Tensor:
        return t.view(rows, -1, 1, head_dim)

    expected = unfused.attend(0, heads_of(q), heads_of(k), heads_of(v), slots, unfused.attention_mask(slots), 0.3)
    got = reference.decode_attention(q, k, v, fused.keys[0], fused.values[0], key_valid, slots, 0.3)
    torch.testing.assert_close(got, expected.reshape(rows, -1), rtol=1e-5, atol=1e-5)
    assert torch.equal(fused.keys[0], unfused.keys[0]) and torch.equal(fused.values[0], unfused.values[0])


def _attention_operands(tokens: int = 3) -> dict:
    rows, kv_heads, max_len, head_dim = 2, 2, 8, 16
    return dict(q=torch.zeros(rows * tokens, 4 * head_dim), k=torch.zeros(rows * tokens, kv_heads * head_dim),
                v=torch.zeros(rows * tokens, kv_heads * head_dim), keys=torch.zeros(rows, kv_heads, max_len, head_dim),
                values=torch.zeros(rows, kv_heads, max_len, head_dim),
                key_valid=torch.ones(rows, max_len, dtype=torch.bool), scale=0.25)


@pytest.mark.parametrize("change, match", [
    (dict(q=torch.zeros(5, 64)), "same number of tokens for each of 2 rows"),
    (dict(q=torch.zeros(18, 64), k=torch.zeros(18, 32), v=torch.zeros(18, 32)), "does not fit a cache of 8 slots"),
    (dict(values=torch.zeros(2, 2, 9, 16)), "keys and values must share shape"),
    (dict(k=torch.zeros(6, 16)), r"k must be \[6, 32\]"),
    (dict(q=torch.zeros(6, 48)), "3 query heads are not a multiple of 2 kv heads"),
    (dict(key_valid=torch.ones(2, 8)), "key_valid must be a bool"),
    (dict(rotary=("half", torch.zeros(6, 3), torch.zeros(6, 3))), "rotary cos/sin must be"),
])
def test_prompt_attention_refuses_malformed_operands(change, match):
    """Checked before any launch (here on the CPU, where none could run)."""
    from tendril.generation.kernels import prompt_kernel

    with pytest.raises(ValueError, match=match):
        prompt_kernel.prompt_attention(**{**_attention_operands(), **change})


@pytest.mark.parametrize("change, match", [
    (dict(values=torch.zeros(2, 2, 9, 16)), "keys and values must share shape"),
    (dict(k=torch.zeros(2, 16)), r"k must be \[2, 32\]"),
    (dict(rotary=("half", torch.zeros(2, 3), torch.zeros(2, 3))), "rotary cos/sin must be"),
    (dict(slot=torch.zeros(2, dtype=torch.long)), "slot must be a one-element int64 tensor"),
])
def test_decode_attention_refuses_malformed_operands(change, match):
    from tendril.generation.kernels import attention

    operands = {**_attention_operands(tokens=1), "slot": torch.zeros(1, dtype=torch.long), **change}
    with pytest.raises(ValueError, match=match):
        attention.decode_attention(**operands)


def _step_inputs_operands() -> dict:
    return dict(sequences=torch.zeros(2, 9, dtype=torch.long), counter=torch.zeros((), dtype=torch.long), offset=4,
                position_base=torch.zeros(2, dtype=torch.long), tokens=torch.zeros(11, 8),
                positions=torch.zeros(7, 8), rotary=torch.zeros(7, 2, 4))


@pytest.mark.parametrize("change, match", [
    (dict(sequences=torch.zeros(2, 9)), "sequences must be an int64"),
    (dict(counter=torch.zeros(2, dtype=torch.long)), "counter must be a one-element int64"),
    (dict(position_base=torch.zeros(3, dtype=torch.long)), r"position_base must be a contiguous int64 \[2\]"),
    (dict(positions=torch.zeros(7, 6)), "positions must be a contiguous"),
    (dict(rotary=torch.zeros(7, 3, 4)), "rotary must be a"),
    (dict(out=(torch.zeros(2, 8), None)), "out's rotary rows must be"),
    (dict(out=(torch.zeros(2, 8, dtype=torch.float16), torch.zeros(2, 2, 4))), "out's hidden must be"),
])
def test_step_inputs_refuses_malformed_operands(change, match):
    """Checked before any launch (here on the CPU, where none could run)."""
    from tendril.generation.kernels import step_inputs_kernel

    with pytest.raises(ValueError, match=match):
        step_inputs_kernel.step_inputs(**{**_step_inputs_operands(), **change})


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_step_matches_the_architecture_forward(family):
    """The fused forward over a left-padded prompt (the prompt pass) and then over one token a row (decode steps):
    logits and every cache slot as the architecture's own forward computes them."""
    model = tiny_model(family)
    arch = _architecture(model)
    ids, mask = left_padded([6, 3, 5])
    no_eos, key = torch.tensor([], dtype=torch.long), torch.zeros((), dtype=torch.long)
    fused = arch.fused_step()
    decoders = [Decoder.build(arch, ids, mask, 6, LogitsProcessing(), no_eos, key, torch.float32, step,
                              prompt_forward=step) for step in (None, fused)]
    tokens = torch.tensor([7, 9, 11])
    with torch.no_grad():
        unfused_prompt, fused_prompt = (decoder.prefill() for decoder in decoders)
        torch.testing.assert_close(fused_prompt, unfused_prompt, rtol=1e-4, atol=1e-4)
        logits = []
        for offset in range(3):
            slot = torch.tensor(ids.shape[1] + offset)
            logits.append([decoder.step(tokens + offset, slot) for decoder in decoders])
    for unfused, fused in logits:
        torch.testing.assert_close(fused, unfused, rtol=1e-4, atol=1e-4)
    for a, b in zip(decoders[0].cache.keys + decoders[0].cache.values,
                    decoders[1].cache.keys + decoders[1].cache.values, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family, options", [("gpt2", dict(num_beams=3, num_return_sequences=2)),
                                             ("llama", dict(num_beams=2, length_penalty=0.5)),
                                             *((family, dict()) for family in FAMILIES)])
def test_fused_generate_matches_hf(family, options):
    model = tiny_model(family)
    ids, mask = left_padded([5, 3])
    expected = hf_generate(model, ids, mask, None, max_new_tokens=6, **options)
    got = generate(model, ids, mask, max_new_tokens=6, eos_token_id=[], pad_token_id=0, step="fused",
                   **options)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("step, num_beams, table", [("fused", 3, True), ("fused", 1, False), ("eager", 3, False)])
def test_only_fused_beam_search_reorders_through_a_row_table(step, num_beams, table):
    model = tiny_model("gpt2")
    plan = Plan.build(max_new_tokens=4, processing=LogitsProcessing(), eos=(), pad=0, num_beams=num_beams, step=step)
    ids = left_padded([4])[0].repeat_interleave(num_beams, dim=0)
    key = torch.zeros((), dtype=torch.long)
    search = DecodeLoop(model, _architecture(model), plan).search(ids, torch.ones_like(ids), key)
    assert (search.decoder.cache.source_rows is not None) == table


@pytest.mark.parametrize("step, rows, tokens, fused_prompt", [
    ("fused", 4, FUSED_PROMPT_TOKENS // 4, True), ("fused", 1, FUSED_PROMPT_TOKENS + 1, False),
    ("eager", 1, 4, False)])
def test_the_fused_step_runs_short_prompts_and_leaves_longer_ones_to_the_model(step, rows, tokens, fused_prompt):
    model = tiny_model("gpt2")
    plan = Plan.build(max_new_tokens=2, processing=LogitsProcessing(), eos=(), pad=0, step=step)
    loop = DecodeLoop(model, _architecture(model), plan)
    ids = torch.ones(rows, tokens, dtype=torch.long)
    search = loop.search(ids, torch.ones_like(ids), torch.zeros((), dtype=torch.long))
    assert search.decoder.prompt_forward is (loop.step_forward if fused_prompt else None)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_fused_beam_steps_through_the_row_table_follow_the_copying_eager_steps(family):
    """Beam states stepped by the fused step (cache reordered through its row table) and by the eager step
    (cache copied): same sequences and source beams, scores equal up to summation order; again after a
    prompt pass of another prompt on the same buffers (the table is reset by it)."""
    model = tiny_model(family)
    first, second = left_padded([5, 5])[0], left_padded([5, 5], seed=1)[0]
    states = [decode_step(model, first, max_new_tokens=6, num_beams=3, step=step) for step in ("eager", "fused")]
    for prompt in (None, second):
        for state in states:
            if prompt is not None:
                state.restart(prompt)
            for _ in range(4):
                state.step()
        for eager, fused in zip(*(state.buffers for state in states), strict=True):
            if eager.is_floating_point():
                torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-5)
            else:
                assert torch.equal(fused, eager)


def test_step_values_are_checked(gpt2):
    ids, mask = left_padded([3])
    with pytest.raises(ValueError, match="step must be one of 'eager', 'compiled', 'fused', got 'fast'"):
        generate(gpt2, ids, mask, max_new_tokens=2, step="fast")
    with pytest.raises(ValueError, match="does not support compile_step"):
        generate(gpt2, ids, mask, max_new_tokens=2, compile_step=True)
    model = tiny_model("gpt2")
    model.config.activation_function = "gelu_fast"
    with pytest.raises(UnsupportedModelError, match="activation 'gelu_fast'"):
        generate(model, ids, mask, max_new_tokens=2, step="fused")


def test_projection_and_norm_read_hf_modules():
    gpt2 = tiny_model("gpt2")
    attn = gpt2.transformer.h[0].attn
    projection = Projection.of(attn.c_attn)
    assert projection.in_features == 64 and projection.out_sizes == (192,)
    assert projection.weights[0].data_ptr() == attn.c_attn.weight.data_ptr()  # a view, not a copy
    with pytest.raises(ValueError, match=r"neither nn\.Linear nor Conv1D"):
        Projection.of(gpt2.transformer.h[0].ln_1)
    with pytest.raises(ValueError, match="share dtype"):
        Projection.of(attn.c_attn, torch.nn.Linear(32, 8))
    assert Norm.of(tiny_model("llama").model.norm).kind == "rms"


def test_triton_kernels_match_their_references_under_the_interpreter():
    run_interpreted("tests.generation.interpreted_kernels", "interpreted checks passed")


def _gpt2_projection(out_f: int, in_f: int, conv1d: bool, dtype: torch.dtype = torch.float16) -> Projection:
    w = torch.zeros(out_f, in_f, dtype=dtype)
    bias = torch.zeros(out_f, dtype=dtype) if conv1d else None
    return Projection((w.t().contiguous().t() if conv1d else w,), (bias,))


def test_decode_kernels_compile_for_hopper():
    """The kernels as a GPT-2 / Llama decode launches them (PDL on) compile for sm_90: type errors the
    interpreter cannot see (hopper_compile.py)."""
    from tendril.generation.kernels import argmax_kernel, attention, linear, step_inputs_kernel
    from tests.generation.hopper_compile import hopper_compile

    half = torch.float16
    norm = Norm("layer", torch.ones(768, dtype=half), torch.zeros(768, dtype=half), 1e-5)
    x, wide = torch.zeros(1, 768, dtype=half), torch.zeros(4, 3072, dtype=half)
    gate, up = (Projection((torch.zeros(64, 48, dtype=half), torch.zeros(64, 48, dtype=half)), (None, None)),
                torch.zeros(4, 48, dtype=half))
    rms = Norm("rms", torch.ones(48, dtype=half), None, 1e-6)
    launches = [
        lambda: linear.fused_linear(x, _gpt2_projection(2304, 768, True), norm=norm, pdl=True),
        lambda: linear.fused_linear(wide[:1], _gpt2_projection(768, 3072, True), addends=(x,), pdl=True),
        lambda: linear.fused_linear(x, _gpt2_projection(50257, 768, False), norm=norm, pdl=True,
                                    out=torch.zeros(1, 50257)),
        lambda: linear.fused_linear(wide, _gpt2_projection(16, 3072, True),
                                    norm=Norm("layer", torch.ones(3072, dtype=half), None, 1e-5), pdl=True),
        lambda: linear.fused_linear(up, gate, norm=rms, activation="silu", gated=True, pdl=True),
    ]
    for launch in launches:
        assert hopper_compile(linear._fused_linear_kernel, launch) == 1
    cache = torch.zeros(1, 2, 144, 32, dtype=half)
    qkv = torch.zeros(1, 3 * 64, dtype=half)
    q, k, v = qkv.split(64, dim=1)
    tables = torch.zeros(1, 32, dtype=half)
    assert hopper_compile(attention._decode_attention_kernel, lambda: attention.decode_attention(
        q, k, v, cache, cache.clone(), torch.ones(1, 144, dtype=torch.bool), torch.zeros(1, dtype=torch.long),
        0.125, ("half", tables, tables), pdl=True)) == 1
    beams = torch.zeros(4, 12, 144, 64, dtype=half)  # GPT-2's 4-beam step reads through the row table
    q4, k4, v4 = torch.zeros(4, 3 * 768, dtype=half).split(768, dim=1)
    assert hopper_compile(attention._decode_attention_kernel, lambda: attention.decode_attention(
        q4, k4, v4, beams, beams.clone(), torch.ones(4, 144, dtype=torch.bool), torch.zeros(1, dtype=torch.long),
        0.125, source_rows=torch.zeros(4, 144, dtype=torch.int32), pdl=True)) == 1
    for eos in (torch.tensor([50256]), torch.zeros(0, dtype=torch.long)):  # with and without the eos test
        assert hopper_compile(argmax_kernel._greedy_kernel, lambda eos=eos: hopper_compile(
            argmax_kernel._chunk_argmax_kernel, lambda: argmax_kernel.greedy_choice(
                torch.zeros(1, 50257), torch.zeros((), dtype=torch.long), torch.zeros(1, 144, dtype=torch.long),
                torch.ones(1, dtype=torch.bool), eos, 50256, 16, 128, pdl=True))) == 1
    assert hopper_compile(step_inputs_kernel._step_inputs_kernel, lambda: step_inputs_kernel.step_inputs(
        torch.zeros(4, 144, dtype=torch.long), torch.zeros(1, dtype=torch.long), 15, torch.zeros(4, dtype=torch.long),
        torch.zeros(50257, 768, dtype=half), torch.zeros(1024, 768, dtype=half), None, pdl=True)) == 1


def test_bf16_llama_kernels_compile_for_hopper():
    """A bf16 Llama step's launches (RMSNorm + q/k/v, rotary attention over a bf16 cache, RMSNorm + gated
    SiLU, down + residual, the LM head widened to float32) and its prompt pass's compile for sm_90 with PDL on."""
    from tendril.generation.kernels import attention, linear, prompt_kernel, step_inputs_kernel
    from tests.generation.hopper_compile import hopper_compile

    bf16 = torch.bfloat16
    x = torch.zeros(1, 64, dtype=bf16)
    rms = Norm("rms", torch.ones(64, dtype=bf16), None, 1e-5)
    qkv = Projection(tuple(torch.zeros(n, 64, dtype=bf16) for n in (64, 32, 32)), (None, None, None))
    gate_up = Projection((torch.zeros(96, 64, dtype=bf16), torch.zeros(96, 64, dtype=bf16)), (None, None))
    down = Projection((torch.zeros(64, 96, dtype=bf16),), (None,))
    head = Projection((torch.zeros(1000, 64, dtype=bf16),), (None,))
    launches = [
        lambda: linear.fused_linear(x, qkv, norm=rms, pdl=True),
        lambda: linear.fused_linear(x, gate_up, norm=rms, activation="silu", gated=True, pdl=True),
        lambda: linear.fused_linear(torch.zeros(1, 96, dtype=bf16), down, addends=(x,), pdl=True),
        lambda: linear.fused_linear(x, head, norm=rms, out_dtype=torch.float32, pdl=True),
    ]
    for launch in launches:
        assert hopper_compile(linear._fused_linear_kernel, launch) == 1
    cache = torch.zeros(1, 2, 144, 16, dtype=bf16)
    q, k, v = torch.zeros(1, 64, dtype=bf16), torch.zeros(1, 32, dtype=bf16), torch.zeros(1, 32, dtype=bf16)
    tables = torch.zeros(1, 16, dtype=bf16)
    assert hopper_compile(attention._decode_attention_kernel, lambda: attention.decode_attention(
        q, k, v, cache, cache.clone(), torch.ones(1, 144, dtype=torch.bool), torch.zeros(1, dtype=torch.long),
        0.25, ("half", tables, tables), pdl=True, slot_offset=15)) == 1
    assert hopper_compile(step_inputs_kernel._step_inputs_kernel, lambda: step_inputs_kernel.step_inputs(
        torch.zeros(1, 144, dtype=torch.long), torch.zeros(1, dtype=torch.long), 15, torch.zeros(1, dtype=torch.long),
        torch.zeros(128256, 64, dtype=bf16), None, torch.zeros(144, 2, 16, dtype=bf16), pdl=True)) == 1
    # the prompt pass: 16 tokens through the tensor-core projection and the prompt's attention
    prompt = torch.zeros(16, 64, dtype=bf16)
    assert hopper_compile(linear._fused_linear_kernel,
                          lambda: linear.fused_linear(prompt, qkv, norm=rms, pdl=True)) == 1
    q16, k16, v16, tables16 = prompt, prompt[:, :32], prompt[:, 32:], torch.zeros(16, 16, dtype=bf16)
    assert hopper_compile(prompt_kernel._prompt_attention_kernel, lambda: prompt_kernel.prompt_attention(
        q16, k16, v16, cache, cache.clone(), torch.ones(1, 144, dtype=torch.bool), 0.25, ("half", tables16, tables16),
        pdl=True)) == 1


def test_streaming_kernels_compile_for_hopper():
    """The token ring's publishing kernel and the clock kernel (the device's global timer, inline PTX)."""
    from tendril.generation.kernels import publish
    from tests.generation.hopper_compile import hopper_compile

    words, stamps = torch.zeros(5, dtype=torch.long), torch.zeros(5, dtype=torch.long)
    one = torch.ones((), dtype=torch.long)
    assert hopper_compile(publish._publish_kernel, lambda: publish.publish(
        words, stamps, torch.ones((), dtype=torch.bool), one, torch.ones(1, dtype=torch.long), 32)) == 1
    assert hopper_compile(publish._clock_kernel, lambda: publish._clock_kernel[(1,)](words)) == 1
    with pytest.raises(ValueError, match="one shape"):
        publish.publish(words, stamps[:4], torch.ones((), dtype=torch.bool), one, one, 32)
    with pytest.raises(ValueError, match="CUDA tensor"):
        publish.device_clock(words)


def test_programmatic_launch_is_off_without_a_hopper_gpu(monkeypatch):
    from tendril import config
    from tendril.generation.kernels import pdl

    assert not pdl.enabled(torch.device("cpu"))
    monkeypatch.setattr(config, "settings", config.Config(pdl=False))
    assert not pdl.enabled(torch.device("cuda"))  # switched off before the device is asked


def test_programmatic_launch_is_never_asked_of_the_interpreter():
    from tendril.generation.kernels import linear, pdl

    assert pdl.resolve(True, torch.device("cpu"), linear._fused_linear_kernel)  # a compiled kernel may be asked

    def interpreted_kernel() -> None:  # what Triton's interpreter puts in place of a JIT function
        pass

    assert not pdl.resolve(True, torch.device("cpu"), interpreted_kernel)
    assert not pdl.resolve(None, torch.device("cpu"), interpreted_kernel)
