"""What every convolution dataflow implements, so that layers, `tune` and `release_unused_kernels` treat them
alike (`registry.py` lists them).

A `ConvKernel` runs a whole layer (`SparseConvStep`) on a batch, with bias, residual and ReLU. Most read a copy of
the weights in their own order, built once from the compressed weights and held on the layer in the attribute
named by `reads`, so the layer can drop the copies its chosen kernel does not read. `variants` is how `tune`
sees a kernel: each variant carries the copy it reads (one per plan, say) and a call that runs it on the layer's
real input; `tune` times every variant and keeps the fastest variant's copy on the layer.

`dtypes` says which network dtypes (the dtype of the layer's values and activations) a kernel runs: `tune` skips a
kernel for a network of another dtype, recording why (`SparseNetwork.rejected_kernels`), and a layer forced onto
it raises. Every kernel accumulates in fp32 and returns the network's dtype.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tendril.sparse.activations import CompressedActivations

if TYPE_CHECKING:
    from tendril.sparse.steps import RunState, SparseConvStep
    from tendril.sparse.tuning import KernelTuner


@dataclass(frozen=True)
class TuneSample:
    """One layer's first input sample as `tune` times the candidates on it."""

    dense_input: torch.Tensor
    """`[C, H, W]`, contiguous."""
    residual: torch.Tensor | None
    """`[K, OH, OW]`, contiguous, for layers with a fused residual add."""
    init: torch.Tensor
    """A `[K, OH, OW]` accumulator the compressed-input kernels convolve into (its values do not matter)."""
    state: RunState


@dataclass(frozen=True)
class Variant:
    """One way `tune` can run a kernel on a layer: the weight copy it reads (None: the compressed weights) and
    a call that runs it on the `TuneSample`."""

    copy: object | None
    run: Callable[[], object]


class ConvKernel(ABC):
    """One convolution dataflow under the `"cuda"` backend (or a backend's only one, `registry.BACKEND_KERNELS`)."""

    name: str
    """What `SparseConvStep.conv_kernel` holds and `SparseNetwork.kernel_times` records."""
    reads: str | None = None
    """The layer attribute holding the weight copy this kernel reads; None: the compressed weights only."""
    checked: bool = False
    """Whether `tune` admits it only once the layer's output agrees with its float64 reference (a kernel that
    fails to build or run is then rejected, not an error)."""
    kept_after_tune: bool = True
    """Whether `tune` keeps this kernel's copy when another kernel wins (False: cheap to rebuild, dropped)."""
    dtypes: tuple[torch.dtype, ...] = (torch.float32,)
    """The network dtypes this kernel runs (values and activations in that dtype; accumulation in fp32)."""

    def unsupported_dtype(self, dtype: torch.dtype) -> str | None:
        """Why this kernel cannot run a network of `dtype` (None: it can)."""
        if dtype in self.dtypes:
            return None
        supported = ", ".join(str(d).removeprefix("torch.") for d in self.dtypes)
        return f"the {self.name} kernel runs {supported} only, not {str(dtype).removeprefix('torch.')}"

    @abstractmethod
    def run(
        self, step: SparseConvStep, x: torch.Tensor, residual: torch.Tensor | None, state: RunState
    ) -> torch.Tensor:
        """The layer's output for the dense batch `x` (`[N, C, H, W]`) and its `residual` (None when not fused)."""

    def variants(self, step: SparseConvStep, sample: TuneSample, tuner: KernelTuner) -> list[Variant]:
        """The variants `tune` times on `step`, their copies prepared (none: not a candidate for this layer)."""
        return []

    def before_tune(self, tuner: KernelTuner) -> None:
        """Work done once per `tune`, before any layer (e.g. compiling every layer's kernels at once); none by
        default."""
        return None

    def held_copy(self, step: SparseConvStep) -> object | None:
        """The part of `step`'s copy for this kernel that counts as weights in `held_bytes` (not workspaces)."""
        return None if self.reads is None else getattr(step, self.reads)


class CompressedInputKernel(ConvKernel):
    """A kernel that reads compressed activations: each sample is compressed for the layer, then convolved into
    an fp32 accumulator that starts as bias (+ the residual), cast to the input's dtype at the end (no copy for
    fp32)."""

    @abstractmethod
    def convolve(
        self, step: SparseConvStep, acts: CompressedActivations, init: torch.Tensor, state: RunState
    ) -> torch.Tensor:
        """`init + conv(acts)`, then the layer's ReLU, for one sample (`init` is fp32, and so is the result)."""

    def run(
        self, step: SparseConvStep, x: torch.Tensor, residual: torch.Tensor | None, state: RunState
    ) -> torch.Tensor:
        g = step.weights.geometry
        outputs = []
        for b in range(x.shape[0]):
            acts = state.compress(step.name, x[b], step.layout)
            init = step.bias.float().view(-1, 1, 1).expand(g.out_channels, *g.out_hw)
            init = (init + residual[b].float()) if residual is not None else init.contiguous()
            outputs.append(self.convolve(step, acts, init, state).to(x.dtype))
        return batched(outputs)

    def variants(self, step: SparseConvStep, sample: TuneSample, tuner: KernelTuner) -> list[Variant]:
        """One variant, timed as the layer runs: the input is compressed first."""

        def compress_and_convolve() -> object:
            acts = sample.state.compress(step.name, sample.dense_input, step.layout)
            return self.convolve(step, acts, sample.init, sample.state)

        return [Variant(self.held_copy(step), compress_and_convolve)]


def batched(samples: list[torch.Tensor]) -> torch.Tensor:
    """One output per sample stacked into a batch (a view, not a copy, for the batch of one the engine is built for)."""
    return samples[0].unsqueeze(0) if len(samples) == 1 else torch.stack(samples)
