"""The per-op and per-call fast paths of zero-copy inputs and dispatch (CPU, null backend): they skip work,
never checks. Each test breaks one shortcut's assumption and asserts the answer is still eager's."""

import gc

import pytest
import torch

from tendril.config import Config
from tendril.graphs.backend import NullBackend
from tendril.graphs.callable import graphed
from tendril.graphs.stats import Misprediction
from tendril.graphs.zero_copy import ops
from tendril.graphs.zero_copy.lanes import partner
from tendril.graphs.zero_copy.mode import ZeroCopyMode
from tendril.graphs.zero_copy.ops import out_call
from tendril.graphs.zero_copy.predictor import _PRUNE_MIN, CONFIRMATIONS, Link


def make(fn):
    return graphed(fn, backend=NullBackend(), config=Config())


def test_out_call_is_the_torch_binding_of_functions_and_methods_with_an_out_overload():
    assert out_call(torch.Tensor.index_select) is torch.index_select
    assert out_call(torch.index_select) is torch.index_select
    assert out_call(torch.cat) is torch.cat
    for func in (
        torch.Tensor.unsqueeze,  # a view: no out= form
        torch.Tensor.add_,  # in place
        torch.Tensor.__getitem__,
        torch.Tensor.float,  # torch.float is a dtype
        torch.Tensor.__rsub__,  # a Python function
        torch.nn.functional.relu,  # a Python function named like torch.relu
        torch.split,
    ):
        assert out_call(func) is None, func


def test_a_binding_that_rejects_the_arguments_unlinks_its_producer_and_the_answer_stays_eager():
    func = torch.Tensor.index_select

    def rejects(*args, **kwargs):
        raise TypeError("index_select() received an invalid combination of arguments")

    ops._OUT_CALLS[func] = rejects  # a binding refusing the arguments before anything runs
    try:
        fast = make(lambda x: x * 2)
        x = torch.randn(6, 3)
        beam = torch.tensor([5, 4, 3, 2, 1, 0])
        with fast.zero_copy():
            for _ in range(6):
                y = x.index_select(0, beam)
                torch.testing.assert_close(fast(y), y * 2)
                x = y + 1
        assert fast.stats.redirects == 0
        assert "its out= form raised index_select()" in fast.stats.misprediction_details[Misprediction.NO_OUT_FORM]
    finally:
        ops._OUT_CALLS.pop(func, None)


def test_an_out_form_that_raises_unlinks_its_producer_instead_of_growing_the_buffer():
    func = torch.Tensor.mul

    def refuse(*args, **kwargs):
        raise RuntimeError("out= refused for this test")

    ops._OUT_CALLS[func] = refuse
    try:
        fast = make(lambda x: x + 1)
        x = torch.randn(8)
        with fast.zero_copy():
            for _ in range(8):
                y = x * 3
                torch.testing.assert_close(fast(y), y + 1)
        buffers = [b for arena in fast._zero_copy.lanes.arenas.values() for b in arena.buffers.values()]
        assert all(b.numel() <= 2 * 8 for b in buffers)  # never grown past the first sizing
        assert "out= form raised" in fast.stats.misprediction_details[Misprediction.NO_OUT_FORM]
    finally:
        ops._OUT_CALLS.pop(func, None)


def test_a_reused_tensor_id_never_selects_another_tensors_producer():
    """Records are keyed by id(tensor) and checked through a weak reference: a tensor that dies and whose
    id is taken by a tensor from elsewhere must not be learned as produced by the dead one's op."""
    fast = make(lambda x: x + 1)
    predictor = fast._plug_in().predictor
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
    predictor = fast._plug_in().predictor
    kept = []
    with fast.zero_copy():
        for index in range(3 * _PRUNE_MIN):
            y = torch.full((2,), float(index))
            if index % 3 == 0:
                kept.append(y + 0)
    assert len(predictor.produced) < 2 * _PRUNE_MIN + len(kept)
    assert all(predictor.produced[id(t)].ref() is t for t in kept)  # live outputs keep their records


