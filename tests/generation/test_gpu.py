"""On the GPU: the decode loop captured as one graph (prefill, then a device WHILE loop), exact against HF,
replayed for new inputs of the same shape, and free of host syncs."""

from __future__ import annotations

import pytest
import torch

from tendril.generation import generate
from tendril.generation.api import _state, graphed_runners
from tendril.generation.noise import draw_key
from tendril.graphs.control import control_flow_stats
from tests.generation.models import hf_generate, left_padded, tiny_model

pytestmark = pytest.mark.gpu
NEW = 16


def _eos_hit_by(model, ids, mask, row: int, step: int) -> int:
    return int(hf_generate(model, ids, mask, None, max_new_tokens=NEW)[row, ids.shape[1] + step])


@pytest.mark.parametrize("family", ["gpt2", "gptj", "llama", "qwen2"])
@pytest.mark.parametrize("num_beams", [1, 4])
def test_graphed_generation_matches_hf_and_replays(family, num_beams):
    model = tiny_model(family, device="cuda")
    ids, mask = left_padded([7, 3, 5], device="cuda")
    eos = _eos_hit_by(model, ids, mask, row=1, step=2)
    options = dict(num_beams=num_beams, num_return_sequences=2 if num_beams > 1 else 1)
    for eos_id in (None, eos):
        expected = hf_generate(model, ids, mask, eos_id, max_new_tokens=NEW, **options)
        got = generate(model, ids, mask, max_new_tokens=NEW, eos_token_id=[] if eos_id is None else eos_id,
                       pad_token_id=0, **options)
        assert torch.equal(got, expected), (got, expected)
    # new prompts of the same shape replay the captured graphs
    other_ids, other_mask = left_padded([2, 7, 6], seed=5, device="cuda")
    expected = hf_generate(model, other_ids, other_mask, eos, max_new_tokens=NEW, **options)
    got = generate(model, other_ids, other_mask, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=0, **options)
    assert torch.equal(got, expected)
    stats = [r.stats for r in graphed_runners(model)]
    assert sum(len(s.graphs) for s in stats) == 2, [s.fallback_details for s in stats]
    assert sum(s.replays for s in stats) == 3 and sum(s.eager_calls for s in stats) == 0
    assert control_flow_stats().conditional_node > 0, control_flow_stats().fallback_reasons


def test_gpt2_fp16_greedy_matches_hf():
    model = tiny_model("gpt2", device="cuda", dtype=torch.float16)
    ids, mask = left_padded([6, 4], device="cuda")
    expected = hf_generate(model, ids, mask, None, max_new_tokens=NEW)
    got = generate(model, ids, mask, max_new_tokens=NEW, eos_token_id=[], pad_token_id=0)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("copies", [True, False])
def test_gpt2_fused_single_row_tokens_match_hf_with_and_without_weight_copies(copies, monkeypatch):
    from tendril import config

    monkeypatch.setattr(config, "settings", config.Config(weight_copies=copies))
    model = tiny_model("gpt2", device="cuda")  # fp32: the fused step gives HF's tokens
    ids, mask = left_padded([6], device="cuda")
    expected = hf_generate(model, ids, mask, None, max_new_tokens=NEW)
    got = generate(model, ids, mask, max_new_tokens=NEW, step="fused", eos_token_id=[], pad_token_id=0)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("options", [dict(), dict(num_beams=4), dict(do_sample=True, top_p=0.9)])
