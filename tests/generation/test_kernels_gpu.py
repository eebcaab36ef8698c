"""On the GPU: the fused decode kernels against their references (every option, odd and GPT-2 124M sizes,
NaN-poisoned outputs), and `step="fused"` graphed end to end, exact against HF for every family (fp32, fp16
on the tiny models) or up to near ties (bf16)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.cases.decode_models import TIE_ULPS, tie_gap_ulps
from benchmarks.tools.linear_sweep import SWEEP_SHAPES
from tendril.generation import generate
from tendril.generation.api import _state, graphed_runners, release_graphs
from tendril.generation.kernels import launch, linear, reference
from tendril.generation.kernels.layers import Norm, Projection
from tendril.generation.loop import FUSED_PROMPT_TOKENS
from tendril.generation.noise import draw_key
from tests.generation.kernel_cases import (
    check_argmax,
    check_attention,
    check_attention_through_rows,
    check_greedy_choice,
    check_linear,
    check_prompt_attention,
    check_step_inputs,
    check_weight_copies,
)
from tests.generation.models import hf_generate, left_padded, tiny_model

pytestmark = pytest.mark.gpu
NEW = 16


@pytest.mark.parametrize("pdl", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_linear_kernel_matches_reference(dtype, pdl):
    assert check_linear(dtype, "cuda", rows=1, pdl=pdl) > 0
    assert check_weight_copies(dtype, "cuda") > 0
    assert check_linear(dtype, "cuda", rows=4, pdl=pdl) > 0
    assert check_linear(dtype, "cuda", rows=6, launches=((None, None, None),), pdl=pdl) > 0  # a half-full row group


def test_argmax_kernel_matches_torch():
    assert check_argmax("cuda") > 0


def test_greedy_choice_kernel_matches_its_reference():
    assert check_greedy_choice("cuda") > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_step_inputs_kernel_matches_its_reference(dtype):
    assert check_step_inputs(dtype, "cuda") > 0



@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_attention_kernel_matches_reference_without_spilling(dtype):
    from tendril.generation.kernels import attention

    forget_compiled(attention._decode_attention_kernel)
    assert check_attention(dtype, "cuda") > 0
    spilled = {key: spills for key, spills in compiled_spills(attention._decode_attention_kernel).items() if spills}
    assert not spilled, spilled


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_prompt_attention_kernel_matches_reference_without_spilling(dtype):
    from tendril.generation.kernels import prompt_kernel

    forget_compiled(prompt_kernel._prompt_attention_kernel)
    assert check_prompt_attention(dtype, "cuda") > 0
    spilled = {key: spills for key, spills in compiled_spills(prompt_kernel._prompt_attention_kernel).items() if spills}
    assert not spilled, spilled


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_attention_kernel_reads_through_a_row_table(dtype):
    assert check_attention_through_rows(dtype, "cuda") > 0


@pytest.mark.parametrize("out_f, in_f, conv1d", [(2304, 768, True), (768, 3072, True), (50257, 768, False)])
def test_linear_kernel_at_gpt2_sizes(out_f, in_f, conv1d):
    torch.manual_seed(0)
    w = (torch.randn(out_f, in_f, device="cuda") * 0.02).half()
    if conv1d:
        w = w.t().contiguous().t()
    projection = Projection((w,), (None if not conv1d else (torch.randn(out_f, device="cuda") * 0.02).half(),))
    norm = Norm("layer", torch.rand(in_f, device="cuda").half() + 0.5, torch.randn(in_f, device="cuda").half(), 1e-5)
    x = torch.randn(1, in_f, device="cuda").half()
    out = torch.full((1, out_f), float("nan"), device="cuda", dtype=torch.float16)
    got = linear.fused_linear(x, projection, norm=norm, out=out)
    expected = reference.fused_linear(x, projection, norm=norm)
    assert not got.isnan().any()
    torch.testing.assert_close(got, expected, rtol=4e-3, atol=4e-3)


def forget_compiled(kernel) -> None:
    """Drop `kernel`'s compiled variants, so that `compiled_spills` sees only the launches that follow."""
    for cache in kernel.device_caches.values():
        cache[0].clear()


def compiled_spills(kernel) -> dict[str, int]:
    """Bytes spilled by every variant of `kernel` compiled in this process since `forget_compiled` (as launched:
    Triton's own argument specialization, which a compile without a GPU lacks), by cache key."""
    spills = {}
    for cache in kernel.device_caches.values():
        for key, compiled in cache[0].items():
            compiled._init_handles()
            spills[str(key)] = compiled.n_spills
    return spills


