import time

import pytest

from tendril.utils.timing import summarize, time_callable, time_interleaved


def test_summarize_orders_percentiles():
    t = summarize([5.0, 1.0, 3.0, 2.0, 4.0])
    assert t.median_ms == 3.0 and t.n == 5
    assert t.p10_ms <= t.median_ms <= t.p90_ms
    assert summarize([2.0]).as_dict() == {"median_ms": 2.0, "p10_ms": 2.0, "p90_ms": 2.0, "n": 1}


def test_time_callable_rotates_inputs_and_measures_host_time():
    seen = []

    def work(i):
        seen.append(i)
        time.sleep(0.002)

    t = time_callable(work, [(0,), (1,), (2,)], warmup=1, reps=6)
    assert seen == [0, 0, 1, 2, 0, 1, 2]
    assert t.n == 6 and t.median_ms >= 2.0


@pytest.mark.parametrize("kwargs", [{"reps": 0}, {"warmup": -1}, {"inputs": []}])
def test_time_callable_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        time_callable(lambda: None, **kwargs)


def test_time_interleaved_takes_turns_per_argument_and_times_each_callable_apart():
    seen = []

    def slow(i):
        seen.append(("slow", i))
        time.sleep(0.004)

    def fast(i):
        seen.append(("fast", i))

    timings = time_interleaved({"slow": slow, "fast": fast}, [(0,), (1,), (2,)])
    assert seen == [("slow", 0), ("fast", 0), ("slow", 1), ("fast", 1), ("slow", 2), ("fast", 2)]
    assert list(timings) == ["slow", "fast"] and timings["slow"].n == timings["fast"].n == 3
    assert timings["slow"].median_ms >= 4.0 > timings["fast"].median_ms


@pytest.mark.parametrize("fns, inputs", [({}, [(0,)]), ({"f": print}, [])])
def test_time_interleaved_needs_a_callable_and_an_argument_tuple(fns, inputs):
    with pytest.raises(ValueError, match="at least one"):
        time_interleaved(fns, inputs)
