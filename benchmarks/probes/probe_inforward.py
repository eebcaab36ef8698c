import sys, time, statistics, numpy as np, torch
sys.path[:0] = ["src", "."]
from benchmarks.tools import profile_sparse_cpu as P
from tendril.sparse.ops import cpu_threads
T = int(sys.argv[1])
net, x, _ = P.build(False)
net.set_backend("cpu", T)
flush = np.ones(64 << 20, dtype=np.uint8)
def med(fn, n=15, pre=None):
    s = []
    for _ in range(n):
        if pre: pre()
        t = time.perf_counter(); fn(); s.append(time.perf_counter() - t)
    return statistics.median(s) * 1e6
with torch.no_grad():
    for _ in range(3): net(x)
    traces = []
    for _ in range(5):
        tr = P.KernelTrace()
        with tr.installed(net.steps):
            net(x)
        traces.append(tr)
    calls = traces[0].calls
    infwd = [statistics.median(t.calls[i].end - t.calls[i].start for t in traces) * 1e6 for i in range(len(calls))]
    rows = []
    with cpu_threads.kernel_threads(T):
        replay = [[] for _ in calls]
        for _ in range(7):
            for i, c in enumerate(calls):
                t = time.perf_counter(); c.run(); replay[i].append(time.perf_counter() - t)
        replay = [statistics.median(r) * 1e6 for r in replay]
        after_next = []
        for i, c in enumerate(calls):
            nxt = calls[i + 1:i + 4]
            after_next.append(med(c.run, pre=lambda nxt=nxt: [n.run() for n in nxt]) if nxt else float("nan"))
        for i, c in enumerate(calls):
            warm = med(c.run)
            cold = med(c.run, pre=lambda: flush.__iadd__(1))
            prev = med(c.run, pre=calls[i - 1].run) if i else float("nan")
            rows.append((c.step, c.kernel, infwd[i], warm, cold, prev, replay[i], after_next[i]))
tot = [sum(r[k] for r in rows) for k in (2, 3, 4, 6)]
print(f"T={T} sums: in-forward {tot[0]:.0f} warm {tot[1]:.0f} after-flush {tot[2]:.0f} sequence-replay {tot[3]:.0f}")
rows.sort(key=lambda r: r[3] - r[2])
for r in rows[:14]:
    print(f"{r[0]:24s} {r[1]:18s} fwd {r[2]:7.1f} warm {r[3]:7.1f} flushed {r[4]:7.1f} after-prev {r[5]:7.1f} "
          f"replay {r[6]:7.1f} after-next3 {r[7]:7.1f}")