def test_occurrence_counting_separates_overloads_and_resets_at_every_call():
    fast = make(lambda a, b: a - b)
    predictor = fast._plug_in().predictor
    x = torch.randn(5)
    results, expected = [], []
    with fast.zero_copy():
        for t in range(8):
            x = x * 0.5 + t % 2  # mul #0, add #0 (not passed)
            a = x + 1.0  # add #1
            b = x.add(x, alpha=2)  # add #2: same method, next occurrence
            c = torch.sub(x, 1)  # torch.sub #0, not passed
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


def test_calls_run_without_the_mode_and_give_it_back():
    """The mode is lifted off torch's mode stack while a call runs (its tensor handling pays no per-call cost),
    restored after it, also when the call raises; ops between calls still reach the predictor."""
    seen = []

    def fn(x):
        seen.append(torch.overrides._get_current_function_mode())
        if x.sum() < 0:
            raise ValueError("negative")
        return x + 1

    fast = make(fn)
    x = torch.ones(3)
    with fast.zero_copy():
        mode = torch.overrides._get_current_function_mode()
        assert isinstance(mode, ZeroCopyMode)
        for _ in range(3):
            y = x * 2
            torch.testing.assert_close(fast(y), y + 1)
            assert torch.overrides._get_current_function_mode() is mode
        with pytest.raises(ValueError, match="negative"):
            fast(-x)
        assert torch.overrides._get_current_function_mode() is mode
    assert seen and all(current is None for current in seen)
    assert torch.overrides._get_current_function_mode() is None
    assert fast.stats.redirects >= 1


def test_a_compiled_producer_inside_the_block_stays_eager_equal():
    """torch.compile traces through function modes: code compiled inside a `zero_copy()` block must still give
    eager's answer, whether or not its outputs are redirected."""
    fast = make(lambda x: x * 2)
    produce = torch.compile(lambda x, order: torch.index_select(x, 0, order) + 1, backend="eager")
    x = torch.randn(2, 3)
    order = torch.tensor([1, 0])
    with torch.inference_mode(), fast.zero_copy():
        for _ in range(5):
            torch.testing.assert_close(fast(produce(x, order)), (x[[1, 0]] + 1) * 2)


@pytest.mark.parametrize("inference", [True, False])
def test_a_whole_view_of_an_op_output_is_redirected_through_that_op_and_then_copies_nothing(inference):
    """HF's beam search passes `tokens[:, None]`: the view has no out= form, the op it views (`sub`) has."""
    fast = make(lambda ids, x: x * ids)
    x = torch.randn(4, 3)
    scores = torch.randn(4)
    expected = []
    copied = []
    with torch.inference_mode(inference), fast.zero_copy():
        for _ in range(6):
            top = scores.argsort()
            tokens = top - 1
            before = fast.stats.input_bytes_copied
            out = fast(tokens[:, None], x)
            copied.append(fast.stats.input_bytes_copied - before)
            expected.append(x * (top - 1)[:, None])
            torch.testing.assert_close(out, expected[-1])
            scores = scores.roll(1)
            x = x.index_select(0, top)
    assert copied[-2:] == [0, 0]
    assert fast.stats.redirects >= 4 and not fast.stats.mispredictions


@pytest.mark.parametrize(
    "view",
    [
        lambda t: t.view(torch.float32),  # reinterprets the bits: sub's out= form would convert them
        lambda t: t[:2],  # part of the output
        lambda t: t.view(2, 2).t(),  # another element order
    ],
    ids=["dtype", "part", "transposed"],
)
def test_views_that_are_not_the_whole_output_in_order_are_copied_and_stay_eager(view):
    fast = make(lambda v: v * 2)
    base = torch.arange(4, dtype=torch.int32)
    with torch.inference_mode(), fast.zero_copy():
        for step in range(6):
            passed = view(base - step)
            torch.testing.assert_close(fast(passed), passed * 2, equal_nan=True)  # int bits read as float: NaNs
    assert fast.stats.redirects == 0
    assert fast.stats.input_bytes_copied >= 6 * passed.numel() * passed.element_size()


