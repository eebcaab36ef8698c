"""Case `graphs-training`: whole training steps (forward, loss, backward, optimizer step) graphed per bucket.

Models (random weights, AMP fp16 with `torch.amp.GradScaler` and fused, capturable AdamW, batch 4; the step functions
are in `benchmarks.hf_training_steps`, written without host syncs):

- `wav2vec2`: HF `Wav2Vec2ForCTC`, base config (layerdrop and SpecAugment 0: both decide on the host), audio of 1-4 s
  drawn per batch, bucketed by 0.25 s, CTC loss on device lengths (`tendril.graphs.training.ctc`);
- `gpt2`: HF `GPT2LMHeadModel` 124M, a language-model fine-tuning step on 32-512 tokens, bucketed by 32.

`GRAPHS_TRAINING_MODELS` picks the models (comma-separated, default both); `--quick` runs tiny configs on shorter
inputs. The allocator's settings (`PYTORCH_CUDA_ALLOC_CONF`, e.g. `expandable_segments:True`, which changes how
pools fragment) are recorded with the results. Variants, one after the other in one process on the same batches:

- `eager`: the step function on each batch as it comes (padded only to the batch's own longest item); for Wav2Vec2
  also HF's own step (`labels=`, torch's CTC loss, host syncs included: what users run today), reported as
  `wav2vec2_speedup_vs_eager_hf_loss`, since the device CTC loss launches a few kernels per frame, which graphs
  make cheap but eager execution does not;
- `tendril`: `tendril.graphed_step(step, ..., buckets=...)` after a warm-up pass that captures every bucket
  (reported: `warmup_s`, graphs, pool);
- `compile`: the model under `torch.compile(mode="reduce-overhead")` with its default shape handling (the first
  shape compiled static, the next one dynamic for every later length; CUDA graphs of forward and backward recorded
  per bucket shape; the CTC loss and the optimizer step eager, fused), on the bucket-padded batches; its warm-up
  (compiling, then recording every bucket) is reported as `warmup_s`;
- `tendril+compile`: tendril's graphs of the step on `torch.compile(model)` (Inductor's kernels without its CUDA
  graphs), reported as `*_tendril_compile_speedup_vs_compile`: Inductor's fusion shortens the kernels, which a
  graph of eager kernels cannot.

Step time: wall time of a pass over the batches (no host synchronisation inside, one at its end) per step; the
median over passes. Kernel time: the summed GPU time of all device operations the profiler records over the
eager pass, per step. `*_step_over_kernel_time` is tendril's step time over that: near 1 when no launch overhead is
left (tendril runs padded batches, so a ratio under the padding's extra work is at the floor).

Memory: `wav2vec2_memory_ratio_vs_separate_pools` is the device memory of every bucket's step captured with
`torch.cuda.graph` into a pool of its own over tendril's (all buckets in one shared pool, captured ahead of time,
largest first, by `GraphedStep.capture`; both measured as the growth of device memory in use, cudaMemGetInfo after
emptying the allocator's cache). The timed variant's `pool_mib` is the same pool captured in call order.

Correctness: `max_param_rel_diff_amp_20_steps` is the largest relative difference of any parameter or optimizer
state tensor between 20 graphed and 20 eager AMP steps on the same padded batches, dropout 0, over the models run
(less the key-projection biases, `hf_training_steps.ZERO_GRADIENT`), every run under torch's deterministic
algorithms (`deterministic_algorithms`; operations without one are listed in `extra`) and one attention kernel
(`hf_training_steps.ONE_ATTENTION_KERNEL`), so that the difference is the graphs' own.
`{model}_max_param_rel_diff_amp_20_steps_default_algorithms` is the same for one model with torch's default
algorithms and the attention kernels graphs capture with, as users run them.
Two eager runs are compared the same way in both modes (`eager twice`): the floor that their kernels' own
run-to-run noise sets.
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.attention import sdpa_kernel

import tendril
from benchmarks import cudagraph_skips
from benchmarks import hf_training_steps as hf
from benchmarks.registry import Context, Goal, register
from tendril.graphs.buckets import Buckets
from tendril.graphs.capture import GRAPH_SDPA_BACKENDS
from tendril.graphs.cuda_backend import CudaBackend
from tendril.utils.device_memory import device_memory_in_use
from tendril.utils.timing import Timing, summarize

SAMPLE_RATE = 16_000
BATCH = 4
W2V_VOCAB = 32
W2V_LABELS = 64
"""Label columns per item (about 16 characters per second of audio at 4 s; shorter transcripts padded with -100)."""
GPT2_VOCAB = 50257
MODELS = ("wav2vec2", "gpt2")
CORRECTNESS_STEPS = 20
CUBLAS_WORKSPACE = "CUBLAS_WORKSPACE_CONFIG"
CORRECTNESS_LR = 1e-5
"""A fine-tuning rate: 20 steps move every parameter well past fp32 rounding, while the run stays out of the chaotic
regime of a large rate from random weights, where two eager runs already part by their backward's atomics."""


