"""Where a call's time goes when `update` prefetches executables (a diagnostic behind the `graphs-memory` case).

GPT-2 fp16 (random weights) graphed at lengths 1..N, called with lengths growing by one per call (as in
generation), per-call wall time with a synchronisation after each call, against dedicated executables:

- `resident`: `lru` with a budget that holds every executable (after the first pass nothing is switched: the
  cost of serving a call from the cache rather than through torch's replay);
- `update`: `update` under `--budget`, prefetching (the background thread updates the next length's
  executable and uploads it in the call's stream);
- `update, side-stream upload`: the same, but the upload goes to a stream of the worker's own, which the
  next launch waits for (an event), so that it overlaps the running call instead of queueing behind it;
- `update, no upload`: the same without the upload (the next launch uploads);
- `update, no prefetch`: every switch on the calling thread.

The two upload variants replace `CudaExecutables._update_and_upload` for their run only (an experiment, not
tendril's code path). Each variant runs in a process of its own: executables destroyed earlier in a process
leave driver memory that later instantiations reuse without measurable growth, so the learnt charge per node
falls and a budget stops binding (a first version of this tool ran them in one process: no update variant
switched at all). Writes OUT/update_prefetch_cost.json.

    PYTHONPATH=src:. python3 -m benchmarks.tools.update_prefetch_cost --out OUT [--lengths 256 --budget 16MiB]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from benchmarks.cases import graphs_memory as case
from benchmarks.tools.graph_switch_cost import per_call_ms
from tendril.cuda import graph_exec
from tendril.graphs import cuda_backend
from tendril.graphs.callable import graphed


@contextlib.contextmanager
def patched_upload(mode: str) -> Iterator[None]:
    """`mode` "side-stream": background updates upload in a worker stream, the next launch waits for it;
    "none": no upload; "call-stream": tendril's own."""
    if mode == "call-stream":
        yield
        return
    executables = cuda_backend.CudaExecutables
    original_update, original_launch = executables._update_and_upload, executables.launch
    side: dict[torch.device, torch.cuda.Stream] = {}
    uploaded: dict[int, torch.cuda.Event] = {}

    def update_and_upload(self, executable, raw, last_launch, stream):
        with torch.cuda.device(self.device):
            cuda_backend._relax_this_thread()
            self._wait_for(last_launch)
            outcome = graph_exec.update(executable, raw)
            if outcome.ok and mode == "side-stream":
                worker_stream = side.setdefault(self.device, torch.cuda.Stream(self.device))
                graph_exec.upload(executable, worker_stream.cuda_stream)
                event = torch.cuda.Event()
                event.record(worker_stream)
                uploaded[executable] = event
        return outcome

    def launch(self, executable, stream):
        event = uploaded.pop(executable, None)
        if event is not None:
            stream.wait_event(event)
        original_launch(self, executable, stream)

    executables._update_and_upload, executables.launch = update_and_upload, launch
    try:
        yield
    finally:
        executables._update_and_upload, executables.launch = original_update, original_launch


VARIANTS: dict[str, tuple[dict[str, Any], str]] = {
    "resident": ({"graph_memory_budget": "4GiB", "graph_memory_strategy": "lru"}, "call-stream"),
    "update": ({"graph_memory_strategy": "update"}, "call-stream"),
    "update, side-stream upload": ({"graph_memory_strategy": "update"}, "side-stream"),
    "update, no upload": ({"graph_memory_strategy": "update"}, "none"),
    "update, no prefetch": ({"graph_memory_strategy": "update", "graph_memory_prefetch": False}, "call-stream"),
}


def measure(name: str, lengths: int, budget: str, passes: int) -> dict[str, Any]:
    """One variant against dedicated executables, in this process (which should be fresh: executables destroyed
    earlier in a process leave driver memory that new ones reuse unmeasured, so a budget would not bind)."""
    options, upload = VARIANTS[name]
    options = {"graph_memory_budget": budget, **options}
    device = torch.device("cuda")
    model = case._gpt2(device)
    torch.manual_seed(0)
    ids = {n: torch.randint(0, case.VOCAB, (1, n), device=device) for n in range(1, lengths + 1)}
    sequence = list(ids.values())
    order = [(ids[n],) for n in sorted(ids, reverse=True)]
    with torch.inference_mode(), patched_upload(upload):
        case._load_kernels(model, ids)
        fast = graphed(model, max_graphs=lengths, **options)
        fast.capture(order, progress=False)
        dedicated = graphed(model, max_graphs=lengths)
        dedicated.capture(order, progress=False)
        per_call_ms(fast, sequence)
        per_call_ms(dedicated, sequence)
        ours, theirs = [], []
        for _ in range(passes):
            ours.extend(per_call_ms(fast, sequence))
            theirs.extend(per_call_ms(dedicated, sequence))
    memory = [r.memory for r in fast.stats.graphs.values()]
    return {
        "ratio_vs_dedicated": sum(ours) / sum(theirs),
        "ms_per_call_median": statistics.median(ours),
        "dedicated_ms_per_call_median": statistics.median(theirs),
        **{
            field: sum(getattr(m, field) for m in memory)
            for field in ("instantiations", "updates", "prefetches", "prefetch_waits", "switch_ms")
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--lengths", type=int, default=256, help="GPT-2 lengths 1..N")
    parser.add_argument("--budget", default="16MiB", help="graph_memory_budget of the update variants")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--variant", choices=list(VARIANTS), help="run only this one, print its JSON (internal)")
    args = parser.parse_args()
    if args.variant is not None:
        print(json.dumps(measure(args.variant, args.lengths, args.budget, args.passes)))
        return
    if args.out is None:
        parser.error("--out is required")
    args.out.mkdir(parents=True, exist_ok=True)
    settings = {"lengths": args.lengths, "budget": args.budget, "passes": args.passes}
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "args": settings}
    for name in VARIANTS:  # each in a fresh process
        command = [sys.executable, "-m", "benchmarks.tools.update_prefetch_cost", "--variant", name]
        command += ["--lengths", str(args.lengths), "--budget", args.budget, "--passes", str(args.passes)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=True)
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])
        print(name, json.dumps(results[name]), flush=True)
    (args.out / "update_prefetch_cost.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
