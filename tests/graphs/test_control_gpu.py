"""tendril.cond / while_loop captured as CUDA conditional nodes, checked against the eager lowering."""

import math

import pytest
import torch

from tendril.graphs import control
from tendril.graphs.capture import garbage_collection_paused
from tendril.graphs.control import HostSyncInGraphError, cond, loops, while_loop

pytestmark = pytest.mark.gpu


def _capture(fn, *args):
    """Warm up on a side stream (eager lowering), then capture `fn(*args)` with torch.cuda.graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), garbage_collection_paused():  # a collection could destroy an old graph mid-capture
        out = fn(*args)
    return graph, out


def _replay_without_host_sync(graph):
    torch.cuda.set_sync_debug_mode("error")
    try:
        graph.replay()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def _poison(outputs):
    for t in outputs:
        t.fill_(-1 if not t.is_floating_point() else math.nan)


def _mlp_loop(weights, limit, x):
    """Apply a small MLP until `limit` steps or until the activations' norm leaves a band (early exit)."""

    def keep_going(i, h):
        return (i < limit) & (h.norm() < 40.0)

    def body(i, h):
        for w in weights:
            h = torch.tanh(h @ w) * 2.0 + h * 0.5
        return i + 1, h

    return while_loop(keep_going, body, (torch.zeros((), dtype=torch.int64, device=x.device), x))


def test_while_node_matches_eager_including_zero_trip_and_early_exit():
    torch.manual_seed(0)
    weights = [torch.randn(16, 16, device="cuda") / 4 for _ in range(3)]
    limit = torch.tensor(5, device="cuda")
    x = torch.randn(4, 16, device="cuda")
    before = control.control_flow_stats().conditional_node
    graph, outputs = _capture(lambda lim, v: _mlp_loop(weights, lim, v), limit, x)
    assert control.control_flow_stats().conditional_node == before + 1
    steps_seen = set()
    for steps in [0, 1, 3, 7, 25, 200]:
        limit.fill_(steps)
        x.copy_(torch.randn(4, 16, device="cuda") * (0.1 if steps % 2 else 1.0))
        expected_i, expected_x = _mlp_loop(weights, limit, x)
        _poison(outputs)
        _replay_without_host_sync(graph)
        assert outputs[0].item() == expected_i.item()
        torch.testing.assert_close(outputs[1], expected_x)
        steps_seen.add(expected_i.item())
    assert 0 in steps_seen and len(steps_seen) >= 4  # zero-trip, full runs and early exits all exercised


def _nested_program(lowering):
    def outer_body(i, total, x):
        _, acc = while_loop(
            lambda j, a: j < i,
            lambda j, a: (j + 1, a + j),
            (torch.zeros_like(i), torch.zeros_like(i)),
            max_iterations=12,
            lowering=lowering,
        )
        bonus = cond(i % 2 == 0, lambda a: a * 10, lambda a: a, acc, lowering=lowering)
        y = cond(x.sum() > 0, lambda v: v * 0.5, lambda v: v - 1.0, x, lowering=lowering)
        return i + 1, total + bonus, y

    def run(limit, x):
        zero = torch.zeros((), dtype=torch.int64, device=x.device)
        return while_loop(
            lambda i, t, v: i < limit, outer_body, (zero, zero.clone(), x), max_iterations=12, lowering=lowering
        )

    return run


@pytest.mark.parametrize("lowering", ["auto", "predication"])
def test_nested_loops_and_conds_inside_loops_match_eager(lowering):
    run = _nested_program(lowering)
    limit = torch.tensor(3, device="cuda")
    x = torch.randn(8, device="cuda")
    graph, outputs = _capture(run, limit, x)
    eager = _nested_program("auto")
    for steps in [0, 1, 4, 9, 12]:
        limit.fill_(steps)
        x.copy_(torch.randn(8, device="cuda"))
        expected = eager(limit, x)
        _poison(outputs)
        _replay_without_host_sync(graph)
        for got, want in zip(outputs, expected, strict=True):
            torch.testing.assert_close(got, want)
    if lowering == "predication":
        control.check_loop_bounds()


def test_predicated_loop_reports_an_exceeded_bound_after_replay():
    limit = torch.tensor(2, device="cuda")
    x = torch.zeros(3, device="cuda")
    control.clear_loop_bound_checks()
    graph, (i, _) = _capture(
        lambda lim, v: while_loop(
            lambda i, v: i < lim,
            lambda i, v: (i + 1, v + 1),
            (torch.zeros((), dtype=torch.int64, device="cuda"), v),
            max_iterations=4,
            lowering="predication",
            name="bounded",
        ),
        limit,
        x,
    )
    _replay_without_host_sync(graph)
    control.check_loop_bounds()
    assert i.item() == 2
    limit.fill_(9)
    _replay_without_host_sync(graph)
    assert i.item() == 4  # truncated at the bound
    with pytest.raises(control.LoopBoundExceeded, match=r"bounded \(max_iterations=4\)"):
        control.check_loop_bounds()
    control.clear_loop_bound_checks()