@dataclass(frozen=True)
class Setup:
    """One model's run: how to build it and its batches."""

    name: str
    make_model: Callable[[float], Any]
    make_step: Callable[..., Callable[..., torch.Tensor]]
    buckets: Buckets
    batch: Callable[[int, torch.Generator], tuple[torch.Tensor, ...]]
    lengths: tuple[int, ...]
    """The bucket sizes: each batch's longest item is drawn between the first and the last."""


# -- pure helpers (tested on the CPU) -----------------------------------------------------------------


def bucket_sizes(low: int, high: int, step: int) -> tuple[int, ...]:
    """Sizes `low, low + step, ..., high` (`high - low` a multiple of `step`)."""
    if step < 1 or high < low or (high - low) % step:
        raise ValueError(f"cannot bucket [{low}, {high}] by {step}")
    return tuple(range(low, high + 1, step))


def chosen_models(value: str | None) -> tuple[str, ...]:
    """The models named by GRAPHS_TRAINING_MODELS (comma-separated), in the case's order; all when unset."""
    if not value:
        return MODELS
    names = [part.strip() for part in value.split(",") if part.strip()]
    unknown = sorted(set(names) - set(MODELS))
    if unknown or not names:
        raise ValueError(f"GRAPHS_TRAINING_MODELS={value!r}: expected a comma-separated subset of {', '.join(MODELS)}")
    return tuple(name for name in MODELS if name in names)


def draw_lengths(sizes: tuple[int, ...], count: int, generator: torch.Generator) -> list[int]:
    """`count` lengths uniform over [smallest size, largest size] (1-4 s of audio, 32-512 tokens)."""
    return torch.randint(sizes[0], sizes[-1] + 1, (count,), generator=generator).tolist()


def ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator > 0 else float("inf")


# -- models -------------------------------------------------------------------------------------------


def _wav2vec2_setup(quick: bool) -> Setup:
    seconds = (1.0, 2.0) if quick else (1.0, 4.0)
    quarter = SAMPLE_RATE // 4
    sizes = bucket_sizes(int(seconds[0] * SAMPLE_RATE), int(seconds[1] * SAMPLE_RATE), quarter)

    return Setup(
        "wav2vec2",
        lambda dropout: hf.wav2vec2_model(tiny=quick, vocab=W2V_VOCAB, dropout=dropout),
        hf.wav2vec2_step,
        hf.wav2vec2_buckets(sizes),
        lambda n, g: hf.wav2vec2_batch(n, BATCH, W2V_LABELS, W2V_VOCAB, g),
        sizes,
    )


def _gpt2_setup(quick: bool) -> Setup:
    sizes = bucket_sizes(32, 128 if quick else 512, 32)

    def make(dropout: float) -> Any:
        if quick:
            return hf.gpt2_model(dropout=dropout, vocab=GPT2_VOCAB)
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(use_cache=False, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
        return GPT2LMHeadModel(config).cuda().train()

    return Setup(
        "gpt2",
        make,
        hf.gpt2_step,
        hf.gpt2_buckets(sizes),
        lambda n, g: hf.gpt2_batch(n, BATCH, GPT2_VOCAB, g),
        sizes,
    )


# -- measurements -------------------------------------------------------------------------------------


def _pass_ms(step: Callable[..., Any], data: list[tuple[torch.Tensor, ...]]) -> float:
    """Wall time per step of one pass over `data`, synchronised once at the end."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for batch in data:
        step(*batch)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / len(data)


def _time(step: Callable[..., Any], data: list[tuple[torch.Tensor, ...]], passes: int) -> Timing:
    return summarize([_pass_ms(step, data) for _ in range(passes)])


def kernel_ms(step: Callable[..., Any], data: list[tuple[torch.Tensor, ...]]) -> float:
    """Summed GPU time of the device operations of one pass over `data`, per step (profiler)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for batch in data:
            step(*batch)
        torch.cuda.synchronize()
    busy_us = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == DeviceType.CUDA)
    return busy_us / 1e3 / len(data)


