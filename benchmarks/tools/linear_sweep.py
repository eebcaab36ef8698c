"""The `--sweep` of `profile_generation`: the fused linear kernel timed over launch configurations for a model's
projection shapes, against cuBLAS (see that tool's docstring)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch

SWEEP_SHAPES: dict[str, list[tuple[Any, ...]]] = {
    # (label, out, in, weight layout, norm ("layer", "rms" or None), activation, residual[, gated: two weights of
    # `out` columns, the activation of the first times the second])
    "gpt2": [
        ("ln_1+c_attn", 2304, 768, "conv1d", "layer", "none", False),
        ("attn.c_proj+res", 768, 768, "conv1d", None, "none", True),
        ("ln_2+c_fc+gelu", 3072, 768, "conv1d", "layer", "gelu_tanh", False),
        ("mlp.c_proj+res", 768, 3072, "conv1d", None, "none", True),
        ("ln_f+lm_head", 50257, 768, "linear", "layer", "none", False),
    ],
    "llama1b": [
        ("norm+qkv", 3072, 2048, "linear", "rms", "none", False),
        ("o_proj+res", 2048, 2048, "linear", None, "none", True),
        ("norm+gate_up", 8192, 2048, "linear", "rms", "silu", False, True),
        ("down_proj+res", 2048, 8192, "linear", None, "none", True),
        ("norm+lm_head", 128256, 2048, "linear", "rms", "none", False),
    ],
}
"""The projections of one decoder layer and the head, per `--model`."""
SWEEP_LAYOUTS = {shape[0]: shape[3] for shapes in SWEEP_SHAPES.values() for shape in shapes}
"""Each swept projection's weight layout in its model."""


def _graph_time_us(fn: Callable[[int], Any], copies: int, launches: int = 24, reps: int = 10) -> float:
    """Microseconds per launch of `fn(copy)` captured `launches` times in one CUDA graph (rotating copies)."""
    for i in range(2):
        fn(i % copies)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(launches):
            fn(i % copies)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * launches)


SWEEP_SIZE = 16
"""Launches timed per shape by `--sweep` besides the default (a Triton compilation each: about 2 minutes in all)."""


