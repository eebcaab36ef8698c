"""Case `generation-streaming`: what streaming tokens out of the one-launch decode loop costs, and how soon
each token reaches the streamer.

Models (random weights, batch 1, 16-token prompt, 256 new tokens, greedy, eos disabled): GPT-2 124M in
fp16 and Llama-3.2-1B's shape in bf16, each with tendril's fastest step that runs it
(`decode_models.fastest_step`, named in a note). `--quick`: tiny models of the same structure.

- Overhead: calls with and without a streamer, interleaved, timed on the host (`perf_counter` around a call
  that returns the generated ids, so both include the final host sync); the fraction is
  (streamed median - plain median) / plain median, the extra time per token as a share of a token's time.
- Delivery: the streamer stamps each token's arrival in `put` with `time.perf_counter_ns()`. The decode
  loop stamps each token with the device's global timer as it publishes it into the ring
  (`TokenRing.stamp`, `%globaltimer`, ns). Mapping the device clock onto the host clock: a calibration
  launches a one-store kernel (`kernels.publish.device_clock`) that writes the global timer into mapped
  host memory, the host spinning on it; if the host read `h0` before the launch and `h1` once it saw the
  value `g`, then `g` happened between `h0` and `h1`, so the offset (device minus host) lies in
  [g - h1, g - h0]. The intersection of these intervals over `CALIBRATIONS` rounds gives the offset to
  within half its width (reported; a few microseconds). A calibration runs right before and right after
  every measured call, and a token's offset is interpolated linearly in host time between the two, which
  also takes out any drift between the clocks during a call (the largest drift is reported). A token's
  delivery latency is its arrival minus its device stamp mapped to host time; the p99 is over every token
  of every measured call. Tokens the ring did not deliver while the loop ran (lapped, or late) count with
  their real, longer latency.
- First token visible: the host time from entering `generate` to the first generated token's arrival in
  the streamer, beside the whole call's time.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from benchmarks.cases.decode_models import fastest_step, gpt2, llama, tiny_gpt2, tiny_llama
from benchmarks.registry import Context, Goal, register
from tendril.generation import Step, generate
from tendril.generation.api import _state
from tendril.generation.streaming import TokenRing

PROMPT_LEN = 16
NEW_TOKENS = 256
CALIBRATIONS = 64
"""Rounds of one clock calibration (each a launch and a spin, some tens of microseconds)."""
CLOCK_TIMEOUT_NS = 10**9


class StampingStreamer:
    """An HF-style streamer that records when each value arrives (`perf_counter_ns`)."""

    def __init__(self) -> None:
        self.arrivals: list[int] = []
        self.tokens: list[int] = []
        self.ended = False

    def put(self, value: torch.Tensor) -> None:
        self.arrivals.append(time.perf_counter_ns())
        self.tokens.append(int(value.reshape(-1)[-1]))

    def end(self) -> None:
        self.ended = True


class DeviceClock:
    """Maps the device's global timer onto `perf_counter_ns` (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        from tendril.cuda.mapped import MappedHostMemory

        memory = MappedHostMemory(8, device)
        self.device_word, self.host_word = memory.device_view(torch.int64), memory.host_view(torch.int64).numpy()

    def offset(self, rounds: int = CALIBRATIONS) -> tuple[float, float, float]:
        """(host time of the calibration, device minus host offset, its uncertainty), all in ns."""
        from tendril.generation.kernels.publish import device_clock

        low, high, shortest = -np.inf, np.inf, (np.inf, 0.0)
        for _ in range(rounds):
            self.host_word[0] = 0
            before = time.perf_counter_ns()
            device_clock(self.device_word)
            while self.host_word[0] == 0:
                if time.perf_counter_ns() - before > CLOCK_TIMEOUT_NS:
                    raise RuntimeError("the clock kernel's store never reached the host")
            after = time.perf_counter_ns()
            seen = int(self.host_word[0])
            low, high = max(low, seen - after), min(high, seen - before)
            shortest = min(shortest, (after - before, seen - (before + after) / 2))
        torch.cuda.synchronize()
        if low > high:  # inconsistent bounds (clock jumps): the shortest round's midpoint
            return float(time.perf_counter_ns()), shortest[1], shortest[0] / 2
        return float(time.perf_counter_ns()), (low + high) / 2, (high - low) / 2


@dataclass
class Delivery:
    """Per-token delivery latencies (us) and first-token times (ms) over the measured streamed calls."""

    latencies_us: list[float] = field(default_factory=list)
    first_visible_ms: list[float] = field(default_factory=list)
    call_ms: list[float] = field(default_factory=list)
    uncertainty_us: float = 0.0
    drift_us: float = 0.0


def _ring(model: nn.Module) -> TokenRing:
    """The ring of `model`'s one streaming loop."""
    rings = [loop.ring for loop in _state(model).loops.by_plan.values() if loop.ring is not None]
    if len(rings) != 1:
        raise RuntimeError(f"expected one streaming loop, found {len(rings)}")
    return rings[0]


Call = Callable[..., torch.Tensor]


def calls(model: nn.Module, step: Step, new_tokens: int) -> tuple[Call, Call]:
    """(plain(ids), streamed(ids, streamer)): greedy `generate` calls without and with a streamer."""
    def plain(ids: torch.Tensor) -> torch.Tensor:
        return generate(model, ids, max_new_tokens=new_tokens, eos_token_id=[], pad_token_id=0, step=step)

    def streamed(ids: torch.Tensor, streamer: StampingStreamer) -> torch.Tensor:
        return generate(model, ids, max_new_tokens=new_tokens, eos_token_id=[], pad_token_id=0, step=step,
                        streamer=streamer)

    return plain, streamed


