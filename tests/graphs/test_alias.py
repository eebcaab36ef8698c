"""Zero-copy inputs (`tendril.graphs.zero_copy`) through the null backend on the CPU: what is learned, what is
redirected, what falls back and why, and that every answer equals eager however the program misbehaves."""

import contextlib
import dataclasses
import pickle

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tendril.config import Config
from tendril.graphs.backend import NullBackend
from tendril.graphs.callable import GraphedCallable, graphed
from tendril.graphs.inputs import InputPlacement
from tendril.graphs.key import GraphKey, TensorSpec, flatten_call, key_of, step_between
from tendril.graphs.memory import PlaceholderArena
from tendril.graphs.stats import GraphStats, Misprediction
from tendril.graphs.zero_copy.lanes import REDIRECT_LANES, LaneKey, Lanes, empty_at, lane_of, partner
from tendril.graphs.zero_copy.ops import out_form, signature
from tendril.graphs.zero_copy.plugin import ZeroCopy

aten = torch.ops.aten


def step(ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """A decode-step stand-in: the cache grows by one position, a score depends on all of it."""
    new = ids.float().unsqueeze(-1) * 0.1
    k2 = torch.cat([k, new.expand(-1, 1, k.shape[-1])], dim=1)
    v2 = torch.cat([v, (new * 2).expand(-1, 1, v.shape[-1])], dim=1)
    return (ids * 2 + 1) % 7, (k2 * v2).sum(-1), k2, v2


def make(fn=step) -> GraphedCallable:
    return graphed(fn, backend=NullBackend(), config=Config())


def beam_loop(fn, steps: int, seed: int = 0, context=contextlib.nullcontext, keep: bool | str = False, device="cpu"):
    """Host loop reordering the cache by random beam indices every step (as HF beam search does); `keep`
    keeps every step's cache inputs (`"views"`: only views of them) until the end."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 7, (4, 1), generator=gen).to(device)
    k, v = torch.randn(4, 3, 5, generator=gen).to(device), torch.randn(4, 3, 5, generator=gen).to(device)
    scores, kept = [], []
    with context():
        for _ in range(steps):
            new_ids, score, k2, v2 = fn(ids, k, v)
            scores.append(score.clone())
            if keep == "views":
                kept.append((k[1:], v[:, 2:]))
            elif keep:
                kept.append((k, v))
            beam = torch.randperm(4, generator=gen).to(device)
            k, v, ids = k2.index_select(0, beam), v2.index_select(0, beam), new_ids.index_select(0, beam)
    return scores, [(a.clone(), b.clone()) for a, b in kept], (k.clone(), v.clone())


def assert_same(eager, fast) -> None:
    for a, b in zip(eager[0], fast[0], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for (a, b), (c, d) in zip(eager[1], fast[1], strict=True):
        torch.testing.assert_close((a, b), (c, d), rtol=0, atol=0)
    torch.testing.assert_close(eager[2], fast[2], rtol=0, atol=0)


def test_out_form_finds_the_out_overload_of_single_output_functional_ops():
    assert out_form(aten.index_select.default) is aten.index_select.out
    assert out_form(aten.add.Tensor) is aten.add.out
    assert out_form(aten.div.Tensor_mode) is aten.div.out_mode
    assert out_form(aten.cat.default) is aten.cat.out
    for op in (aten.topk.default, aten.unsqueeze.default, aten.slice.Tensor, aten.add_.Tensor):
        assert out_form(op) is None, op


def test_signature_separates_dtypes_and_constants_but_not_shapes():
    a, b = torch.zeros(2, 3), torch.zeros(5, 3)
    assert signature((a, 0, torch.zeros(2, dtype=torch.long)), {}) == signature(
        (b, 0, torch.ones(7, dtype=torch.long)), {}
    )
    assert signature((a, 0), {}) != signature((a.half(), 0), {})
    assert signature((a, 0), {}) != signature((a, 1), {})


def test_empty_at_grows_within_the_buffer_and_refuses_past_it():
    buffer = torch.full((6,), float("nan"))
    out = torch.index_select(torch.arange(8.0).view(4, 2), 0, torch.tensor([2, 0]), out=empty_at(buffer))
    assert out.data_ptr() == buffer.data_ptr() and buffer[:4].tolist() == [4, 5, 0, 1]
    with pytest.raises(RuntimeError):
        torch.index_select(torch.arange(8.0).view(4, 2), 0, torch.tensor([2, 0, 1, 3]), out=empty_at(buffer))
    assert buffer[4:].isnan().all()  # the refused op wrote nothing


def test_lane_keys_differ_from_plain_keys_and_partners_alternate():
    fast = make()
    fast(torch.zeros(4, 1, dtype=torch.long), torch.zeros(4, 3, 5), torch.zeros(4, 3, 5))
    key = fast.keys()[0]
    lane = LaneKey(key.structure, key.tensors, key.constants, 1)
    assert lane != key and hash(lane) != hash(key) and str(lane).endswith("@lane1")
    assert [partner(0), partner(1), partner(2)] == [1, 2, 1] and set(REDIRECT_LANES) == {1, 2}


def test_a_lane_key_is_made_once_per_key_lane_and_generation_and_hashes_as_its_fields():
    """`Lanes.lane_key` returns the same `LaneKey` at every call (its hash is computed once), a new one for
    another lane or generation, and never one made for another key object (checked by identity, as a key
    cache entry would be after its key died and another took its id)."""
    spec = lambda n: TensorSpec((n,), torch.float32, torch.device("cpu"))  # noqa: E731
    lanes = Lanes(PlaceholderArena())
    a, b = GraphKey(("flat", 1, ()), (spec(3),), ()), GraphKey(("flat", 1, ()), (spec(4),), ())
    first = lanes.lane_key(a, 1)
    assert lanes.lane_key(a, 1) is first and first == LaneKey(a.structure, a.tensors, a.constants, 1, 0)
    assert hash(first) == hash(LaneKey(a.structure, a.tensors, a.constants, 1, 0)) == hash(first)
    assert lanes.lane_key(a, 2).lane == 2 and lanes.lane_key(a, 2) != first
    lanes._lane_keys[(id(b), 1, 0)] = (a, first)  # as if b had taken a dead key's id
    assert lanes.lane_key(b, 1).tensors == b.tensors
    lanes.generations[1] += 1
    assert lanes.lane_key(a, 1) == LaneKey(a.structure, a.tensors, a.constants, 1, 1)
    assert [f.name for f in dataclasses.fields(LaneKey)] == ["structure", "tensors", "constants", "lane", "generation"]
    copied = pickle.loads(pickle.dumps(first))
    assert "_hash" not in copied.__dict__ and copied == first and hash(copied) == hash(first)
    assert step_between(lanes.lane_key(a, 1), lanes.lane_key(b, 1)) == ((1,),)  # shapes only: the cache is no field


def test_a_call_goes_to_the_lane_most_of_its_arguments_sit_in_and_the_first_met_on_a_tie():
    spec = TensorSpec((3,), torch.float32, torch.device("cpu"))

    def lane_of_call(*where):
        lanes = Lanes(PlaceholderArena())
        leaves = [lanes.placeholder(lane, position, spec) for position, lane in enumerate(where)]
        flat = flatten_call(tuple(leaves), {})
        return lane_of(lanes.key_for(key_of(flat), flat, flat.tensor_indices(), GraphStats()))

    assert lane_of_call(1, 2) == 1 and lane_of_call(2, 1) == 2
    assert lane_of_call(1, 2, 2) == 2 and lane_of_call(2, 1, 1) == 1 and lane_of_call(1, 1, 2) == 1


def test_reallocating_a_redirect_target_moves_its_lane_to_graphs_of_the_new_buffers():
    """A lane graph reads the buffers its lane had at capture; once a redirect target's buffer is reallocated
    (grown), calls of that lane go to graphs keyed by the new generation. Carried positions do not count."""
    lanes = Lanes(PlaceholderArena())
    spec = lambda n: TensorSpec((n,), torch.float32, torch.device("cpu"))  # noqa: E731
    lanes.placeholder(1, 0, spec(4))
    lanes.placeholder(1, 0, spec(3))  # fits: same buffer
    assert lanes.generations == {1: 0, 2: 0}
    old = LaneKey((), (spec(9),), (), 1, lanes.generations[1])
    lanes.placeholder(1, 0, spec(9))  # outgrown: reallocated
    assert lanes.generations == {1: 1, 2: 0}
    assert lanes.current(old) == LaneKey((), (spec(9),), (), 1, 1)
    assert str(lanes.current(old)).endswith("@lane1/buffers1")
    lanes.placeholder(2, 1, spec(4))
    lanes.carried.add(1)
    lanes.placeholder(2, 1, spec(64))
    assert lanes.generations == {1: 1, 2: 0}
    plain = GraphKey((), (spec(9),), ())
    assert lanes.current(plain) is plain


def test_a_producer_that_outgrows_its_lane_sizes_the_buffer_for_its_output_once():
    fast = make(lambda x: x * 2)
    x = torch.randn(4, 3)
    beam = torch.tensor([3, 1, 2, 0])
    with fast.zero_copy():
        for _ in range(4):
            y = x.index_select(0, beam)
            torch.testing.assert_close(fast(y), y * 2)
        x = torch.randn(40, 3)
        beam = torch.arange(40).flip(0)
        reallocations = dict(fast._zero_copy.lanes.generations)
        for step in range(6):
            if step == 2:  # the too-large output was copied (and relinked) once; then both lanes fit
                copied = fast.stats.input_bytes_copied
            y = x.index_select(0, beam)
            torch.testing.assert_close(fast(y), y * 2)
    assert fast.stats.input_bytes_copied == copied
    assert fast.stats.mispredictions[Misprediction.TOO_LARGE] == 1
    assert sum(fast._zero_copy.lanes.generations.values()) - sum(reallocations.values()) == 2  # each lane once
    assert set(fast.stats.mispredictions) == {Misprediction.TOO_LARGE}


def test_beam_loop_under_zero_copy_equals_eager_and_stops_copying_the_cache():
    eager = beam_loop(step, 10)
    fast = make()
    assert_same(eager, beam_loop(fast, 10, context=fast.zero_copy))
    stats = fast.stats
    assert stats.redirects >= 2 * 6 and stats.input_copies_avoided >= 2 * 6
    assert not {Misprediction.NOT_PASSED, Misprediction.MOVED, Misprediction.REFERENCED} & set(stats.mispredictions)
    keys = fast.keys()
    assert any(isinstance(key, LaneKey) for key in keys)


def test_steady_state_copies_only_what_has_no_out_form():
    def viewed_ids(ids, k):
        return ids + 1, torch.cat([k, k[:, :1]], dim=1)

    fast = make(viewed_ids)
    ids, k = torch.zeros(4, 1, dtype=torch.long), torch.randn(4, 2, 3)
    with fast.zero_copy():
        for _ in range(6):
            before = fast.stats.input_bytes_copied
            new_ids, k2 = fast(ids, k)
            ids, k = new_ids.view(-1)[:, None], k2.index_select(0, torch.tensor([3, 2, 1, 0]))
    assert fast.stats.input_bytes_copied - before == ids.numel() * ids.element_size()
    assert fast.stats.mispredictions[Misprediction.NO_OUT_FORM] >= 4


@pytest.mark.parametrize("keep", [True, "views"])
def test_kept_references_are_never_clobbered(keep):
    eager = beam_loop(step, 8, keep=keep)
    fast = make()
    assert_same(eager, beam_loop(fast, 8, context=fast.zero_copy, keep=keep))
    assert fast.stats.mispredictions[Misprediction.REFERENCED] > 0


def test_a_producer_that_reads_its_target_buffer_is_not_redirected():
    def fn(x):
        return x * 2

    fast = make(fn)
    x = torch.randn(3, 4)
    results, expected = [], []
    with fast.zero_copy():
        for _ in range(5):
            results.append(fast(x).clone())
            expected.append(x * 2)
            x = torch.cat([x[1:], x[:1]])  # the next input from the current one: alternating lanes keep this legal
    for a, b in zip(expected, results, strict=True):
        torch.testing.assert_close(a, b)


def test_an_argument_living_in_another_arguments_placeholder_is_copied_correctly():
    def fn(a, b):
        return a * 10 + b

    fast = make(fn)
    a, b = torch.randn(5), torch.randn(5)
    fast(a, b)
    (pa, pb), _ = fast.inputs_for(a, b)
    pa.copy_(torch.arange(5.0))
    pb.copy_(torch.ones(5))
    expected = fn(pb.clone(), pa.clone())
    torch.testing.assert_close(fast(pb, pa), expected)  # swapped: each source is the other's placeholder
    pa.copy_(torch.arange(5.0))
    reversed_pa = pa[torch.tensor([4, 3, 2, 1, 0])]
    expected = fn(pa.clone(), reversed_pa.clone())
    torch.testing.assert_close(fast(pa, reversed_pa), expected)
    torch.testing.assert_close(fast(pb[1:].view(2, 2)[0].repeat(3)[:5], pb), fn(pb[1:3].repeat(3)[:5], pb))


def test_inputs_for_written_in_place_skips_the_copy():
    fast = make(lambda x: x.sum(0))
    (view,), _ = fast.inputs_for(torch.zeros(3, 2))
    torch.index_select(torch.arange(8.0).view(4, 2), 0, torch.tensor([3, 1, 0]), out=view)
    before = fast.stats.input_copies
    torch.testing.assert_close(fast(view), torch.tensor([8.0, 11.0]))
    assert fast.stats.input_copies == before and fast.stats.input_copies_avoided == 1


def test_two_callables_sharing_a_producer_each_get_the_right_values():
    f1, f2 = make(lambda x: x * 2), make(lambda x: x + 100)
    x = torch.randn(4)
    with f1.zero_copy(), f2.zero_copy():
        for _ in range(6):
            y = torch.sin(x)
            torch.testing.assert_close(f1(y), torch.sin(x) * 2)
            torch.testing.assert_close(f2(y), torch.sin(x) + 100)
            x = x + 1


def test_in_place_update_of_a_redirected_input_is_seen_by_the_call():
    fast = make(lambda x: x * 3)
    x = torch.randn(6)
    with fast.zero_copy():
        for t in range(6):
            y = x + t
            y.mul_(-1)
            torch.testing.assert_close(fast(y), (x + t) * -3)


def test_a_changed_signature_is_counted_and_still_correct():
    fast = make(lambda x: x.float() * 2)
    x = torch.arange(6.0)
    with fast.zero_copy():
        for t in range(8):
            source = x.double() if t == 5 else x
            y = source + 1
            torch.testing.assert_close(fast(y), (source + 1).float() * 2)
    # the float64 step breaks the float32 prediction; the relearned links wait for confirmation
    assert fast.stats.mispredictions[Misprediction.SIGNATURE] == 1


def test_growing_inputs_outgrow_lane_buffers_and_stay_correct():
    fast = make(lambda x: x.cumsum(0))
    x = torch.randn(2)
    with fast.zero_copy():
        for _ in range(12):
            y = torch.cat([x, x[:1] * 0.5])
            torch.testing.assert_close(fast(y), y.cumsum(0))
            x = y
    assert fast.stats.input_copies_avoided > 0


def test_pinned_positions_of_graphs_returning_their_input():
    lanes = Lanes(PlaceholderArena())
    placeholder = torch.zeros(8)
    lanes.pin_aliased_outputs([3], [placeholder], (placeholder[2:4], torch.ones(2)))
    assert lanes.pinned == {3}


def test_stats_count_bytes_per_call():
    fast = make(lambda x: x + 1)
    for _ in range(3):
        fast(torch.zeros(10))
    assert fast.stats.input_bytes_copied == 3 * 40 and fast.stats.bytes_copied_per_call == 40
    assert isinstance(fast.stats, GraphStats)


PERTURBATIONS = ("none", "keep", "skip_call", "wrong_arg", "in_place", "double", "swap", "shape")


def misbehaving_loop(call, context, perturbations, device="cpu"):
    """A host loop that breaks predictions in every way: kept references, skipped calls, other producers,
    in-place updates, other dtypes, swapped arguments, other shapes."""
    a, b = torch.arange(6.0, device=device), torch.ones(6, device=device)
    reverse = torch.arange(5, -1, -1, device=device)
    kept, results = [], []
    with context():
        for index, what in enumerate(perturbations):
            a2 = a.index_select(0, reverse) + index
            b2 = b * 0.5
            if what == "keep":
                kept.append(a2)
            if what == "skip_call":
                a, b = a2, b2
                continue
            if what == "wrong_arg":
                a2 = torch.linspace(0, 1, 6, device=device)
            if what == "in_place":
                a2.add_(3)
            if what == "double":
                a2 = a2.double().float()
            if what == "swap":
                a2, b2 = b2, a2
            if what == "shape":
                a2, b2 = torch.cat([a2, a2[:1]]), torch.cat([b2, b2[:1]])
            out, cum = call(a2, b2)
            results.append((out.clone(), cum.clone()))
            a, b = out[: a.shape[0]].clone() if what == "shape" else out, b2[: b.shape[0]]
    return results, [k.clone() for k in kept]


def misbehaving_fn(a, b):
    return a * 2 + b.sum(), a.cumsum(0)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.sampled_from(PERTURBATIONS), min_size=4, max_size=12))
@example(["shape", "shape", "none", "none", "shape"])  # a kept redirected tensor outlives its outgrown buffer
def test_any_sequence_of_misbehaviour_equals_eager(perturbations):
    """The host loop misbehaves in every way a prediction can break; answers are always eager's."""
    eager = misbehaving_loop(misbehaving_fn, contextlib.nullcontext, perturbations)
    fast = make(misbehaving_fn)
    got = misbehaving_loop(fast, fast.zero_copy, perturbations)
    torch.testing.assert_close(got, eager, rtol=0, atol=0)


def test_signatures_tell_int_float_and_bool_constants_apart():
    a = torch.zeros(3, dtype=torch.long)
    assert len({signature((a, 1), {}), signature((a, 1.0), {}), signature((a, True), {})}) == 3


@pytest.mark.parametrize("inference", [True, False])
def test_redirected_outputs_are_the_same_kind_of_tensor_as_eager_ones_and_free_their_slot_when_dropped(inference):
    fast = graphed(lambda x: x * 2, backend=NullBackend(), config=Config())
    beams = torch.tensor([2, 0, 1])
    x = torch.randn(3, 4)
    with torch.inference_mode(inference), fast.zero_copy():
        for _ in range(6):
            y = x.index_select(0, beams)
            assert y.is_inference() == inference
            torch.testing.assert_close(fast(y), y * 2)
            x = y + 1
    assert fast.stats.redirects >= 3 and Misprediction.REFERENCED not in fast.stats.mispredictions
    aliases = list(fast._zero_copy.lanes.aliases.values())
    assert aliases and all(len(alias.templates) == 1 for alias in aliases)
    del x, y
    assert not any(alias.referenced() for alias in aliases)


def test_a_callable_without_zero_copy_never_makes_the_plug_in():
    fast = make(lambda x: x * 2)
    x = torch.arange(4.0)
    fast(x)
    fast.capture([(torch.zeros(8),)], progress=False)
    (placeholder,), _ = fast.inputs_for(x)
    placeholder.copy_(x)
    torch.testing.assert_close(fast(placeholder), x * 2)
    assert fast._zero_copy is None and type(fast._inputs) is InputPlacement
    with fast.zero_copy():
        assert isinstance(fast._zero_copy, ZeroCopy) and fast._inputs is fast._zero_copy
    assert fast.stats.input_copies_avoided == 1


def test_the_plug_in_pins_positions_whose_placeholder_graphs_captured_before_it_return():
    """A graph returning a view of its placeholder keeps that position from redirects, whether it was captured
    before the plug-in existed or after."""
    arena = PlaceholderArena()
    placeholder = arena.placeholder(1, TensorSpec((4,), torch.float32, torch.device("cpu")))
    other = torch.zeros(4)
    zero_copy = ZeroCopy(arena, GraphStats(), [([1], [placeholder], (other, placeholder[1:]))])
    assert zero_copy.lanes.pinned == {1}
