"""Dispatch policy of `GraphedCallable`, run through the null backend on the CPU: which calls replay,
which capture, which fall back and why, what the stats say, and that every answer equals eager."""

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tendril.config import Config
from tendril.graphs.admission import GraphFallbackWarning
from tendril.graphs.backend import CaptureFailed, NullBackend
from tendril.graphs.buckets import sequence_buckets
from tendril.graphs.callable import Call, GraphedCallable, graphed
from tendril.graphs.key import GraphKey
from tendril.graphs.stats import Fallback


def mlp(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    return torch.tanh(x @ torch.ones(x.shape[-1], 3)) * scale


def make(fn=mlp, **options) -> tuple[GraphedCallable, NullBackend]:
    backend = options.pop("backend", None) or NullBackend()
    return graphed(fn, backend=backend, config=options.pop("config", Config()), **options), backend


def test_first_call_captures_later_calls_replay_and_match_eager():
    fast, backend = make()
    for _ in range(3):
        x = torch.randn(2, 4)
        torch.testing.assert_close(fast(x), mlp(x))
    assert (backend.captures, fast.stats.captures, fast.stats.replays, fast.stats.eager_calls) == (1, 1, 3, 0)
    assert fast.stats.graphs[fast.keys()[0]].replays == 3


def test_each_new_key_captures_once_and_constants_are_part_of_the_key():
    fast, backend = make()
    for n in (1, 2, 1, 2, 3):
        x = torch.randn(n, 4)
        torch.testing.assert_close(fast(x, scale=0.5), mlp(x, 0.5))
    fast(torch.randn(1, 4), scale=2.0)
    assert backend.captures == 4 and fast.stats.replays == 6


def test_keys_past_max_graphs_run_eagerly_with_one_warning_and_existing_graphs_keep_replaying():
    fast, _ = make(max_graphs=2)
    fast(torch.randn(1, 4))
    fast(torch.randn(2, 4))
    with pytest.warns(GraphFallbackWarning, match="max_graphs"):
        x = torch.randn(3, 4)
        torch.testing.assert_close(fast(x), mlp(x))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fast(torch.randn(4, 4))
        fast(torch.randn(1, 4))
    assert fast.stats.fallbacks[Fallback.LIMIT] == 2
    assert fast.stats.captures == 2 and fast.stats.replays == 3


def test_max_graphs_zero_means_always_eager():
    fast, backend = make(max_graphs=0)
    with pytest.warns(GraphFallbackWarning):
        fast(torch.randn(1, 4))
    assert backend.captures == 0 and fast.stats.fallbacks[Fallback.LIMIT] == 1


def test_containers_of_hashable_values_are_flattened_into_the_key():
    fast, _ = make(fn=lambda x, options: x * options["k"])
    assert fast(torch.ones(2), {"k": 3}).tolist() == [3, 3] and fast.stats.captures == 1
    assert fast(torch.ones(2), {"k": 4}).tolist() == [4, 4] and fast.stats.captures == 2


def test_unhashable_leaf_is_reported():
    class Opaque:
        __hash__ = None

    fast, _ = make(fn=lambda x, o: x + 1)
    with pytest.warns(GraphFallbackWarning):
        fast(torch.zeros(1), Opaque())
    assert fast.stats.fallbacks[Fallback.UNKEYABLE] == 1


def test_tensors_off_the_graph_device_run_eagerly():
    fast, backend = make(backend=NullBackend(graph_device_type="cuda"))
    x = torch.randn(2, 4)
    with pytest.warns(GraphFallbackWarning, match="not on a CUDA device"):
        torch.testing.assert_close(fast(x), mlp(x))
    assert backend.captures == 0 and fast.stats.fallbacks[Fallback.CPU_TENSOR] == 1
    assert "cpu" in fast.stats.fallback_details[Fallback.CPU_TENSOR]


def test_failed_capture_runs_eagerly_is_not_retried_and_other_keys_still_graph():
    def fail(key: GraphKey):
        if key.tensors[0].shape[0] == 3:
            return CaptureFailed(Fallback.HOST_SYNC, "x.item() at model.py:12")
        return None

    fast, backend = make(backend=NullBackend(fail=fail))
    x3 = torch.randn(3, 4)
    with pytest.warns(GraphFallbackWarning, match="synchronises with the host"):
        torch.testing.assert_close(fast(x3), mlp(x3))
    torch.testing.assert_close(fast(x3), mlp(x3))
    x2 = torch.randn(2, 4)
    torch.testing.assert_close(fast(x2), mlp(x2))
    assert fast.stats.fallbacks[Fallback.HOST_SYNC] == 2
    assert fast.stats.fallback_details[Fallback.HOST_SYNC] == "x.item() at model.py:12"
    assert backend.captures == 1 and fast.stats.replays == 1
    assert list(fast.stats.failed_keys.values()) == [Fallback.HOST_SYNC]


def failing_once(message: str):
    """A function whose first run (the capture, with warmup=0) raises `message`, as capturing would."""
    runs = []

    def fn(x):
        runs.append(1)
        if len(runs) == 1:
            raise RuntimeError(message)
        return x + 1

    return fn


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        ("CUDA error: operation not permitted when stream is capturing", Fallback.HOST_SYNC),
        ("called a synchronizing CUDA operation", Fallback.HOST_SYNC),
        ("unsupported op under capture", Fallback.CAPTURE_ERROR),
    ],
)
def test_exceptions_while_capturing_are_classified_and_the_call_still_answers(message, reason):
    fast, _ = make(fn=failing_once(message), warmup=0)
    with pytest.warns(GraphFallbackWarning, match=reason.value[:20]):
        assert fast(torch.zeros(2)).tolist() == [1, 1]
    assert fast.stats.fallbacks[reason] == 1 and message in fast.stats.fallback_details[reason]
    assert fast(torch.zeros(2)).tolist() == [1, 1] and fast.stats.captures == 0