SHAPES = [(*shape, False)[:8] for shape in SWEEP_SHAPES["gpt2"] + SWEEP_SHAPES["llama1b"]]  # gated: False unless set


def _model_sized_case(out_f: int, in_f: int, layout: str, norm_kind: str | None, activation: str, residual: bool,
                      gated: bool, dtype: torch.dtype, rows: int
                      ) -> tuple[torch.Tensor, Projection, dict, torch.Tensor]:
    """x, the projection, `fused_linear`'s options and the reference's result for one of `SHAPES` at `rows` rows."""
    torch.manual_seed(0)
    segments = 2 if gated else 1
    w = (torch.randn(segments * out_f, in_f, device="cuda") * 0.02).to(dtype)
    if layout == "conv1d":
        w = w.t().contiguous().t()
    bias = (torch.randn(segments * out_f, device="cuda") * 0.02).to(dtype) if layout == "conv1d" else None
    projection = Projection(w.split(out_f), (None,) * segments if bias is None else bias.split(out_f))
    norm = None if norm_kind is None else Norm(
        norm_kind, (torch.rand(in_f, device="cuda") + 0.5).to(dtype),
        torch.randn(in_f, device="cuda").to(dtype) if norm_kind == "layer" else None, 1e-5)
    x = torch.randn(rows, in_f, device="cuda").to(dtype)
    options = dict(norm=norm, activation=activation, gated=gated,
                   addends=(torch.randn(rows, out_f, device="cuda").to(dtype),) if residual else ())
    return x, projection, options, reference.fused_linear(x, projection, **options)


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    return dict(rtol=4e-3, atol=4e-3) if dtype == torch.float16 else dict(rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("label, out_f, in_f, layout, norm_kind, activation, residual, gated", SHAPES,
                         ids=[shape[0] for shape in SHAPES])
def test_linear_tensor_core_and_cuda_core_paths_at_model_sizes(label, out_f, in_f, layout, norm_kind, activation,
                                                                 residual, gated, dtype):
    """A 4-beam step's projections of GPT-2 and Llama-3.2-1B in their models' layouts: the tensor-core path (the
    default at 4 rows there) and the CUDA-core path each match the reference, so each other up to the order of their
    float32 sums, as does the greedy step's default launch (one row), and no launch spills registers."""
    rows = 4
    x, projection, options, expected = _model_sized_case(out_f, in_f, layout, norm_kind, activation, residual, gated,
                                                         dtype, rows)
    assert launch.launch_config((2 if gated else 1) * out_f, in_f, rows, k_contiguous=layout == "linear").dot
    results = []
    forget_compiled(linear._fused_linear_kernel)  # other tests' launches (other dtypes, tiles) are not checked here
    for dot in (None, True, False):
        for _ in range(2):  # a split launch leaves its counters at zero for the next
            out = torch.full((rows, out_f), float("nan"), device="cuda", dtype=dtype)
            got = linear.fused_linear(x, projection, out=out, dot=dot, **options)
            assert not got.isnan().any() and not projection.split_k_counters.any()
            torch.testing.assert_close(got, expected, **_tolerance(dtype))
        results.append(got)
    assert torch.equal(results[0], results[1])  # the default is the tensor-core path
    torch.testing.assert_close(results[1], results[2], **_tolerance(dtype))
    one_row = {**options, "addends": tuple(addend[:1] for addend in options["addends"])}
    out = torch.full((1, out_f), float("nan"), device="cuda", dtype=dtype)
    torch.testing.assert_close(linear.fused_linear(x[:1], projection, out=out, **one_row), expected[:1],
                               **_tolerance(dtype))
    spilled = {key: spills for key, spills in compiled_spills(linear._fused_linear_kernel).items() if spills}
    assert not spilled, spilled


GPT2_LAYERS = [shape for shape in SHAPES if shape[3] == "conv1d"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("label, out_f, in_f, layout, norm_kind, activation, residual, gated", GPT2_LAYERS,
                         ids=[shape[0] for shape in GPT2_LAYERS])
def test_gpt2_layers_of_2_to_4_rows_on_their_copies_take_deep_cuda_core_tiles(label, out_f, in_f, layout, norm_kind,
                                                                             activation, residual, gated, dtype):
    """GPT-2's layer projections with their K-contiguous copies, as its beam steps read them: 2, 3 and 4 rows
    launch on CUDA cores over deep tiles (`launch._few_rows_deep`), read the copies, match the reference into
    NaN-poisoned outputs, equal the tensor-core path up to the order of float32 sums, and spill no registers."""
    forget_compiled(linear._fused_linear_kernel)
    for rows in (2, 3, 4):
        x, model_layout, options, expected = _model_sized_case(out_f, in_f, layout, norm_kind, activation, residual,
                                                               gated, dtype, rows)
        projection = model_layout.with_copies()
        assert projection.copy_rows == 4 and projection.weights_for(rows) == projection.copies
        assert not launch.launch_config(out_f, in_f, rows, k_contiguous=True).dot
        out = torch.full((rows, out_f), float("nan"), device="cuda", dtype=dtype)
        got = linear.fused_linear(x, projection, out=out, **options)
        torch.testing.assert_close(got, expected, **_tolerance(dtype))
        torch.testing.assert_close(got, linear.fused_linear(x, projection, dot=True, **options), **_tolerance(dtype))
    spilled = {key: spills for key, spills in compiled_spills(linear._fused_linear_kernel).items() if spills}
    assert not spilled, spilled


@pytest.mark.parametrize("family", ["gpt2", "gptj", "llama", "mistral", "qwen2"])
@pytest.mark.parametrize("num_beams", [1, 4])
def test_fused_generation_is_graphed_and_matches_hf(family, num_beams):
    model = tiny_model(family, device="cuda")
    ids, mask = left_padded([7, 3, 5], device="cuda")
    options = dict(num_beams=num_beams, num_return_sequences=2 if num_beams > 1 else 1)
    expected = hf_generate(model, ids, mask, None, max_new_tokens=NEW, **options)
    for _ in range(2):  # capture, then replay
        got = generate(model, ids, mask, max_new_tokens=NEW, eos_token_id=[], pad_token_id=0, step="fused",
                       **options)
        assert torch.equal(got, expected), (got, expected)
    other_ids, other_mask = left_padded([2, 7, 6], seed=5, device="cuda")
    expected = hf_generate(model, other_ids, other_mask, None, max_new_tokens=NEW, **options)
    got = generate(model, other_ids, other_mask, max_new_tokens=NEW, eos_token_id=[], pad_token_id=0,
                   step="fused", **options)
    assert torch.equal(got, expected)
    (runner,) = graphed_runners(model)
    assert len(runner.stats.graphs) == 1 and runner.stats.replays == 3 and runner.stats.eager_calls == 0, (
        runner.stats.fallback_details)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_fused_fp16_greedy_matches_hf(family):
    model = tiny_model(family, device="cuda", dtype=torch.float16)
    ids, mask = left_padded([6, 4], device="cuda")
    expected = hf_generate(model, ids, mask, None, max_new_tokens=NEW)
    got = generate(model, ids, mask, max_new_tokens=NEW, eos_token_id=[], pad_token_id=0, step="fused")
    assert torch.equal(got, expected)


def test_fused_generation_leaves_a_long_prompt_to_the_model_and_matches_hf():
    """A prompt longer than `FUSED_PROMPT_TOKENS` runs the model's own forward, then the fused decode steps."""
    model = tiny_model("llama", device="cuda")
    ids, mask = left_padded([FUSED_PROMPT_TOKENS + 3, FUSED_PROMPT_TOKENS - 5], device="cuda")
    expected = hf_generate(model, ids, mask, None, max_new_tokens=NEW)
    got = generate(model, ids, mask, max_new_tokens=NEW, eos_token_id=[], pad_token_id=0, step="fused")
    assert torch.equal(got, expected)


def test_fused_llama_replays_a_shorter_loop_after_a_longer_one():
    """A longer cache gives the fused step another rotary table; the graph captured for the shorter loop goes on
    reading its own (were it freed, its memory could hold anything by the replay). In float32, where the fused
    step's tokens equal HF's."""
    model = tiny_model("llama", device="cuda")
    ids, mask = left_padded([6, 4], device="cuda")
    for new_tokens in (NEW, 3 * NEW, NEW, 3 * NEW):  # captured, captured, replayed, replayed
        expected = hf_generate(model, ids, mask, None, max_new_tokens=new_tokens)
        got = generate(model, ids, mask, max_new_tokens=new_tokens, eos_token_id=[], pad_token_id=0, step="fused")
        assert torch.equal(got, expected), new_tokens


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2"])
def test_fused_bf16_greedy_is_hf_up_to_near_ties(family):
    """bf16 through the fused step, graphed: HF's tokens, or tokens HF itself (teacher-forced) scores within
    `TIE_ULPS` bf16 ulps of its best at every step, on several prompts."""
    model = tiny_model(family, device="cuda", dtype=torch.bfloat16)
    identical = 0
    for seed in range(4):
        ids, mask = left_padded([6], seed=seed, device="cuda")
        expected = hf_generate(model, ids, mask, None, max_new_tokens=NEW)
        got = generate(model, ids, mask, max_new_tokens=NEW, eos_token_id=[], pad_token_id=0, step="fused")
        assert got.shape == expected.shape
        identical += bool(torch.equal(got, expected))
        assert torch.equal(got, expected) or tie_gap_ulps(model, got, ids.shape[1]) <= TIE_ULPS, (got, expected)
    assert identical >= 2  # near ties are the exception
    (runner,) = graphed_runners(model)
    assert runner.stats.eager_calls == 0 and runner.stats.replays >= 3, runner.stats.fallback_details


@pytest.mark.parametrize("num_beams", [1, 4])
def test_fused_bf16_llama_1b_layer_shape_runs_graphed(num_beams):
    """A layer of Llama-3.2-1B's shape (hidden 2048, 32/8 heads, head 64, intermediate 8192, a vocabulary past
    one argmax chunk) in bf16: the fused step runs graphed, and greedy follows HF up to near ties."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=1, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=20000, tie_word_embeddings=True,
                         max_position_embeddings=256, rope_theta=500000.0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    ids = torch.randint(0, 20000, (1, 16), device="cuda")
    mask = torch.ones_like(ids)
    options = dict(max_new_tokens=NEW, num_beams=num_beams)
    got = generate(model, ids, mask, eos_token_id=[], pad_token_id=0, step="fused", **options)
    expected = hf_generate(model, ids, mask, None, **options)
    assert got.shape == expected.shape and not (got < 0).any()
    if num_beams == 1:
        assert torch.equal(got, expected) or tie_gap_ulps(model, got, 16) <= TIE_ULPS, (got, expected)
    (runner,) = graphed_runners(model)
    assert runner.stats.eager_calls == 0, runner.stats.fallback_details


def test_fused_replay_does_not_sync_with_the_host():
    model = tiny_model("gpt2", device="cuda")
    ids, mask = left_padded([5, 5], device="cuda")
    generate(model, ids, mask, max_new_tokens=NEW, eos_token_id=3, pad_token_id=0, step="fused")
    (runner,) = graphed_runners(model)
    (plan,) = _state(model).loops.by_plan
    key = draw_key(ids.device, 1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        runner(plan, ids, mask, key)
        runner(plan, ids, mask, key)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert runner.stats.replays == 3 and runner.stats.eager_calls == 0


def test_loop_graph_captures_when_the_capture_stream_is_the_pooled_body_stream():
    """The #6 beam failure (CAPTURE_ERROR, cudaStreamBeginCaptureToGraph: cudaErrorIllegalState): torch hands
    out `torch.cuda.Stream()`s round robin from a pool of 32, and both the graphed runner's capture stream (one
    per new runner) and the loop body's side stream came from it; every 32nd runner captured on the very stream
    the body is then captured on. Here the pool is advanced so that the next runner's stream is that one."""
    from tendril.graphs.control import capture

    model = tiny_model("gpt2", device="cuda")
    ids, mask = left_padded([4, 3], device="cuda")
    expected = hf_generate(model, ids, mask, None, max_new_tokens=4)
    options = dict(max_new_tokens=4, eos_token_id=[], pad_token_id=0, step="fused")
    assert torch.equal(generate(model, ids, mask, **options), expected)  # the body's side stream exists now
    body_stream = capture._side_stream(torch.cuda.current_device(), 1).cuda_stream
    cycle = [torch.cuda.Stream().cuda_stream for _ in range(64)]
    if body_stream in cycle:  # the pool: stop one stream before the body's, so the next runner gets it
        while torch.cuda.Stream().cuda_stream != cycle[cycle.index(body_stream) - 1]:
            pass
    release_graphs(model)
    assert torch.equal(generate(model, ids, mask, **options), expected)
    (runner,) = graphed_runners(model)
    assert len(runner.stats.graphs) == 1 and runner.stats.eager_calls == 0, runner.stats.fallback_details
