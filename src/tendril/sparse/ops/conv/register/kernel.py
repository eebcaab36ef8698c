"""Register-tiled sparse-weight convolution in CUDA C++ (NVRTC): compile and launch the kernel of
`source.py` (`sparse_weight_conv.cu`), the dataflow of `tiling.py`.

The kernel reads the layer's dense input (no compression pass), writes a fresh output with bias,
residual and ReLU fused, and, in the blocks of each group's first k-block, counts the nonzero
inputs of the tile's share of the input plane (`counts`, summed for `SparseNetwork.layers`). Each
plan (`RegisterTilePlan`) compiles to its own specialised kernel (`source.compile_options`),
cached by NVRTC; `precompile` compiles many plans in parallel worker processes. Launches never sync
with the host, so a network using it replays inside a CUDA graph. The CPU mirror of the exact
algorithm is `emulation.py`.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tendril.sparse.format import SparseConvWeights
from tendril.sparse.ops.conv.register.source import KERNEL_NAME, compile_options, source
from tendril.sparse.ops.conv.register.tiling import RegisterTilePlan, RowMaskWeights

if TYPE_CHECKING:
    from tendril.cuda.nvrtc import Kernel


_KERNELS: dict[tuple[str, ...], Kernel] = {}


def precompile(
    plans: Sequence[RegisterTilePlan], workers: int | None = None, capability: tuple[int, int] | None = None
) -> int:
    """Compile the kernels of `plans` in parallel worker processes, into the NVRTC disk cache that `conv`
    then loads from (each plan is its own fully unrolled kernel, seconds of ptxas each), for `capability`
    (default: the current device's). Plans already loaded in this process are skipped; returns how many
    kernels were compiled. Raises when a worker fails. Does nothing useful when the cache directory is not
    writable (`conv` then compiles each kernel on first use).

    The workers are fresh interpreters (`python -c`), not multiprocessing children, so nothing of the
    caller's `__main__` runs again in them; they use NVRTC only, never CUDA."""
    options = sorted({compile_options(p) for p in plans} - set(_KERNELS))
    if len(options) < 2:
        return 0
    capability = capability or torch.cuda.get_device_capability()
    workers = min(workers or os.cpu_count() or 1, len(options))
    package_root = str(Path(__file__).resolve().parents[5])  # the directory that holds `tendril`
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
    code = (
        "import json, sys\n"
        "from tendril.cuda.nvrtc import _cubin\n"
        "from tendril.sparse.ops.conv.register.source import KERNEL_NAME, source\n"
        "job = json.load(sys.stdin)\n"
        "for options in job['options']:\n"
        "    _cubin(source(), KERNEL_NAME, tuple(options), tuple(job['capability']))\n"
    )
    processes = []
    for batch in (options[i::workers] for i in range(workers)):
        process = subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True
        )
        assert process.stdin is not None
        process.stdin.write(json.dumps({"options": batch, "capability": list(capability)}))
        process.stdin.close()
        processes.append(process)
    failures = []
    for process in processes:
        assert process.stderr is not None
        error = process.stderr.read()
        if process.wait() != 0:
            failures.append(error.strip()[-2000:])
    if failures:
        raise RuntimeError(f"precompiling register-tiled kernels failed in {len(failures)} worker(s):\n{failures[0]}")
    return len(options)


def _kernel(plan: RegisterTilePlan) -> Kernel:
    from tendril.cuda.nvrtc import compile_kernel

    options = compile_options(plan)
    kernel = _KERNELS.get(options)
    if kernel is None:
        kernel = _KERNELS[options] = compile_kernel(source(), KERNEL_NAME, options=options)
    return kernel