def test_functions_writing_into_their_inputs_run_eagerly_and_mutate_like_eager():
    def bump(x):
        x.add_(1)
        return x * 2

    fast, _ = make(fn=bump)
    x = torch.zeros(3)
    with pytest.warns(GraphFallbackWarning, match="writes into its tensor arguments"):
        out = fast(x)
    assert x.tolist() == [1, 1, 1] and out.tolist() == [2, 2, 2]
    assert fast.stats.captures == 0 and fast.stats.fallbacks[Fallback.MUTATES_INPUTS] == 1


def test_grad_mode_with_inputs_requiring_grad_runs_eagerly():
    fast, _ = make()
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.warns(GraphFallbackWarning, match="requires grad"):
        out = fast(x)
    assert out.requires_grad and fast.stats.fallbacks[Fallback.REQUIRES_GRAD] == 1
    with torch.no_grad():
        fast(x)
    assert fast.stats.captures == 1


def test_disabled_graphs_run_eagerly():
    fast, backend = make(config=Config(disable_graphs=True))
    with pytest.warns(GraphFallbackWarning, match="TENDRIL_NO_GRAPHS"):
        fast(torch.randn(1, 4))
    assert backend.captures == 0 and fast.stats.fallbacks[Fallback.GRAPHS_DISABLED] == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")
def test_without_cuda_the_default_backend_runs_eagerly_and_says_so_once():
    fast = graphed(mlp)
    x = torch.randn(2, 4)
    with pytest.warns(GraphFallbackWarning, match="no CUDA device"):
        torch.testing.assert_close(fast(x), mlp(x))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fast(x)
    assert fast.stats.fallbacks[Fallback.NO_CUDA] == 2
    assert fast.capture([(x,)], progress=False) == 0


