"""What `capture` undoes when a capture cannot end (CUDA invalidated it; `_end_capture`), on stand-ins for the graph,
the generator and the allocator's pool calls; `test_graphed_memory_gpu.py` has the same on a GPU."""

from __future__ import annotations

import pytest
import torch

from tendril.graphs import capture as capture_module
from tendril.graphs.capture import _end_capture, accepts_captures, capture

DEVICE = torch.device("cuda", 1)
POOL = (0, 7)


class Graph:
    def __init__(self, error: str | None) -> None:
        self.error = error

    def capture_end(self) -> None:
        if self.error is not None:
            raise RuntimeError(self.error)


class Generator:
    def __init__(self, calls: list[tuple]) -> None:
        self.calls = calls

    def graphsafe_set_state(self, state: object) -> None:
        self.calls.append(("generator", state))


@pytest.fixture(autouse=True)
def no_abandoned_pools(monkeypatch):
    monkeypatch.setattr(capture_module, "_abandoned_pools", set())


def allocator(monkeypatch, calls: list[tuple], end_error: str | None = None) -> None:
    def end(device: int, pool: tuple[int, int]) -> None:
        calls.append(("end", device, pool))
        if end_error is not None:
            raise RuntimeError(end_error)

    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", end, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_releasePool", lambda *a: calls.append(("release", *a)), raising=False)


def test_an_invalidated_capture_restores_the_generator_and_releases_the_pool(monkeypatch):
    calls: list[tuple] = []
    allocator(monkeypatch, calls)
    with pytest.raises(RuntimeError, match="not permitted"):
        _end_capture(Graph("CUDA error: operation not permitted when stream is capturing"), Generator(calls),
                     "saved", DEVICE, POOL)  # fmt: skip
    assert calls == [("end", 1, POOL), ("release", 1, POOL), ("generator", "saved")]
    assert not accepts_captures(POOL) and accepts_captures((0, 8))


def test_a_pool_pytorch_stopped_routing_to_is_still_released(monkeypatch):
    calls: list[tuple] = []
    allocator(monkeypatch, calls, end_error="endAllocatePool: not currently recording to mempool_id")
    with pytest.raises(RuntimeError, match="Invalid capture"):
        _end_capture(Graph("Invalid capture."), Generator(calls), "saved", DEVICE, POOL)
    assert calls == [("end", 1, POOL), ("release", 1, POOL), ("generator", "saved")]


def test_an_unexpected_allocator_error_is_raised(monkeypatch):
    calls: list[tuple] = []
    allocator(monkeypatch, calls, end_error="some other failure")
    with pytest.raises(RuntimeError, match="some other failure"):
        _end_capture(Graph("Invalid capture."), Generator(calls), "saved", DEVICE, POOL)
    assert calls[-1] == ("generator", "saved"), "the generator is restored whatever the allocator raised"


def test_a_capture_that_ends_leaves_the_pool_to_pytorch(monkeypatch):
    calls: list[tuple] = []
    allocator(monkeypatch, calls)
    _end_capture(Graph(None), Generator(calls), "saved", DEVICE, POOL)
    assert calls == [] and accepts_captures(POOL)


def test_capturing_into_an_abandoned_pool_is_refused_before_it_begins():
    """PyTorch's pinned-host allocator still routes to an abandoned pool: a capture into it would fail at
    `capture_begin` with "already recording to mempool_id"; `capture` names the cause instead."""
    capture_module._abandoned_pools.add(POOL)
    with pytest.raises(ValueError, match="abandoned"):
        capture(lambda: None, pool=POOL)
