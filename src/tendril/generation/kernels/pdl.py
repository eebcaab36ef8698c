"""Programmatic dependent launch (PDL) of the decode kernels: each kernel starts while the one before it runs.

A batch-1 decode step is a long chain of small kernels. Launched plainly, each starts only when the one
before it has finished, so its launch, its first weight loads from memory and the previous kernel's tail are
paid one after the other. On Hopper and later GPUs a kernel launched with
PDL may start as soon as every program of the kernel before it has called `gdc_launch_dependents`
(the fused kernels call it first thing). Its programs then load what no kernel of the step writes (a
projection's first weight tile) and block in `gdc_wait` until the previous kernel has finished and its
writes are visible; everything else, including every store, comes after the wait. Waiting is
transitive (a kernel finishes only after its own wait), so after `gdc_wait` all earlier kernels are done.

The rule that keeps it correct: before `gdc_wait` a kernel writes nothing, and reads only tensors that stay constant
while the step runs (weights, biases, norm gains) or that were written before the step's chain of PDL kernels began:
by an earlier step, or by PyTorch kernels at the head of the step (the slot and position arithmetic, the embedding).
Those launch without PDL: each starts only when every kernel before it has finished and its writes are visible, and
every kernel after the last of them starts after it has started. In the decode loops of `step="fused"` the step
begins instead with `step_inputs_kernel.py`'s kernel, the first of the chain, which reads the loop's state after its
own wait. What any kernel of the chain writes may be read only after the wait. Attention reads before it the cache
slots earlier steps wrote and its slot index: a tensor the PyTorch kernels computed, or the loop's step counter,
which only the loop's copy of its state after the step writes (`attention.py`). CUDA graph capture records the
launches as programmatic edges, so replays keep the overlap.

`enabled(device)` says whether the kernels launch this way: on CUDA devices of compute capability 9.0 or
later, unless `tendril.settings.pdl` is off (`TENDRIL_PDL=0`, for comparisons); `resolve` is what each launch
asks, and never says yes under Triton's interpreter (which has no grid dependency control).
"""

from __future__ import annotations

import functools

import torch
import triton

from tendril import config

MIN_CAPABILITY = (9, 0)
"""Programmatic dependent launch needs Hopper (sm_90) or later."""


@functools.lru_cache(maxsize=16)
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= MIN_CAPABILITY


def enabled(device: torch.device) -> bool:
    """Whether decode kernels on `device` launch with programmatic dependent launch."""
    if device.type != "cuda" or not config.settings.pdl:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capable(index)


def resolve(requested: bool | None, device: torch.device, kernel: object) -> bool:
    """Whether a launch of `kernel` on `device` uses PDL: `requested`, or `enabled(device)` when None; never
    when the kernel runs in Triton's interpreter."""
    wanted = enabled(device) if requested is None else requested
    return wanted and isinstance(kernel, triton.runtime.JITFunction)
