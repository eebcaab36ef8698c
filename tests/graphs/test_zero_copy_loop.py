"""The `graphs-zero-copy` benchmark's decode loop on the CPU (tiny GPT-2, null backend): the three variants
choose the same beams as eager, and zero-copy / carried state stop copying the cache."""

import pytest
import torch

from benchmarks.cases import graphs_zero_copy as case
from tendril.config import Config
from tendril.graphs.backend import NullBackend
from tendril.graphs.callable import graphed
from tendril.graphs.stats import Misprediction

pytest.importorskip("transformers")


def reordered(state: case.State) -> case.Past:
    """The carried step returns its cache before the beam reordering the next step does first."""
    return tuple(p.index_select(0, state.beam_idx) for p in state.past)


@pytest.fixture(scope="module")
def tiny():
    from transformers import GPT2Config

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=97, n_positions=64, bos_token_id=0, eos_token_id=0)
    return case.gpt2(torch.device("cpu"), torch.float32, config)


def test_host_and_device_beam_steps_agree_eagerly(tiny):
    start = case.prefix(tiny.config, 5, torch.device("cpu"), torch.float32)
    with torch.inference_mode():
        host = case.run_loop(lambda s: case.host_step(case.forward_step(tiny), s), start, 5)
        device = case.run_loop(lambda s: case.device_step(case.carried_step(tiny), s), start, 5)
    assert case.states_equal(host, device)
    for a, b in zip(host, device, strict=True):
        torch.testing.assert_close(a.past, reordered(b))


def test_plain_auto_and_carried_variants_equal_eager_and_copy_as_designed(tiny):
    start = case.prefix(tiny.config, 5, torch.device("cpu"), torch.float32)
    cache_bytes = sum(p.numel() * p.element_size() for p in start.past)
    with torch.inference_mode():
        eager = case.run_loop(lambda s: case.host_step(case.forward_step(tiny), s), start, 6)
        plain = graphed(case.forward_step(tiny), backend=NullBackend(), config=Config())
        auto = graphed(case.forward_step(tiny), backend=NullBackend(), config=Config())
        carried = case.carry_all(graphed(case.carried_step(tiny), backend=NullBackend(), config=Config()))
        runs = {
            "plain": case.run_loop(lambda s: case.host_step(plain, s), start, 6),
            "carried": case.run_loop(lambda s: case.device_step(carried, s), start, 6),
        }
        for _ in range(2):  # the second pass starts with confirmed predictions
            with auto.zero_copy():
                before = auto.stats.input_bytes_copied
                runs["auto"] = case.run_loop(lambda s: case.host_step(auto, s), start, 6)
    for name, states in runs.items():
        assert case.states_equal(eager, states), name
        for a, b in zip(eager, states, strict=True):
            torch.testing.assert_close(a.past, reordered(b) if name == "carried" else b.past)
    assert plain.stats.input_bytes_copied > 6 * cache_bytes
    auto_bytes = auto.stats.input_bytes_copied - before
    assert auto_bytes < 1.5 * cache_bytes  # the prefix copy at the first call of the pass, then tokens only
    assert set(auto.stats.mispredictions) <= {Misprediction.NO_OUT_FORM}
    assert carried.stats.input_copies_avoided >= 5 * 5


def test_copy_runs_cover_each_run_of_consecutive_copies_with_its_gaps_and_count_its_copies():
    copy = case.COPY_OPERATION + " (Device -> Device)"
    operations = [
        ("kernel", 0.0, 5.0),
        (copy, 10.0, 12.0),
        (copy, 13.0, 20.0),  # the gap 12-13 belongs to the copies' span
        ("graph kernel", 21.0, 50.0),
        (copy, 60.0, 64.0),
    ]
    shuffled = [operations[i] for i in (3, 0, 4, 2, 1)]
    runs = case.copy_runs(shuffled)
    assert [span for span, _ in runs] == pytest.approx([0.010, 0.004]) and [count for _, count in runs] == [2, 1]
    assert case.copy_runs([("kernel", 0.0, 1.0)]) == []


def test_staging_spans_are_the_runs_with_a_copy_per_cache_tensor_one_per_step():
    copy = case.COPY_OPERATION + " (Device -> Device)"
    operations = [(copy, -50.0 + i, -49.0 + i) for i in range(3)] + [("kernel", -40.0, -39.0)]  # cloning the start
    for step in range(case.STEPS):
        begin = 100.0 * step
        operations += [(copy, begin, begin + 1.0), ("kernel", begin + 2.0, begin + 3.0)]  # a lone copy
        operations += [(copy, begin + 10.0 + i, begin + 10.5 + i) for i in range(3)]  # the staging of 3 tensors
        operations.append(("graph kernel", begin + 14.0, begin + 50.0))
    assert case.staging_spans_ms(operations, tensors=3) == pytest.approx([0.0025] * case.STEPS)
    with pytest.raises(RuntimeError, match="staging copies"):
        case.staging_spans_ms(operations[8:], tensors=3)


def test_the_manual_loop_writes_the_next_placeholders_and_equals_eager(tiny):
    """(d) writes the reordered cache into the next call's placeholders by hand: the same beams as eager, and
    after the first call only the tokens are copied."""
    start = case.prefix(tiny.config, 5, torch.device("cpu"), torch.float32)
    with torch.inference_mode():
        eager = case.run_loop(lambda s: case.host_step(case.forward_step(tiny), s), start, 6)
        manual = graphed(case.forward_step(tiny), backend=NullBackend(), config=Config())
        copied = []
        states = case.run_loop(lambda s: case.manual_step(manual, s), start, 6,
                               on_step=lambda _: copied.append(manual.stats.input_bytes_copied))
    assert case.states_equal(eager, states)
    for a, b in zip(eager, states, strict=True):
        torch.testing.assert_close(a.past, b.past)
    cache_bytes = sum(p.numel() * p.element_size() for p in start.past)
    assert copied[0] >= cache_bytes and copied[-1] == copied[0]
