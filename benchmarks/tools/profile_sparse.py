"""Where the device time of a converted sparse CNN goes, step by step and kernel by kernel (the `sparse-cnn` models).

For each model (`--models`, default AlexNet and ResNet-50, pruned and converted as the `sparse-cnn` case does,
`tune` included):
- the whole network inside one CUDA graph, replayed back to back: ms per call, and under `torch.profiler`
  (kernels of a graph are traced one by one) the kernels per call grouped by name, with the busy time (sum of
  kernel durations) and the idle gaps between kernels (launch latency inside the graph);
- every step on its own, on the activations it sees in a forward: device microseconds per call behind a GPU
  sleep (as inside the graph, not the host's launch cost) and the kernels it launches.

    PYTHONPATH=src:. python3 -m benchmarks.tools.profile_sparse --out OUT [--models alexnet,resnet50]

Writes OUT/profile_sparse.json and OUT/profile_sparse.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Any

import torch

from benchmarks.cases import sparse_cnn as case
from benchmarks.registry import Context
from benchmarks.tools.profile_generation import kernel_profile
from tendril.sparse import convert
from tendril.sparse.tuning import device_ms
from tendril.utils.timing import time_callable

STEP_REPS = 20


def profile_model(name: str, device: torch.device) -> dict[str, Any]:
    ctx = Context(device=device, quick=False)
    model, _ = case.pruned_model(ctx, name)
    inputs = [torch.randn(1, 3, 224, 224, device=device) for _ in range(4)]
    with torch.no_grad():
        case.set_tf32(False)
        net = convert(model, inputs[0])
        replay, _ = case.graphed(net, inputs[0])
        timing = time_callable(replay, [(x,) for x in inputs], device=device, warmup=5, reps=100)
        graph = kernel_profile(lambda: replay(inputs[1]), calls=20)
        steps = []
        for call in net.step_calls(inputs[1]):
            launched = kernel_profile(call.run, calls=1)
            steps.append({
                "step": call.name,
                "kernel": call.kernel,
                "device_us": round(1e3 * device_ms(call.run, STEP_REPS) / STEP_REPS, 2),
                "kernels": [g.name[:80] for g in launched.groups for _ in range(round(g.per_call))],
            })
    return {
        "graph_ms_per_call": timing.median_ms,
        "graph_kernels_per_call": graph.operations_per_call,
        "graph_busy_us_per_call": graph.busy_us_per_call,
        "graph_gap_us_per_call": graph.gap_us_per_call,
        "graph_kernel_groups": [
            {"name": g.name[:120], "per_call": g.per_call, "mean_us": round(g.mean_us, 2),
             "total_us": round(g.total_us_per_call, 2)}
            for g in graph.groups
        ],
        "steps": steps,
    }


def _markdown(report: dict[str, Any]) -> str:
    lines = ["# Profile of converted sparse CNNs (`benchmarks.tools.profile_sparse`)", "",
             f"- command: `{report['command']}`",
             f"- device: {report['device']}; torch {report['torch']}; {report['date']}", ""]
    for name, r in report["models"].items():
        lines += [f"## {name}", "",
                  f"graph: {r['graph_ms_per_call']:.4f} ms per call, {r['graph_kernels_per_call']:.0f} kernels, "
                  f"busy {r['graph_busy_us_per_call']:.1f} us, gaps {r['graph_gap_us_per_call']:.1f} us", "",
                  "| kernel | per call | mean us | total us |", "|---|---:|---:|---:|"]
        lines += [f"| `{g['name'][:70]}` | {g['per_call']:.0f} | {g['mean_us']} | {g['total_us']} |"
                  for g in r["graph_kernel_groups"][:25]]
        lines += ["", "| step | kernel | device us | kernels launched |", "|---|---|---:|---|"]
        lines += [f"| {s['step']} | {s['kernel']} | {s['device_us']} | {len(s['kernels'])}: "
                  f"{', '.join(k[:40] for k in s['kernels'])} |" for s in r["steps"]]
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--models", default="alexnet,resnet50")
    args = parser.parse_args()
    device = torch.device("cuda")
    report: dict[str, Any] = {
        "command": " ".join(["python3 -m benchmarks.tools.profile_sparse", *sys.argv[1:]]),
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "models": {},
    }
    names = args.models.split(",")
    case.precompile_models(Context(device=device, quick=False), names)
    for name in names:
        report["models"][name] = profile_model(name, device)
        print(f"{name}: {report['models'][name]['graph_ms_per_call']:.4f} ms per graph call", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "profile_sparse.json").write_text(json.dumps(report, indent=1))
    (args.out / "profile_sparse.md").write_text(_markdown(report))


if __name__ == "__main__":
    main()
