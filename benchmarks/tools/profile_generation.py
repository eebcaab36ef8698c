"""Kernel-level profile of tendril's decode step, batch 1: GPT-2 124M fp16 (the `generation` case's model) or
Llama-3.2-1B's shape in bf16 (`--model llama1b`, the `decode-roofline` case's), greedy or `--beams N`.

For each step variant (`generate`'s `step`, the compiled one optionally with Inductor options):
- end to end: warm-up seconds, ms per call and per token of `tendril.generate` (128 new tokens, eos off),
  and whether the tokens equal HF eager `generate`;
- the decode step alone: tendril's loop body (`tendril.generation.decode_step`: the variant's forward plus
  token choice) captured as one CUDA graph and replayed back to back: ms per step, and under `torch.profiler`
  (CUDA activity; kernels of a graph are traced one by one) the kernels per step grouped by name, with count,
  mean and total microseconds, busy time (sum of kernel durations) and the idle gaps between kernels (launch latency);
- the whole loop graph under the profiler: GPU operations per call outside the loop's body (a conditional node's
  body is not traced), grouped by name as the step's are: what a call adds to its steps;
- the call's time split: a call of one new token (time to first token: setup, prompt pass and first choice), a loop
  iteration as the difference between calls of all and of half the new tokens over the tokens between them, beside
  the step graph alone (replayed over as many steps as its state allows), and what is left of the call ("other":
  ms per call less the first token and the iterations after it).
`--sweep` also times the fused linear kernel over launch configurations (block sizes, split-K, warps, with
`--beams` > 1 its tensor-core and CUDA-core paths, on nn.Linear weights at up to four rows the deep CUDA-core
tiles; see `linear_sweep.py`) for the model's five projection shapes (`SWEEP_SHAPES`) at `--beams` rows against
cuBLAS (each in a CUDA graph of repeated launches, weights rotated through more memory than L2 holds), about two
minutes.
`--sweep-layout linear` times them all with nn.Linear's weight layout (K contiguous), as a one-time copy of GPT-2's
Conv1D weights would hold them; `--sweep-grid` (several rows) times every tensor-core launch of a grid
(`tensor_core_grid`) instead of a random draw, about six minutes for Llama-1B.

    PYTHONPATH=src:. python3 -m benchmarks.tools.profile_generation --out OUT [--variants eager,compiled,fused]
        [--model gpt2|llama1b] [--beams N] [--sweep [--sweep-layout model|linear] [--sweep-grid]
        [--sweep-shapes LABEL,...]]
        [--fused-prompt-tokens N]

Writes OUT/profile_generation.json and OUT/profile_generation.md.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
import torch._dynamo
import torch._inductor.config as inductor_config
from torch import nn

from benchmarks.cases import decode_models
from benchmarks.cases import generation as case
from benchmarks.tools.linear_sweep import SWEEP_LAYOUTS, SWEEP_SIZE, sweep_linear
from tendril.generation import STEPS, Step, decode_step, generate
from tendril.generation import loop as decode_loop
from tendril.generation.api import release_graphs
from tendril.generation.kernels import pdl
from tendril.graphs.capture import GRAPH_SDPA_BACKENDS, capture
from tendril.utils.timing import time_callable

INDUCTOR_OPTIONS: dict[str, dict[str, Any]] = {
    "cdt": {"coordinate_descent_tuning": True},
    "autotune": {"max_autotune": True, "coordinate_descent_tuning": True},
}
"""Variant suffixes: `compiled-cdt` compiles with these `torch._inductor.config` options patched in."""

MODELS: dict[str, tuple[str, Callable[[torch.device], nn.Module]]] = {
    "gpt2": ("GPT-2 124M fp16", lambda device: case.gpt2(device)),
    "llama1b": ("Llama-3.2-1B's shape, bf16", lambda device: decode_models.llama(device, torch.bfloat16)),
}
"""`--model`: a description and a builder (random weights, eos off) of each profiled model."""

GAP_LIMIT_US = 50.0
"""Idle time between consecutive kernels shorter than this counts as launch latency inside a graph."""


@dataclass
class KernelGroup:
    name: str
    per_call: float
    mean_us: float
    total_us_per_call: float


@dataclass
class KernelProfile:
    calls: int
    operations_per_call: float
    busy_us_per_call: float
    gap_us_per_call: float
    groups: list[KernelGroup] = field(default_factory=list)


def kernel_profile(fn: Callable[[], Any], calls: int) -> KernelProfile:
    """The GPU operations of `calls` calls of `fn`, traced by the profiler and grouped by name."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    durations: dict[str, list[float]] = collections.defaultdict(list)
    gaps = 0.0
    for event in events:
        durations[event.name].append(event.time_range.elapsed_us())
    for previous, event in itertools.pairwise(events):
        gap = event.time_range.start - previous.time_range.end
        if 0 < gap < GAP_LIMIT_US:
            gaps += gap
    groups = [KernelGroup(name[:240], len(d) / calls, statistics.fmean(d), sum(d) / calls)
              for name, d in durations.items()]
    groups.sort(key=lambda g: -g.total_us_per_call)
    busy = sum(g.total_us_per_call for g in groups)
    return KernelProfile(calls, len(events) / calls, busy, gaps / calls, groups)