def test_ahead_of_time_capture_goes_largest_first_and_sizes_placeholders_once():
    order = []

    def fail(key):
        order.append(key.tensors[0].shape[0])
        return None

    fast, backend = make(backend=NullBackend(fail=fail))
    examples = [torch.randn(n, 4) for n in (2, 7, 1, 7, 4)]
    assert fast.capture(examples, progress=False) == 4
    assert order == [7, 4, 2, 1]
    assert fast.stats.placeholder_bytes == 7 * 4 * 4  # one buffer, sized by the largest, shared by all
    x = torch.randn(4, 4)
    torch.testing.assert_close(fast(x), mlp(x))
    assert backend.captures == 4


def test_capture_accepts_calls_dicts_and_tuples():
    fast, _ = make()
    x = torch.randn(2, 4)
    assert fast.capture([Call((x,), {"scale": 2.0}), {"x": x}, (x, 3.0), x], progress=False) == 4
    with pytest.raises(TypeError, match="capture example"):
        fast.capture([3], progress=False)


def test_placeholders_of_all_shapes_share_one_buffer_and_growth_keeps_old_graphs_valid():
    fast, _ = make()
    small, large = torch.randn(2, 4), torch.randn(5, 4)
    fast(small)
    fast(large)  # grows the buffer: the first graph keeps its old one
    for x in (small, large, torch.randn(2, 4)):
        torch.testing.assert_close(fast(x), mlp(x))
    (ph_small,), _ = fast.static_inputs(small)
    (ph_large,), _ = fast.static_inputs(torch.randn(3, 4))
    assert ph_large.data_ptr() != ph_small.data_ptr()  # 3 rows fit the grown buffer, 2 rows use the old one
    (ph_five,), _ = fast.static_inputs(large)
    assert ph_five.data_ptr() == ph_large.data_ptr()


def test_arguments_already_in_their_placeholder_are_not_copied():
    fast, _ = make()
    (placeholder,), kwargs = fast.static_inputs(torch.randn(2, 4))
    copies = fast.stats.input_copies
    placeholder.copy_(torch.randn(2, 4))
    torch.testing.assert_close(fast(placeholder, **kwargs), mlp(placeholder))
    assert fast.stats.input_copies == copies
    fast(torch.randn(2, 4))
    assert fast.stats.input_copies == copies + 1


def test_outputs_are_overwritten_by_the_next_call_unless_cloned():
    fast, _ = make()
    x1, x2 = torch.randn(2, 4), torch.randn(2, 4)
    first = fast(x1)
    fast(x2)
    torch.testing.assert_close(first, mlp(x2))  # the documented lifetime rule
    safe, _ = make(clone_outputs=True)
    kept = safe(x1)
    safe(x2)
    torch.testing.assert_close(kept, mlp(x1))


def test_debug_mode_detects_use_of_an_overwritten_output():
    from tendril.graphs.outputs import StaleOutputError

    fast, _ = make(config=Config(debug=True))
    first = fast(torch.randn(2, 4))
    view = first[0]
    assert torch.isfinite(first.sum())
    fast(torch.randn(2, 4))
    with pytest.raises(StaleOutputError, match="overwrote"):
        first.sum()
    with pytest.raises(StaleOutputError):
        view + 1


def test_buckets_pad_calls_so_one_graph_serves_many_lengths():
    def causal_mean(input_ids, attention_mask):
        values = input_ids.float() * attention_mask
        return values.cumsum(1) / attention_mask.cumsum(1).clamp(min=1)

    fast, backend = make(fn=causal_mean, buckets=sequence_buckets((4, 8, 16)))
    for n in (1, 3, 4, 5, 8, 9, 16, 2, 12):
        ids = torch.randint(0, 100, (1, n))
        mask = torch.ones(1, n)
        expected = causal_mean(ids, mask)
        out = fast(ids, attention_mask=mask)
        assert out.shape == (1, n)
        torch.testing.assert_close(out, expected)
    assert backend.captures == 3 and fast.stats.padded_calls == 9


