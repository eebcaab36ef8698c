"""`benchmarks.host_clock`: the clock ratio of one core alone against every thread busy."""

from __future__ import annotations

import pytest

from benchmarks import host_clock

pytest.importorskip("numba")


def test_the_ratio_and_ceiling_follow_the_medians():
    clock = host_clock.HostClock(threads=16, one_ms=10.0, all_ms=12.5)
    assert clock.ratio == pytest.approx(0.8)
    assert clock.scaling_ceiling == pytest.approx(12.8)


def test_a_measurement_times_the_chains_on_one_thread_and_on_all():
    clock = host_clock.measure(2, reps=2, steps=200_000)
    assert clock.threads in (1, 2)  # the pool may be smaller than asked
    assert clock.one_ms > 0 and clock.all_ms > 0
    assert 0 < clock.ratio < 10


def test_longer_chains_take_longer():
    short, long = host_clock.measure(1, reps=3, steps=100_000), host_clock.measure(1, reps=3, steps=2_000_000)
    assert long.one_ms > 5 * short.one_ms


@pytest.mark.parametrize("args", [(0, 1, 1), (1, 0, 1), (1, 1, 0)])
def test_non_positive_arguments_are_refused(args):
    with pytest.raises(ValueError, match="must be positive"):
        host_clock.measure(*args)
