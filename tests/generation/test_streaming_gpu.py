"""On the GPU: streaming out of the one-launch decode loop. The captured graph (prefill, WHILE node, eager or
fused step) publishes each token into mapped host memory; the streamed tokens are the returned ones."""

from __future__ import annotations

import itertools

import pytest
import torch

from tendril.cuda.mapped import MappedHostMemory
from tendril.generation import generate, streaming
from tendril.generation.api import _state, graphed_runners
from tendril.generation.kernels import publish
from tendril.generation.noise import draw_key
from tendril.generation.streaming import Slot, TokenRing
from tests.generation.models import left_padded, tiny_model
from tests.generation.test_streaming import Collector, LappedStreamer

pytestmark = pytest.mark.gpu
NEW = 24


def test_mapped_memory_is_one_allocation_seen_from_both_sides():
    memory = MappedHostMemory(8 * 16, torch.device("cuda"))
    device, host = memory.device_view(torch.int64), memory.host_view(torch.int64)
    assert device.is_cuda and not host.is_cuda and device.shape == host.shape == (16,)
    device.copy_(torch.arange(16, device="cuda"))
    torch.cuda.synchronize()
    assert host.tolist() == list(range(16))
    del memory, device
    assert host.sum() == 120  # the host view alone keeps the memory alive


def test_a_cuda_ring_is_written_only_by_captured_graphs():
    ring = TokenRing(4, torch.device("cuda"))
    one, live = torch.ones((), dtype=torch.long, device="cuda"), torch.ones((), dtype=torch.bool, device="cuda")
    token = torch.tensor([9], device="cuda")
    ring.publish(live, one, token)  # an eager run (a graph's warm-up)
    torch.cuda.synchronize()
    assert ring.read(1)[0] is Slot.PENDING
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ring.publish(live, one, token)
    clock = torch.zeros(2, dtype=torch.long, device="cuda")
    publish.device_clock(clock[0:])
    graph.replay()
    publish.device_clock(clock[1:])
    torch.cuda.synchronize()
    assert ring.read(1) == (Slot.READY, 9)
    assert int(clock[0]) <= ring.stamp(1) <= int(clock[1]) and ring.stamp(2) == 0


def test_each_streamed_token_carries_its_device_time():
    model = tiny_model("gpt2", device="cuda", dtype=torch.float16)
    ids, _ = left_padded([5], device="cuda")
    clock = torch.zeros(2, dtype=torch.long, device="cuda")
    for _ in range(2):  # capture, then replay
        publish.device_clock(clock[0:])
        generate(model, ids, max_new_tokens=NEW, eos_token_id=[], step="fused", streamer=Collector())
        publish.device_clock(clock[1:])
        torch.cuda.synchronize()
        stamps = [_streaming_loop(model).ring.stamp(count) for count in range(1, NEW + 1)]
        assert int(clock[0]) < stamps[0] and stamps[-1] < int(clock[1])
        assert all(a <= b for a, b in itertools.pairwise(stamps)) and stamps[0] < stamps[-1], stamps


def _streaming_loop(model):
    (loop,) = [loop for loop in _state(model).loops.by_plan.values() if loop.ring is not None]
    return loop


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("sample", [False, True])
@pytest.mark.parametrize("step", ["eager", "fused"])
def test_streamed_tokens_are_the_returned_tokens(family, dtype, sample, step):
    model = tiny_model(family, device="cuda", dtype=dtype)
    options = dict(max_new_tokens=NEW, eos_token_id=[], do_sample=sample, step=step)
    for seed in (3, 4):  # the first call captures the graph, the second replays it
        ids, _ = left_padded([6], seed=seed, device="cuda")
        streamer = Collector()
        out = generate(model, ids, streamer=streamer, seed=seed, **options)
        assert torch.equal(out, generate(model, ids, seed=seed, **options))
        assert torch.equal(streamer.values[0], ids.cpu()) and streamer.ends == 1
        assert streamer.tokens == out[0, ids.shape[1] :].tolist()
        ring = _streaming_loop(model).ring
        assert ring.words.is_cuda and not ring.host_words.is_cuda
        assert [ring.read(count) for count in range(1, NEW + 1)] == [(Slot.READY, t) for t in streamer.tokens]
    stats = [run.stats for run in graphed_runners(model)]
    assert sum(s.eager_calls for s in stats) == 0, [s.fallback_details for s in stats]


@pytest.mark.parametrize("step", ["eager", "fused"])
def test_beam_search_streams_the_returned_sequence_at_the_end(step):
    model = tiny_model("llama", device="cuda", dtype=torch.float16)
    options = dict(max_new_tokens=NEW, eos_token_id=[], num_beams=4, step=step)
    for seed in (3, 4):  # the first call captures the graph, the second replays it
        ids, _ = left_padded([6], seed=seed, device="cuda")
        streamer = Collector()
        out = generate(model, ids, streamer=streamer, **options)
        assert torch.equal(out, generate(model, ids, **options))
        assert torch.equal(streamer.values[0], ids.cpu()) and streamer.ends == 1
        assert streamer.tokens == out[0, ids.shape[1] :].tolist() and len(streamer.tokens) == NEW
    stats = [run.stats for run in graphed_runners(model)]
    assert sum(s.eager_calls for s in stats) == 0, [s.fallback_details for s in stats]


def test_eos_ends_the_stream_where_the_result_ends():
    model = tiny_model("gpt2", device="cuda")
    ids, _ = left_padded([5], device="cuda")
    free = generate(model, ids, max_new_tokens=NEW, eos_token_id=[])
    eos = int(free[0, ids.shape[1] + 5])
    streamer = Collector()
    out = generate(model, ids, max_new_tokens=NEW, eos_token_id=eos, streamer=streamer)
    assert streamer.tokens == out[0, ids.shape[1] :].tolist() and streamer.tokens[-1] == eos


def test_a_tiny_ring_on_the_gpu_still_delivers_every_token(monkeypatch):
    monkeypatch.setattr(streaming, "RING_SLOTS", 2)
    model = tiny_model("llama", device="cuda")
    ids, _ = left_padded([4], device="cuda")
    options = dict(max_new_tokens=64, eos_token_id=[])
    first = Collector()
    out = generate(model, ids, streamer=first, **options)
    assert first.tokens == out[0, ids.shape[1] :].tolist()
    lapped = LappedStreamer(_streaming_loop(model).ring)
    assert torch.equal(generate(model, ids, streamer=lapped, **options), out)
    assert lapped.saw_lap and lapped.tokens == first.tokens


def test_streaming_replays_without_syncing_inside_the_launch():
    """The replay itself never syncs with the host: the ring is written by the graph, read by another thread."""
    model = tiny_model("gpt2", device="cuda")
    ids, _ = left_padded([5], device="cuda")
    generate(model, ids, max_new_tokens=NEW, eos_token_id=[], streamer=Collector())  # capture
    (runner,) = graphed_runners(model)
    (plan,) = [plan for plan, loop in _state(model).loops.by_plan.items() if loop.ring is not None]
    key = draw_key(ids.device, 1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        state = runner(plan, ids, torch.ones_like(ids), key)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert int(state[0]) == NEW