def _fresh(setup: Setup, dropout: float, lr: float = 1e-5) -> tuple[Any, torch.optim.Optimizer, torch.amp.GradScaler]:
    torch.manual_seed(0)
    model = setup.make_model(dropout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, fused=True, capturable=True)
    return model, optimizer, torch.amp.GradScaler("cuda")


def _padded(setup: Setup, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    names = [name for name, _ in setup.buckets.pads]
    call = setup.buckets.pad(batch, {}, {name: index for index, name in enumerate(names)})
    return tuple(call.args) if call is not None else batch


def _tendril(ctx: Context, setup: Setup, data: list, passes: int) -> tuple[Timing, Any]:
    model, optimizer, scaler = _fresh(setup, 0.1)
    step = tendril.graphed_step(
        setup.make_step(model, optimizer, scaler, amp=True), model=model, optimizer=optimizer, scaler=scaler,
        buckets=setup.buckets,
    )  # fmt: skip
    timing = _warm_and_time(ctx, f"{setup.name} tendril", setup, step, data, passes)
    return timing, step


def _tendril_compiled(ctx: Context, setup: Setup, data: list, passes: int) -> Timing | None:
    """tendril's graphs of the step on `torch.compile(model)` (Inductor's fused kernels, no CUDA graphs of its
    own; default shape handling): one launch per step as `tendril`, with the kernels `compile` runs. None, with the
    error in the notes, where it fails."""
    import torch._dynamo

    _raise_recompile_limit(setup)
    model, optimizer, scaler = _fresh(setup, 0.1)
    step = tendril.graphed_step(
        setup.make_step(torch.compile(model), optimizer, scaler, amp=True), model=model, optimizer=optimizer,
        scaler=scaler, buckets=setup.buckets,
    )  # fmt: skip
    try:
        return _warm_and_time(ctx, f"{setup.name} tendril+compile", setup, step, data, passes)
    except RuntimeError as error:
        ctx.note(f"{setup.name}: tendril on torch.compile(model) failed: {str(error).splitlines()[0]}")
        ctx.extra[f"{setup.name}_tendril_compile_failure"] = str(error)
        return None
    finally:
        torch._dynamo.reset()


def _warm_and_time(ctx: Context, label: str, setup: Setup, step: Any, data: list, passes: int) -> Timing:
    """Every bucket's warm-up and capture, then the timed passes; warm-up, graphs and pool reported under
    `label`."""
    generator = torch.Generator().manual_seed(7)
    start = time.perf_counter()
    for size in setup.lengths:
        for _ in range(3):
            step(*setup.batch(size, generator))
    torch.cuda.synchronize()
    ctx.add_value(label, "warmup_s", time.perf_counter() - start)
    timing = _time(step, data, passes)
    ctx.add_timing(label, timing, "ms_per_step")
    ctx.add_value(label, "graphs", len(step.keys()))
    ctx.add_value(label, "pool_mib", step.stats.pool_bytes / 2**20)
    if step.stats.eager_calls:
        ctx.note(f"{label} ran {step.stats.eager_calls} steps eagerly:\n{step.stats.table()}")
    return timing


def _raise_recompile_limit(setup: Setup) -> None:
    """Room for a compile per bucket shape (dynamo's default limit would fall back to eager past it)."""
    import torch._dynamo

    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    setattr(torch._dynamo.config, limit, max(getattr(torch._dynamo.config, limit), 4 * len(setup.lengths)))


def _compiled(ctx: Context, setup: Setup, data: list, passes: int) -> Timing | None:
    """The same step function on `torch.compile(model, mode="reduce-overhead")`: compiled forward and backward,
    captured by torch's CUDA-graph trees per shape; the loss outside the model (the CTC loss) and the optimizer
    step run eagerly. None, with the error in the notes, where torch's step fails."""
    import torch._dynamo

    _raise_recompile_limit(setup)
    model, optimizer, scaler = _fresh(setup, 0.1)
    compiled = torch.compile(model, mode="reduce-overhead")
    plain = setup.make_step(compiled, optimizer, scaler, amp=True, keep_grads=False)

    def step(*batch: torch.Tensor) -> torch.Tensor:
        torch.compiler.cudagraph_mark_step_begin()
        return plain(*batch).clone()

    generator = torch.Generator().manual_seed(7)
    start = time.perf_counter()
    size = setup.lengths[0]
    with cudagraph_skips.watch() as skips:
        ctx.extra[f"{setup.name}_compile_cudagraph_skips"] = skips  # filled in when the block ends
        try:
            for size in setup.lengths:
                for _ in range(3):
                    step(*_padded(setup, setup.batch(size, generator)))
            torch.cuda.synchronize()
            ctx.add_value(f"{setup.name} compile", "warmup_s", time.perf_counter() - start)
            padded = [_padded(setup, batch) for batch in data]
            timing = _time(step, padded, passes)
        except RuntimeError as error:
            first_line = str(error).splitlines()[0]
            ctx.note(f"{setup.name}: torch.compile(mode='reduce-overhead') failed warming up size {size}: {first_line}")
            ctx.extra[f"{setup.name}_compile_failure"] = str(error)
            return None
        finally:
            torch._dynamo.reset()
    ctx.add_timing(f"{setup.name} compile reduce-overhead", timing, "ms_per_step")
    return timing


def _separate_pools_bytes(setup: Setup, device: torch.device) -> int:
    """Device memory of every bucket's step captured by `torch.cuda.graph`, each into a pool of its own."""
    model, optimizer, scaler = _fresh(setup, 0.0)
    step = setup.make_step(model, optimizer, scaler, amp=True)
    generator = torch.Generator().manual_seed(7)
    examples = [_padded(setup, setup.batch(size, generator)) for size in setup.lengths]
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream), sdpa_kernel(list(GRAPH_SDPA_BACKENDS)):
        for batch in examples:  # warm every shape, make the optimizer state and gradients
            step(*batch)
    torch.cuda.current_stream(device).wait_stream(stream)
    before = device_memory_in_use(device)
    graphs = []
    with sdpa_kernel(list(GRAPH_SDPA_BACKENDS)):
        for batch in examples:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step(*batch)
            graphs.append(graph)
    used = device_memory_in_use(device) - before
    del graphs, model, optimizer, scaler, step
    device_memory_in_use(device)
    return used