class StepGraph:
    """The variant's decode step (loop body) captured alone, replayed from the state after prefill."""

    def __init__(self, model: nn.Module, prompt: torch.Tensor, new_tokens: int, step: Step, beams: int) -> None:
        self.state = decode_step(model, prompt, max_new_tokens=new_tokens, num_beams=beams, step=step)  # `generate`'s
        with torch.inference_mode():
            self.graph = capture(self.state.step, sdpa_backends=GRAPH_SDPA_BACKENDS)
        self.max_replays = self.state.max_new_tokens - 4  # capture's warm-up ran the step twice

    def replay(self, times: int) -> None:
        self.state.reset()
        for _ in range(times):
            self.graph.graph.replay()

    def ms_per_step(self, replays: int, reps: int = 5) -> float:
        samples = []
        for _ in range(reps):
            self.state.reset()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(replays):
                self.graph.graph.replay()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) / replays)
        return statistics.median(samples)


def parse_variant(variant: str) -> tuple[Step, dict[str, Any]]:
    """(`generate`'s step, Inductor options) of a variant name: a step, or `compiled-` and an `INDUCTOR_OPTIONS` key."""
    step, _, suffix = variant.partition("-")
    if step not in STEPS or (suffix and (step != "compiled" or suffix not in INDUCTOR_OPTIONS)):
        raise ValueError(f"variant {variant!r}: expected one of {', '.join(STEPS)}, or compiled-SUFFIX with a "
                         f"suffix in {', '.join(INDUCTOR_OPTIONS)}")
    return cast(Step, step), INDUCTOR_OPTIONS[suffix] if suffix else {}