# -- the redirect path's caches and shortcuts (`ZeroCopyPredictor.dispatch` / `_redirect`) -----------------

CPU = torch.device("cpu")


def warmed_reorder_loop(fast, steps=4):
    """`steps` steps of `x -> x.index_select(0, beam)` into `fast` (so its link is confirmed and redirecting)."""
    x = torch.randn(4, 3)
    beam = torch.tensor([3, 1, 2, 0])
    for _ in range(steps):
        y = x.index_select(0, beam)
        torch.testing.assert_close(fast(y), y * 2)
        x = y + 1
    return x, beam


def test_a_link_serves_its_own_function_only():
    """Links are found by (id of the function, occurrence) and then checked to be that function's: a link found
    under another function's slot (as after a reused id) is never used, even one whose signature matches."""
    fast = make(lambda x: x * 2)
    with fast.zero_copy():
        x, _ = warmed_reorder_loop(fast)
    impostor = Link(
        torch.Tensor.sub, torch.sub, 0, ops.signature((x, 1), {}), x.dtype, x.device, x.numel(), CONFIRMATIONS
    )
    fast._zero_copy.predictor.links[(id(torch.Tensor.add), 0)] = impostor  # sub's link where add's first run looks
    expected = x + 1
    redirects = fast.stats.redirects
    with fast.zero_copy():
        y = x.add(1)
    torch.testing.assert_close(y, expected)  # through the impostor it would be x - 1, written into a placeholder
    assert fast.stats.redirects == redirects


def test_a_slot_buffer_reallocated_elsewhere_is_never_written_through_a_stale_cached_record():
    """A link caches its slot records per lane; when a slot's buffer is reallocated by another path (a capture,
    a carried output: `Lanes.buffer`), the record is retired and the next redirect writes the new buffer, the
    one the call's graph reads. Through the stale record the call would find its argument in the old buffer and
    copy it (`MOVED`)."""
    fast = make(lambda x: x * 2)
    lanes = fast._plug_in().lanes
    with fast.zero_copy():
        x, beam = warmed_reorder_loop(fast)
        cached = dict(enumerate(next(iter(fast._zero_copy.predictor.links.values())).aliases))  # lane -> slot record
        assert all(cached[lane] is not None for lane in (1, 2))
        for lane in (1, 2):
            lanes.buffer(lane, 0, torch.float32, CPU, 1000)  # reallocated: every graph of the lane is outgrown
        assert all(cached[lane].retired for lane in (1, 2))
        copied = fast.stats.input_bytes_copied
        redirects = fast.stats.redirects
        for _ in range(4):
            y = x.index_select(0, beam)
            torch.testing.assert_close(fast(y), y * 2)
            x = y + 1
    assert fast.stats.redirects == redirects + 4
    assert fast.stats.input_bytes_copied == copied
    assert not fast.stats.mispredictions


def test_a_link_never_reuses_a_slot_record_smaller_than_its_output_needs():
    """The cached record is reused only while it holds twice the link's output (what `Lanes.redirect_alias`
    asks); a link that learned of a larger output grows the slot before its redirect, never after a failure."""
    fast = make(lambda x: x * 2)
    predictor = fast._plug_in().predictor
    with fast.zero_copy():
        x, beam = warmed_reorder_loop(fast)
        link = next(iter(predictor.links.values()))
        link.numel = 500  # as `_outgrown` records a larger output
        for _ in range(2):
            y = x.index_select(0, beam)
            torch.testing.assert_close(fast(y), y * 2)
            x = y + 1
        assert all(alias is None or alias.capacity >= 1000 for alias in link.aliases)
        lanes = fast._zero_copy.lanes
        assert all(lanes.arena(lane).buffers[(0, torch.float32, CPU)].numel() >= 1000 for lane in (1, 2))
    assert Misprediction.TOO_LARGE not in fast.stats.mispredictions


