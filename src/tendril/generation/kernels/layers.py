"""What the fused decode kernels read from a Hugging Face model: norms and projections as plain tensors.

A `Norm` is a LayerNorm (weight, bias) or an RMSNorm (Llama's: `weight * normalized.to(dtype)`); a
`Projection` is one or more weight matrices whose outputs are concatenated (GPT-2's fused QKV is one
matrix, Llama's q/k/v three). Every weight is held as an `[out, in]` view: `nn.Linear.weight` as it is,
GPT-2's `Conv1D.weight` ([in, out]) transposed, so kernels take any layout through strides. Modules are read
once, when a decode path is built; the tensors are the model's own.

One exception to reading the model's own tensors: a projection whose weights are not K-contiguous (Conv1D) may hold
K-contiguous copies that launches of few rows read instead (`Projection.with_copies`). Those launches run on CUDA
cores over deep tiles, long runs of K per column (`launch.py`), which a column-contiguous layout does not have: one
row always, up to `FEW_ROWS` rows (beams) when the projection is small (`deep_rows`). Launches of more rows (prompts,
many beams) run on tensor cores, and read the model's layout. The copies cost the weights' memory once more, and
follow the model's weights through `Projection.refresh`, which every decode call whose rows read them runs on the
device before its prompt pass. It copies every weight: a version counter would miss writes through `.data`, which do
not move it, and a stale copy would give wrong tokens silently.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

SPLIT_K_LOCKS = 1024
"""Split-K arrival counters each `Projection` holds (the linear kernel splits K only for launches with at most
this many column blocks x row groups: the small ones, where the split is what fills the GPU)."""

FEW_ROWS = 4
"""Rows a program computes together on the CUDA-core path (reading each weight tile once for all of them), and the
most rows a launch on deep CUDA-core tiles takes (`deep_rows`)."""
SMALL_LAUNCH_BYTES_PER_SM = 49152
"""A projection whose 16-bit weights come to fewer bytes per SM than this (GPT-2's layers) is bound by memory latency,
not bandwidth: its time is a few round trips. Its one-row launches narrow their column blocks for more programs per SM
(`launch.SMALL_LAUNCH_PROGRAMS_PER_SM`), and launches of up to `FEW_ROWS` rows take deep CUDA-core tiles too, whose
whole share of the weights loads before the programmatic dependent launch's wait, with no split-K reduction (a
tensor-core launch splits K, and pads the rows to an MMA tile). Larger projections (Llama-1B's layers: 64-500 KB per
SM) keep the widest one-row blocks their registers allow, and tensor cores for several rows."""


def sm_count(device: torch.device) -> int:
    """The SMs a launch on `device` spreads over; 132 off CUDA, where the interpreter runs the kernels."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def is_small(columns: int, in_features: int, element_size: int, sms: int) -> bool:
    """Whether a projection of this shape has 16-bit weights of fewer bytes per SM than `SMALL_LAUNCH_BYTES_PER_SM`."""
    return element_size == 2 and columns * in_features * element_size < SMALL_LAUNCH_BYTES_PER_SM * sms


def deep_rows(columns: int, in_features: int, element_size: int, sms: int) -> int:
    """The most rows whose default launch on K-contiguous weights of this shape takes deep CUDA-core tiles
    (`launch.launch_config`): `FEW_ROWS` for a small projection (`is_small`), otherwise one. The launches of at most
    that many rows are the ones that read a projection's copies."""
    return FEW_ROWS if is_small(columns, in_features, element_size, sms) else 1


ACTIVATIONS = {"none": 0, "gelu_tanh": 1, "gelu": 2, "silu": 3, "relu": 4}
"""Activation codes of the kernels. `gelu_tanh` is HF's `gelu_new`/`gelu_pytorch_tanh` formula."""

HF_ACTIVATIONS = {
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu": "gelu",
    "silu": "silu",
    "swish": "silu",
    "relu": "relu",
}
"""HF `activation_function`/`hidden_act` names -> kernel activations (None: not reproduced)."""


def activation_for(hf_name: str) -> str | None:
    """The kernel activation reproducing HF's `hf_name`, or None when the fused kernels have none."""
    return HF_ACTIVATIONS.get(hf_name)


@dataclass(frozen=True)
class Norm:
    """A normalization over the last dimension applied before a projection."""

    kind: str
    """"layer" (LayerNorm, with bias) or "rms" (RMSNorm as Llama computes it)."""
    weight: torch.Tensor
    bias: torch.Tensor | None
    eps: float

    @classmethod
    def of(cls, module: nn.Module) -> Norm:
        """The norm of an `nn.LayerNorm` or a Llama-style RMSNorm (`weight`, `variance_epsilon` or `eps`)."""
        if isinstance(module, nn.LayerNorm):
            if module.weight is None:
                raise ValueError("LayerNorm without elementwise affine weights is not supported by the fused kernels")
            return cls("layer", module.weight, module.bias, float(module.eps))
        eps = getattr(module, "variance_epsilon", None)
        if eps is None:
            eps = getattr(module, "eps", None)
        weight = getattr(module, "weight", None)
        if eps is None or not isinstance(weight, torch.Tensor) or getattr(module, "bias", None) is not None:
            raise ValueError(f"{type(module).__name__} is neither nn.LayerNorm nor a Llama-style RMSNorm")
        return cls("rms", weight, None, float(eps))