def sweep_configs(out_f: int, in_f: int, k_contiguous: bool, rows: int = 1, size: int = SWEEP_SIZE,
                  normed: bool = False, segments: int = 1, sm_count: int | None = None,
                  grid: bool = False) -> list[tuple[int, int, int, int, bool]]:
    """(BLOCK_N, BLOCK_K, SPLIT_K, num_warps, dot) tried by `--sweep` for one shape and row count, the default first,
    for several rows the other path's default (CUDA cores or tensor cores, `launch.launch_config`) second, on
    nn.Linear weights and up to `launch.FEW_ROWS` rows every deep CUDA-core launch (`deep_configs`)
    next, then `size` others drawn
    (with a fixed seed) from the plausible ones (all of them when `size` is larger): tiles of 2-16K elements, at
    least 64 programs, at most 8 tiles a program, K split into whole non-empty shares, on either path for several
    rows. `grid` (several rows): every tensor-core launch of `tensor_core_grid` instead of the drawn ones.
    `sm_count`: the GPU's (None: device 0's)."""
    import random

    from tendril.generation.kernels import launch

    if sm_count is None:
        sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    columns = segments * out_f
    defaults = [launch.launch_config(columns, in_f, rows, k_contiguous=k_contiguous, sm_count=sm_count, normed=normed,
                                     matrices=segments)]
    if rows > 1:
        defaults.append(launch.launch_config(columns, in_f, rows, k_contiguous=k_contiguous, sm_count=sm_count,
                                             normed=normed, dot=not defaults[0].dot, matrices=segments))
    chosen = [(d.block_n, d.block_k, d.split_k, d.num_warps, d.dot) for d in defaults]
    if k_contiguous and rows <= launch.FEW_ROWS:
        chosen += [c for c in deep_configs(in_f, segments, rows) if c not in chosen]
    if grid and rows > 1:
        return [*chosen, *[c for c in tensor_core_grid(in_f, segments) if c not in chosen]]
    pool = []
    for block_n, block_k, split_k, warps, dot in itertools.product((8, 16, 32, 64, 256), (64, 128, 256, 512),
                                                                  (1, 2, 3, 4, 6, 8, 12, 16), (4, 8), (False, True)):
        k_tiles = -(-in_f // block_k)
        programs = -(-out_f // block_n) * split_k
        if (2048 <= block_n * block_k <= 16384 and programs >= 64 and split_k <= k_tiles
                and -(-k_tiles // split_k) <= 8 and k_tiles % split_k == 0
                and (split_k == 1 or -(-out_f // block_n) <= 1024)
                and (not dot or (rows > 1 and block_n >= launch.DOT_MIN))):
            pool.append((block_n, block_k, split_k, warps, dot))
    random.Random(0).shuffle(pool)
    return [*chosen, *[c for c in pool if c not in chosen][:size]]


def tensor_core_grid(in_f: int, segments: int = 1) -> list[tuple[int, int, int, int, bool]]:
    """Every tensor-core launch of 16-64 columns, 32-256 deep, K split 1-8 ways (into at most its tiles), 4 or 8
    warps, holding 1-8K weight elements a tile over its `segments` matrices (`--sweep-grid`)."""
    return [(block_n, block_k, split_k, warps, True)
            for block_n, block_k, split_k, warps in itertools.product((16, 32, 64), (32, 64, 128, 256), (1, 2, 4, 8),
                                                                      (4, 8))
            if 1024 <= block_n * block_k * segments <= 8192 and split_k <= -(-in_f // block_k)]


def deep_configs(in_f: int, segments: int = 1, rows: int = 1) -> list[tuple[int, int, int, int, bool]]:
    """The deep CUDA-core launches around the one-row rule's (`launch._one_row_deep`): shares of one tile over all of
    K or two of half of it, 1-16 columns wide, unsplit, whose products (tiles in flight, every matrix counted, times
    the program's rows: the broadcast product holds one per row) come to at least 4K elements and at most
    `launch.ONE_ROW_TILE` at 4 warps (more spill), twice that at 8. For several rows (beams) they are measured
    against the tensor-core launches, and around the few-row rule's (`launch._few_rows_deep`) for small projections."""
    import triton

    from tendril.generation.kernels import launch

    block_m = min(triton.next_power_of_2(rows), launch.FEW_ROWS)
    configs = []
    top = triton.next_power_of_2(in_f)
    for block_k in (top, top // 2):
        for block_n in (1, 2, 4, 8, 16):
            for warps in (4, 8):
                held = block_m * launch.one_row_held(block_n, block_k, in_f, segments)
                if 4096 <= held <= launch.ONE_ROW_TILE * warps // 4:
                    configs.append((block_n, block_k, 1, warps, False))
    return configs


def _sweep_shape(label: str, out_f: int, in_f: int, layout: str, norm_kind: str | None, activation: str,
                 residual: bool, gated: bool = False, *, rows: int, dtype: torch.dtype, size: int,
                 grid: bool = False) -> dict[str, Any]:
    from tendril.generation.kernels import linear
    from tendril.generation.kernels.layers import Norm, Projection

    device = torch.device("cuda")
    segments = 2 if gated else 1
    copies = max(2, min(64, -(-160 * 2**20 // (segments * out_f * in_f * 2))))
    projections, stacked = [], []  # cuBLAS multiplies a gated projection's two weights as one matrix
    for _ in range(copies):
        w = torch.randn(segments * out_f, in_f, device=device, dtype=dtype) * 0.02
        if layout == "conv1d":
            w = w.t().contiguous().t()  # an [out, in] view of an [in, out] tensor, like Conv1D's
        bias = None if SWEEP_LAYOUTS[label] == "linear" else torch.randn(segments * out_f, device=device,
                                                                            dtype=dtype) * 0.02
        stacked.append((w, bias))
        projections.append(Projection(w.split(out_f), (None,) * segments if bias is None else bias.split(out_f)))
    x = torch.randn(rows, in_f, device=device, dtype=dtype)
    norm_bias = torch.zeros(in_f, device=device, dtype=dtype) if norm_kind == "layer" else None
    norm = None if norm_kind is None else Norm(norm_kind, torch.ones(in_f, device=device, dtype=dtype), norm_bias, 1e-5)
    addends = (torch.randn(rows, out_f, device=device, dtype=dtype),) if residual else ()
    out = torch.empty(rows, out_f, device=device, dtype=dtype)

    def cublas(i: int) -> torch.Tensor:
        return torch.nn.functional.linear(x, *stacked[i])

    expected = linear.fused_linear(x, projections[0], norm=norm, activation=activation, addends=addends, gated=gated)
    element = torch.finfo(dtype).bits // 8
    moved = element * (segments * out_f * in_f + rows * in_f + rows * out_f * (1 + len(addends)))
    entry: dict[str, Any] = {"shape": label, "layout": layout, "rows": rows, "bytes_per_launch": moved,
                             "cublas_us": _graph_time_us(cublas, copies), "configs": []}
    configs = sweep_configs(out_f, in_f, layout == "linear", rows, size, normed=norm is not None, segments=segments,
                            grid=grid)
    for index, (block_n, block_k, split_k, warps, dot) in enumerate(configs):
        def fused(i: int, bn: int = block_n, bk: int = block_k, sk: int = split_k, nw: int = warps,
                  dt: bool = dot) -> torch.Tensor:
            return linear.fused_linear(x, projections[i], norm=norm, activation=activation, addends=addends,
                                       gated=gated, out=out, block_n=bn, block_k=bk, split_k=sk, num_warps=nw, dot=dt)

        config: dict[str, Any] = {"block_n": block_n, "block_k": block_k, "split_k": split_k, "warps": warps,
                                  "dot": dot, "default": index == 0, "other_path_default": rows > 1 and index == 1}
        try:
            config["us"] = _graph_time_us(fused, copies)
            fused(0)
            config["max_abs_diff_vs_default"] = float((out.float() - expected.float()).abs().max())
        except Exception as error:  # a configuration that does not compile is reported
            config["error"] = f"{type(error).__name__}: {error}"[:200]
        entry["configs"].append(config)
    timed = [c for c in entry["configs"] if "us" in c]
    entry["best"] = min(timed, key=lambda c: c["us"]) if timed else None
    return entry


def sweep_linear(model: str = "gpt2", rows: int = 1, size: int = SWEEP_SIZE, layout: str = "model",
                 grid: bool = False, shapes: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """The projection shapes of `model` (those labelled in `shapes`; None: all) swept (`_sweep_shape`); `layout`
    "linear" holds every weight as nn.Linear does (K contiguous), "model" as the model does; `grid` as in
    `sweep_configs`."""
    dtype = torch.float16 if model == "gpt2" else torch.bfloat16
    labels = [shape[0] for shape in SWEEP_SHAPES[model]]
    unknown = sorted(set(shapes or ()) - set(labels))
    if unknown:
        raise ValueError(f"no {model} projection labelled {', '.join(unknown)}; expected some of {', '.join(labels)}")
    results = []
    for label, out_f, in_f, weight_layout, *rest in SWEEP_SHAPES[model]:
        if shapes is not None and label not in shapes:
            continue
        entry = _sweep_shape(label, out_f, in_f, weight_layout if layout == "model" else layout, *rest, rows=rows,
                             dtype=dtype, size=size, grid=grid)
        results.append(entry)
        defaults = {("dot" if c["dot"] else "fma"): c.get("us") for c in entry["configs"]
                    if c["default"] or c["other_path_default"]}
        print(f"sweep {entry['shape']}: cublas {entry['cublas_us']:.2f} us, defaults {defaults}, best {entry['best']}",
              flush=True)
    return results