def test_slot_records_count_their_templates_under_both_inference_modes():
    """A slot is referenced when its storage has more users than its record's own (the storage object and one
    template per inference mode): a record used in and out of inference mode has two templates and is free."""
    fast = make(lambda x: x * 2)
    beam = torch.tensor([2, 0, 1])
    x = torch.randn(3, 4)
    with fast.zero_copy():
        for inference in (False, True, False, True):  # graphs captured first outside inference mode (null backend)
            with torch.inference_mode(inference), torch.no_grad():
                for _ in range(4):
                    y = x.index_select(0, beam)
                    torch.testing.assert_close(fast(y), y * 2)
                    x = y + 1
    assert Misprediction.REFERENCED not in fast.stats.mispredictions
    assert fast.stats.redirects >= 12
    aliases = list(fast._zero_copy.lanes.aliases.values())
    assert aliases and all(len(alias.templates) == 2 for alias in aliases)
    del x, y
    assert not any(alias.referenced() for alias in aliases)


def _index_select(x):
    return x.index_select(0, torch.tensor([3, 1, 2, 0]))


def _cat(x):  # a list argument: `survey` has no pointers, `reads_range` walks the list
    return torch.cat([x[2:], x[:2]])


@pytest.mark.parametrize(
    ("produce", "rows"), [(_index_select, [3, 1, 2, 0]), (_cat, [2, 3, 0, 1])], ids=["arg", "list"]
)
def test_a_producer_reading_its_target_slot_through_another_storage_is_not_redirected(produce, rows):
    """The program reads the memory the next redirect would write through a tensor of another storage (the
    lane buffer itself), so the slot's use count does not show it: the pointer check refuses the redirect."""
    fast = make(lambda x: x * 2)
    x = torch.randn(4, 3)
    with fast.zero_copy():
        for step in range(8):
            if step >= 4:
                lane = partner(fast._zero_copy.lanes.last_lane)
                buffer = fast._zero_copy.lanes.arena(lane).buffers[(0, torch.float32, CPU)]
                inside = buffer[: x.numel()].view(4, 3)
                inside.copy_(x)
                x = inside
            want = x[rows] * 2
            torch.testing.assert_close(fast(produce(x)), want)
            x = want * 0.25
    assert fast.stats.mispredictions[Misprediction.READS_PLACEHOLDER] == 4
    assert fast.stats.redirects >= 1


def test_a_producer_with_a_sparse_argument_stays_eager_equal():
    """A tensor without storage has no data pointer to check: the redirect is refused (it may read the slot),
    the program does not fail on it."""
    fast = make(lambda x: x * 2)
    sparse = torch.eye(4).to_sparse()
    x = torch.randn(4, 3)
    with fast.zero_copy():
        for _ in range(6):
            torch.testing.assert_close(fast(torch.mm(sparse, x)), x * 2)
            x = x + 1
    assert fast.stats.mispredictions[Misprediction.READS_PLACEHOLDER] >= 1
    assert fast.stats.redirects == 0


def test_survey_describes_arguments_as_signature_did_and_gives_pointers_of_plain_tensors_only():
    a, index = torch.randn(3, 2), torch.tensor([2, 0])
    parameter = torch.nn.Parameter(torch.randn(3, 2))

    def described(args, kwargs):  # the definition `survey` inlines
        return (*map(ops.describe, args), *kwargs, *map(ops.describe, kwargs.values()))

    cases = [
        ((a, 0, index), {}),
        ((a, 1.0, True, None, "x"), {}),
        ((parameter, 0, index), {}),
        (([a, index], 1), {}),
        ((a,), {"dim": 1, "other": index}),
        ((torch.eye(2).to_sparse(), a), {}),
        ((torch.tensor(2.0), a), {}),
    ]
    for args, kwargs in cases:
        assert ops.signature(args, kwargs) == described(args, kwargs), args
    assert ops.survey((a, 0, index), {})[1] == [a.data_ptr(), index.data_ptr()]
    for args, kwargs in cases[2:6]:  # a subclass, a list, keywords, a sparse tensor: walked by `reads_range`
        assert ops.survey(args, kwargs)[1] is None, args
    assert ops.signature((parameter,), {}) == ops.signature((parameter.detach(),), {})
