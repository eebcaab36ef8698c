"""Timing of callables, shared by `tendril demo` and the benchmarks.

On CUDA each call is bracketed by a pair of CUDA events recorded on the current stream and read after
one final synchronisation, so the host is never blocked between calls: the time of a call is the
device time between its events, which includes any gaps while the device waits for the host to
launch work (what launch overhead costs). On the CPU each call is timed with `perf_counter`.
Warm-up calls come first; the statistics are medians and percentiles over the timed calls.
`time_interleaved` times several callables in turns, call by call, so that whatever drifts during a
run touches each of them alike.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Timing:
    """Per-call time statistics in milliseconds over `n` timed calls."""

    median_ms: float
    p10_ms: float
    p90_ms: float
    n: int

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def summarize(samples_ms: Sequence[float]) -> Timing:
    if not samples_ms:
        raise ValueError("no timing samples: time at least one call")
    ordered = sorted(samples_ms)
    if len(ordered) == 1:
        only = ordered[0]
        return Timing(only, only, only, 1)
    deciles = statistics.quantiles(ordered, n=10, method="inclusive")
    return Timing(statistics.median(ordered), deciles[0], deciles[-1], len(ordered))


def time_callable(
    fn: Callable[..., Any],
    inputs: Sequence[tuple[Any, ...]] = ((),),
    *,
    device: torch.device | str = "cpu",
    warmup: int = 10,
    reps: int = 100,
) -> Timing:
    """Time `fn(*args)` over `reps` calls, rotating through `inputs` so caches do not flatter it."""
    if reps < 1 or warmup < 0:
        raise ValueError(f"need reps >= 1 and warmup >= 0, got reps={reps}, warmup={warmup}")
    if not inputs:
        raise ValueError("inputs must hold at least one argument tuple")
    device = torch.device(device)
    for i in range(warmup):
        fn(*inputs[i % len(inputs)])
    if device.type == "cuda":
        return summarize(_time_cuda(fn, inputs, device, reps))
    return summarize(_time_host(fn, inputs, reps))


def time_interleaved(
    fns: Mapping[str, Callable[..., Any]],
    inputs: Sequence[tuple[Any, ...]],
    *,
    device: torch.device | str = "cpu",
) -> dict[str, Timing]:
    """Time each of `fns` once per argument tuple of `inputs`, in turns: the first tuple through every callable
    (in the mapping's order), then the second, and so on. Callables timed one after another meet different
    clocks, host load and allocator states; in turns, whatever drifts over the run touches each of them alike.
    No warm-up: warm the callables first."""
    if not fns or not inputs:
        raise ValueError("time_interleaved needs at least one callable and one argument tuple")
    names = [name for _ in inputs for name in fns]
    calls = [(fn, args) for args in inputs for fn in fns.values()]
    device = torch.device(device)
    if device.type == "cuda":
        samples = _time_cuda(_apply, calls, device, len(calls))
    else:
        samples = _time_host(_apply, calls, len(calls))
    return {name: summarize([ms for call, ms in zip(names, samples, strict=True) if call == name]) for name in fns}


def _apply(fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    return fn(*args)


def _time_cuda(
    fn: Callable[..., Any], inputs: Sequence[tuple[Any, ...]], device: torch.device, reps: int
) -> list[float]:
    with torch.cuda.device(device):
        torch.cuda.synchronize()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for i, (start, end) in enumerate(events):
            start.record()
            fn(*inputs[i % len(inputs)])
            end.record()
        torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def _time_host(fn: Callable[..., Any], inputs: Sequence[tuple[Any, ...]], reps: int) -> list[float]:
    samples = []
    for i in range(reps):
        args = inputs[i % len(inputs)]
        start = time.perf_counter()
        fn(*args)
        samples.append((time.perf_counter() - start) * 1e3)
    return samples
