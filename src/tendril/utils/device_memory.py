"""Device memory as the driver sees it: everything allocated on the GPU, PyTorch's pools and the driver's own."""

from __future__ import annotations

import gc

import torch


def device_memory_in_use(device: torch.device | str | None = None) -> int:
    """Bytes in use on `device` after freeing what Python and PyTorch's cache hold but no longer need.

    Synchronises and empties PyTorch's cache: for measurements between phases, never on a hot path.
    """
    torch.cuda.synchronize(device)
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return int(total - free)
