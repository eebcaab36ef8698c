"""Figures of the cases where a curve says more than a table: `NAME.png` beside `NAME.json`.

One function per case reads the case's results (the JSON the runner writes) and draws one figure. The runner calls
`write_plot` after writing the JSON when matplotlib is installed (`pip install tendril[bench]`);
`python -m benchmarks plot NAME [--results DIR]` redraws a figure from a committed JSON. A results file names its
case in `case`, so a variant run saved under another name (`sparse-cnn-resnet50.json`) is drawn by its case's
function.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

Result = dict[str, Any]
INSTALL_HINT = "plots need matplotlib: `pip install tendril[bench]`"


def available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def _figure(columns: int = 1, width: float = 7.0) -> tuple[Figure, Any]:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width * columns, 4.2), layout="constrained")
    return figure, figure.subplots(1, columns, squeeze=False)[0]


def _title(result: Result, text: str) -> str:
    return f"{text}\n{result['device']}, torch {result['torch']}"


def _rows(result: Result, metric: str) -> dict[str, dict[str, float]]:
    return {row["variant"]: row for row in result["rows"] if row["metric"] == metric}


def graphs_dynamic_shapes(result: Result) -> Figure:
    """GPT-2 latency against sequence length: eager, a graph per length, tendril's shared pool."""
    figure, (axes,) = _figure()
    by_variant: dict[str, list[tuple[int, dict[str, float]]]] = {}
    for variant, row in _rows(result, "ms_per_call").items():
        match = re.fullmatch(r"(.+) L=(\d+)", variant)
        if match:
            by_variant.setdefault(match[1], []).append((int(match[2]), row))
    for variant, points in by_variant.items():
        points.sort()
        lengths = [length for length, _ in points]
        style = "--" if variant == "tendril" else "-"
        axes.plot(lengths, [row["median"] for _, row in points], style, label=variant, linewidth=1.2)
        axes.fill_between(lengths, [row["p10"] for _, row in points], [row["p90"] for _, row in points], alpha=0.2)
    axes.set(xlabel="sequence length (tokens)", ylabel="ms per call (median, p10-p90)", yscale="log")
    axes.set_title(_title(result, "GPT-2 fp16 forward, batch 1, every length"), fontsize=10)
    axes.legend()
    return figure


def _rolling_median(values: list[float], window: int) -> list[float]:
    import numpy as np

    array = np.asarray(values)
    half = window // 2
    return [float(np.median(array[max(0, i - half) : i + half + 1])) for i in range(len(array))]


def graphs_memory(result: Result) -> Figure:
    """GPT-2 per-call latency against length, dedicated executables against tendril's budgeted cache, growing and
    random orders (dots: each length; lines: a rolling median over 33 lengths; the few calls that waited for an
    executable far longer than the line lie above the axes)."""
    by_length = result["extra"]["GPT-2"]["ms_per_call_by_length"]
    figure, panels = _figure(columns=len(by_length), width=5.5)
    labels = {"b": "(b) an executable per length", "c": "(c) tendril under its memory budget"}
    for axes, (order, variants) in zip(panels, by_length.items(), strict=True):
        highest = 0.0
        for key, per_length in variants.items():
            points = sorted((int(length), ms) for length, ms in per_length.items())
            lengths = [length for length, _ in points]
            times = [ms for _, ms in points]
            dots = axes.plot(lengths, times, ".", markersize=1.5, alpha=0.35)[0]
            medians = _rolling_median(times, 33)
            highest = max(highest, *medians)
            axes.plot(lengths, medians, color=dots.get_color(), label=labels.get(key, key))
        ratio = result["targets"].get(f"latency_overhead_{order}_len")
        axes.set(xlabel="sequence length (tokens)", ylabel="ms per call", ylim=(0, 1.25 * highest))
        axes.set_title(f"{order} lengths" + (f": (c) / (b) = {ratio:.3f}" if ratio else ""), fontsize=10)
        axes.legend(fontsize=8)
    figure.suptitle(_title(result, "GPT-2 fp16, one graph per length 1..1024"), fontsize=10)
    return figure