def compile_for(plan: RegisterTilePlan, arch: str = "sm_90", extra_options: tuple[str, ...] = ()) -> tuple[bytes, str]:
    """Compile the plan's kernel for `arch` without a GPU (NVRTC only): `(cubin, NVRTC log)`.

    For checks and resource reports (`extra_options=("--resource-usage",)` puts the registers,
    spills and shared memory in the log); `conv` compiles for the current device itself.
    """
    from cuda.bindings import nvrtc

    from tendril.cuda.nvrtc import CompileError, _program_log
    from tendril.cuda.runtime import check

    options = (*compile_options(plan), f"--gpu-architecture={arch}", *extra_options)
    program = check(
        nvrtc.nvrtcCreateProgram(source().encode(), f"{KERNEL_NAME}.cu".encode(), 0, [], []), "nvrtcCreateProgram"
    )
    try:
        (err,) = nvrtc.nvrtcCompileProgram(program, len(options), [o.encode() for o in options])
        log = _program_log(program)
        if int(err) != 0:
            raise CompileError(f"NVRTC could not compile {KERNEL_NAME} (options {list(options)}):\n{log}")
        size = check(nvrtc.nvrtcGetCUBINSize(program), "nvrtcGetCUBINSize")
        cubin = b" " * size
        check(nvrtc.nvrtcGetCUBIN(program, cubin), "nvrtcGetCUBIN")
        return cubin, log
    finally:
        nvrtc.nvrtcDestroyProgram(program)


@dataclass
class RegisterConvLayer:
    """One layer's packed weights and the static buffers its launches use (split workspace, tickets,
    per-tile nonzero counts), allocated once so that launches are capturable."""

    weights: RowMaskWeights
    workspace: torch.Tensor
    tickets: torch.Tensor
    counts: torch.Tensor
    """`[groups × splits × tiles]` int32: nonzero inputs each first-k-block tile counted at the last launch."""

    @property
    def plan(self) -> RegisterTilePlan:
        return self.weights.plan

    @classmethod
    def prepare(cls, weights: SparseConvWeights, plan: RegisterTilePlan) -> RegisterConvLayer:
        device = weights.values.device
        g = weights.geometry
        packed = RowMaskWeights.prepare(weights, plan)
        tiles, k_blocks, splits = plan.grid
        workspace_numel = splits * g.out_channels * g.out_hw[0] * g.out_hw[1] if splits > 1 else 1
        return cls(
            packed,
            torch.empty(workspace_numel, device=device),
            torch.zeros(tiles * k_blocks, dtype=torch.int32, device=device),
            torch.zeros(g.groups * splits * tiles, dtype=torch.int32, device=device),
        )


def conv(
    x: torch.Tensor,
    layer: RegisterConvLayer,
    bias: torch.Tensor,
    *,
    residual: torch.Tensor | None = None,
    relu: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`[relu](conv(x, weights) + bias + residual)` for one dense `[C, H, W]` sample, written to `out`
    (a new tensor when None) and returned.

    Also leaves the nonzero count of `x` in `layer.counts` (summed over its entries)."""
    plan = layer.plan
    g = plan.geometry
    if tuple(x.shape) != (g.in_channels, *g.in_hw) or x.dtype != torch.float32 or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous float32 {[g.in_channels, *g.in_hw]} tensor, got {tuple(x.shape)}")
    out_shape = (g.out_channels, *g.out_hw)
    if bias.shape != (g.out_channels,) or bias.dtype != torch.float32 or not bias.is_contiguous():
        raise ValueError(f"bias must be a contiguous float32 [{g.out_channels}] tensor (the kernel is fp32 only)")
    if residual is not None and (
        tuple(residual.shape) != out_shape or residual.dtype != torch.float32 or not residual.is_contiguous()
    ):
        raise ValueError(f"residual must be a contiguous float32 {list(out_shape)} tensor")
    if out is None:
        out = torch.empty(out_shape, device=x.device)
    elif tuple(out.shape) != out_shape or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous float32 {list(out_shape)} tensor")
    packed = layer.weights
    i32 = ctypes.c_int32
    _kernel(plan).launch(
        plan.grid,
        plan.warps * 32,
        [
            out,
            x,
            bias,
            x if residual is None else residual,
            packed.values if packed.values.numel() else bias,
            packed.records,
            packed.chan_ptr,
            layer.workspace,
            layer.tickets,
            layer.counts,
            i32(g.in_hw[0]),
            i32(g.in_hw[1]),
            i32(g.out_hw[0]),
            i32(g.out_hw[1]),
            i32(g.out_channels),
            i32(plan.group_in),
            i32(plan.group_out),
            i32(plan.k_blocks_per_group),
            i32(plan.tiles[1]),
            i32(plan.split_channels),
            i32(int(relu)),
            i32(int(residual is not None)),
        ],
    )
    return out