def _tendril_pool_bytes(setup: Setup, device: torch.device) -> int:
    """Device memory of tendril's graphs of every bucket (one shared pool, placeholders, executables), captured
    ahead of time, largest first (`GraphedStep.capture`)."""
    model, optimizer, scaler = _fresh(setup, 0.0)
    plain = setup.make_step(model, optimizer, scaler, amp=True)
    generator = torch.Generator().manual_seed(7)
    examples = [setup.batch(size, generator) for size in setup.lengths]
    plain(*examples[0])  # the optimizer state and gradients, as the separate pools' measurement has them
    before = device_memory_in_use(device)
    step = tendril.graphed_step(plain, model=model, optimizer=optimizer, scaler=scaler, buckets=setup.buckets)
    captured = step.capture(examples)
    used = device_memory_in_use(device) - before
    assert captured == len(examples), step.stats.table()
    del step, plain, model, optimizer, scaler
    device_memory_in_use(device)
    return used


def correctness_lengths(sizes: tuple[int, ...], steps: int) -> list[int]:
    """Lengths for the correctness run: three, in two buckets, so that most of its steps are replays."""
    top = sizes[-1]
    below = sizes[-2] if len(sizes) > 1 else top
    pattern = [top, below, top - 1, below - 1]
    return [pattern[i % len(pattern)] for i in range(steps)]


@contextlib.contextmanager
def deterministic_algorithms(found: list[str]) -> Iterator[None]:
    """torch's deterministic algorithms (warn-only: an operation without one warns, and its message is added to
    `found`), with cuBLAS's deterministic workspace setting, restored afterwards."""
    previous = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    workspace = os.environ.get(CUBLAS_WORKSPACE)
    os.environ[CUBLAS_WORKSPACE] = ":4096:8"
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
        found.extend(sorted({str(w.message).splitlines()[0] for w in caught} - set(found)))
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])
        if workspace is None:
            os.environ.pop(CUBLAS_WORKSPACE, None)
        else:
            os.environ[CUBLAS_WORKSPACE] = workspace


