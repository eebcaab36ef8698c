"""One-off probe: ResNet-50 d0.1 CPU forwards with the direct kernel's bands of BAND_FLOATS 1024 (as is), 512, 256,
128 on N threads and on 1; networks of the same weights, forwards interleaved in one process."""
import statistics
import sys
import time

import torch

from benchmarks.cases.sparse_cpu import _rescale, resnet50
from tendril.sparse import convert, prune
from tendril.sparse.ops.conv.cpu import kernel as K

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 16
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 41
variants = [int(v) for v in sys.argv[3].split(",")] if len(sys.argv) > 3 else [1024, 512, 256, 128]
torch.manual_seed(0)
model = resnet50().eval()
prune(model, 0.1)
_rescale(model, 0.1)
x = torch.randn(1, 3, 224, 224)
default = K.BAND_FLOATS
with torch.no_grad():
    nets = {}
    for band in variants:
        K.BAND_FLOATS = band
        net = convert(model, x)
        net.set_backend("cpu", threads)
        net(x)
        nets[band] = net
    K.BAND_FLOATS = default
    ref = nets[variants[0]](x).clone()
    print("maxdiff", [float((n(x) - ref).abs().max()) for n in nets.values()], flush=True)
    for count, n_reps in ((threads, reps), (1, max(5, reps // 5))):
        for net in nets.values():
            net.set_backend("cpu", count)
            net(x)
        times = {b: [] for b in nets}
        order = list(nets)
        for i in range(n_reps):
            for b in order[i % len(order):] + order[: i % len(order)]:
                start = time.perf_counter()
                nets[b](x)
                times[b].append((time.perf_counter() - start) * 1e3)
        for b, t in times.items():
            t.sort()
            median = statistics.median(t)
            print(f"band {b} threads={count}: median {median:.3f} p10 {t[len(t) // 10]:.3f} min {t[0]:.3f}", flush=True)
