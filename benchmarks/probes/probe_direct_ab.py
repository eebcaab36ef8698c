"""One-off probe: the sparse CPU engine's direct kernel, a base source tree's against this tree's, per ResNet-50 layer
shape at density 0.1, minimum times of interleaved calls on the same operands (robust to a loaded host).

Variants: `base` (the base tree's kernel: weights padded to a multiple of eight, channel blocks of equal counts, bands
but the last rounded to 64 floats), `new` (this tree), `new16` (this tree, bands rounded to 16 floats), `exact`
(this tree, no band rounded). Usage: `PYTHONPATH=src:. python3 benchmarks/probes/probe_direct_ab.py BASE_SRC THREADS`
with `BASE_SRC` a `git archive` of the base commit's `src` and a fresh `NUMBA_CACHE_DIR` (the base kernels load as a
module numba cannot cache by name)."""

import importlib.util
import sys
import time

import numpy as np
import torch

from tendril.sparse.format import ConvGeometry, SparseConvWeights
from tendril.sparse.ops import cpu_threads
from tendril.sparse.ops.conv.cpu import kernel as K

SHAPES = [(64, 256, 1, 56, True), (64, 64, 1, 56, False), (256, 64, 1, 56, False), (64, 64, 3, 56, False),
          (128, 512, 1, 28, True), (512, 128, 1, 28, False), (128, 128, 3, 28, False),
          (256, 1024, 1, 14, True), (1024, 256, 1, 14, False), (256, 256, 3, 14, False),
          (512, 2048, 1, 7, True), (2048, 512, 1, 7, False), (512, 512, 3, 7, False)]
"""(in channels, out channels, kernel, plane, residual): ResNet-50's convolutions at stride 1."""


def main(base_src: str, threads: int) -> None:
    spec = importlib.util.spec_from_file_location("base_kernels", f"{base_src}/tendril/sparse/ops/cpu_kernels.py")
    assert spec is not None and spec.loader is not None
    base_kernels = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(base_kernels)
    torch.manual_seed(0)
    totals: dict[str, float] = {}
    with cpu_threads.kernel_threads(threads) as used:
        kernels = cpu_threads.kernels()
        for cin, cout, k, hw, res in SHAPES:
            p = (k - 1) // 2
            g = ConvGeometry(cin, cout, (k, k), (1, 1), (p, p), 1, (hw, hw))
            w = torch.randn(cout, cin, k, k) * (torch.rand(cout, cin, k, k) < 0.1)
            weights = SparseConvWeights.from_dense(w, g)
            K.DIRECT_PAD = 8
            plan8 = K.CpuConvPlan.prepare(weights)
            K.DIRECT_PAD = 4
            plan = K.CpuConvPlan.prepare(weights)
            x = torch.relu(torch.randn(cin, hw, hw))
            if plan.reads_input:
                planes = x.reshape(-1).numpy()
            else:
                kernels.fill_planes(x.numpy(), 1, 1, p, p, plan.planes.numpy(), plan.row, plan.plane_rows,
                                    np.empty(cin, np.int32), plan.weights_per_channel.numpy())
                planes = plan.planes.reshape(-1).numpy().copy()
            bias = np.random.randn(cout).astype(np.float32)
            resid = np.random.randn(cout, hw, hw).astype(np.float32) if res else np.empty((0, 0, 0), np.float32)
            new = list(K.DirectCall.of(plan, used, bias, True).arguments)
            bands = -(-hw // plan.band_rows)
            k_blocks = min(cout, -(-K.UNITS_PER_THREAD * used // bands)) if used > 1 else 1
            base = [*new[:6], plan8.direct_values.numpy(), plan8.direct_base.numpy(), plan8.k_ptr.numpy(),
                    *new[10:12], -(-cout // k_blocks), 64]
            new16 = [*new[:-1], 16]
            exact = list(new)
            exact[9] = np.full_like(new[9], 1 << 40)
            runs = {"base": (base_kernels.conv_direct, base), "new": (kernels.conv_direct, new),
                    "new16": (kernels.conv_direct, new16), "exact": (kernels.conv_direct, exact)}
            outs = {name: np.empty((cout, hw * hw), np.float32) for name in runs}
            best = dict.fromkeys(runs, float("inf"))
            for rep in range(40):
                for name, (fn, args) in runs.items():
                    start = time.perf_counter()
                    fn(outs[name], resid, planes, np.empty((0, 0), np.int32), *args)
                    if rep >= 2:
                        best[name] = min(best[name], time.perf_counter() - start)
            for name in runs:
                assert np.allclose(outs[name], outs["base"], rtol=1e-4, atol=1e-4), name
                totals[name] = totals.get(name, 0.0) + best[name]
            print(f"{cin}->{cout} k{k} {hw}x{hw}: " + "  ".join(f"{n} {t * 1e6:.1f}" for n, t in best.items())
                  + f" us  nnz/channel {weights.nnz / cout:.1f}")
    print("total " + "  ".join(f"{n} {t * 1e3:.3f} ms" for n, t in totals.items()))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