NETWORK_NAMES = {"alexnet": "AlexNet", "vgg16": "VGG-16", "resnet50": "ResNet-50"}
SPARSE_VARIANTS = {
    "tendril gpu CUDA graph": "tendril",
    "tendril gpu sparse-kernels-only CUDA graph": "tendril, sparse kernels only",
    "dense cuDNN fp32 CUDA graph": "cuDNN fp32",
    "dense cuDNN tf32 CUDA graph": "cuDNN tf32",
    "dense cuDNN fp16 CUDA graph": "cuDNN fp16",
}


def sparse_cnn(result: Result) -> Figure:
    """Per-network speed against cuDNN fp32, every network inside a CUDA graph (higher is faster)."""
    import numpy as np

    times = _rows(result, "ms_per_call")
    networks = [name for name in NETWORK_NAMES if f"{name} dense cuDNN fp32 CUDA graph" in times]
    shown = [(suffix, label) for suffix, label in SPARSE_VARIANTS.items() if f"{networks[0]} {suffix}" in times]
    figure, (axes,) = _figure()
    width = 0.8 / len(shown)
    for index, (suffix, label) in enumerate(shown):
        speedups = [
            times[f"{net} dense cuDNN fp32 CUDA graph"]["median"] / times[f"{net} {suffix}"]["median"]
            for net in networks
        ]
        bars = axes.bar(np.arange(len(networks)) + (index - (len(shown) - 1) / 2) * width, speedups, width, label=label)
        axes.bar_label(bars, fmt="%.2f", fontsize=7)
    axes.axhline(1.0, color="grey", linewidth=0.8)
    axes.set_xticks(range(len(networks)), [NETWORK_NAMES[name] for name in networks])
    axes.set(ylabel="speed relative to cuDNN fp32 (x)")
    axes.set_title(_title(result, "pruned CNNs, batch 1, whole network in a CUDA graph"), fontsize=10)
    axes.legend(fontsize=8)
    return figure


def sparse_conv_kernels(result: Result) -> Figure:
    """Per-layer time relative to cuDNN fp32 against the fraction of multiply-adds left (weight density times input
    activation density): below the line the sparse kernel is faster."""
    layers = next(value for key, value in result["extra"].items() if key.endswith("layers"))
    density = [layer["weight_density"] * layer["activation_density"] for layer in layers]
    figure, (axes,) = _figure()
    for key, label in (("register_best_ms", "register-tiled kernel (best plan)"), ("old_ms", "shared-memory kernel")):
        axes.scatter(density, [layer[key] / layer["cudnn_ms"] for layer in layers], label=label, s=18)
    axes.axhline(1.0, color="grey", linewidth=0.8, label="cuDNN fp32")
    axes.set(
        xlabel="multiply-adds left: weight density x activation density",
        ylabel="time relative to cuDNN fp32",
        yscale="log",
    )
    axes.set_title(_title(result, f"sparse convolution kernels, {len(layers)} layers, fp32"), fontsize=10)
    axes.legend(fontsize=8)
    return figure


SCALING_VARIANTS = {
    "dense cuDNN fp32 CUDA graph": "cuDNN fp32",
    "dense TF32 CUDA graph": "cuDNN TF32",
    "dense cuDNN fp16 channels_last benchmark-mode CUDA graph": "cuDNN fp16 channels_last",
    "tendril fp16 CUDA graph": "tendril fp16",
    "tendril fp16 sparse-kernels-only CUDA graph": "tendril fp16, sparse kernels only",
}


def sparse_scaling(result: Result) -> Figure:
    """Per network, time against weight density for each variant (a variant whose time follows the work falls
    towards the left)."""
    points: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for variant, row in _rows(result, "ms_per_call").items():
        match = re.fullmatch(r"(\w+)_d([0-9.]+) (.+)", variant)
        if match and match[3] in SCALING_VARIANTS:
            points.setdefault((match[1], match[3]), []).append((float(match[2]), row["median"]))
    networks = [name for name in NETWORK_NAMES if any(net == name for net, _ in points)]
    if not networks:
        raise ValueError("sparse-scaling results hold no timed network to plot")
    figure, axes = _figure(columns=len(networks), width=4.6)
    for ax, network in zip(axes, networks, strict=True):
        for suffix, label in SCALING_VARIANTS.items():
            curve = sorted(points.get((network, suffix), []))
            if curve:
                ax.plot([d for d, _ in curve], [ms for _, ms in curve], "o-", label=label, linewidth=1.2, markersize=3)
        ax.set(xlabel="weight density", ylabel="ms per forward (CUDA graph)", title=NETWORK_NAMES[network])
        ax.set_ylim(bottom=0)
    axes[0].legend(fontsize=7)
    figure.suptitle(_title(result, "pruned CNNs, batch 1, 224x224: time against weight density"), fontsize=10)
    return figure