def test_replay_does_not_sync_with_the_host(options):
    model = tiny_model("gpt2", device="cuda")
    ids, mask = left_padded([5, 5], device="cuda")
    generate(model, ids, mask, max_new_tokens=NEW, eos_token_id=3, pad_token_id=0, seed=0, **options)  # capture
    (runner,) = graphed_runners(model)
    (plan,) = _state(model).loops.by_plan
    copies = options.get("num_beams", 1)
    prompt, prompt_mask = ids.repeat_interleave(copies, 0), mask.repeat_interleave(copies, 0)
    key = draw_key(ids.device, 1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        state = runner(plan, prompt, prompt_mask, key)
        state = runner(plan, prompt, prompt_mask, key)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert runner.stats.replays == 3 and runner.stats.eager_calls == 0
    assert int(state[0]) >= 1


def test_sampling_on_the_gpu_is_reproducible_and_varies_per_step():
    model = tiny_model("gpt2", device="cuda")
    ids, mask = left_padded([5, 3], device="cuda")
    sample = dict(max_new_tokens=NEW, eos_token_id=[], do_sample=True, top_k=0)
    a = generate(model, ids, mask, seed=1, **sample)
    assert torch.equal(a, generate(model, ids, mask, seed=1, **sample))
    assert not torch.equal(a, generate(model, ids, mask, seed=2, **sample))
    assert len(set(a[0, ids.shape[1]:].tolist())) > 3  # not one token repeated: the noise changes per step


def test_benchmark_per_step_graph_variant_matches_tendril():
    from benchmarks.cases import generation as case

    model = case.gpt2(torch.device("cuda"), torch.float32, n_layer=2, n_embd=64, n_head=4, vocab_size=96,
                      n_positions=64)
    prompts = [torch.randint(0, 96, (1, 5), generator=torch.Generator().manual_seed(i)).cuda() for i in range(2)]
    step_graph = case.PerStepGraph(model, prompts[0], NEW, 1)
    for prompt in prompts:
        expected = case.tendril_generate(model, NEW, 1)(prompt)
        assert torch.equal(step_graph(prompt).clone(), expected)


@pytest.mark.parametrize("num_beams", [1, 4])
def test_compiled_step_is_captured_in_the_loop_graph_and_matches_hf(num_beams):
    model = tiny_model("gpt2", device="cuda")
    ids, mask = left_padded([6, 4], device="cuda")
    expected = hf_generate(model, ids, mask, None, max_new_tokens=NEW, num_beams=num_beams)
    for _ in range(2):
        got = generate(model, ids, mask, max_new_tokens=NEW, eos_token_id=[], pad_token_id=0, num_beams=num_beams,
                       step="compiled")
        assert torch.equal(got, expected)
    (runner,) = graphed_runners(model)
    assert len(runner.stats.graphs) == 1 and runner.stats.eager_calls == 0, runner.stats.fallback_details


@pytest.mark.parametrize("num_beams", [1, 4])
def test_generation_graphs_follow_the_default_graph_memory_budget(num_beams, monkeypatch):
    from tendril import config

    monkeypatch.setattr(config, "settings", config.Config(graph_memory_budget="1KiB"))
    model = tiny_model("gpt2", device="cuda")
    for lengths in ([7, 3], [4, 4, 4], [7, 3]):  # two prompt shapes, then the first again
        ids, mask = left_padded(lengths, device="cuda")
        expected = hf_generate(model, ids, mask, None, max_new_tokens=NEW, num_beams=num_beams)
        got = generate(model, ids, mask, max_new_tokens=NEW, eos_token_id=[], pad_token_id=0, num_beams=num_beams)
        assert torch.equal(got, expected)
    (runner,) = graphed_runners(model)
    assert runner._backend.memory.budget == 1024  # smaller than one executable: every switch counts
    memory = [record.memory for record in runner.stats.graphs.values()]
    assert len(memory) == 2 and sum(m.instantiations + m.updates for m in memory) >= 3, memory


def test_generate_from_several_threads_gives_each_call_its_own_tokens():
    import threading

    model = tiny_model("gpt2", device="cuda")
    prompts = [left_padded([5, 3], seed=seed, device="cuda") for seed in range(4)]
    options = dict(max_new_tokens=NEW, eos_token_id=[], pad_token_id=0)
    expected = [generate(model, ids, mask, **options) for ids, mask in prompts]
    got: dict[int, torch.Tensor] = {}

    def work(index: int) -> None:
        for _ in range(5):
            got[index] = generate(model, *prompts[index], **options)
            if not torch.equal(got[index], expected[index]):
                return

    threads = [threading.Thread(target=work, args=(index,)) for index in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(torch.equal(got[index], expected[index]) for index in range(4))
