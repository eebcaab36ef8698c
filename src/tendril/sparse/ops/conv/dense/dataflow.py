"""cuDNN on the layer's dense pruned weights (the layer's `dense_weight`), in the network's dtype (fp32 networks in
full fp32, never TF32; fp16 and bf16 ones in half with cuDNN's fp32 accumulation), the whole
batch at once, with the algorithm cuDNN measured fastest at `tune` (`benchmarked_shape`): where dense math
measures faster than every sparse kernel, a layer falls back to it (`SparseNetwork.dense_fallback`).

`"dense"`: the convolution with bias, then the residual and ReLU as PyTorch ops; `"dense-fused"` (layers with a
fused ReLU): one cuDNN call for all of it (`cudnn_convolution_relu` / `_add_relu`). `DenseWeightKernel` is what
they share with cuBLAS's `"gemm"` (`ops/conv/gemm`): the copy, its preparation, the math mode and input counting.
The dense copy is cheap to rebuild, so `tune` drops it unless a dense kernel wins.
"""

from __future__ import annotations

import contextlib
import functools
from abc import abstractmethod
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tendril.sparse.ops.conv.interface import ConvKernel, TuneSample, Variant
from tendril.sparse.validation import VALUE_DTYPES

if TYPE_CHECKING:
    from tendril.sparse.steps import RunState, SparseConvStep
    from tendril.sparse.tuning import KernelTuner


@contextlib.contextmanager
def fp32_dense_math(benchmark: bool = False) -> Iterator[None]:
    """cuDNN convolutions and cuBLAS matrix products in full fp32 inside the block (PyTorch lets convolutions, and
    a user's setting matrix products, use TF32), and half ones accumulating in fp32 (no reduced-precision split-K
    reductions); `benchmark`: with the algorithm cuDNN measured fastest for each shape
    (`torch.backends.cudnn.benchmark`), not its heuristic's."""
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    previous = (
        cudnn.allow_tf32,
        cudnn.benchmark,
        matmul.allow_tf32,
        matmul.allow_fp16_reduced_precision_reduction,
        matmul.allow_bf16_reduced_precision_reduction,
    )
    cudnn.allow_tf32, cudnn.benchmark, matmul.allow_tf32 = False, benchmark, False
    matmul.allow_fp16_reduced_precision_reduction = matmul.allow_bf16_reduced_precision_reduction = False
    try:
        yield
    finally:
        cudnn.allow_tf32, cudnn.benchmark, matmul.allow_tf32 = previous[:3]
        matmul.allow_fp16_reduced_precision_reduction, matmul.allow_bf16_reduced_precision_reduction = previous[3:]


class DenseWeightKernel(ConvKernel):
    """A kernel that reads the dense pruned weights: checked by `tune`, timed only with `dense_fallback`."""

    reads = "dense_weight"
    checked = True
    kept_after_tune = False
    dtypes = VALUE_DTYPES

    def serves(self, step: SparseConvStep) -> bool:
        """Whether this kernel can run `step`'s layer."""
        return True

    @abstractmethod
    def compute(
        self, step: SparseConvStep, weight: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> torch.Tensor:
        """The layer's output from the dense `weight` (in the network's dtype), TF32 ruled out."""

    def run(
        self, step: SparseConvStep, x: torch.Tensor, residual: torch.Tensor | None, state: RunState
    ) -> torch.Tensor:
        if step.dense_weight is None:
            raise ValueError(f"{step.name}: the dense kernel was chosen but not prepared; SparseNetwork.tune builds it")
        if state.count_inputs:
            state.last_counts[step.name] = torch.count_nonzero(x[-1]).view(1)
        with fp32_dense_math(benchmark=tuple(x.shape) == step.benchmarked_shape):
            return self.compute(step, step.dense_weight, x, residual)

    def variants(self, step: SparseConvStep, sample: TuneSample, tuner: KernelTuner) -> list[Variant]:
        """The dense copy (shared by every dense kernel), and cuDNN's algorithm search at the sample's shape: the
        first, untimed call of each kernel runs it."""
        if not tuner.net.dense_fallback or not self.serves(step):
            return []
        if step.dense_weight is None:
            step.dense_weight = step.weights.to_dense().to(sample.dense_input.device)
        step.benchmarked_shape = (1, *sample.dense_input.shape)
        residual = None if sample.residual is None else sample.residual[None]
        run = functools.partial(self.run, step, sample.dense_input[None], residual, sample.state)
        return [Variant(step.dense_weight, run)]


class CudnnKernel(DenseWeightKernel):
    """cuDNN's convolution: `fused`, with bias, residual and ReLU in the same call (layers with a ReLU only)."""

    def __init__(self, fused: bool) -> None:
        self.name = "dense-fused" if fused else "dense"
        self.fused = fused

    def serves(self, step: SparseConvStep) -> bool:
        return step.relu or not self.fused

    def compute(
        self, step: SparseConvStep, weight: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> torch.Tensor:
        g = step.weights.geometry
        dilation = (1, 1)
        if self.fused and residual is not None:
            return torch.cudnn_convolution_add_relu(
                x, weight, residual, 1.0, step.bias, g.stride, g.padding, dilation, g.groups
            )
        if self.fused:
            return torch.cudnn_convolution_relu(x, weight, step.bias, g.stride, g.padding, dilation, g.groups)
        y = F.conv2d(x, weight, step.bias, stride=g.stride, padding=g.padding, groups=g.groups)
        if residual is not None:
            y.add_(residual)
        return y.relu_() if step.relu else y


CUDNN = CudnnKernel(fused=False)
CUDNN_FUSED = CudnnKernel(fused=True)