def max_param_rel_diff(ctx: Context, setup: Setup, deterministic: bool) -> float:
    """Largest relative difference of parameters and optimizer state, 20 AMP steps graphed against eager. The
    same between two eager runs is reported beside it (`eager twice`: the run-to-run noise of the step's own
    kernels); the worst tensors of both, and every run's loss and loss scale per step, go into `extra`.
    `deterministic`: all three runs under `deterministic_algorithms` and on `hf.ONE_ATTENTION_KERNEL`, so that what
    differs is the graphs'; otherwise with torch's default algorithms and the attention kernels graphs capture with
    (`GRAPH_SDPA_BACKENDS`), as users run them."""
    mode = "deterministic" if deterministic else "default"
    generator = torch.Generator().manual_seed(3)
    lengths = correctness_lengths(setup.lengths, CORRECTNESS_STEPS)
    batches = [_padded(setup, setup.batch(n, generator)) for n in lengths]
    states, traces, nondeterministic = [], {}, []

    def run(label: str, step: Callable[..., torch.Tensor], scaler: torch.amp.GradScaler) -> None:
        losses, scales = [], []
        for batch in batches:
            losses.append(step(*batch).float())
            scales.append(scaler.get_scale())
        traces[label] = {"loss": torch.stack(losses).tolist(), "scale": scales}

    algorithms = deterministic_algorithms(nondeterministic) if deterministic else contextlib.nullcontext()
    attention = hf.ONE_ATTENTION_KERNEL if deterministic else GRAPH_SDPA_BACKENDS
    with sdpa_kernel(list(attention)), algorithms:
        for label in ("eager", "eager twice"):
            reference, reference_optimizer, reference_scaler = _fresh(setup, 0.0, CORRECTNESS_LR)
            run(label, setup.make_step(reference, reference_optimizer, reference_scaler, amp=True), reference_scaler)
            states.append(hf.state_of(reference, reference_optimizer))
        model, optimizer, scaler = _fresh(setup, 0.0, CORRECTNESS_LR)
        step = tendril.graphed_step(
            setup.make_step(model, optimizer, scaler, amp=True), model=model, optimizer=optimizer, scaler=scaler,
            buckets=setup.buckets, backend=CudaBackend(attention),
        )  # fmt: skip
        run("tendril", step, scaler)
        torch.cuda.synchronize()
    ctx.add_value(f"{setup.name} tendril {mode}", "replays_in_correctness_steps", step.stats.replays)
    graphed = hf.rel_diffs(hf.state_of(model, optimizer), states[0])
    twice = hf.rel_diffs(states[1], states[0])
    ctx.add_value(f"{setup.name} eager twice {mode}", "max_param_rel_diff_amp_20_steps", max(twice.values()))
    ctx.add_value(f"{setup.name} tendril {mode}", "max_param_rel_diff_amp_20_steps", max(graphed.values()))
    ctx.extra[f"{setup.name}_worst_rel_diffs_{mode}"] = {
        "tendril_vs_eager": dict(list(graphed.items())[:5]),
        "eager_twice": dict(list(twice.items())[:5]),
    }
    ctx.extra[f"{setup.name}_correctness_steps_{mode}"] = traces
    if deterministic:
        ctx.extra[f"{setup.name}_without_deterministic_algorithms"] = nondeterministic
    if step.stats.eager_calls:  # then the comparison is not of graphs at all
        ctx.note(f"{setup.name}: tendril ran {step.stats.eager_calls} of its correctness steps ({mode} algorithms) "
                 f"eagerly:\n{step.stats.table()}")
        return float("inf")
    return max(graphed.values())


