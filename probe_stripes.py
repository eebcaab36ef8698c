"""One-off probe (not kept): ResNet-50 d0.1 on the sparse CPU engine, the direct kernel's stripes off/on, interleaved."""
import json, os, statistics, sys, time
import torch
from benchmarks.cases.sparse_cpu import resnet50, _rescale
from tendril.sparse import convert, prune
from tendril.sparse.ops.conv.cpu import kernel

threads = int(sys.argv[1]) if len(sys.argv) > 1 else os.cpu_count()
torch.manual_seed(0)
model = resnet50().eval()
prune(model, 0.1)
_rescale(model, 0.1)
x = torch.randn(1, 3, 224, 224)
configs = {"off": float("inf"), "192": 192, "48": 48}
nets = {}
with torch.no_grad():
    for name, floats in configs.items():
        kernel.STRIPE_FLOATS = floats
        net = convert(model, x)
        net.set_backend("cpu", threads)
        net(x); net(x)
        nets[name] = net
    outs = {n: net(x).clone() for n, net in nets.items()}
    same = {n: bool(torch.equal(outs[n], outs["off"])) for n in nets}
    times = {n: [] for n in nets}
    for _ in range(40):
        for n, net in nets.items():
            t = time.perf_counter(); net(x); times[n].append((time.perf_counter() - t) * 1e3)
    steps = {}
    for n, net in nets.items():
        runs = [net.profile(x, count_inputs=False) for _ in range(15)]
        steps[n] = {name: round(statistics.median(r[i][1] for r in runs), 3) for i, (name, _) in enumerate(runs[0])}
report = {"threads": threads, "bit_identical": same,
          "median_ms": {n: round(statistics.median(t), 3) for n, t in times.items()},
          "p10_ms": {n: round(sorted(t)[4], 3) for n, t in times.items()}, "steps_ms": steps}
print(json.dumps({k: v for k, v in report.items() if k != "steps_ms"}))
out = os.environ.get("OUT")
if out:
    json.dump(report, open(os.path.join(out, f"probe_stripes_{threads}.json"), "w"), indent=1)
