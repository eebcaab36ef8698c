"""Every convolution kernel, by name: what `SparseConvStep` dispatches on and what `tune` times (`interface.py`
says what a kernel provides; a new dataflow is a folder here with its `ConvKernel`, added to `KERNELS`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tendril.sparse.ops.conv.cartesian_cuda.dataflow import CARTESIAN_CUDA
from tendril.sparse.ops.conv.cartesian_triton.dataflow import CARTESIAN_TRITON
from tendril.sparse.ops.conv.cpu.dataflow import CPU
from tendril.sparse.ops.conv.dense.dataflow import CUDNN, CUDNN_FUSED, DenseWeightKernel
from tendril.sparse.ops.conv.ell.dataflow import ELL
from tendril.sparse.ops.conv.gemm.dataflow import GEMM
from tendril.sparse.ops.conv.interface import ConvKernel
from tendril.sparse.ops.conv.register.dataflow import REGISTER

if TYPE_CHECKING:
    from tendril.sparse.steps import SparseConvStep

KERNELS: tuple[ConvKernel, ...] = (CARTESIAN_CUDA, CARTESIAN_TRITON, REGISTER, ELL, CUDNN, CUDNN_FUSED, GEMM)
"""The `"cuda"` backend's kernels, in the order `tune` prepares, times and checks them."""
BY_NAME = {kernel.name: kernel for kernel in KERNELS}
DEFAULT_KERNEL = CARTESIAN_CUDA
"""What a GPU layer of an fp32 network runs before `tune` (its copy, `tiled`, is built at conversion)."""
HALF_DEFAULT_KERNEL = CARTESIAN_TRITON
"""What a GPU layer of an fp16 or bf16 network runs before `tune` (`DEFAULT_KERNEL` is fp32 only)."""
BACKEND_KERNELS: dict[str, ConvKernel] = {"triton": CARTESIAN_TRITON, "cpu": CPU}
"""The backends with one kernel for every layer."""
WEIGHT_COPIES = tuple(dict.fromkeys(kernel.reads for kernel in KERNELS if kernel.reads is not None))
"""The layer attributes that hold kernels' own copies of the weights."""
DENSE_KERNELS = tuple(kernel.name for kernel in KERNELS if isinstance(kernel, DenseWeightKernel))
CHECKED_KERNELS = tuple(kernel.name for kernel in KERNELS if kernel.checked)
"""Candidates `tune` admits only once the layer's output agrees with its float64 dense reference."""


def kernel_for(backend: str, name: str) -> ConvKernel:
    """The kernel a layer whose `conv_kernel` is `name` runs under `backend`."""
    if backend in BACKEND_KERNELS:
        return BACKEND_KERNELS[backend]
    if name not in BY_NAME:
        raise ValueError(f"conv kernel {name!r}: expected one of {tuple(BY_NAME)}")
    return BY_NAME[name]


def dense_kernels_for(step: SparseConvStep) -> tuple[str, ...]:
    """The dense kernels that can serve `step`: cuDNN fuses only a ReLU (with the residual); the GEMM takes no
    groups."""
    return tuple(kernel.name for kernel in KERNELS if isinstance(kernel, DenseWeightKernel) and kernel.serves(step))
