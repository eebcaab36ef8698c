"""Host time of the executable cache's own bookkeeping per call (no GPU: a driver that does nothing).

What `ExecutableCache.launch` (acquire, and the switch decision) and `prefetch_next` (forecast, room, background
submissions) cost in Python per call, for GPT-2-like keys at lengths 1..N in `FAMILIES_PER_LENGTH`-sized topology
families under a budget of `--executables` executables: lengths growing by one per call, and a random order; under
`update` with prefetching (`PREFETCH_AHEAD` calls ahead). On the H200 a call runs on the GPU for 0.9-3 ms while the
host does this after the launch; it competes with the background thread for the interpreter.

    PYTHONPATH=src:. python3 -m benchmarks.tools.cache_host_cost --out OUT [--lengths 1024] [--executables 55]

Writes OUT/cache_host_cost.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from benchmarks.results import machine
from tendril.cuda.graph_exec import Topology, UpdateOutcome
from tendril.graphs.cuda_backend import PREFETCH_AHEAD
from tendril.graphs.executables import PRIOR_BYTES_PER_NODE, ExecutableCache, MemoryStrategy
from tendril.graphs.key import GraphKey, TensorSpec, next_in_step
from tendril.graphs.stats import GraphMemory

NODES = 293
"""Nodes of a GPT-2 forward graph."""
FAMILIES_PER_LENGTH = 21
"""Lengths per topology family (GPT-2's 1024 lengths make 49 families)."""
REPEATS = 3


class NullDriver:
    """An `ExecutableDriver` whose operations do nothing and complete at once."""

    def __init__(self) -> None:
        self._next = 0

    def instantiate(self, graph: Any) -> tuple[int, int | None]:
        self._next += 1
        return self._next, None

    def update(self, executable: Any, graph: Any) -> UpdateOutcome:
        return UpdateOutcome(True)

    def launch(self, executable: Any, stream: Any, switch_to: Any = None) -> UpdateOutcome:
        return UpdateOutcome(True)

    def destroy(self, executable: Any) -> None:
        pass

    def instantiate_async(self, graph: Any, stream: Any) -> Future[tuple[int, int | None]]:
        return _done(self.instantiate(graph))

    def update_async(self, executable: Any, graph: Any, stream: Any) -> Future[UpdateOutcome]:
        return _done(UpdateOutcome(True))

    def destroy_async(self, executable: Any) -> Future[None]:
        return _done(None)

    def close(self) -> None:
        pass


def _done(value: Any) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_result(value)
    return future


def _key(length: int) -> GraphKey:
    return GraphKey(("flat", 1, ()), (TensorSpec((1, length), torch.int64, torch.device("cuda", 0)),), ())


def measure(lengths: int, executables: int, order: list[int]) -> dict[str, float]:
    """Median over repeats of the mean microseconds per call of `launch` and of `prefetch_next`."""
    cache = ExecutableCache(
        NullDriver(),
        MemoryStrategy.UPDATE,
        executables * NODES * PRIOR_BYTES_PER_NODE,
        predict_next=next_in_step,
        ahead=PREFETCH_AHEAD,
    )
    keys = {n: _key(n) for n in range(1, lengths + 1)}
    for n, key in keys.items():
        cache.add(key, n, Topology(NODES, f"family {n // FAMILIES_PER_LENGTH}"), GraphMemory())
    launch_us, prefetch_us = [], []
    for _ in range(REPEATS + 1):  # the first pass warms up
        spent = [0.0, 0.0]
        for n in order:
            start = time.perf_counter()
            cache.launch(keys[n], None)
            middle = time.perf_counter()
            cache.prefetch_next(None)
            spent[0] += middle - start
            spent[1] += time.perf_counter() - middle
        launch_us.append(spent[0] / len(order) * 1e6)
        prefetch_us.append(spent[1] / len(order) * 1e6)
    return {"launch_us": statistics.median(launch_us[1:]), "prefetch_next_us": statistics.median(prefetch_us[1:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--lengths", type=int, default=1024)
    parser.add_argument("--executables", type=int, default=55)
    args = parser.parse_args()
    growing = list(range(1, args.lengths + 1))
    shuffled = list(growing)
    random.Random(0).shuffle(shuffled)
    result: dict[str, Any] = {
        "command": f"python -m benchmarks.tools.cache_host_cost --out {args.out} --lengths {args.lengths} "
        f"--executables {args.executables}",
        **machine(),
        "lengths": args.lengths,
        "executables": args.executables,
    }
    for name, order in (("growing", growing), ("random", shuffled)):
        result[f"update {name}"] = measure(args.lengths, args.executables, order)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cache_host_cost.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