def test_a_bucketed_output_whose_size_equals_the_bucket_is_returned_whole():
    """BERT-like: a sequence output cut back to the call's length, a pooled output of hidden size 8 under an
    8 bucket left whole (a size coincidence, not a padded axis)."""
    weight = torch.randn(8, 8)

    def encoder(input_ids, attention_mask):
        hidden = torch.nn.functional.one_hot(input_ids % 8, 8).float() @ weight * attention_mask[..., None]
        return {"sequence": hidden, "pooled": hidden.sum(1).tanh()}

    fast, backend = make(fn=encoder, buckets=sequence_buckets((8, 16)))
    for n in (5, 8, 3, 12):
        ids = torch.randint(0, 100, (2, n))
        mask = torch.ones(2, n)
        out = fast(ids, attention_mask=mask)
        expected = encoder(ids, mask)
        assert out["sequence"].shape == (2, n, 8) and out["pooled"].shape == (2, 8)
        torch.testing.assert_close(out, expected)
    assert backend.captures == 2


def test_a_bucket_whose_outputs_do_not_follow_the_length_one_to_one_runs_eagerly_and_says_why():
    def strided(input_ids, attention_mask):
        return (input_ids.float() * attention_mask)[:, ::2]

    fast, backend = make(fn=strided, buckets=sequence_buckets((8,)))
    ids, mask = torch.randint(0, 100, (1, 5)), torch.ones(1, 5)
    with pytest.warns(GraphFallbackWarning, match="one to one"):
        out = fast(ids, attention_mask=mask)
    torch.testing.assert_close(out, strided(ids, mask))
    fast(torch.randint(0, 100, (1, 6)), attention_mask=torch.ones(1, 6))
    assert backend.captures == 1 and fast.stats.fallbacks[Fallback.PADDED_OUTPUTS] == 2  # never retried


def test_buckets_without_cutting_return_padded_outputs_and_trace_nothing():
    calls = []

    def fn(input_ids, attention_mask):
        calls.append(input_ids.shape[1])
        return input_ids * attention_mask

    fast, _ = make(fn=fn, buckets=sequence_buckets((8,), cut_outputs=False))
    assert fast(torch.ones(1, 3, dtype=torch.long), attention_mask=torch.ones(1, 3, dtype=torch.long)).shape == (1, 8)
    assert set(calls) == {8}


def test_stats_table_explains_graphs_and_fallbacks():
    fast, _ = make(max_graphs=1)
    fast(torch.randn(1, 4))
    with pytest.warns(GraphFallbackWarning):
        fast(torch.randn(2, 4))
    table = fast.stats.table()
    assert "1 replays, 1 eager, 1 graphs" in table and "max_graphs" in table and "float32[1, 4]" in table


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 6), st.sampled_from([0.5, 1.0])), min_size=1, max_size=12))
def test_random_call_sequences_match_eager(calls):
    fast, backend = make(max_graphs=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphFallbackWarning)
        for rows, scale in calls:
            x = torch.randn(rows, 4)
            torch.testing.assert_close(fast(x, scale=scale), mlp(x, scale))
    distinct = len(set(calls))
    assert backend.captures == min(distinct, 4)
    assert fast.stats.replays + fast.stats.eager_calls == len(calls)


def _synchronize() -> None:
    raise RuntimeError("CUDA error: operation not permitted when stream is capturing")


def _benchmark_kernel() -> None:
    _synchronize()


def test_a_capture_error_names_where_it_was_raised_and_who_called():
    """A CUDA error raised by a library's helper (a synchronize) names the code that called it too."""
    from tendril.graphs.backend import classify_capture_error

    try:
        _benchmark_kernel()
    except RuntimeError as error:
        failure = classify_capture_error(error)
    assert failure.reason is Fallback.HOST_SYNC
    message = "RuntimeError: CUDA error: operation not permitted when stream is capturing"
    assert failure.detail.startswith(f"{message} (raised at ")
    where = failure.detail.split("(raised at ", 1)[1]
    assert where.index("test_dispatch.py:") < where.index(" _synchronize from ") < where.index(" _benchmark_kernel)")
