"""Mapped page-locked host memory: one allocation seen as a CPU tensor and as a CUDA tensor.

`MappedHostMemory(nbytes, device)` allocates with `cudaHostAlloc(cudaHostAllocMapped)` (plain cached memory,
not write-combined, so host reads stay cheap) and takes its device address from `cudaHostGetDevicePointer`.
`host_view` and `device_view` are tensors over the same bytes: a kernel writing through the device view
stores straight into host memory over the bus, with no copy and no synchronization, so a host thread can
watch the bytes change while the kernel (or a CUDA graph) runs. The CUDA programming guide's "Mapped Memory"
section (under "Page-Locked Host Memory") states the contract: such memory is shared, and what the host
reads while the device writes is only ordered by what the device's stores themselves guarantee.

The memory is freed when the last view is gone (each view keeps this object alive).
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import torch

from tendril.cuda.runtime import check

_TYPESTR = {torch.int64: "<i8", torch.int32: "<i4"}


def _free(host_pointer: int) -> None:
    from cuda.bindings import runtime

    runtime.cudaFreeHost(host_pointer)


class MappedHostMemory:
    """`nbytes` of page-locked host memory mapped into `device`'s address space."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        from cuda.bindings import runtime

        if device.type != "cuda":
            raise ValueError(f"mapped host memory is for CUDA devices, got {device}")
        self.nbytes = nbytes
        self.device = device
        with torch.cuda.device(device):  # the allocation is mapped into this device's (primary) context
            check(runtime.cudaSetDevice(torch.cuda.current_device()), "cudaSetDevice")
            self.host_pointer = int(check(runtime.cudaHostAlloc(nbytes, runtime.cudaHostAllocMapped),
                                          "cudaHostAlloc"))
            weakref.finalize(self, _free, self.host_pointer)
            self.device_pointer = int(check(runtime.cudaHostGetDevicePointer(self.host_pointer, 0),
                                            "cudaHostGetDevicePointer"))

    def host_view(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole allocation as a 1-D CPU tensor of `dtype` (int64 or int32)."""
        return torch.from_numpy(np.asarray(_HostArray(self, dtype)))

    def device_view(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole allocation as a 1-D tensor on `self.device`; kernels writing it store into host memory."""
        view = torch.as_tensor(_DeviceArray(self, dtype), device=self.device)
        if view.data_ptr() != self.device_pointer:
            raise RuntimeError(f"torch copied the mapped memory instead of viewing it (on {view.device})")
        return view


def _describe(memory: MappedHostMemory, pointer: int, dtype: torch.dtype) -> dict[str, Any]:
    itemsize = torch.empty((), dtype=dtype).element_size()
    return {"shape": (memory.nbytes // itemsize,), "typestr": _TYPESTR[dtype], "data": (pointer, False),
            "strides": None, "version": 3}


class _HostArray:
    """NumPy's view of the memory; the array keeps this object, and so the memory, alive."""

    def __init__(self, memory: MappedHostMemory, dtype: torch.dtype) -> None:
        self.memory = memory
        self.__array_interface__ = _describe(memory, memory.host_pointer, dtype)


class _DeviceArray:
    """torch's CUDA view of the memory; the tensor keeps this object, and so the memory, alive."""

    def __init__(self, memory: MappedHostMemory, dtype: torch.dtype) -> None:
        self.memory = memory
        self.__cuda_array_interface__ = _describe(memory, memory.device_pointer, dtype)
