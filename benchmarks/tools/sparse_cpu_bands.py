"""How the split of the sparse CPU engine's direct convolution into bands of output rows changes its time on threads.

The direct kernel's work units are (band of output rows, block of output channels), shared out statically. A layer's
bands are as tall as its accumulators allow, so on ResNet-50 every convolution below 56×56 has one band: its units
are output-channel blocks, and every thread reads the whole of the layer's input planes, which the fill before it has
just written from every thread's cache. More bands give each thread fewer rows of the planes (and their halo) to read.

For each convolution of `profile_sparse_cpu`'s representative layers that runs the direct kernel, at each thread
count: the direct kernel alone (back to back, its planes read-only and cached) and after the layer's own kernels
before it (the fill or count, as in a forward), for the plan's split and for about `BAND_FACTORS` × threads bands.
Every split's output is checked to be bit-identical to the plan's.

    PYTHONPATH=src:. python3 -m benchmarks.tools.sparse_cpu_bands --out OUT [--threads 2,16] [--quick]

`--quick`: `profile_sparse_cpu`'s small network, few repetitions, at most 2 threads. Writes OUT/sparse_cpu_bands.json
and .md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numba
import numpy as np
import torch

from benchmarks.tools.profile_sparse_cpu import (
    KernelTrace,
    build,
    host,
    representative_layers,
    samples,
    shape_of,
    thread_counts,
    us_stats,
)
from tendril.sparse.ops import cpu_threads
from tendril.sparse.ops.conv.cpu.kernel import DirectCall
from tendril.sparse.steps import RunState, SparseConvStep

BAND_FACTORS = (0.5, 1, 2)
"""Bands tried per thread (besides the plan's split)."""
REPS = 200
QUICK_REPS = 10


def layer_splits(step: SparseConvStep, args: list[torch.Tensor], threads: int, reps: int) -> list[dict[str, Any]]:
    """The layer's direct kernel at each split (none where the layer takes another dataflow at `threads`)."""
    state = RunState("cpu", threads, torch.zeros(1, dtype=torch.int32))
    trace = KernelTrace()
    with torch.no_grad(), cpu_threads.kernel_threads(threads):
        step.run(args, state)
        with trace.installed():
            step.run(args, state)
        direct = [c for c in trace.calls if c.kernel == "conv_direct"]
        if not direct:
            return []
        before = [c for c in trace.calls if c.kernel != "conv_direct"]
        out, residual, planes = direct[0].run.args[:3]
        prepared = state.prepared[id(step)]
        expected = out.copy()
        rows = []
        for bands in (None, *sorted({max(1, round(f * threads)) for f in BAND_FACTORS})):
            call = DirectCall.of(prepared.plan, prepared.used, prepared.bias_array, step.relu, bands=bands)
            out.fill(np.nan)
            call.run(out, residual, planes)
            if not np.array_equal(out, expected):
                raise AssertionError(f"{step.name}: {call.bands} bands changed the output")

            def after_before(call: DirectCall = call) -> None:
                for kernel in before:
                    kernel.run()
                call.run(out, residual, planes)

            rows.append({
                "split": "the plan's" if bands is None else f"asked for {bands}",
                "bands": call.bands,
                "k_blocks": -(-step.weights.geometry.out_channels // call.arguments[11]),
                "alone_us": us_stats(samples(lambda call=call: call.run(out, residual, planes), reps)),
                "after_before_us": us_stats(samples(after_before, reps)),
            })  # fmt: skip
        return rows


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "# `sparse_cpu_bands`: the direct kernel's split into bands",
        "",
        f"- command: `{report['command']}`",
        f"- date: {report['date']}; host: {report['host']}; numba threading layer: {report['numba_threading_layer']}",
        "",
        "µs, median [p10, p90]: the direct kernel alone, and after the layer's kernels before it (as in a forward).",
    ]
    for layer in report["layers"]:
        lines += ["", f"## `{layer['layer']}`: {layer['shape']}", "",
                  "| threads | bands | got | channel blocks | alone | after the kernels before it |",
                  "|---:|---|---:|---:|---:|---:|"]  # fmt: skip
        for threads, rows in layer["threads"].items():
            for row in rows:
                cells = [threads, row["split"], row["bands"], row["k_blocks"], _cell(row["alone_us"]),
                         _cell(row["after_before_us"])]  # fmt: skip
                lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines) + "\n"


def _cell(stats: dict[str, float]) -> str:
    return f"{stats['median']:.1f} [{stats['p10']:.1f}, {stats['p90']:.1f}]"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--threads", default="2,16", help="thread counts above 1, e.g. 2,4,8,16")
    parser.add_argument("--quick", action="store_true", help="a small network, few repetitions, 2 threads")
    args = parser.parse_args(argv)
    requested = thread_counts(args.threads)
    cpu_threads.kernels()  # numba's pool on the engine's threading layer, before anything parallel runs
    pool = numba.config.NUMBA_NUM_THREADS
    usable = [n for n in requested if 1 < n <= pool and (not args.quick or n <= 2)]
    if not usable:
        raise ValueError(f"--threads {args.threads}: none above 1 fits numba's pool of {pool} threads")
    net, _, layer_inputs = build(args.quick)
    steps = {s.name: s for s in net.steps}
    convs = [name for name in representative_layers(net) if isinstance(steps[name], SparseConvStep)]
    reps = QUICK_REPS if args.quick else REPS
    layers = []
    for name in convs:
        step = steps[name]
        per = {str(n): layer_splits(step, layer_inputs[name], n, reps) for n in usable}
        layers.append({"layer": name, "shape": shape_of(step), "threads": per})
        print(f"{name}: done", flush=True)
    report = {
        "tool": "sparse_cpu_bands",
        "command": " ".join(["python3 -m benchmarks.tools.sparse_cpu_bands", *(argv or sys.argv[1:])]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "quick": args.quick, "threads": usable, "host": host(), "numba": numba.__version__,
        "numba_threading_layer": cpu_threads.threading_layer(), "layers": layers,
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sparse_cpu_bands.json").write_text(json.dumps(report, indent=1))
    (args.out / "sparse_cpu_bands.md").write_text(markdown(report))
    return report


if __name__ == "__main__":
    main()