def run_variant(variant: str, model: nn.Module, prompts: list[torch.Tensor], reference: torch.Tensor,
                new_tokens: int, reps: int, beams: int = 1) -> dict[str, Any]:
    step, options = parse_variant(variant)
    release_graphs(model)
    torch._dynamo.reset()

    def call_of(tokens: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def call(prompt: torch.Tensor) -> torch.Tensor:
            return generate(model, prompt, max_new_tokens=tokens, num_beams=beams, eos_token_id=[], pad_token_id=0,
                            step=step)
        return call

    def ms_per_call(tokens: int) -> float:
        call_of(tokens)(prompts[0])
        return time_callable(call_of(tokens), [(p,) for p in prompts], device="cuda", warmup=1, reps=reps).median_ms

    call = call_of(new_tokens)

    torch.cuda.synchronize()
    begin = time.perf_counter()
    with inductor_config.patch(**options):
        first = call(prompts[0]).clone()
    torch.cuda.synchronize()
    result: dict[str, Any] = {"variant": variant, "warmup_s": time.perf_counter() - begin,
                              "matches_hf": bool(first.shape == reference.shape and torch.equal(first, reference))}
    timing = time_callable(call, [(p,) for p in prompts], device="cuda", warmup=1, reps=reps)
    result["ms_per_call"] = timing.median_ms
    result["ms_per_token"] = timing.median_ms / new_tokens
    result["tok_per_s"] = new_tokens / (timing.median_ms / 1e3)
    loop = kernel_profile(lambda: call(prompts[0]), calls=2)
    result["loop_operations_per_call"] = loop.operations_per_call
    result["loop_busy_us_per_call"] = loop.busy_us_per_call
    result["outside_loop_kernels"] = [{"name": g.name, "per_call": g.per_call, "mean_us": g.mean_us,
                                       "total_us": g.total_us_per_call} for g in loop.groups]

    result["first_token_ms"] = ms_per_call(1)
    half = max(new_tokens // 2, 1)
    result["half_call_ms"] = ms_per_call(half)
    result["loop_ms_per_step"] = (timing.median_ms - result["half_call_ms"]) / max(new_tokens - half, 1)
    result["other_ms"] = timing.median_ms - result["first_token_ms"] - (new_tokens - 1) * result["loop_ms_per_step"]
    step_graph = StepGraph(model, prompts[0], new_tokens, step, beams)
    replays = step_graph.max_replays
    result["step_graph_ms"] = step_graph.ms_per_step(replays)
    profiled = kernel_profile(lambda: step_graph.replay(replays), calls=1)
    result["step"] = {
        "operations": profiled.operations_per_call / replays,
        "busy_us": profiled.busy_us_per_call / replays,
        "gap_us": profiled.gap_us_per_call / replays,
        "kernels": [{"name": g.name, "per_step": g.per_call / replays, "mean_us": g.mean_us,
                     "total_us": g.total_us_per_call / replays} for g in profiled.groups],
    }
    return result


# ---------------------------------------------------------------------------------------- report


def markdown(report: dict[str, Any]) -> str:
    search = "greedy" if report.get("beams", 1) == 1 else f"{report['beams']}-beam"
    lines = [f"# Profile of the {search} decode step ({MODELS[report.get('model', 'gpt2')][0]}, batch 1)", "",
             f"- device: {report['device']}; torch {report['torch']}; {report['new_tokens']} new tokens, "
             f"prompt {report['prompt_len']} (the fused step's kernels run prompts of up to "
             f"{report.get('fused_prompt_tokens', '?')} tokens); fused kernels with programmatic dependent launch: "
             f"{'yes' if report.get('programmatic_launch') else 'no'} (then a kernel's traced time includes its wait "
             "for the one before, so busy and mean times overlap)"]
    if report["variants"]:
        lines += ["", "| variant | tok/s | ms/token | warm-up s | = HF | first token ms | loop ms/step | other ms | "
                  "step graph ms | ops/step | busy us/step | gaps us/step | ops/call outside the loop |",
                  "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report["variants"]:
        if "error" in r:
            lines.append(f"| {r['variant']} | failed: {r['error'][:120]} ||||||||||||")
            continue
        s = r["step"]
        lines.append(f"| {r['variant']} | {r['tok_per_s']:.0f} | {r['ms_per_token']:.4f} | {r['warmup_s']:.2f} | "
                     f"{'yes' if r['matches_hf'] else 'NO'} | {r['first_token_ms']:.3f} | "
                     f"{r['loop_ms_per_step']:.4f} | {r.get('other_ms', float('nan')):.3f} | "
                     f"{r['step_graph_ms']:.4f} | {s['operations']:.1f} | "
                     f"{s['busy_us']:.1f} | {s['gap_us']:.1f} | {r['loop_operations_per_call']:.0f} |")
    for r in report["variants"]:
        if "error" in r:
            continue
        lines += ["", f"## {r['variant']}: kernels per step", "", "| kernel | per step | mean us | us/step |",
                  "|---|---:|---:|---:|"]
        for k in r["step"]["kernels"][:40]:
            name = k["name"].replace("|", "\\|")[:140]
            lines.append(f"| `{name}` | {k['per_step']:.2f} | {k['mean_us']:.2f} | {k['total_us']:.2f} |")
        lines += ["", f"## {r['variant']}: kernels per call outside the loop's body (15 largest)", "",
                  "| kernel | per call | mean us | us/call |", "|---|---:|---:|---:|"]
        for k in r.get("outside_loop_kernels", [])[:15]:
            name = k["name"].replace("|", "\\|")[:140]
            lines.append(f"| `{name}` | {k['per_call']:.2f} | {k['mean_us']:.2f} | {k['total_us']:.2f} |")
    if report.get("sweep"):
        lines += ["", "## Fused linear kernel: block-size sweep (us per launch inside a CUDA graph)", "",
                  "GB/s: the bytes a launch must move (weights, input, output, residual) over its time.", "",
                  "| shape | MB | cuBLAS | default | default GB/s | best | best GB/s | best config |",
                  "|---|---:|---:|---:|---:|---:|---:|---|"]
        for e in report["sweep"]:
            default = next((c["us"] for c in e["configs"] if c.get("default")), float("nan"))
            best = e["best"] or {}
            best_us = best.get("us", float("nan"))
            moved = e.get("bytes_per_launch", float("nan"))
            shape = e["shape"] if e.get("rows", 1) == 1 else f"{e['shape']} ({e['rows']} rows)"
            if e.get("layout") == "linear" and SWEEP_LAYOUTS.get(e["shape"]) == "conv1d":
                shape += ", weights K-contiguous"
            lines.append(f"| {shape} | {moved / 1e6:.2f} | {e['cublas_us']:.2f} | {default:.2f} | "
                         f"{moved / default / 1e3:.0f} | {best_us:.2f} | {moved / best_us / 1e3:.0f} | "
                         f"n={best.get('block_n')} k={best.get('block_k')} split={best.get('split_k')} "
                         f"warps={best.get('warps')}{' dot' if best.get('dot') else ''} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--variants", default="eager,compiled,fused",
                        help="comma-separated: eager, compiled, compiled-cdt, compiled-autotune, fused (none: "
                             "only the sweep)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--sweep", action="store_true", help="also sweep the fused linear kernel's block sizes")
    parser.add_argument("--sweep-size", type=int, default=SWEEP_SIZE,
                        help="launch configurations drawn per shape besides the defaults")
    parser.add_argument("--sweep-layout", choices=("model", "linear"), default="model",
                        help="linear: sweep every projection with its weights K-contiguous (nn.Linear's layout)")
    parser.add_argument("--sweep-shapes", help="comma-separated labels of the projections to sweep (default: all)")
    parser.add_argument("--sweep-grid", action="store_true",
                        help="with --beams > 1: sweep every tensor-core launch of a grid (about 80 a shape) instead of "
                             "--sweep-size drawn ones")
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt2")
    parser.add_argument("--beams", type=int, default=1, help="beam search with this many beams (1: greedy)")
    parser.add_argument("--fused-prompt-tokens", type=int, default=decode_loop.FUSED_PROMPT_TOKENS,
                        help="the longest prompt step='fused' runs through its kernels (0: the model's own forward "
                             "for every prompt), to compare the two prompt passes")
    args = parser.parse_args()
    decode_loop.FUSED_PROMPT_TOKENS = args.fused_prompt_tokens
    if args.beams < 1:
        parser.error(f"--beams {args.beams}: expected at least 1")
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    model = MODELS[args.model][1](device)
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (1, args.prompt_len), generator=generator).to(device) for _ in range(4)]
    reference = case.hf_eager(model, args.new_tokens, args.beams)(prompts[0])
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "model": args.model, "beams": args.beams,
                              "new_tokens": args.new_tokens, "prompt_len": args.prompt_len,
                              "fused_prompt_tokens": args.fused_prompt_tokens,
                              "programmatic_launch": pdl.enabled(device), "variants": []}
    for variant in filter(None, args.variants.split(",")):
        print(f"variant {variant} ...", flush=True)
        try:
            result = run_variant(variant, model, prompts, reference, args.new_tokens, args.reps, args.beams)
        except Exception as error:  # one failing variant must not hide the others
            traceback.print_exc()
            result = {"variant": variant, "error": f"{type(error).__name__}: {error}"[:500]}
        report["variants"].append(result)
        print(json.dumps({k: v for k, v in result.items() if k != "step"}), flush=True)
        (args.out / "profile_generation.json").write_text(json.dumps(report, indent=1))
    if args.sweep:
        shapes = args.sweep_shapes.split(",") if args.sweep_shapes else None
        report["sweep"] = sweep_linear(args.model, args.beams, args.sweep_size, args.sweep_layout, args.sweep_grid,
                                       shapes)
    (args.out / "profile_generation.json").write_text(json.dumps(report, indent=1))
    (args.out / "profile_generation.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
