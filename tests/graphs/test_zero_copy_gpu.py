"""Zero-copy inputs and loop-carried state with real CUDA graphs: where predictions hold the copies
disappear, where they break (and under aliasing hazards) results still equal eager."""

import contextlib

import pytest
import torch

from tendril.graphs.callable import graphed
from tendril.graphs.stats import Misprediction
from tendril.graphs.zero_copy.lanes import LaneKey
from tests.graphs import test_alias, test_carry

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def test_beam_loop_zero_copy_equals_eager_and_replays_lane_graphs():
    eager = test_alias.beam_loop(test_alias.step, 12, device=CUDA)
    fast = graphed(test_alias.step)
    got = test_alias.beam_loop(fast, 12, context=fast.zero_copy, device=CUDA)
    test_alias.assert_same(eager, got)
    assert fast.stats.eager_calls == 0
    assert fast.stats.input_copies_avoided >= 2 * 8 and fast.stats.redirects >= 2 * 8
    assert any(isinstance(key, LaneKey) for key in list(fast.keys()))


def test_redirected_tensors_are_the_placeholders_the_graph_reads():
    fast = graphed(lambda x: x * 2)
    x = torch.randn(1024, device=CUDA)
    inputs, outputs = [], []
    with fast.zero_copy():
        for _ in range(4):
            y = x + 1
            out = fast(y)
            inputs.append(y.clone())
            outputs.append(out.clone())
            x = outputs[-1]
    for y_seen, out in zip(inputs, outputs, strict=True):
        torch.testing.assert_close(out, y_seen * 2)
    arenas = fast._zero_copy.lanes.arenas.values()
    lane_buffers = {buffer.data_ptr() for arena in arenas for buffer in arena.buffers.values()}
    assert y.data_ptr() in lane_buffers
    assert fast.stats.input_bytes_copied == 2 * 1024 * 4  # the two calls that learned and confirmed the producer


@pytest.mark.parametrize("seed", range(6))
def test_misbehaving_loops_equal_eager(seed):
    generator = torch.Generator().manual_seed(seed)
    choices = test_alias.PERTURBATIONS
    perturbations = [choices[int(i)] for i in torch.randint(0, len(choices), (14,), generator=generator)]
    eager = test_alias.misbehaving_loop(test_alias.misbehaving_fn, contextlib.nullcontext, perturbations, CUDA)
    fast = graphed(test_alias.misbehaving_fn)
    got = test_alias.misbehaving_loop(fast, fast.zero_copy, perturbations, CUDA)
    torch.testing.assert_close(got, eager, rtol=0, atol=0)


def test_kept_references_are_not_clobbered_on_cuda():
    eager = test_alias.beam_loop(test_alias.step, 8, keep=True, device=CUDA)
    fast = graphed(test_alias.step)
    test_alias.assert_same(eager, test_alias.beam_loop(fast, 8, context=fast.zero_copy, keep=True, device=CUDA))
    assert fast.stats.mispredictions[Misprediction.REFERENCED] > 0


def test_an_argument_that_is_another_arguments_placeholder():
    def fn(a, b):
        return a * 10 + b

    fast = graphed(fn)
    a, b = torch.randn(64, device=CUDA), torch.randn(64, device=CUDA)
    fast(a, b)
    (pa, pb), _ = fast.inputs_for(a, b)
    pa.copy_(torch.arange(64.0, device=CUDA))
    pb.copy_(torch.ones(64, device=CUDA))
    expected = fn(pb.clone(), pa.clone())
    torch.testing.assert_close(fast(pb, pa), expected)
    view = pa.flip(0)
    expected = fn(pa.clone(), view.clone())
    torch.testing.assert_close(fast(pa, view), expected)


def test_views_of_redirected_inputs_and_in_place_updates():
    fast = graphed(lambda x, y: x @ y)
    x = torch.randn(8, 8, device=CUDA)
    with fast.zero_copy():
        for t in range(6):
            a = x + t
            a[0].zero_()  # in place, before the call
            b = a.t()  # a view of a redirected tensor as another argument
            torch.testing.assert_close(fast(a, b), a @ b)


def test_two_callables_sharing_a_producer():
    f1, f2 = graphed(lambda x: x * 2), graphed(lambda x: x.flip(0))
    x = torch.randn(256, device=CUDA)
    with f1.zero_copy(), f2.zero_copy():
        for _ in range(6):
            y = torch.sin(x)
            torch.testing.assert_close(f1(y), torch.sin(x) * 2)
            torch.testing.assert_close(f2(y), torch.sin(x).flip(0))
            x = x + 1


def test_carried_loop_on_cuda_equals_eager_and_copies_nothing_but_argsort():
    eager = test_carry.loop(test_carry.step, 10, device=CUDA)
    fast = graphed(test_carry.step)
    fast.carry(output=0, input=0).carry(output=1, input=1).carry(output=2, input=2)
    torch.testing.assert_close(test_carry.loop(fast, 10, device=CUDA), eager, rtol=0, atol=0)
    stats = fast.stats
    assert stats.eager_calls == 0 and stats.input_copies == 4 and stats.input_copies_avoided == 4 * 9
    first_call_bytes = 4 * 8 + 2 * 4 * 3 * 5 * 4 + 4 * 8
    assert stats.input_bytes_copied == first_call_bytes + 10 * 4 * 8


def test_hf_gpt2_beam_decode_three_ways_on_cuda():
    from transformers import GPT2Config

    from benchmarks.cases import graphs_zero_copy as case

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=512, n_positions=128)
    model = case.gpt2(CUDA, torch.float32, config)
    start = case.prefix(config, 17, CUDA, torch.float32)
    cache_bytes = sum(p.numel() * p.element_size() for p in start.past)
    with torch.inference_mode():
        eager = case.run_loop(lambda s: case.host_step(case.forward_step(model), s), start, 8)
        plain = graphed(case.forward_step(model))
        auto = graphed(case.forward_step(model))
        carried = case.carry_all(graphed(case.carried_step(model)))
        runs = {
            "plain": case.run_loop(lambda s: case.host_step(plain, s), start, 8),
            "carried": case.run_loop(lambda s: case.device_step(carried, s), start, 8),
        }
        for _ in range(2):
            with auto.zero_copy():
                before = auto.stats.input_bytes_copied
                runs["auto"] = case.run_loop(lambda s: case.host_step(auto, s), start, 8)
    for name, states in runs.items():
        assert case.states_equal(eager, states), name
        for a, b in zip(eager, states, strict=True):
            past = tuple(p.index_select(0, b.beam_idx) for p in b.past) if name == "carried" else b.past
            torch.testing.assert_close(a.past, past, rtol=1e-4, atol=1e-4)
    for fast in (plain, auto, carried):
        assert fast.stats.eager_calls == 0, fast.stats.table()
    assert auto.stats.input_bytes_copied - before < 1.5 * cache_bytes
    assert carried.stats.input_copies_avoided >= 5 * 7


def test_zero_copy_holds_in_every_cache_length_phase_on_cuda():
    """The benchmark's phases (a short cache, then longer ones that outgrow the lane buffers) with real graphs:
    after the first steps of a phase the redirected cache is exactly what the graphs read."""
    from tests.graphs import test_zero_copy_phases as phases

    auto = graphed(phases.toy_step, max_graphs=1024)
    with torch.inference_mode():
        report = phases.decode_phases(phases.toy_step, auto, phases.ToyConfig, device="cuda")
    phases.assert_zero_copy_in_every_phase(report)
    assert auto.stats.eager_calls == 0, auto.stats.table()
