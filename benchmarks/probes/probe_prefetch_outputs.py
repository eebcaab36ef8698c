"""Probe: ResNet-50 d0.1 CPU forwards on N threads; the direct kernel prefetching each channel's output rows for
writing (and its residual rows for reading) before the channel's passes (B, C) against the kernel as it is (A)."""
import statistics
import sys
import time

import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from benchmarks.cases.sparse_cpu import _rescale, resnet50
from tendril.sparse import convert, prune
from tendril.sparse.ops.conv.cpu import prepared as P
from tendril.sparse.ops.cpu_kernels import _at, write_band


def _prefetch(rw):
    @intrinsic
    def prefetch(typingctx, arr, idx):
        sig = types.void(arr, idx)

        def codegen(context, builder, signature, args):
            aryty = signature.args[0]
            ary = context.make_array(aryty)(context, builder, args[0])
            ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]], wraparound=False)
            i32 = ir.IntType(32)
            signature_type = ir.FunctionType(ir.VoidType(), [ptr.type, i32, i32, i32])
            fn = cgutils.get_or_insert_function(builder.module, signature_type, "llvm.prefetch.p0")
            builder.call(fn, [ptr, ir.Constant(i32, rw), ir.Constant(i32, 3), ir.Constant(i32, 1)])
            return context.get_dummy_value()
        return sig, codegen
    return prefetch


prefetch_write, prefetch_read = _prefetch(1), _prefetch(0)


def make_kernel(read_residual):
    @njit(parallel=True, fastmath=True)
    def conv_direct_pf(out, residual, planes, band_counts, out_at, out_row, out_h, out_w, bias, relu, values, base,
                       k_ptr, reach, row, band_rows, k_starts, vector):
        bands = (out_h + band_rows - 1) // band_rows
        k_blocks = k_starts.shape[0] - 1
        has_residual = residual.shape[0] > 0
        flat_residual = residual.reshape(-1)
        counted = band_counts.shape[0] > 0
        for unit in prange(bands * k_blocks):
            band, kb = unit // k_blocks, unit % k_blocks
            y0 = band * band_rows
            rows = min(band_rows, out_h - y0)
            t0 = y0 * row
            rounded = -(-rows * row // vector) * vector
            acc = np.empty(-(-band_rows * row // vector) * vector, dtype=np.float32)
            for k in range(k_starts[kb], k_starts[kb + 1]):
                target = out[k]
                for yy in range(rows):
                    at = out_at + (y0 + yy) * out_row
                    for x in range(0, out_w, 16):
                        prefetch_write(target, np.uint64(at + x))
                    if read_residual and has_residual:
                        r_at = k * out_h * out_w + (y0 + yy) * out_w
                        for x in range(0, out_w, 16):
                            prefetch_read(flat_residual, np.uint64(r_at + x))
                m = rounded if reach[k] + t0 + rounded <= planes.shape[0] else rows * row
                acc[:m] = 0
                i, last = k_ptr[k], k_ptr[k + 1]
                while i + 8 <= last:
                    b0, b1, b2, b3 = _at(base[i], t0), _at(base[i + 1], t0), _at(base[i + 2], t0), _at(base[i + 3], t0)
                    b4, b5, b6, b7 = _at(base[i + 4], t0), _at(base[i + 5], t0), _at(base[i + 6], t0), _at(base[i + 7], t0)  # noqa: E501
                    w0, w1, w2, w3 = values[i], values[i + 1], values[i + 2], values[i + 3]
                    w4, w5, w6, w7 = values[i + 4], values[i + 5], values[i + 6], values[i + 7]
                    for q in range(np.uint64(m)):
                        low = (w0 * planes[b0 + q] + w1 * planes[b1 + q]) + (w2 * planes[b2 + q] + w3 * planes[b3 + q])
                        high = (w4 * planes[b4 + q] + w5 * planes[b5 + q]) + (w6 * planes[b6 + q] + w7 * planes[b7 + q])
                        acc[q] += low + high
                    i += 8
                if i < last:
                    b0, b1, b2, b3 = _at(base[i], t0), _at(base[i + 1], t0), _at(base[i + 2], t0), _at(base[i + 3], t0)
                    w0, w1, w2, w3 = values[i], values[i + 1], values[i + 2], values[i + 3]
                    for q in range(np.uint64(m)):
                        low = w0 * planes[b0 + q] + w1 * planes[b1 + q]
                        acc[q] += low + (w2 * planes[b2 + q] + w3 * planes[b3 + q])
                written = write_band(target, out_at, out_row, out_w, acc, bias[k], flat_residual, k * out_h * out_w,
                                     has_residual, relu, y0, rows, row)
                if counted:
                    band_counts[band, k] = written
    return conv_direct_pf


class Wrapped:
    def __init__(self, direct, kernel):
        self.direct, self.kernel, self.bands = direct, kernel, direct.bands

    def run(self, out, residual, planes, band_counts=P.kernel.NOT_COUNTED):
        self.kernel(out, residual, planes, band_counts, *self.direct.arguments)


threads = int(sys.argv[1]) if len(sys.argv) > 1 else 16
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 41
torch.manual_seed(0)
model = resnet50().eval()
prune(model, 0.1)
_rescale(model, 0.1)
x = torch.randn(1, 3, 224, 224)
variants = {"A": None, "B": make_kernel(True), "C": make_kernel(False)}
with torch.no_grad():
    nets = {name: convert(model, x) for name in variants}
    for name, net in nets.items():
        net.set_backend("cpu", threads)
        net(x)
        if variants[name] is not None:
            for prep in net.state.prepared.values():
                if isinstance(prep, P.PreparedConv):
                    prep.direct = Wrapped(prep.direct, variants[name])
    ref = nets["A"](x).clone()
    for name, net in nets.items():
        print(name, "maxdiff", float((net(x) - ref).abs().max()), flush=True)
    times = {name: [] for name in nets}
    order = list(nets)
    for i in range(reps):
        for name in order[i % 3:] + order[: i % 3]:
            start = time.perf_counter()
            nets[name](x)
            times[name].append((time.perf_counter() - start) * 1e3)
    for name, t in times.items():
        t.sort()
        print(f"{name} threads={threads}: median {statistics.median(t):.3f} p10 {t[len(t)//10]:.3f} min {t[0]:.3f}")
