"""Where the device time of the `graphs-zero-copy` decode loop goes, per kernel, plain against automatic.

A diagnostic behind `copy_time_saved_fraction_auto`: the case's HF-style 4-beam GPT-2 loop at one cache
length, (a) `plain` and (b) `auto`, each warmed up as the case does, then profiled (CUPTI through
`torch.profiler`, kernels inside graph replays included) over `--reps` repetitions of the case's
`STEPS` steps. Kernels are grouped by name; the table lists each group's device microseconds per step in
both variants and the difference, largest first, so a kernel that got slower under zero-copy shows up
directly. The device time per step of both variants is also measured over `--device-reps` interleaved
repetitions behind a GPU sleep (the case's `device_ms_per_step`), with its spread, and the case's copy
time (`copy_ms`, `graphs_zero_copy.copies_in_loop`) beside the timeline's copy span, in one process (in
separate runs the two read 138 and 162-171 us at L=512).

    PYTHONPATH=src:. python3 -m benchmarks.tools.zero_copy_profile --out OUT [--length 512] [--host-profile]

Writes OUT/zero_copy_profile.json and OUT/zero_copy_profile.md.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import statistics
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from benchmarks.cases import graphs_zero_copy as case
from benchmarks.tools.profile_generation import GAP_LIMIT_US, kernel_profile
from tendril import graphed
from tendril.graphs import CudaBackend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--length", type=int, default=case.TARGET_LENGTH)
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--device-reps", type=int, default=15)
    parser.add_argument("--host-profile", action="store_true",
                        help="also profile each variant's host side (cProfile) and list its costliest functions")
    args = parser.parse_args()
    device = torch.device("cuda")
    model = case.gpt2(device)
    backend = CudaBackend()
    plain = graphed(case.forward_step(model), backend=backend, max_graphs=1024)
    auto = graphed(case.forward_step(model), backend=backend, max_graphs=1024)
    variants = [
        case.Variant("plain", plain, lambda s: case.host_step(plain, s), nullcontext),
        case.Variant("auto", auto, lambda s: case.host_step(auto, s), auto.zero_copy),
    ]
    steps_profiled = case.STEPS * args.reps
    report: dict[str, Any] = {"length": args.length, "steps_profiled": steps_profiled, "variants": {}}
    with torch.inference_mode():
        start = case.prefix(model.config, args.length, device, torch.float16)
        for variant in variants:
            for _ in range(2):
                with variant.context():
                    case.run_loop(variant.step, start, case.STEPS)
        device_times: dict[str, list[float]] = {v.name: [] for v in variants}
        case_copies: list[float] = []
        case_waits: list[float] = []
        for rep in range(args.device_reps):
            for variant in variants:
                case.device_rep(variant, start, device_times[variant.name])
            if rep < 5:  # the case's own copy-time measure, in this process beside the timeline's
                case.copies_in_loop(variants[0], start, case_copies, case_waits)
        report["case_copy_us"] = statistics.median(case_copies) * 1e3
        report["case_copy_host_wait_us"] = max(case_waits)
        for variant in variants:

            def repetition(v: case.Variant = variant) -> None:
                state = start.clone()
                with v.context():
                    for _ in range(case.STEPS):
                        state = v.step(state)

            profile = kernel_profile(repetition, calls=args.reps)
            behind_sleep = timeline_behind_sleep(variant, start)
            times = device_times[variant.name]
            report["variants"][variant.name] = {
                "device_ms_per_step_median": statistics.median(times),
                "device_ms_per_step_p10": statistics.quantiles(times, n=10)[0],
                "device_ms_per_step_p90": statistics.quantiles(times, n=10)[-1],
                "operations_per_step": profile.operations_per_call / case.STEPS,
                "busy_us_per_step": profile.busy_us_per_call / case.STEPS,
                "gap_us_per_step": profile.gap_us_per_call / case.STEPS,
                "kernels": {g.name: {"per_step": g.per_call / case.STEPS,
                                     "us_per_step": g.total_us_per_call / case.STEPS,
                                     "mean_us": g.mean_us} for g in profile.groups},
            }
            report["variants"][variant.name]["behind_sleep"] = behind_sleep
            if args.host_profile:
                steps = case.STEPS * args.reps
                report["variants"][variant.name]["host_profile"] = host_profile(repetition, steps=steps)
            report["variants"][variant.name]["stats"] = {
                "redirects": variant.fast.stats.redirects,
                "mispredictions": {r.name: n for r, n in variant.fast.stats.mispredictions.items()},
            }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "zero_copy_profile.json").write_text(json.dumps(report, indent=2))
    (args.out / "zero_copy_profile.md").write_text(markdown(report))
    print(markdown(report))


def host_profile(repetition: Any, steps: int, top: int = 30) -> dict[str, Any]:
    """cProfile of `steps // case.STEPS` repetitions: the host's microseconds per step in all, in the `top`
    functions by own time and in the `top` by time including callees."""
    import cProfile
    import pstats
    import time

    profiler = cProfile.Profile()
    torch.cuda.synchronize()
    began = time.perf_counter()
    profiler.enable()
    for _ in range(steps // case.STEPS):
        repetition()
    profiler.disable()
    total_us = (time.perf_counter() - began) * 1e6 / steps
    torch.cuda.synchronize()
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    by_own = sorted(stats.items(), key=lambda item: -item[1][2])[:top]
    by_total = sorted(stats.items(), key=lambda item: -item[1][3])[:top]
    return {
        "us_per_step_profiled": total_us,
        "functions": [{"function": f"{path.rsplit('/', 1)[-1]}:{line}({name})", "calls_per_step": calls / steps,
                       "own_us_per_step": own * 1e6 / steps, "total_us_per_step": total * 1e6 / steps}
                      for (path, line, name), (_, calls, own, total, _) in [*by_own, *by_total]],
    }


def short_name(kernel: str) -> str:
    """A kernel's name without its template arguments and parameters, at most 48 characters."""
    kernel = kernel.replace("(anonymous namespace)::", "")
    for marker in ("<", "("):
        kernel = kernel.split(marker, 1)[0]
    return kernel.removeprefix("void ").rsplit("::", 1)[-1].strip()[:48] or "?"