def overhead(plain: Call, streamed: Call, prompts: list[torch.Tensor], reps: int) -> tuple[list[float], list[float]]:
    """ms per call without and with a streamer, the two interleaved (so slow drifts hit both alike)."""
    without: list[float] = []
    with_streamer: list[float] = []
    for i in range(reps):
        ids = prompts[i % len(prompts)]
        start = time.perf_counter()
        plain(ids)
        middle = time.perf_counter()
        streamed(ids, StampingStreamer())
        end = time.perf_counter()
        without.append((middle - start) * 1e3)
        with_streamer.append((end - middle) * 1e3)
    return without, with_streamer


def delivery(model: nn.Module, streamed: Call, prompts: list[torch.Tensor], reps: int,
             clock: DeviceClock) -> Delivery:
    """Streamed calls between two clock calibrations each: every token's device-to-streamer latency."""
    result = Delivery()
    for i in range(reps):
        ids = prompts[i % len(prompts)]
        streamer = StampingStreamer()
        before = clock.offset()
        start = time.perf_counter_ns()
        out = streamed(ids, streamer)
        end = time.perf_counter_ns()
        after = clock.offset()
        ring = _ring(model)
        new = out.shape[1] - ids.shape[1]
        if streamer.tokens[1:] != out[0, ids.shape[1]:].tolist() or not streamer.ended:
            raise RuntimeError("the streamed tokens differ from the returned ones")
        for count, arrival in enumerate(streamer.arrivals[1:], start=1):
            stamp = ring.stamp(count)
            if stamp == 0:
                raise RuntimeError(f"token {count} of {new} has no device stamp")
            share = (arrival - before[0]) / max(after[0] - before[0], 1.0)
            offset = before[1] + share * (after[1] - before[1])
            result.latencies_us.append((arrival - (stamp - offset)) / 1e3)
        result.first_visible_ms.append((streamer.arrivals[1] - start) / 1e6)
        result.call_ms.append((end - start) / 1e6)
        result.uncertainty_us = max(result.uncertainty_us, before[2] / 1e3, after[2] / 1e3)
        result.drift_us = max(result.drift_us, abs(after[1] - before[1]) / 1e3)
    return result


def measure_model(ctx: Context, label: str, model: nn.Module, new_tokens: int, reps: int) -> tuple[float, Delivery]:
    """One model's overhead fraction and deliveries, with rows and notes; returns (fraction, delivery)."""
    generator = torch.Generator().manual_seed(0)
    vocab = model.get_input_embeddings().num_embeddings  # type: ignore[operator]
    prompts = [torch.randint(0, vocab, (1, PROMPT_LEN), generator=generator).to(ctx.device) for _ in range(4)]
    step = fastest_step(ctx, label, model, prompts[0])
    ctx.note(f"{label}: tendril step={step!r}")
    plain, streamed = calls(model, step, new_tokens)
    for ids in prompts[:2]:  # capture both loops (with and without a ring), then warm
        plain(ids)
        streamed(ids, StampingStreamer())
    plain_ms, streamed_ms = overhead(plain, streamed, prompts, reps)
    base, with_streamer = statistics.median(plain_ms), statistics.median(streamed_ms)
    for name, samples in (("no streamer", plain_ms), ("streamer", streamed_ms)):
        ctx.add_value(f"{label} {name}", "ms_per_call", statistics.median(samples))
        ctx.add_value(f"{label} {name}", "us_per_token", statistics.median(samples) * 1e3 / new_tokens)
    fraction = (with_streamer - base) / base
    ctx.add_value(label, "stream_overhead_fraction", fraction)
    result = delivery(model, streamed, prompts, max(2, reps // 2), DeviceClock(ctx.device))
    latencies = np.asarray(result.latencies_us)
    for quantile in (50, 90, 99):
        ctx.add_value(label, f"delivery_p{quantile}_us", float(np.percentile(latencies, quantile)))
    ctx.add_value(label, "delivery_max_us", float(latencies.max()))
    ctx.add_value(label, "first_token_visible_ms", statistics.median(result.first_visible_ms))
    ctx.add_value(label, "streamed_call_ms", statistics.median(result.call_ms))
    ctx.note(f"{label}: clock mapping within +-{result.uncertainty_us:.2f} us; largest drift over a call "
             f"{result.drift_us:.2f} us; {len(latencies)} tokens; min latency {latencies.min():.1f} us")
    return fraction, result


@register("generation-streaming", "token streaming out of the one-launch decode loop: overhead and per-token "
          "delivery latency, GPT-2 fp16 and Llama-1B-shape bf16, 256 tokens")
def run(ctx: Context) -> None:
    device = ctx.device
    reps = 4 if ctx.quick else 20
    new_tokens = 32 if ctx.quick else NEW_TOKENS
    small = gpt2(device) if not ctx.quick else tiny_gpt2(device, torch.float16)
    fraction, result = measure_model(ctx, "gpt2 fp16", small, new_tokens, reps)
    ctx.target("gpt2_stream_overhead_fraction", fraction, Goal("<=", 0.03))
    ctx.target("gpt2_token_delivery_p99_us", float(np.percentile(result.latencies_us, 99)), Goal("<=", 200))
    del small
    torch.cuda.empty_cache()
    large = llama(device, torch.bfloat16) if not ctx.quick else tiny_llama(device, torch.bfloat16)
    fraction, result = measure_model(ctx, "llama1b bf16", large, new_tokens, reps)
    ctx.target("llama1b_stream_overhead_fraction", fraction, Goal("<=", 0.03))
    ctx.target("llama1b_first_token_visible_ms", statistics.median(result.first_visible_ms))
    ctx.note(f"llama1b bf16: first token visible after {statistics.median(result.first_visible_ms):.2f} ms of a "
             f"{statistics.median(result.call_ms):.2f} ms streamed call ({new_tokens} tokens)")