@dataclass(frozen=True)
class Projection:
    """`x -> cat([x @ w.T + b for w, b in segments], -1)`: 1 to 3 weight matrices read through strides."""

    weights: tuple[torch.Tensor, ...]
    """[out_i, in] views, all with the same strides."""
    biases: tuple[torch.Tensor | None, ...]
    copies: tuple[torch.Tensor, ...] | None = None
    """K-contiguous copies of `weights` that launches of at most `copy_rows` rows read instead (module docstring), or
    None."""
    copy_rows: int = field(init=False, compare=False)
    """The most rows whose launches read `copies` (`deep_rows` of this projection); 0 without copies."""
    split_k_counters: torch.Tensor = field(init=False, repr=False, compare=False)
    """int32 [SPLIT_K_LOCKS], zero between launches: the linear kernel's per-block arrival counters when it
    splits K (the last program of a block to arrive reduces the partial sums and resets its counter). Held per
    projection, so launches of different projections never share them; launches of one projection must not
    run concurrently on two streams."""

    def __post_init__(self) -> None:
        if not 1 <= len(self.weights) <= 3 or len(self.biases) != len(self.weights):
            raise ValueError(f"a projection has 1 to 3 weights, each with a bias or None; got {len(self.weights)}")
        first = self.weights[0]
        for w in self.weights[1:]:
            if w.stride() != first.stride() or w.shape[1] != first.shape[1] or w.dtype != first.dtype:
                raise ValueError("the weights of a fused projection must share dtype, input size and strides")
        if len({b is None for b in self.biases}) > 1:
            raise ValueError("the weights of a fused projection must all have a bias or all have none")
        if self.copies is not None and [
            (c.shape, c.dtype, c.device, c.stride(1)) for c in self.copies
        ] != [(w.shape, w.dtype, w.device, 1) for w in self.weights]:
            raise ValueError("weight copies must be K-contiguous tensors of the weights' shapes, dtype and device")
        copy_rows = 0 if self.copies is None else deep_rows(
            self.out_features, self.in_features, first.element_size(), sm_count(first.device))
        object.__setattr__(self, "copy_rows", copy_rows)
        counters = torch.zeros(SPLIT_K_LOCKS, dtype=torch.int32, device=first.device)
        object.__setattr__(self, "split_k_counters", counters)

    @classmethod
    def of(cls, *modules: Any) -> Projection:
        """From `nn.Linear` modules or HF `Conv1D` modules (weight [in, out]), concatenated in order."""
        weights, biases = [], []
        for module in modules:
            weight = module.weight
            if isinstance(module, nn.Linear):
                weights.append(weight)
            elif type(module).__name__ == "Conv1D" and weight.dim() == 2:
                weights.append(weight.t())
            else:
                raise ValueError(f"{type(module).__name__} is neither nn.Linear nor Conv1D")
            biases.append(module.bias)
        return cls(tuple(weights), tuple(biases))

    def with_copies(self) -> Projection:
        """This projection with K-contiguous copies of its weights for launches of few rows (module docstring);
        itself when its weights are K-contiguous already."""
        if self.weights[0].stride(1) == 1:
            return self
        return Projection(self.weights, self.biases, tuple(w.contiguous() for w in self.weights))

    def weights_for(self, rows: int) -> tuple[torch.Tensor, ...]:
        """The weights a launch of `rows` rows reads: the copies for at most `copy_rows` rows."""
        return self.copies if self.copies is not None and rows <= self.copy_rows else self.weights

    def refresh(self, rows: int) -> None:
        """Copy the weights into the copies if launches of `rows` rows read them (`weights_for`); capturable:
        device copies only. Under inference mode, since the copies may be inference tensors (built under
        `generate`)."""
        if self.copies is None or self.weights_for(rows) is not self.copies:
            return
        with torch.inference_mode():
            for weight, copy in zip(self.weights, self.copies, strict=True):
                copy.copy_(weight)

    @property
    def in_features(self) -> int:
        return int(self.weights[0].shape[1])

    @property
    def out_sizes(self) -> tuple[int, ...]:
        return tuple(int(w.shape[0]) for w in self.weights)

    @property
    def out_features(self) -> int:
        return sum(self.out_sizes)
