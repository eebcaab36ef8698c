"""Memory shared by all graphs of one callable: placeholders and the graph pool.

Placeholders. Each tensor argument position (leaf index, dtype, device) has one buffer; the
placeholder of every key is a contiguous view of its first `numel` elements, so the inputs of all
shapes share storage. Capturing a larger shape than the buffer holds allocates a new buffer at least
twice the old size (graphs captured earlier keep the old one), so lazily growing shapes allocate
O(log n) buffers; ahead-of-time `capture([...])` goes largest first and allocates each buffer once.

Graph pool. All graphs of a callable are captured into one private pool (one per device). PyTorch's
allocator hands a capture the pool's free blocks first, so a graph captured after a larger one
finds the larger one's intermediates already free and reuses them: the pool grows to the size of the
largest graph rather than the sum (Grape's memory tape; vLLM and CUDA-graph trees do the same).
That alone leaves every graph's *outputs* allocated, and the outputs of hundreds of shapes add up
(GPT-2's logits at length 256 are 25 MiB). So after capture, `release_outputs` re-creates the
outputs as tensors that point at the same device memory without owning it, and drops the originals:
the allocator sees the blocks as free, the next capture reuses them, and all graphs' outputs share
memory. The price is the lifetime rule documented on `GraphedCallable`: outputs stay valid until the
callable's next call. Pool blocks are never returned to the device while any graph of the pool is
alive, so the non-owning outputs never dangle while the callable lives.

Executables. Each instantiated graph also holds driver memory outside the pool; under a budget
(`GraphMemoryPolicy.budget`; `parse_bytes` reads "256MiB") that memory is managed by
`tendril.graphs.executables`. `host_resident_bytes` bounds the host memory the kept graphs take.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from tendril.graphs.key import TensorSpec


@dataclass
class PlaceholderArena:
    """One growing buffer per argument position; placeholders are views of it."""

    buffers: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = field(default_factory=dict)
    retired_bytes: int = 0
    """Bytes of outgrown buffers still held by graphs captured before they grew."""

    def placeholder(self, position: int, spec: TensorSpec, example: torch.Tensor | None = None) -> torch.Tensor:
        """A contiguous view of the buffer for `position`, shaped as `spec` (growing the buffer if needed).

        Placeholders are ordinary (non-inference) tensors so their version counter reveals whether the
        captured function wrote into its inputs.
        """
        slot = (position, spec.dtype, spec.device)
        buffer = self.buffers.get(slot)
        if buffer is None or buffer.numel() < spec.numel:
            capacity = spec.numel if buffer is None else max(spec.numel, 2 * buffer.numel())
            if buffer is not None:
                self.retired_bytes += buffer.numel() * buffer.element_size()
            with torch.inference_mode(False):
                buffer = torch.empty(max(capacity, 1), dtype=spec.dtype, device=spec.device)
            self.buffers[slot] = buffer
        with torch.inference_mode(False), torch.no_grad():
            view = buffer[: spec.numel].view(spec.shape)
            if example is not None:
                view.copy_(example)
        return view

    def reserve(self, position: int, spec: TensorSpec) -> None:
        """Make the buffer for `position` large enough for `spec` (before capturing smaller shapes)."""
        self.placeholder(position, spec)

    @property
    def nbytes(self) -> int:
        live = sum(buffer.numel() * buffer.element_size() for buffer in self.buffers.values())
        return live + self.retired_bytes


def non_owning(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor viewing the same memory as `tensor` that does not keep that memory allocated."""
    storage = tensor.untyped_storage()
    alias = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), tensor.device, storage.nbytes())
    with torch.inference_mode(False), torch.no_grad():
        out = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        out.set_(alias, tensor.storage_offset(), tensor.shape, tensor.stride())
    return out


def release_outputs(outputs: Any) -> Any:
    """`outputs` with every tensor replaced by a non-owning view of its memory (see the module docstring).

    The caller must drop every other reference to the original tensors for their blocks to return
    to the pool.
    """
    return pytree.tree_map_only(torch.Tensor, non_owning, outputs)


def pool_reserved_bytes(device: torch.device) -> int:
    """Bytes PyTorch's allocator holds on `device` (all pools); deltas across a capture give its pool growth."""
    return int(torch.cuda.memory_reserved(device))


def device_free_bytes(device: torch.device) -> int:
    """Free device memory as the driver reports it (cudaMemGetInfo); deltas give the driver's own allocations."""
    free, _ = torch.cuda.mem_get_info(device)
    return int(free)


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
}


def parse_bytes(value: int | str | None) -> int | None:
    """A byte count from an int or a string such as "256MiB", "1.5 GiB" or "512MB" (None stays None)."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError("a memory size must be an int or a string such as '256MiB', not a bool")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a memory size must be >= 0 bytes, got {value}")
        return value
    if not isinstance(value, str):
        raise TypeError(f"a memory size must be an int or a string such as '256MiB', got {type(value).__name__}")
    text = value.strip().lower().replace(" ", "")
    digits = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(digits) :]
    if unit not in _UNITS or not digits:
        raise ValueError(f"cannot read {value!r} as a memory size: write e.g. '256MiB', '1.5GiB', '512MB' or an int")
    try:
        amount = float(digits)
    except ValueError:
        raise ValueError(f"cannot read {value!r} as a memory size: write e.g. '256MiB' or an int") from None
    if amount < 0:
        raise ValueError(f"a memory size must be >= 0 bytes, got {value!r}")
    return int(amount * _UNITS[unit])


def host_resident_bytes() -> int | None:
    """This process's resident host memory (Linux /proc/self/statm), or None where it cannot be read.

    Deltas around a capture bound the host memory a kept CUDA graph holds (from above: they also
    count whatever else Python allocated meanwhile)."""
    try:
        with open("/proc/self/statm") as statm:
            resident_pages = int(statm.read().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    import os

    return resident_pages * os.sysconf("SC_PAGE_SIZE")