GENERATION_LABELS = {
    "tendril": 'tendril step="eager"',
    "tendril compiled step": 'tendril step="compiled"',
    "tendril fused step": 'tendril step="fused"',
    "tendril eager": 'tendril step="eager"',
    "tendril compiled": 'tendril step="compiled"',
    "tendril fused": 'tendril step="fused"',
}


def generation(result: Result) -> Figure:
    """Tokens per second of each variant, greedy and 4-beam (GPT-2 124M fp16, batch 1, 128 new tokens)."""
    rates = {variant: row["median"] for variant, row in _rows(result, "tok_per_s").items() if "fastest" not in variant}
    modes = sorted({variant.split(" ", 1)[0] for variant in rates}, key=lambda mode: mode != "greedy")
    figure, panels = _figure(columns=len(modes), width=5.0)
    for axes, mode in zip(panels, modes, strict=True):
        variants = sorted(
            (rate, variant.split(" ", 1)[1]) for variant, rate in rates.items() if variant.startswith(f"{mode} ")
        )
        bars = axes.barh(
            [GENERATION_LABELS.get(name, name) for _, name in variants],
            [rate for rate, _ in variants],
            color=["tab:orange" if name.startswith("tendril") else "tab:grey" for _, name in variants],
        )
        axes.bar_label(bars, fmt="%.0f", fontsize=8)
        axes.margins(x=0.15)
        axes.set(xlabel="tokens per second")
        axes.set_title(mode, fontsize=10)
    figure.suptitle(_title(result, "GPT-2 124M fp16 generation, batch 1, 128 new tokens"), fontsize=10)
    return figure


def decode_roofline(result: Result) -> Figure:
    """Per model and search, each variant's decode speed as a fraction of the HBM roofline (1.0: every weight and
    cache byte read once per token at the measured bandwidth)."""
    fractions: dict[str, dict[str, float]] = {}
    for variant, row in _rows(result, "roofline_fraction").items():
        model, mode, name = variant.split(" ", 2)
        if "fastest" not in name:
            fractions.setdefault(f"{model} {mode}", {})[name] = row["median"]
    if not fractions:
        raise ValueError("decode-roofline results hold no roofline fraction to plot")
    figure, panels = _figure(columns=len(fractions), width=3.6)
    for axes, (panel, values) in zip(panels, fractions.items(), strict=True):
        variants = sorted((fraction, name) for name, fraction in values.items())
        bars = axes.barh(
            [GENERATION_LABELS.get(name, name) for _, name in variants],
            [fraction for fraction, _ in variants],
            color=["tab:orange" if name.startswith("tendril") else "tab:grey" for _, name in variants],
        )
        axes.bar_label(bars, fmt="%.2f", fontsize=8)
        axes.axvline(1.0, color="black", linewidth=0.8)
        axes.set(xlim=(0, 1.1), xlabel="fraction of the HBM roofline")
        axes.set_title(panel, fontsize=10)
    figure.suptitle(_title(result, "batch-1 decode against the memory-bandwidth roofline"), fontsize=10)
    return figure


PLOTS: dict[str, Callable[[Result], Figure]] = {
    "graphs-dynamic-shapes": graphs_dynamic_shapes,
    "graphs-memory": graphs_memory,
    "sparse-cnn": sparse_cnn,
    "sparse-conv-kernels": sparse_conv_kernels,
    "sparse-scaling": sparse_scaling,
    "generation": generation,
    "decode-roofline": decode_roofline,
}


def write_plot(result: Result, png_path: Path) -> Path | None:
    """Draw `result`'s figure into `png_path`; None for a case without one."""
    draw = PLOTS.get(result["case"])
    if draw is None:
        return None
    figure = draw(result)
    figure.savefig(png_path, dpi=110)
    return png_path


def plot_file(json_path: Path) -> Path | None:
    """Redraw the figure of a results file: `NAME.json` -> `NAME.png` beside it."""
    return write_plot(json.loads(json_path.read_text()), json_path.with_suffix(".png"))
