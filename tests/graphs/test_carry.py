"""Loop-carried state (`tendril.graphs.zero_copy.carry`) through the null backend on the CPU."""

import pytest
import torch

from tendril.config import Config
from tendril.graphs.backend import NullBackend
from tendril.graphs.callable import graphed
from tendril.graphs.stats import Misprediction


def step(ids, past, beam):
    """Reorders its cache by last step's beams, grows it, and picks the next beams: everything on the device."""
    past = tuple(p.index_select(0, beam) for p in past)
    new = ids.float().unsqueeze(-1) * 0.1
    present = tuple(torch.cat([p, new.expand(-1, 1, p.shape[-1])], dim=1) for p in past)
    score = present[0].sum((1, 2)) - present[1].sum((1, 2))
    next_beam = torch.argsort(score)
    return (ids.index_select(0, next_beam) * 3 + 1) % 11, present, next_beam, score


def loop(fn, steps: int, seed: int = 0, fresh_at: int | None = None, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 7, (4, 1), generator=gen).to(device)
    past = (torch.randn(4, 3, 5, generator=gen).to(device), torch.randn(4, 3, 5, generator=gen).to(device))
    beam = torch.arange(4, device=device)
    history = []
    for index in range(steps):
        if index == fresh_at:
            past = tuple(p.clone() for p in past)
        ids, past, beam, score = fn(ids, past, beam)
        history.append((ids.clone(), score.clone(), beam.clone()))
    return history, [p.clone() for p in past]


def carried(fn=step):
    fast = graphed(fn, backend=NullBackend(), config=Config())
    return fast.carry(output=0, input=0).carry(output=1, input=1).carry(output=(2,), input=2)


def test_carried_loop_equals_eager_and_copies_only_the_first_call():
    eager = loop(step, 9)
    fast = carried()
    torch.testing.assert_close(loop(fast, 9), eager, rtol=0, atol=0)
    stats = fast.stats
    assert stats.input_copies == 4  # the first call's ids, two cache tensors and beams
    assert stats.input_copies_avoided == 4 * 8
    first_call_bytes = 4 * 8 + 2 * 4 * 3 * 5 * 4 + 4 * 8
    argsort_bytes = 4 * 8  # copied inside every graph: argsort has no out= form
    assert stats.input_bytes_copied == first_call_bytes + 9 * argsort_bytes


def test_carried_outputs_are_written_where_the_next_call_reads():
    fast = carried()
    loop(fast, 3)
    for key, bindings in fast._zero_copy.carry.bindings.items():
        cache = [binding for binding in bindings if binding.position in (1, 2)]
        assert all(binding.producer is not None and "cat" in str(binding.producer.op) for binding in cache), key


def test_only_outputs_without_an_out_form_are_copied_inside_the_graph():
    fast = carried()
    loop(fast, 4)
    detail = fast.stats.misprediction_details[Misprediction.CARRY_COPY]
    assert "32 bytes" in detail  # argsort's indices (a multi-output sort) only


def test_a_fresh_tensor_in_place_of_carried_state_is_copied_and_correct():
    eager = loop(step, 8, fresh_at=4)
    fast = carried()
    torch.testing.assert_close(loop(fast, 8, fresh_at=4), eager, rtol=0, atol=0)
    assert fast.stats.input_copies > 4


def test_restarting_the_loop_reuses_the_graphs():
    fast = carried()
    first = loop(fast, 6)
    captures = fast.stats.captures
    torch.testing.assert_close(loop(fast, 6), first, rtol=0, atol=0)
    assert fast.stats.captures == captures


def test_keyword_inputs_and_nested_output_paths():
    def fn(x, *, state):
        new = {"h": state["h"] * 0.5 + x}
        return {"out": x.sum(), "next": new}

    fast = graphed(fn, backend=NullBackend(), config=Config()).carry(output=("next",), input="state")
    state = {"h": torch.ones(3)}
    expected = {"h": torch.ones(3)}
    for t in range(5):
        x = torch.full((3,), float(t))
        result = fast(x, state=state)
        state = result["next"]
        expected = fn(x, state=expected)["next"]
        torch.testing.assert_close(state, expected)
    assert fast.stats.input_copies_avoided == 4


def test_carry_after_the_first_call_is_refused():
    fast = graphed(step, backend=NullBackend(), config=Config())
    loop(fast, 1)
    with pytest.raises(RuntimeError, match="before the first call"):
        fast.carry(output=1, input=1)


@pytest.mark.parametrize(
    ("output", "input", "message"),
    [(3, 1, "holds 1 tensors, the input 2"), (1, 5, "no such argument"), (7, 1, "no element 7"), (2, 1, "holds 1")],
)
def test_declarations_that_do_not_fit_the_call_name_the_problem(output, input, message):
    fast = graphed(step, backend=NullBackend(), config=Config()).carry(output=output, input=input)
    with pytest.raises(ValueError, match=message):
        loop(fast, 1)


def test_dtype_mismatch_is_refused():
    fast = graphed(lambda x: (x.double(),), backend=NullBackend(), config=Config()).carry(output=0, input=0)
    with pytest.raises(ValueError, match="must match"):
        fast(torch.zeros(2))
