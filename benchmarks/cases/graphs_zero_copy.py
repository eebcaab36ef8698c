"""Case `graphs-zero-copy`: an HF-style beam-search decode loop driven from the host, three ways.

GPT-2 fp16 (random weights), 4 beams, the KV cache reordered by `index_select` on the beam indices
every step as HF's `generate` does. Each step's graph is the model forward with a growing
`DynamicCache` (one graph per cache length; lengths 128, 512 and 1024 are measured over `STEPS`
consecutive steps each):

- (a) `plain`: the host reorders the cache and the call copies it into the graph's placeholders;
- (b) `auto`: the same loop under `fast.zero_copy()`: the reordering `index_select`s write straight
  into the placeholders (`tendril.graphs.zero_copy`);
- (c) `carried`: the reordering moves into the step (it takes the beam indices) and tokens, positions,
  scores, beam indices and the cache are declared loop-carried (`fast.carry`): each graph writes
  them where the next call reads them (`tendril.graphs.zero_copy.carry`).

The loop never synchronises with the host (no early stopping), so the GPU sets the pace unless the
host falls behind (`host_ms_per_step` is the host's own time per step: the function mode of (b) costs
host time per op). `ms_per_step` is what a user's loop runs at: CUDA-event intervals between
consecutive steps, medians over interleaved repetitions of the steady-state steps (every step after
the first of a repetition). `device_ms_per_step` is the device time alone: the same steps enqueued
behind a GPU sleep, so the host is never what the GPU waits for.

The copy time. The targets divide the step-time saving by "the measured copy time in (a)": the device
time (a)'s placeholder copies take *inside (a)'s own loop*, where their sources were just written by the
reordering `index_select`s (at L=128 the whole cache fits in L2). (a)'s loop is run behind a GPU sleep
(so no host gap falls inside a step's copies) under the CUDA profiler, and a step's copy time is the span
of its staging copies in the trace, from the start of the first to the end of the last, gaps between them
included (`copy_ms`; the staging is the one run of at least as many consecutive copies as the cache has
tensors). `copy_trace_host_wait_us` is the longest the GPU waited for the host in any traced loop, in gaps
of 50 us or more: 0 means the sleep was long enough. Other measures are reported beside it: the
same loop with the staging done by hand (`GraphedCallable`'s `_foreach_copy_` into the placeholders
between two CUDA events, then the call on the placeholders), as the copies' span in the trace
(`copy_ms_staged`) and between the events, traced (`copy_ms_bracket`) and not
(`copy_ms_bracket_untraced`: whether tracing slows the copies); and `copy_ms_alone`, the same copy timed in
isolation by `time_callable`.

What removing the copies can save at best: (d) `manual` is (a)'s loop with the reordering written into the
next call's placeholders by hand (`fast.inputs_for` and `index_select(..., out=)`, Grape's published
method), so it has no staging and no host-side redirection; `device_time_saved_vs_manual` divides (b)'s and
(c)'s device-time savings by (d)'s.
`benchmarks/tools/zero_copy_profile.py` showed that (b)'s step keeps every kernel of (a)'s but the
copies, with the same durations. Bytes copied come from each callable's `stats`.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.registry import Context, Goal, register
from tendril.graphs.callable import GraphedCallable, graphed
from tendril.utils.timing import time_callable

BEAMS = 4
STEPS = 8
SLEEP_CYCLES = 200_000_000
"""GPU sleep ahead of device-time repetitions (about 0.1 s at the H200's clock): longer than the host needs
to enqueue `STEPS` steps of any variant."""
LENGTHS = (128, 512, 1024)
TARGET_LENGTH = 512

Past = tuple[torch.Tensor, ...]
"""A KV cache as a flat tuple: keys and values of every layer, `[beams, heads, length, head_dim]` each."""


def gpt2(device: torch.device, dtype: torch.dtype = torch.float16, config: Any = None) -> torch.nn.Module:
    """GPT-2 (124M by default) with random weights, with positions for the longest measured cache."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = config or GPT2Config(n_positions=max(LENGTHS) + 2 * STEPS)
    model = GPT2LMHeadModel(config)
    return model.to(device=device, dtype=dtype).eval()


def forward(
    model: torch.nn.Module, ids: torch.Tensor, positions: torch.Tensor, past: Past
) -> tuple[torch.Tensor, Past]:
    """One decode step of HF GPT-2 on a `DynamicCache` built from `past`: last logits and the grown cache."""
    from transformers import DynamicCache

    pairs = [(past[i], past[i + 1]) for i in range(0, len(past), 2)]
    cache = DynamicCache(pairs)
    out = model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True)
    present = tuple(t for layer in out.past_key_values.layers for t in (layer.keys, layer.values))
    return out.logits[:, -1], present


