"""Probe: ResNet-50 d0.1 CPU forwards on N threads, conv layers with a residual writing their output in place over
the residual (B) against their own buffers (A); two networks of the same weights, forwards interleaved."""
import statistics
import sys
import time

import torch

from benchmarks.cases.sparse_cpu import _rescale, resnet50
from tendril.sparse import convert, prune
from tendril.sparse.ops import cpu_threads
from tendril.sparse.ops.conv.cpu import prepared as P


class InPlace(P.PreparedConv):
    def __call__(self, x, residual, state):
        if residual is None or self.spmm or self.lands or cpu_threads.held() != self.used:
            return super().__call__(x, residual, state)
        saved = self.output, self.reuse
        if not hasattr(self, "inplace_views"):
            self.inplace_views = P.TensorViews(self.output.rows, False)
        self.output, self.reuse = self.inplace_views.of(residual), True
        try:
            return super().__call__(x, residual, state)
        finally:
            self.output, self.reuse = saved


threads = int(sys.argv[1]) if len(sys.argv) > 1 else 16
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 41
torch.manual_seed(0)
model = resnet50().eval()
prune(model, 0.1)
_rescale(model, 0.1)
x = torch.randn(1, 3, 224, 224)
with torch.no_grad():
    a, b = convert(model, x), convert(model, x)
    for net in (a, b):
        net.set_backend("cpu", threads)
        net(x)
    patched = 0
    for prep in list(b.state.prepared.values()):
        if type(prep) is P.PreparedConv:
            prep.__class__ = InPlace
            patched += 1
    ya, yb = a(x).clone(), b(x).clone()
    print("patched", patched, "maxdiff", float((ya - yb).abs().max()), flush=True)
    times = {"A": [], "B": []}
    for i in range(reps):
        for name, net in (("A", a), ("B", b)) if i % 2 == 0 else (("B", b), ("A", a)):
            start = time.perf_counter()
            net(x)
            times[name].append((time.perf_counter() - start) * 1e3)
    for name, t in times.items():
        t.sort()
        print(f"{name} threads={threads}: median {statistics.median(t):.3f} p10 {t[len(t)//10]:.3f} min {t[0]:.3f}")
    yb2 = b(x)
    print("maxdiff after", float((ya - yb2).abs().max()))