def timeline_behind_sleep(variant: case.Variant, start: case.State) -> dict[str, Any]:
    """One repetition enqueued behind a GPU sleep (as `device_ms_per_step` is measured), traced: per step after
    the sleep, the span of the GPU's work, its busy time, and its idle time in gaps shorter and longer than
    `GAP_LIMIT_US` (a long gap behind a sleep means the GPU waited for the host: a synchronisation). The short
    gaps are also summed per (operation before, operation after) pair (`gaps_by_pair`), and the copies'
    span per step is measured as the case measures it (`copy_span_us_per_step`, steps with copies only)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    state = start.clone()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        with variant.context():
            torch.cuda._sleep(case.SLEEP_CYCLES)
            for _ in range(case.STEPS):
                state = variant.step(state)
        del state
        torch.cuda.synchronize()
    events = sorted((e for e in trace.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    sleeps = [i for i, e in enumerate(events) if "sleep" in e.name.lower() or "spin" in e.name.lower()]
    after = events[sleeps[-1] + 1:] if sleeps else events
    busy = sum(e.time_range.elapsed_us() for e in after)
    short = long = 0.0
    pairs: dict[str, float] = collections.defaultdict(float)
    for previous, event in itertools.pairwise(after):
        gap = event.time_range.start - previous.time_range.end
        if gap >= GAP_LIMIT_US:
            long += gap
        elif gap > 0:
            short += gap
            pairs[f"{short_name(previous.name)} -> {short_name(event.name)}"] += gap / case.STEPS
    span = after[-1].time_range.end - after[0].time_range.start if after else 0.0
    per_step = {"span": span, "busy": busy, "short_gap": short, "long_gap": long}
    runs = case.copy_runs([(e.name, e.time_range.start, e.time_range.end) for e in after])
    big = [ms * 1e3 for ms, count in runs if count >= len(start.past)]  # a step's staging (`case.staging_spans_ms`)
    return {
        "found_sleep": float(bool(sleeps)),
        **{f"{k}_us_per_step": v / case.STEPS for k, v in per_step.items()},
        "copy_span_us_per_step": statistics.median(big) if big else 0.0,
        "gaps_by_pair": dict(sorted(pairs.items(), key=lambda item: -item[1])),
    }


def markdown(report: dict[str, Any]) -> str:
    plain, auto = report["variants"]["plain"], report["variants"]["auto"]
    lines = [
        f"# Zero-copy decode loop, per kernel (GPT-2 fp16, 4 beams, L={report['length']})",
        "",
        f"- device: {torch.cuda.get_device_name()}; torch {torch.__version__}; {report['steps_profiled']} steps "
        "profiled per variant",
        "",
        "| variant | device ms/step (p10, median, p90) | ops/step | busy us/step | gaps us/step |",
        "|---|---|---:|---:|---:|",
    ]
    for name, row in report["variants"].items():
        lines.append(f"| {name} | {row['device_ms_per_step_p10']:.4f}, {row['device_ms_per_step_median']:.4f}, "
                     f"{row['device_ms_per_step_p90']:.4f} | {row['operations_per_step']:.1f} | "
                     f"{row['busy_us_per_step']:.1f} | {row['gap_us_per_step']:.1f} |")
    lines += ["", "Behind a GPU sleep (one repetition; gaps of 50 us or more mean the GPU waited for the host):", "",
              "| variant | span us/step | busy us/step | short gaps us/step | long gaps us/step |",
              "|---|---:|---:|---:|---:|"]
    for name, row in report["variants"].items():
        b = row["behind_sleep"]
        lines.append(f"| {name} | {b['span_us_per_step']:.1f} | {b['busy_us_per_step']:.1f} | "
                     f"{b['short_gap_us_per_step']:.1f} | {b['long_gap_us_per_step']:.1f} |")
    plain_pairs, auto_pairs = plain["behind_sleep"]["gaps_by_pair"], auto["behind_sleep"]["gaps_by_pair"]

    def gap_delta(pair: str) -> float:
        return auto_pairs.get(pair, 0.0) - plain_pairs.get(pair, 0.0)

    copy_span = plain["behind_sleep"]["copy_span_us_per_step"]
    lines += ["", f"Copies' span per step in plain behind the sleep: {copy_span:.1f} us (the case's measure, "
              f"`copy_ms`, in this process: {report['case_copy_us']:.1f} us; the GPU waited "
              f"{report['case_copy_host_wait_us']:.0f} us for the host there).",
              "", "Short gaps by neighbouring operations (us per step), largest differences first:", "",
              "| before -> after | plain | auto | auto - plain |", "|---|---:|---:|---:|"]
    for pair in sorted(set(plain_pairs) | set(auto_pairs), key=lambda p: -abs(gap_delta(p)))[:16]:
        lines.append(f"| `{pair}` | {plain_pairs.get(pair, 0.0):.2f} | {auto_pairs.get(pair, 0.0):.2f} | "
                     f"{gap_delta(pair):+.2f} |")
    for name, row in report["variants"].items():
        if "host_profile" not in row:
            continue
        host = row["host_profile"]
        profiled = host["us_per_step_profiled"]
        lines += ["", f"Host profile of {name} (cProfile, {profiled:.0f} us per step under it):", "",
                  "| function | calls/step | own us/step | total us/step |", "|---|---:|---:|---:|"]
        lines += [f"| `{f['function']}` | {f['calls_per_step']:.1f} | {f['own_us_per_step']:.1f} | "
                  f"{f['total_us_per_step']:.1f} |" for f in host["functions"]]
    lines += ["", "| kernel | plain us/step | auto us/step | auto - plain | plain n/step | auto n/step |",
              "|---|---:|---:|---:|---:|---:|"]
    names = set(plain["kernels"]) | set(auto["kernels"])
    empty = {"us_per_step": 0.0, "per_step": 0.0}

    def delta(name: str) -> float:
        return auto["kernels"].get(name, empty)["us_per_step"] - plain["kernels"].get(name, empty)["us_per_step"]

    for name in sorted(names, key=lambda n: -abs(delta(n))):
        a, b = plain["kernels"].get(name, empty), auto["kernels"].get(name, empty)
        lines.append(f"| `{name[:110]}` | {a['us_per_step']:.2f} | {b['us_per_step']:.2f} | {delta(name):+.2f} | "
                     f"{a['per_step']:.2f} | {b['per_step']:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