def test_cond_node_picks_the_branch_on_the_device():
    x = torch.randn(5, device="cuda")

    def fn(v):
        return cond(v.sum() > 0, lambda a: (a * 2, a.max()), lambda a: (a - 3, a.min()), v)

    graph, outputs = _capture(fn, x)
    for sign in [1, -1, 1, -1]:
        x.copy_(torch.rand(5, device="cuda") * sign)
        expected = fn(x)
        _poison(outputs)
        _replay_without_host_sync(graph)
        for got, want in zip(outputs, expected, strict=True):
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize("batch", [1, 3, 16])
def test_loops_inside_graphs_of_several_shapes(batch):
    weights = [torch.randn(16, 16, device="cuda") / 4 for _ in range(2)]
    limit = torch.tensor(6, device="cuda")
    x = torch.randn(batch, 16, device="cuda")

    def fn(lim, v):
        h = torch.relu(v) + 1  # captured work before and after the loop composes with it
        i, h = _mlp_loop(weights, lim, h)
        return i, h.sum(dim=1)

    graph, outputs = _capture(fn, limit, x)
    for steps in [0, 2, 6]:
        limit.fill_(steps)
        x.copy_(torch.randn(batch, 16, device="cuda"))
        expected = fn(limit, x)
        _poison(outputs)
        _replay_without_host_sync(graph)
        for got, want in zip(outputs, expected, strict=True):
            torch.testing.assert_close(got, want)


def test_loops_inside_tendril_graphed_callables_of_several_shapes():
    from tendril.graphs.callable import graphed

    weights = [torch.randn(16, 16, device="cuda") / 4 for _ in range(2)]

    def fn(lim, v):
        i, h = _mlp_loop(weights, lim, v)
        return i, h * 1.0

    fast = graphed(fn, clone_outputs=True)
    for batch in [1, 4, 9, 4, 1]:
        for steps in [0, 3]:
            lim = torch.tensor(steps, device="cuda")
            v = torch.randn(batch, 16, device="cuda")
            got = fast(lim, v)
            expected = fn(lim, v)
            for g, e in zip(got, expected, strict=True):
                torch.testing.assert_close(g, e)
    assert not fast.stats.fallbacks, fast.stats.fallbacks


def test_body_temporaries_survive_later_eager_allocations():
    """Body scratch memory belongs to a graph pool: eager allocations after capture must not reuse it."""
    weights = [torch.randn(64, 64, device="cuda") / 8 for _ in range(4)]
    limit = torch.tensor(10, device="cuda")
    x = torch.randn(32, 64, device="cuda")
    graph, outputs = _capture(lambda lim, v: _mlp_loop(weights, lim, v), limit, x)
    clutter = [torch.full((32, 64), math.nan, device="cuda") for _ in range(64)]
    expected = _mlp_loop(weights, limit, x)
    _replay_without_host_sync(graph)
    del clutter
    for got, want in zip(outputs, expected, strict=True):
        torch.testing.assert_close(got, want)


def test_a_host_sync_inside_a_body_is_named():
    x = torch.ones(3, device="cuda")

    def body(i, v):
        if v.sum().item() > 100:  # a host sync: not capturable
            v = v * 0
        return i + 1, v + 1

    graph = torch.cuda.CUDAGraph()
    with pytest.raises(HostSyncInGraphError, match=r"body.*synchronised with the host at .*test_control_gpu.py"):  # noqa: SIM117
        with torch.cuda.graph(graph):
            while_loop(lambda i, v: i < 3, body, (torch.zeros((), dtype=torch.int64, device="cuda"), x))


def test_cpu_tensors_during_capture_are_named():
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(ValueError, match=r"while_loop carried\[1\] is on cpu, but a CUDA graph is being captured"):  # noqa: SIM117
        with torch.cuda.graph(graph):
            while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, v), (torch.zeros((), device="cuda"), torch.ones(2)))


def test_without_conditional_nodes_a_captured_loop_is_predicated(monkeypatch):
    monkeypatch.setattr(loops, "_conditional_support", lambda needs_else: loops.runtime.Support(False, "forced"))
    control.reset_control_flow_stats()
    control.clear_loop_bound_checks()
    run = _nested_program("auto")
    limit = torch.tensor(4, device="cuda")
    x = torch.randn(8, device="cuda")
    graph, outputs = _capture(run, limit, x)
    stats = control.control_flow_stats()
    assert stats.conditional_node == 0 and stats.predication > 0
    assert stats.fallback_reasons["conditional nodes unavailable: forced"] == stats.predication
    monkeypatch.undo()
    expected = _nested_program("auto")(limit, x)
    _replay_without_host_sync(graph)
    for got, want in zip(outputs, expected, strict=True):
        torch.testing.assert_close(got, want)
    control.check_loop_bounds()
    control.clear_loop_bound_checks()


def test_shape_changing_state_inside_a_capture_is_a_clean_error():
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(ValueError, match=r"body_fn output 1 is \[4\] float32 on cuda:0 but carried 1 is \[3\]"):  # noqa: SIM117
        with torch.cuda.graph(graph):
            while_loop(
                lambda i, v: i < 3,
                lambda i, v: (i + 1, torch.cat([v, v[:1]])),
                (torch.zeros((), dtype=torch.int64, device="cuda"), torch.ones(3, device="cuda")),
            )
