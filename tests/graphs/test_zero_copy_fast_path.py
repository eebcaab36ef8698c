"""The per-op and per-call fast paths of zero-copy inputs and dispatch (CPU, null backend): they skip work,
never checks. Each test breaks one shortcut's assumption and asserts the answer is still eager's."""

import gc

import torch

from tendril.config import Config
from tendril.graphs import alias
from tendril.graphs.alias import ZeroCopyMode, out_call, out_form, refuse_binding
from tendril.graphs.backend import NullBackend
from tendril.graphs.callable import graphed
from tendril.graphs.stats import Misprediction

aten = torch.ops.aten


def make(fn):
    return graphed(fn, backend=NullBackend(), config=Config())


def test_out_call_uses_the_generated_binding_and_falls_back_to_the_overload():
    assert out_call(aten.index_select.default) is torch.index_select
    assert out_call(aten.unsqueeze.default) is None  # a view: no out= form
    assert out_call(aten.split.Tensor) is None  # several outputs
    op = aten.index_select.default
    try:
        assert refuse_binding(op) is out_form(op)
        assert out_call(op) is aten.index_select.out
    finally:
        alias._OUT_CALLS.pop(op, None)
    assert out_call(op) is torch.index_select


def test_a_binding_that_rejects_the_arguments_is_replaced_and_the_answer_stays_eager():
    op = aten.index_select.default

    def rejects(*args, **kwargs):
        raise TypeError("index_select() received an invalid combination of arguments")

    alias._OUT_CALLS[op] = rejects  # a binding refusing the arguments before anything runs
    try:
        fast = make(lambda x: x * 2)
        x = torch.randn(6, 3)
        beam = torch.tensor([5, 4, 3, 2, 1, 0])
        with fast.zero_copy():
            for _ in range(6):
                y = x.index_select(0, beam)
                torch.testing.assert_close(fast(y), y * 2)
                x = y + 1
        assert out_call(op) is aten.index_select.out and fast.stats.redirects >= 2
    finally:
        alias._OUT_CALLS.pop(op, None)


def test_an_out_form_that_raises_unlinks_its_producer_instead_of_growing_the_buffer():
    op = aten.mul.Tensor

    def refuse(*args, **kwargs):
        raise RuntimeError("out= refused for this test")

    alias._OUT_CALLS[op] = refuse
    try:
        fast = make(lambda x: x + 1)
        x = torch.randn(8)
        with fast.zero_copy():
            for _ in range(8):
                y = x * 3
                torch.testing.assert_close(fast(y), y + 1)
        buffers = [b for arena in fast._lanes.arenas.values() for b in arena.buffers.values()]
        assert all(b.numel() <= 2 * 8 for b in buffers)  # never grown past the first sizing
        assert "out= form raised" in fast.stats.misprediction_details[Misprediction.NO_OUT_FORM]
    finally:
        alias._OUT_CALLS.pop(op, None)


def test_a_reused_tensor_id_never_selects_another_tensors_producer():
    """Records are keyed by id(tensor) and checked through a weak reference: a tensor that dies and whose
    id is taken by a tensor from elsewhere must not be learned as produced by the dead one's op."""
    fast = make(lambda x: x + 1)
    predictor = fast._predictor
    with fast.zero_copy():
        dead = torch.zeros(4) * 2  # recorded as produced by mul
        key = id(dead)
        record = predictor.produced[key]
        del dead
        gc.collect()
        assert record.ref() is None
        impostor = torch.ones(4)
        predictor.produced[id(impostor)] = record  # as if the id had been reused
        fast(impostor)
        fast(impostor)
    assert not predictor.links  # the dead record was not taken for the impostor's producer


def test_produced_records_are_pruned_when_their_tensors_die():
    fast = make(lambda x: x + 1)
    predictor = fast._predictor
    kept = []
    with fast.zero_copy():
        for index in range(3 * alias._PRUNE_MIN):
            y = torch.full((2,), float(index))
            if index % 3 == 0:
                kept.append(y + 0)
    assert len(predictor.produced) < 2 * alias._PRUNE_MIN + len(kept)
    assert all(predictor.produced[id(t)].ref() is t for t in kept)  # live outputs keep their records


def test_occurrence_counting_separates_overloads_and_resets_at_every_call():
    fast = make(lambda a, b: a - b)
    predictor = fast._predictor
    x = torch.randn(5)
    results, expected = [], []
    with fast.zero_copy():
        for t in range(8):
            x = x * 0.5 + t % 2  # mul #0, add.Tensor #0 (not passed)
            a = x + 1.0  # add.Tensor #1
            b = x.add(x, alpha=2)  # add.Tensor #2: same overload, next occurrence
            c = torch.sub(x, 1)  # sub.Tensor #0, not passed
            out = fast(a, b)
            assert not predictor.occurrences  # reset by the call
            results.append(out.clone())
            expected.append(a - b)
            del c
    for got, want in zip(results, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    positions = sorted(link.position for link in predictor.links.values())
    assert positions == [0, 1] and fast.stats.redirects >= 2 * 4


def test_key_cache_tells_apart_what_the_key_tells_apart():
    fast = make(lambda x, scale: x * scale)
    x = torch.arange(4.0)
    for scale in (1, 1.0, True, 2):
        torch.testing.assert_close(fast(x, scale), x * scale)
    fast(x.double(), 2)
    fast(x[:3], 2)
    assert len(fast.keys()) == 6 and fast.stats.captures == 6
    for _ in range(2):
        fast(x, 2)
        fast(x.double(), 2)
    assert fast.stats.captures == 6


def test_the_mode_handler_is_not_wrapped_in_dynamo_disable_but_clears_the_frame_callback(monkeypatch):
    """torch wraps mode handlers in dynamo's `disable` (a per-op host cost); this mode opts out and clears
    dynamo's frame callback itself around the handler, so nothing under it is compiled either way."""
    handler = ZeroCopyMode.__dict__["__torch_dispatch__"]
    assert not hasattr(handler, "_torchdynamo_disable") and not hasattr(handler, "__wrapped__")
    calls = []
    real = alias._set_eval_frame

    def spy(callback):
        calls.append(callback)
        return real(callback)

    monkeypatch.setattr(alias, "_set_eval_frame", spy)
    fast = make(lambda x: x + 1)
    x = torch.ones(2)
    with fast.zero_copy():
        x * 2
    assert calls[0] is None and len(calls) == 2  # cleared for the handler, then the prior callback restored
