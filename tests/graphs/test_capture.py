"""The GPU lane end to end: capture a small model, replay it on fresh inputs, compare with eager."""

import pytest
import torch
from torch import nn

from tendril.graphs.capture import capture

pytestmark = pytest.mark.gpu


def test_replayed_graph_matches_eager_on_fresh_random_inputs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.LayerNorm(128), nn.Linear(128, 32)).cuda().eval()
    placeholder = torch.randn(4, 64, device="cuda")
    with torch.inference_mode():
        captured = capture(model, placeholder)
        for _ in range(20):
            x = torch.randn(4, 64, device="cuda")
            placeholder.copy_(x)
            captured.outputs.fill_(float("nan"))
            out = captured.replay()
            torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)


def test_replay_overwrites_the_same_output_storage():
    model = nn.Linear(8, 8).cuda()
    x = torch.randn(2, 8, device="cuda")
    with torch.inference_mode():
        captured = capture(model, x)
        first = captured.replay()
        x.copy_(torch.randn_like(x))
        second = captured.replay()
        assert first.data_ptr() == second.data_ptr()
        torch.testing.assert_close(second, model(x))


def test_a_graph_left_in_a_reference_cycle_does_not_invalidate_a_later_capture():
    """Automatic garbage collection during a capture would destroy the old graph's executable, which CUDA
    forbids while capturing; `capture` pauses collection, so the old graph is freed afterwards."""
    import gc
    import weakref

    x = torch.randn(1024, device="cuda")
    old = capture(lambda t: t * 3, x)
    old.graph.replay()  # instantiated: destroying it calls cudaGraphExecDestroy
    gc.collect()  # resets the allocation counters: no automatic collection before the capture below begins
    cycle: list[object] = [old]
    cycle.append(cycle)
    freed = weakref.ref(old)
    del old, cycle
    thresholds = gc.get_threshold()

    def noisy(t: torch.Tensor) -> torch.Tensor:
        gc.set_threshold(1)  # collect at almost every container allocation, while capturing
        try:
            for _ in range(200):
                [{}]  # noqa: B018 (allocations that would trigger collections)
        finally:
            gc.set_threshold(*thresholds)
        return t + 1

    new = capture(noisy, x, warmup=0)
    assert freed() is not None, "the old graph was collected during the capture"
    gc.collect()
    assert freed() is None
    x.copy_(torch.randn_like(x))
    torch.testing.assert_close(new.replay(), x + 1)
