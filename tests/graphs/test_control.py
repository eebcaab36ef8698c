"""CPU semantics of tendril.cond / tendril.while_loop: eager and predicated lowerings against plain Python."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tendril.graphs import control
from tendril.graphs.control import LoopBoundExceeded, cond, loops, while_loop

LOWERINGS = ["auto", "predication"]


def _count_to(limit):
    return lambda i, x: i < limit


def _step(i, x):
    return i + 1, x * 2 + 1


@pytest.mark.parametrize("lowering", LOWERINGS)
def test_while_loop_runs_until_the_predicate_is_false(lowering):
    i, x = torch.tensor(0), torch.ones(3)
    out_i, out_x = while_loop(_count_to(torch.tensor(4)), _step, (i, x), max_iterations=10, lowering=lowering)
    assert out_i.item() == 4
    torch.testing.assert_close(out_x, torch.full((3,), 31.0))
    assert i.item() == 0 and x.eq(1).all()  # inputs untouched


@pytest.mark.parametrize("lowering", LOWERINGS)
def test_zero_trip_loop_returns_copies_of_the_inputs(lowering):
    i, x = torch.tensor(5), torch.randn(2)
    out_i, out_x = while_loop(_count_to(torch.tensor(3)), _step, (i, x), max_iterations=4, lowering=lowering)
    assert out_i.item() == 5 and torch.equal(out_x, x)
    assert out_x is not x and out_x.data_ptr() != x.data_ptr()


@pytest.mark.parametrize("lowering", LOWERINGS)
def test_exceeding_max_iterations_raises_naming_the_loop(lowering):
    with pytest.raises(LoopBoundExceeded, match=r"counter.*max_iterations=3"):
        while_loop(
            _count_to(torch.tensor(9)),
            _step,
            (torch.tensor(0), torch.ones(1)),
            max_iterations=3,
            lowering=lowering,
            name="counter",
        )


def test_an_exactly_sufficient_bound_is_not_an_overflow():
    out_i, _ = while_loop(
        _count_to(torch.tensor(3)), _step, (torch.tensor(0), torch.ones(1)), max_iterations=3, lowering="predication"
    )
    assert out_i.item() == 3


def test_predication_without_a_bound_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="pass max_iterations=N"):
        while_loop(_count_to(torch.tensor(3)), _step, (torch.tensor(0),), lowering="predication")


@pytest.mark.parametrize("bound", [True, -1, 2.0])
def test_a_bound_that_is_not_a_count_is_refused(bound):
    with pytest.raises(ValueError, match="max_iterations must be a non-negative int"):
        while_loop(_count_to(torch.tensor(1)), _step, (torch.tensor(0), torch.ones(1)), max_iterations=bound)


def test_a_numpy_integer_bound_is_a_count():
    bound = np.int64(2)
    out_i, _ = while_loop(_count_to(torch.tensor(2)), _step, (torch.tensor(0), torch.ones(1)), max_iterations=bound)
    assert out_i.item() == 2


@pytest.mark.parametrize("lowering", LOWERINGS)
def test_nested_loops_and_conds(lowering):
    def outer_body(i, total):
        _, acc = while_loop(
            lambda j, a: j < i,
            lambda j, a: (j + 1, a + j),
            (torch.tensor(0), torch.tensor(0)),
            max_iterations=8,
            lowering=lowering,
        )
        bonus = cond(i % 2 == 0, lambda a: a * 10, lambda a: a, acc, lowering=lowering)
        return i + 1, total + bonus

    _, total = while_loop(
        lambda i, t: i < 6, outer_body, (torch.tensor(0), torch.tensor(0)), max_iterations=8, lowering=lowering
    )
    expected = sum((sum(range(i)) * (10 if i % 2 == 0 else 1)) for i in range(6))
    assert total.item() == expected


@pytest.mark.parametrize("lowering", LOWERINGS)
@pytest.mark.parametrize("flag", [True, False])
def test_cond_picks_the_branch_and_keeps_the_structure(lowering, flag):
    x = torch.randn(4)
    out = cond(torch.tensor(flag), lambda v: (v + 1, v.sum()), lambda v: (v - 1, v.prod()), x, lowering=lowering)
    assert isinstance(out, tuple) and len(out) == 2
    torch.testing.assert_close(out[0], x + 1 if flag else x - 1)
    torch.testing.assert_close(out[1], x.sum() if flag else x.prod())
    single = cond(torch.tensor([flag]), lambda v: v, lambda v: -v, x, lowering=lowering)
    assert isinstance(single, torch.Tensor) and single.shape == x.shape
    torch.testing.assert_close(single, x if flag else -x)
    assert single.data_ptr() != x.data_ptr()  # a branch returning its operand gets a copy


def test_cond_accepts_a_python_bool():
    assert cond(False, lambda: torch.ones(1), lambda: torch.zeros(1)).item() == 0


def test_shape_changing_carried_state_is_refused_naming_the_index():
    with pytest.raises(ValueError, match=r"body_fn output 1 is \[4\] float32 on cpu but carried 1 is \[3\] float32"):
        while_loop(lambda i, x: i < 2, lambda i, x: (i + 1, torch.cat([x, x[:1]])), (torch.tensor(0), torch.ones(3)))


def test_dtype_changing_carried_state_is_refused():
    with pytest.raises(ValueError, match=r"body_fn output 0 is \[\] float32"):
        while_loop(lambda i: i < 2, lambda i: (i + 1.0,), (torch.tensor(0),))


def test_mismatched_branches_are_refused_under_predication():
    with pytest.raises(ValueError, match=r"cond false_fn output 0 is \[2\] float32 on cpu but true_fn output 0 is"):
        cond(torch.tensor(True), lambda x: x, lambda x: x[:2], torch.ones(3), lowering="predication")


def test_bad_predicates_and_arguments_are_named():
    with pytest.raises(TypeError, match=r"cond pred: expected a one-element bool tensor .* got torch.float32"):
        cond(torch.tensor(1.0), lambda: torch.ones(1), lambda: torch.ones(1))
    with pytest.raises(TypeError, match=r"cond_fn result: expected a one-element bool tensor"):
        while_loop(lambda x: x.sum(), lambda x: x, (torch.ones(2),))
    with pytest.raises(TypeError, match=r"while_loop carried\[1\] is a int; .*torch.tensor"):
        while_loop(lambda x, n: x < n, lambda x, n: (x, n), (torch.ones(()), 3))


def test_in_place_mutation_of_inputs_is_refused():
    def body(x):
        x.add_(1)
        return (x,)

    with pytest.raises(ValueError, match="body_fn modified its argument 0 in place"):
        while_loop(lambda x: x < 3, body, (torch.tensor(0),))


def test_lowerings_are_counted_with_reasons():
    control.reset_control_flow_stats()
    while_loop(_count_to(torch.tensor(1)), _step, (torch.tensor(0), torch.ones(1)))
    cond(torch.tensor(True), lambda: torch.ones(1), lambda: torch.zeros(1), lowering="predication")
    stats = control.control_flow_stats()
    assert (stats.eager, stats.predication, stats.conditional_node) == (1, 1, 0)
    assert stats.fallback_reasons == {"lowering='predication' was asked for": 1}


# ---------------------------------------------------------------- random programs (hypothesis)

_OPS = {
    "affine": lambda x: x * 0.5 + 1.0,
    "tanh": torch.tanh,
    "roll": lambda x: torch.roll(x, 1),
    "square": lambda x: x * x * 0.25,
}


def _program(ops, branch_ops, threshold, limit):
    """A loop: x goes through `ops`, then a cond on x.mean() picks one of two op chains; stops on count or size."""

    def run_chain(chain, x):
        for name in chain:
            x = _OPS[name](x)
        return x

    def body(i, x):
        x = run_chain(ops, x)
        x = cond(x.mean() > 0, lambda v: run_chain(branch_ops, v), lambda v: -v, x)
        return i + 1, x

    def keep_going(i, x):
        return (i < limit) & (x.abs().sum() < threshold)

    def reference(i, x):
        while bool(keep_going(i, x)):
            x = run_chain(ops, x)
            x = run_chain(branch_ops, x) if x.mean().item() > 0 else -x
            i = i + 1
        return i, x

    return keep_going, body, reference


@settings(max_examples=40, deadline=None)
@given(
    ops=st.lists(st.sampled_from(sorted(_OPS)), max_size=3),
    branch_ops=st.lists(st.sampled_from(sorted(_OPS)), max_size=2),
    threshold=st.floats(0.5, 50.0),
    limit=st.integers(0, 6),
    start=st.lists(st.floats(-2, 2), min_size=3, max_size=3),
)
def test_random_programs_agree_across_lowerings(ops, branch_ops, threshold, limit, start):
    keep_going, body, reference = _program(ops, branch_ops, threshold, limit)
    x0 = torch.tensor(start)
    expected_i, expected_x = reference(torch.tensor(0), x0)
    for lowering in LOWERINGS:
        i, x = while_loop(keep_going, body, (torch.tensor(0), x0), max_iterations=6, lowering=lowering)
        assert i.item() == expected_i.item()
        torch.testing.assert_close(x, expected_x)


# ---------------------------------------------------------------- lowering policy (no GPU needed)


@pytest.fixture
def capturing_without_conditional_nodes(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(loops, "_conditional_support", lambda needs_else: loops.runtime.Support(False, "no driver"))


def test_capture_without_conditional_nodes_falls_back_to_predication(capturing_without_conditional_nodes):
    assert loops._choose_lowering([], "auto", needs_else=False) == (
        "predication",
        "conditional nodes unavailable: no driver",
    )


def test_cpu_tensors_are_refused_while_capturing(capturing_without_conditional_nodes):
    with pytest.raises(
        ValueError, match=r"while_loop carried\[0\] is on cpu, but a CUDA graph is being captured on cuda:0"
    ):
        while_loop(lambda x: x.sum() > 0, lambda x: x, (torch.zeros(1),), max_iterations=2)


def test_if_else_nodes_need_a_12_8_driver(monkeypatch):
    monkeypatch.setattr(loops.runtime, "conditional_nodes", lambda: loops.runtime.Support(True, "12.6"))
    monkeypatch.setattr(loops.runtime, "driver_version", lambda: 12060)
    loops._conditional_support.cache_clear()
    try:
        assert loops._conditional_support(False).available
        assert loops._conditional_support(True) == loops.runtime.Support(
            False, "IF/ELSE nodes need a driver for CUDA 12.8"
        )
    finally:
        loops._conditional_support.cache_clear()


def test_assign_copies_a_mixed_state_into_its_buffers_as_the_while_node_does():
    """The WHILE node's write-back (one multi-tensor byte copy for the contiguous pairs): every dtype, a 0-d and an
    empty tensor, a transposed value, a value that is a state buffer itself, and values aliasing other buffers
    (a swap), all land as a copy each would land."""
    gen = torch.Generator().manual_seed(0)
    state = [
        torch.tensor(7),
        torch.randn(3, 4, generator=gen),
        torch.randn(4, 3, generator=gen),
        torch.zeros(5, dtype=torch.bool),
        torch.arange(6, dtype=torch.int32),
        torch.empty(0),
        torch.randn(2, generator=gen, dtype=torch.float64),
        torch.randn(2, generator=gen, dtype=torch.float64),
    ]
    new = [
        torch.tensor(8),
        torch.randn(4, 3, generator=gen).t(),  # not contiguous
        state[2],  # the buffer itself
        torch.rand(5, generator=gen) < 0.5,
        torch.arange(6, dtype=torch.int32) * -3,
        torch.empty(0),
        state[7],  # a swap: each value aliases the other's buffer
        state[6],
    ]
    expected = [v.clone() for v in new]
    loops.assign_state(state, new)
    for buffer, value in zip(state, expected, strict=True):
        assert buffer.dtype == value.dtype and torch.equal(buffer, value)
