"""The markdown report of `profile_sparse_cpu` (its module docstring says what each part measures)."""

from __future__ import annotations

import collections
from typing import Any


def _cell(stats: dict[str, float] | None) -> str:
    return "-" if stats is None else f"{stats['median']:.1f} [{stats['p90']:.1f}]"


def markdown(r: dict[str, Any]) -> str:
    """The report `r` (`profile_sparse_cpu.main`'s) as markdown: the whole forward, the empty region, the layers."""
    threads, left_out = [str(n) for n in r["threads"]], r["threads_left_out"]
    gaps = [int(gap) for gap in r["empty_region"][threads[0]]["region_us"]]
    lines = [
        "# Fixed costs of the sparse CPU engine (`benchmarks.tools.profile_sparse_cpu`)", "",
        f"- command: `{r['command']}`; {r['date']}",
        f"- {r['model']} at weight density {r['density']}, input {r['input']}; threads {r['threads']}"
        + (f" (left out: {left_out}, above numba's pool or --quick's two)" if left_out else ""),
        f"- host: {r['host']}",
        f"- torch {r['torch']}, numba {r['numba']} on the `{r['numba_threading_layer']}` threading layer; "
        f"environment: {r['environment'] or 'no OMP_, GOMP_, KMP_, MKL_ or NUMBA_ variables'}",
        *[f"- {note}" for note in r["notes"]], "",
        "## Whole forward", "",
        "Forward: median wall time untraced; busy threads: process CPU time over wall time (spinning workers count). "
        "The rest is from traced forwards (every kernel call timed): time inside the compiled kernels and outside them "
        "(Python glue, torch ops), the same glue alone (a forward with every kernel stubbed, caches warm), the gap "
        "between consecutive kernel calls (µs, median [p90]), and the empty region's wake-up cost after the measured "
        "gap nearest that gap, times the forward's parallel regions.", "",
        "| threads | forward ms | scaling | busy threads | traced ms | kernel calls | regions | in kernels ms "
        "| outside kernels ms | glue alone ms | gap between calls | wake-up per region µs (after gap µs) "
        "| regions × wake-up ms |",
        "|---:" * 13 + "|",
    ]
    first_ms = r["forward"][threads[0]]["ms"]["median"]
    for n in threads:
        f, w = r["forward"][n], r["forward"][n]["wake_estimate"]
        wake = f"{w['wake_us']} ({w['gap_us']}) | {w['ms']:.3f}" if w else "- | -"
        lines.append(f"| {n} | {f['ms']['median']:.3f} | {first_ms / f['ms']['median']:.2f}× | {f['busy_threads']} "
                     f"| {f['traced_ms']:.3f} | {f['kernel_calls']} | {'-' if f['regions'] is None else f['regions']} "
                     f"| {f['kernel_ms']:.3f} | {f['glue_ms']:.3f} | {f['glue_alone_ms']['median']:.3f} "
                     f"| {_cell(f['gap_us'])} | {wake} |")
    lines += ["", "## Empty parallel region, µs: median [p90]", "",
              "| threads | serial compiled call | "
              + " | ".join(f"region after {g} µs of Python" if g else "region back to back" for g in gaps)
              + " |", "|---:" * (len(gaps) + 2) + "|"]
    for n in threads:
        e = r["empty_region"][n]
        regions = " | ".join(_cell(e["region_us"][str(g)]) for g in gaps)
        lines.append(f"| {n} | {_cell(e['serial_call_us'])} | {regions} |")
    return "\n".join([*lines, *_layer_section(r, threads), *_kernel_section(r, threads)]) + "\n"


def _layer_section(r: dict[str, Any], threads: list[str]) -> list[str]:
    lines = ["", "## Representative layers, µs (median)", "",
              "Each compiled kernel the layer's call runs, called again directly back to back on the same arguments; "
              "the layer's call inside `kernel_threads` (torch on one thread, as in a forward) and alone with torch at "
              "N threads (as `sparse-cpu` times layers); the step and its kernels inside the traced forwards. Scaling: "
              "the first thread count's time over the last's."]
    for layer in r["layers"]:
        rows: dict[str, list[float | None]] = {}
        for i, n in enumerate(threads):
            for label, value in _layer_rows(layer["threads"][n], r["forward"][n], layer["layer"]):
                rows.setdefault(label, [None] * len(threads))[i] = value
        lines += ["", f"### `{layer['layer']}`: {layer['shape']} ({'; '.join(layer['roles'])})", "",
                  "| µs | " + " | ".join(f"{n} threads" for n in threads) + " | scaling |",
                  "|---" + "|---:" * (len(threads) + 1) + "|"]
        for label in sorted(rows, key=lambda label: not label.endswith(" direct")):  # the kernels first
            v = rows[label]
            scaling = f"{v[0] / v[-1]:.2f}×" if v[0] and v[-1] and len(v) > 1 else "-"
            lines.append(f"| {label} | " + " | ".join("-" if x is None else f"{x:.1f}" for x in v) + f" | {scaling} |")
    return lines


def _kernel_section(r: dict[str, Any], threads: list[str]) -> list[str]:
    lines = ["", "## Kernels per traced forward: calls, ms inside", "",
              "| kernel | regions per call | " + " | ".join(f"{n} threads" for n in threads) + " |",
              "|---|---:" + "|---:" * len(threads) + "|"]
    for kernel, regions in r["regions_per_call"].items():
        cells = [r["forward"][n]["by_kernel"].get(kernel) for n in threads]
        if any(cells):
            counts = " | ".join("-" if c is None else f"{c['calls']}, {c['ms']:.3f}" for c in cells)
            lines.append(f"| `{kernel}` | {'-' if regions is None else regions} | {counts} |")
    return lines


def _layer_rows(per: dict[str, Any], forward: dict[str, Any], name: str) -> list[tuple[str, float]]:
    rows, seen = [], collections.Counter[str]()
    for k in per["kernels"]:
        seen[k["kernel"]] += 1
        label = f"`{k['kernel']}`" + (f" #{seen[k['kernel']]}" if seen[k["kernel"]] > 1 else "")
        rows.append((f"{label} direct", k["us"]["median"]))
    step = next(s for s in forward["steps"] if s["step"] == name)
    return [*rows, ("kernels called directly, sum", per["kernels_us"]),
            ("layer call, torch on 1 thread", per["call_us"]["median"]),
            ("layer call, torch at N threads", per["call_torch_at_threads_us"]["median"]),
            ("in a forward: the step", step["us"]),
            ("in a forward: its kernels", round(sum(k["us"] for k in step["kernels"]), 2))]
