"""Probe: ResNet-50 d0.1 CPU forwards on N threads with numba's OpenMP workers pinned one to a core (B) against
unpinned (A, every worker's mask all CPUs). Pinning is done from inside a parallel region (each worker calls
sched_setaffinity on itself), so neither OpenMP runtime's own binding is involved. Modes alternate in blocks of
forwards (first two of a block discarded), one network, one process."""
import ctypes
import os
import statistics
import sys
import time

import numpy as np
import torch

from benchmarks.cases.sparse_cpu import _rescale, resnet50
from tendril.sparse import convert, prune
from tendril.sparse.ops import cpu_threads

numba = cpu_threads._numba()
libc = ctypes.CDLL(None)
setaff = libc.sched_setaffinity
setaff.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_void_p]
setaff.restype = ctypes.c_int
getcpu = libc.sched_getcpu
getcpu.argtypes = []
getcpu.restype = ctypes.c_int


@numba.njit(parallel=True)
def apply_masks(masks, status, cpus):
    for i in numba.prange(masks.shape[0] * 64):
        tid = numba.get_thread_id()
        status[tid] = setaff(0, masks.shape[1] * 8, masks[tid].ctypes.data)
        cpus[tid] = getcpu()


threads = int(sys.argv[1]) if len(sys.argv) > 1 else 16
blocks = int(sys.argv[2]) if len(sys.argv) > 2 else 12
per_block = int(sys.argv[3]) if len(sys.argv) > 3 else 8
allowed = sorted(os.sched_getaffinity(0))
words = (max(allowed) // 64) + 1
pinned = np.zeros((threads, words), dtype=np.uint64)
free = np.zeros((threads, words), dtype=np.uint64)
for t in range(threads):
    cpu = allowed[t % len(allowed)]
    pinned[t, cpu // 64] |= np.uint64(1) << np.uint64(cpu % 64)
    for c in allowed:
        free[t, c // 64] |= np.uint64(1) << np.uint64(c % 64)
status = np.full(threads, -9, dtype=np.int32)
cpus = np.full(threads, -9, dtype=np.int32)

torch.manual_seed(0)
model = resnet50().eval()
prune(model, 0.1)
_rescale(model, 0.1)
x = torch.randn(1, 3, 224, 224)
print("allowed cpus", allowed, "threads", threads, flush=True)
with torch.no_grad():
    net = convert(model, x)
    net.set_backend("cpu", threads)
    net(x)
    times = {"unpinned": [], "pinned": []}
    main_mask = os.sched_getaffinity(0)
    with cpu_threads.kernel_threads(threads):
        for b in range(blocks):
            mode = "pinned" if b % 2 else "unpinned"
            apply_masks(pinned if mode == "pinned" else free, status, cpus)
            if b < 2:
                print(mode, "status", status.tolist(), "cpus", cpus.tolist(), flush=True)
            for i in range(per_block + 2):
                start = time.perf_counter()
                net(x)
                if i >= 2:
                    times[mode].append((time.perf_counter() - start) * 1e3)
        apply_masks(free, status, cpus)
    os.sched_setaffinity(0, main_mask)
    for name, t in times.items():
        t.sort()
        print(f"{name} threads={threads}: median {statistics.median(t):.3f} p10 {t[len(t)//10]:.3f} min {t[0]:.3f} n={len(t)}")