def beam_update(logits: torch.Tensor, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """HF beam search's core without early stopping: the best `beams` continuations over all beams.

    Returns the next tokens `[beams, 1]`, their cumulative log-probabilities and the beams they extend.
    """
    vocab = logits.shape[-1]
    logp = torch.log_softmax(logits.float(), dim=-1) + scores[:, None]
    top_scores, top = logp.view(-1).topk(logits.shape[0])
    beam_idx = torch.div(top, vocab, rounding_mode="floor")
    tokens = top - beam_idx * vocab
    return tokens[:, None], top_scores, beam_idx


def forward_step(model: torch.nn.Module) -> Callable[..., tuple[torch.Tensor, Past]]:
    """The graphed step of (a) and (b): `step(ids, positions, *past) -> (logits, present)`."""

    def step(ids: torch.Tensor, positions: torch.Tensor, *past: torch.Tensor) -> tuple[torch.Tensor, Past]:
        return forward(model, ids, positions, past)

    return step


def carried_step(model: torch.nn.Module) -> Callable[..., Any]:
    """The graphed step of (c): reorders the cache, runs the model and the beam update on the device."""

    def step(
        ids: torch.Tensor, positions: torch.Tensor, scores: torch.Tensor, beam_idx: torch.Tensor, past: Past
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Past]:
        past = tuple(p.index_select(0, beam_idx) for p in past)
        logits, present = forward(model, ids, positions, past)
        ids, scores, beam_idx = beam_update(logits, scores)
        return ids, positions + 1, scores, beam_idx, present

    return step


def carry_all(fast: GraphedCallable) -> GraphedCallable:
    """Declare every output of `carried_step` as the same-position input of the next call."""
    for index in range(5):
        fast.carry(output=index, input=index)
    return fast


@dataclass
class State:
    """What the decode loop carries from step to step."""

    ids: torch.Tensor
    positions: torch.Tensor
    scores: torch.Tensor
    beam_idx: torch.Tensor
    past: Past

    def clone(self) -> State:
        return State(
            self.ids.clone(),
            self.positions.clone(),
            self.scores.clone(),
            self.beam_idx.clone(),
            tuple(p.clone() for p in self.past),
        )


def prefix(config: Any, length: int, device: torch.device, dtype: torch.dtype, seed: int = 0) -> State:
    """A random cache of `length` tokens for `BEAMS` beams, as after a prefill."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    head_dim = config.n_embd // config.n_head
    shape = (BEAMS, config.n_head, length, head_dim)
    past = tuple(torch.randn(shape, generator=generator).to(device, dtype) for _ in range(2 * config.n_layer))
    ids = torch.randint(0, config.vocab_size, (BEAMS, 1), generator=generator).to(device)
    positions = torch.full((BEAMS, 1), length, dtype=torch.long, device=device)
    scores = torch.zeros(BEAMS, device=device)
    return State(ids, positions, scores, torch.arange(BEAMS, device=device), past)


def host_step(fn: Callable[..., tuple[torch.Tensor, Past]], state: State) -> State:
    """One step of (a)/(b): the call, then the beam update and the cache reordering on the host side."""
    logits, present = fn(state.ids, state.positions, *state.past)
    ids, scores, beam_idx = beam_update(logits, state.scores)
    past = tuple(p.index_select(0, beam_idx) for p in present)
    return State(ids, state.positions + 1, scores, beam_idx, past)


def manual_step(fast: GraphedCallable, state: State) -> State:
    """(d) `manual`: (a)'s loop with the reordering written by hand into the next call's placeholders
    (`fast.inputs_for`), as Grape's published experiments did with `index_select(..., out=placeholder)`; only
    the four next tokens are copied, so the next call copies nothing else."""
    logits, present = fast(state.ids, state.positions, *state.past)
    ids, scores, beam_idx = beam_update(logits, state.scores)
    (next_ids, next_positions, *next_past), _ = fast.inputs_for(ids, state.positions, *present)
    next_ids.copy_(ids)
    torch.add(state.positions, 1, out=next_positions)
    for source, target in zip(present, next_past, strict=True):
        torch.index_select(source, 0, beam_idx, out=target)
    return State(next_ids, next_positions, scores, beam_idx, tuple(next_past))


def device_step(fn: Callable[..., Any], state: State) -> State:
    """One step of (c): everything happens in the call."""
    ids, positions, scores, beam_idx, present = fn(state.ids, state.positions, state.scores, state.beam_idx, state.past)
    return State(ids, positions, scores, beam_idx, present)


def run_loop(
    step: Callable[[State], State], start: State, steps: int, on_step: Callable[[int], None] | None = None
) -> list[State]:
    """`steps` steps from a copy of `start`; returns every state (each cloned, graph outputs are transient)."""
    state = start.clone()
    states = []
    for index in range(steps):
        state = step(state)
        states.append(state.clone())
        if on_step is not None:
            on_step(index)
    return states


@dataclass
class Variant:
    name: str
    fast: GraphedCallable
    step: Callable[[State], State]
    context: Callable[[], Any]


def _timed_rep(
    variant: Variant, start: State, times: list[float], steady_bytes: list[float], host: list[float]
) -> None:
    events = [torch.cuda.Event(enable_timing=True) for _ in range(STEPS + 1)]
    state = start.clone()
    began = time.perf_counter()
    with variant.context():
        events[0].record()
        copied_after_first = 0
        for index in range(STEPS):
            state = variant.step(state)
            events[index + 1].record()
            if index == 0:
                copied_after_first = variant.fast.stats.input_bytes_copied
        del state
    host.append((time.perf_counter() - began) * 1e3 / STEPS)
    torch.cuda.synchronize()
    times.extend(events[i].elapsed_time(events[i + 1]) for i in range(1, STEPS))
    steady_bytes.append((variant.fast.stats.input_bytes_copied - copied_after_first) / (STEPS - 1))


def device_rep(variant: Variant, start: State, times: list[float], sleep_cycles: int = SLEEP_CYCLES) -> None:
    """Per-step device time: the steps are enqueued behind a GPU sleep, so the GPU never waits for the host."""
    events = [torch.cuda.Event(enable_timing=True) for _ in range(STEPS + 1)]
    state = start.clone()
    torch.cuda.synchronize()
    with variant.context():
        torch.cuda._sleep(sleep_cycles)
        events[0].record()
        for index in range(STEPS):
            state = variant.step(state)
            events[index + 1].record()
        del state
    torch.cuda.synchronize()
    times.extend(events[i].elapsed_time(events[i + 1]) for i in range(1, STEPS))


COPY_OPERATION = "Memcpy DtoD"
"""How the CUDA profiler names a device-to-device copy (what `_foreach_copy_` of cache tensors runs)."""


def copy_runs(operations: Sequence[tuple[str, float, float]]) -> list[tuple[float, int]]:
    """Every maximal run of consecutive copies (`COPY_OPERATION`) in `operations` ((name, start us, end us) in
    any order), in time order: milliseconds from the start of its first to the end of its last copy, and how
    many copies it has."""
    runs = []
    run: list[tuple[float, float]] = []
    for name, begin, end in [*sorted(operations, key=lambda op: op[1]), ("", 0.0, 0.0)]:
        if name.startswith(COPY_OPERATION):
            run.append((begin, end))
            continue
        if run:
            runs.append(((max(e for _, e in run) - run[0][0]) / 1e3, len(run)))
            run = []
    return runs


def staging_spans_ms(operations: Sequence[tuple[str, float, float]], tensors: int) -> list[float]:
    """The span of each step's staging in a traced loop of `STEPS` steps: the last `STEPS` runs of at least
    `tensors` consecutive copies (a step stages every cache tensor in one batch; cloning the start state
    before the loop makes one more run). Raises if there are fewer."""
    spans = [span for span, count in copy_runs(operations) if count >= tensors]
    if len(spans) < STEPS:
        raise RuntimeError(f"expected the staging copies of {STEPS} steps in the trace, found {len(spans)}")
    return spans[-STEPS:]


def _traced(run: Callable[[], None]) -> list[tuple[str, float, float]]:
    """The CUDA operations `run` enqueues, as (name, start us, end us), from the CUDA profiler."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        run()
    return [(e.name, e.time_range.start, e.time_range.end) for e in trace.events() if e.device_type == DeviceType.CUDA]


TRACED_SLEEP_CYCLES = 4 * SLEEP_CYCLES
"""The sleep ahead of a traced loop: the profiler slows the host that enqueues it several times."""
HOST_WAIT_US = 50.0
"""A gap between consecutive operations behind the sleep at least this long means the GPU waited for the host."""


def host_waits_us(operations: Sequence[tuple[str, float, float]]) -> float:
    """Microseconds the GPU spent in gaps of at least `HOST_WAIT_US` after the last sleep of a traced loop."""
    ordered = sorted(operations, key=lambda op: op[1])
    sleeps = [i for i, (name, _, _) in enumerate(ordered) if "sleep" in name.lower() or "spin" in name.lower()]
    after = ordered[sleeps[-1] + 1:] if sleeps else ordered
    gaps = (b[1] - a[2] for a, b in itertools.pairwise(after))
    return sum(gap for gap in gaps if gap >= HOST_WAIT_US)


def copies_in_loop(plain: Variant, start: State, spans: list[float], waits: list[float]) -> None:
    """`copy_ms`: the span of (a)'s staging copies in its own loop behind a GPU sleep (steps after the first);
    appends to `waits` how long the GPU waited for the host in that loop (it should not have)."""
    operations = _traced(lambda: device_rep(plain, start, [], TRACED_SLEEP_CYCLES))
    spans.extend(staging_spans_ms(operations, len(start.past))[1:])
    waits.append(host_waits_us(operations))


def _copies_staged(plain: GraphedCallable, start: State, times: list[float], spans: list[float]) -> None:
    """`copy_ms_staged` and `copy_ms_bracket`: (a)'s loop with the staging done by hand (see the module
    docstring), its copies' span in the trace appended to `spans` and their CUDA-event bracket to `times`."""
    operations = _traced(lambda: _bracketed_copies(plain, start, times, TRACED_SLEEP_CYCLES))
    spans.extend(staging_spans_ms(operations, len(start.past))[1:])


def _bracketed_copies(plain: GraphedCallable, start: State, times: list[float], sleep_cycles: int) -> None:
    state = start.clone()
    brackets = []
    torch.cuda.synchronize()
    torch.cuda._sleep(sleep_cycles)
    for _ in range(STEPS):
        inputs = (state.ids, state.positions, *state.past)
        placeholders, _ = plain.static_inputs(*inputs)
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record()
        torch._foreach_copy_(list(placeholders), list(inputs))
        after.record()
        brackets.append((before, after))
        logits, present = plain(*placeholders)
        ids, scores, beam_idx = beam_update(logits, state.scores)
        past = tuple(p.index_select(0, beam_idx) for p in present)
        state = State(ids, state.positions + 1, scores, beam_idx, past)
    torch.cuda.synchronize()
    times.extend(before.elapsed_time(after) for before, after in brackets[1:])


def _copy_ms_alone(start: State, device: torch.device, reps: int) -> float:
    """(a)'s per-step placeholder copy timed alone: every cache tensor plus tokens and positions."""
    sources = [start.ids, start.positions, *start.past]
    targets = [torch.empty_like(t) for t in sources]
    timing = time_callable(lambda: torch._foreach_copy_(targets, sources), [()], device=device, warmup=3, reps=reps)
    return timing.median_ms


@register("graphs-zero-copy", "HF-style 4-beam GPT-2 decode: placeholder copies vs zero-copy vs loop-carried state")
def run(ctx: Context) -> None:
    from contextlib import nullcontext

    from tendril.graphs.cuda_backend import CudaBackend

    device = ctx.device
    dtype = torch.float16
    lengths = (128,) if ctx.quick else LENGTHS
    reps = 3 if ctx.quick else 30
    device_reps = 2 if ctx.quick else 30
    copy_reps = 2 if ctx.quick else 10
    model = gpt2(device, dtype)
    backend = CudaBackend()  # one pool for all three callables
    plain = graphed(forward_step(model), backend=backend, max_graphs=1024)
    auto = graphed(forward_step(model), backend=backend, max_graphs=1024)
    carried = carry_all(graphed(carried_step(model), backend=backend, max_graphs=1024))
    manual = graphed(forward_step(model), backend=backend, max_graphs=1024)
    variants = [
        Variant("plain", plain, lambda s: host_step(plain, s), nullcontext),
        Variant("auto", auto, lambda s: host_step(auto, s), auto.zero_copy),
        Variant("carried", carried, lambda s: device_step(carried, s), nullcontext),
        Variant("manual", manual, lambda s: manual_step(manual, s), nullcontext),
    ]
    results: dict[int, dict[str, float]] = {}
    timed_mispredictions: dict[str, dict[str, dict[str, int]]] = {}  # per length and variant, after the warm-up
    with torch.inference_mode():
        for length in lengths:
            start = prefix(model.config, length, device, dtype)
            finals = {}
            for variant in variants:  # warm-up: captures every graph these steps use, checks agreement
                for _ in range(2):
                    with variant.context():
                        states = run_loop(variant.step, start, STEPS)
                finals[variant.name] = states[-1]
            for name in ("auto", "carried", "manual"):
                same = torch.equal(finals[name].ids, finals["plain"].ids)
                ctx.note(f"L={length}: {name} tokens after {STEPS} steps {'equal' if same else 'DIFFER from'} plain's")
            times: dict[str, list[float]] = {v.name: [] for v in variants}
            device_times: dict[str, list[float]] = {v.name: [] for v in variants}
            steady: dict[str, list[float]] = {v.name: [] for v in variants}
            host: dict[str, list[float]] = {v.name: [] for v in variants}
            copies: list[float] = []
            waits: list[float] = []
            staged: list[float] = []
            brackets: list[float] = []
            untraced: list[float] = []
            before = {v.name: Counter(v.fast.stats.mispredictions) for v in variants}
            for _ in range(reps):
                for variant in variants:
                    _timed_rep(variant, start, times[variant.name], steady[variant.name], host[variant.name])
            timed_mispredictions[str(length)] = {
                v.name: {reason.name: count for reason, count in (v.fast.stats.mispredictions - before[v.name]).items()}
                for v in variants
            }
            for rep in range(device_reps):
                for variant in variants:
                    device_rep(variant, start, device_times[variant.name])
                if rep < copy_reps:
                    copies_in_loop(variants[0], start, copies, waits)
                    _copies_staged(plain, start, brackets, staged)
                    _bracketed_copies(plain, start, untraced, SLEEP_CYCLES)
            copy_ms = statistics.median(copies)
            row = {"copy_ms": copy_ms}
            for variant in variants:
                step_ms = statistics.median(times[variant.name])
                bytes_per_step = statistics.median(steady[variant.name])
                row[f"{variant.name}_ms"] = step_ms
                row[f"{variant.name}_device_ms"] = statistics.median(device_times[variant.name])
                row[f"{variant.name}_bytes"] = bytes_per_step
                ctx.add_value(f"{variant.name} L={length}", "ms_per_step", step_ms)
                ctx.add_value(f"{variant.name} L={length}", "device_ms_per_step", row[f"{variant.name}_device_ms"])
                ctx.add_value(f"{variant.name} L={length}", "bytes_copied_per_step", bytes_per_step)
                ctx.add_value(f"{variant.name} L={length}", "host_ms_per_step", statistics.median(host[variant.name]))
            ctx.add_value(f"plain L={length}", "copy_ms", copy_ms)
            ctx.add_value(f"plain L={length}", "copy_trace_host_wait_us", max(waits))
            ctx.add_value(f"plain L={length}", "copy_ms_staged", statistics.median(staged))
            ctx.add_value(f"plain L={length}", "copy_ms_bracket", statistics.median(brackets))
            ctx.add_value(f"plain L={length}", "copy_ms_bracket_untraced", statistics.median(untraced))
            ctx.add_value(f"plain L={length}", "copy_ms_alone", _copy_ms_alone(start, device, reps=20))
            manual_saving = row["plain_device_ms"] - row["manual_device_ms"]
            for name in ("auto", "carried"):
                device_saved = row["plain_device_ms"] - row[f"{name}_device_ms"]
                ctx.add_value(f"{name} L={length}", "device_time_saved_fraction", device_saved / copy_ms)
                ctx.add_value(f"{name} L={length}", "device_time_saved_vs_manual", device_saved / manual_saving)
            ctx.add_value(f"manual L={length}", "device_time_saved_fraction", manual_saving / copy_ms)
            results[length] = row
    for variant in variants:
        stats = variant.fast.stats
        ctx.extra[f"{variant.name}_stats"] = {
            "replays": stats.replays,
            "captures": stats.captures,
            "redirects": stats.redirects,
            "input_copies_avoided": stats.input_copies_avoided,
            "mispredictions": {reason.name: count for reason, count in stats.mispredictions.items()},
            "misprediction_details": {reason.name: detail for reason, detail in stats.misprediction_details.items()},
        }
    ctx.extra["per_length"] = {str(length): row for length, row in results.items()}
    ctx.extra["timed_mispredictions"] = timed_mispredictions
    measured = TARGET_LENGTH if TARGET_LENGTH in results else lengths[-1]
    row = results[measured]
    if measured != TARGET_LENGTH:
        ctx.note(f"quick run: targets measured at L={measured} instead of {TARGET_LENGTH}")
    ctx.note(
        "bytes per step are steady-state (steps after the first of each repetition); the first step copies the prefix"
    )
    ctx.note(
        "copy time = device time of (a)'s staging copies inside (a)'s own loop, their span in the CUDA profiler's "
        "trace (copy_ms; copy_ms_staged and copy_ms_bracket: the loop staged by hand, traced and between CUDA events); "
        "device_time_saved_fraction is the same ratio on device time alone (steps enqueued behind a GPU sleep); "
        "device_time_saved_vs_manual divides the device-time saving by that of (d) manual, the reordering written "
        "into the placeholders by hand"
    )
    for name in ("auto", "carried"):
        ratio = row[f"{name}_bytes"] / row["plain_bytes"] if row["plain_bytes"] else float("nan")
        saved = (row["plain_ms"] - row[f"{name}_ms"]) / row["copy_ms"]
        ctx.target(f"copy_bytes_ratio_{name}", ratio, Goal("<=", 0.01))
        ctx.target(f"copy_time_saved_fraction_{name}", saved, Goal(">=", 0.9))


def states_equal(a: Sequence[State], b: Sequence[State]) -> bool:
    """Whether two runs chose the same tokens and beams at every step."""
    return all(torch.equal(x.ids, y.ids) and torch.equal(x.beam_idx, y.beam_idx) for x, y in zip(a, b, strict=True))