def _measure(ctx: Context, setup: Setup) -> dict[str, float]:
    steps = 12 if ctx.quick else 48
    passes = 2 if ctx.quick else 5
    generator = torch.Generator().manual_seed(0)
    data = [setup.batch(n, generator) for n in draw_lengths(setup.lengths, steps, generator)]
    model, optimizer, scaler = _fresh(setup, 0.1)
    eager_step = setup.make_step(model, optimizer, scaler, amp=True)
    eager = _time(eager_step, data, passes + 1)
    ctx.add_timing(f"{setup.name} eager", eager, "ms_per_step")
    kernels = kernel_ms(eager_step, data)
    ctx.add_value(f"{setup.name} eager", "kernel_ms_per_step", kernels)
    hf_loss = None
    if setup.name == "wav2vec2":  # what users run today: HF's own loss (labels=), with its host syncs
        native = hf.wav2vec2_hf_loss_step(model, optimizer, scaler, amp=True)
        hf_loss = _time(native, data, passes + 1)
        ctx.add_timing("wav2vec2 eager, HF's CTC loss", hf_loss, "ms_per_step")
    del model, optimizer, scaler, eager_step
    fast, step = _tendril(ctx, setup, data, passes)
    del step
    device_memory_in_use(ctx.device)
    compiled = _compiled(ctx, setup, data, passes)
    device_memory_in_use(ctx.device)
    fused = _tendril_compiled(ctx, setup, data, passes)
    device_memory_in_use(ctx.device)
    return {
        "over_kernel": ratio(fast.median_ms, kernels),
        "vs_eager": ratio(eager.median_ms, fast.median_ms),
        **({"vs_compile": ratio(compiled.median_ms, fast.median_ms)} if compiled is not None else {}),
        **({"compiled_vs_compile": ratio(compiled.median_ms, fused.median_ms)}
           if compiled is not None and fused is not None else {}),
        "rel_diff": max_param_rel_diff(ctx, setup, deterministic=True),
        "rel_diff_default": max_param_rel_diff(ctx, setup, deterministic=False),
        **({"vs_eager_hf_loss": ratio(hf_loss.median_ms, fast.median_ms)} if hf_loss is not None else {}),
    }


@register("graphs-training", "graphed training steps: Wav2Vec2 CTC, GPT-2 LM, AMP, bucketed (eager, tendril, compile)")
def run(ctx: Context) -> None:
    setups = {"wav2vec2": _wav2vec2_setup, "gpt2": _gpt2_setup}
    names = chosen_models(os.environ.get("GRAPHS_TRAINING_MODELS"))
    diffs = []
    for name in names:
        setup = setups[name](ctx.quick)
        measured = _measure(ctx, setup)
        diffs.append(measured["rel_diff"])
        ctx.target(f"{name}_step_over_kernel_time", measured["over_kernel"], Goal("<=", 1.15))
        ctx.target(f"{name}_speedup_vs_eager", measured["vs_eager"])
        if "vs_compile" in measured:
            ctx.target(f"{name}_speedup_vs_compile", measured["vs_compile"])
        if "compiled_vs_compile" in measured:
            ctx.target(f"{name}_tendril_compile_speedup_vs_compile", measured["compiled_vs_compile"])
        ctx.target(f"{name}_max_param_rel_diff_amp_20_steps_default_algorithms", measured["rel_diff_default"])
        if "vs_eager_hf_loss" in measured:
            ctx.target(f"{name}_speedup_vs_eager_hf_loss", measured["vs_eager_hf_loss"])
        if name == "wav2vec2":
            separate = _separate_pools_bytes(setup, ctx.device)
            shared = _tendril_pool_bytes(setup, ctx.device)
            ctx.add_value("wav2vec2 separate pools", "mib", separate / 2**20)
            ctx.add_value("wav2vec2 tendril", "mib", shared / 2**20)
            ctx.target("wav2vec2_memory_ratio_vs_separate_pools", ratio(separate, shared), Goal(">=", 5))
    ctx.target("max_param_rel_diff_amp_20_steps", max(diffs), Goal("<=", 1e-3))
    ctx.note(f"models: {', '.join(names)}; batch {BATCH}; AMP fp16, GradScaler, fused AdamW; dropout 0.1 for timing")
    ctx.note("eager runs each batch as it comes; tendril, tendril+compile and compile run it padded to its bucket")
    ctx.extra["bucket_sizes"] = {name: list(setups[name](ctx.quick).lengths) for name in names}
    allocator = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    ctx.extra["PYTORCH_CUDA_ALLOC_CONF"] = allocator
    if allocator:
        ctx.note(f"allocator settings: PYTORCH_CUDA_ALLOC_CONF={allocator}")
