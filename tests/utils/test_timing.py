import time

import pytest

from tendril.utils.timing import summarize, time_callable


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
