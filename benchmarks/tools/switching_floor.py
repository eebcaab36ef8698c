"""What switching executables costs at best: bare loops of the two ways a budgeted cache can switch, against dedicated
executables.

A diagnostic behind `graphs-memory`'s latency targets, without tendril's dispatch or cache policy. GPT-2 fp16
forward graphs at lengths 1..N (one shared pool), calls with a device synchronisation after each (as the case), in
growing order (by one per call) and in the case's random order, passes alternating with dedicated executables (all
instantiated). Executables are sized to `--budget-mib` from the driver memory per executable measured here (whole
graphs, and the segments a managed graph is cut into). The variants:

- `fresh ... ahead A` (growing): the shortest lengths keep executables for good (a short call is the hardest to hide
  a switch behind; `unpinned`: none do); the others are instantiated on one worker thread in call order, at most A
  before their call, uploaded on a side stream (the call's stream waits for the upload's event) and destroyed after
  their call, so none is ever updated (an updated executable runs about 1.065x as long on the GPU as a fresh one,
  `update_cost.py`). At most pinned + A + 2 executables live at a time (the one running, one queued for
  destruction).
- `update at launch` (growing and random): one executable per topology family, switched by tendril's own driver
  (`CudaExecutables.launch`: each segment updated right before its launch); the budget's other executables go to
  the shortest lengths for good (`unpinned`: none).
- `contention` (growing): dedicated executables while the worker instantiates, uploads and destroys another length's
  executable once per call (what making executables costs the calling thread, without waits).

Reports per-call time ratios (total over a pass, median over passes), by band of lengths, the calls that waited for
their executable and the worker's host time per operation.

    PYTHONPATH=src:. python3 -m benchmarks.tools.switching_floor --out OUT [--lengths 1024] [--budget-mib 90]

Writes OUT/switching_floor.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.cases.graphs_memory import length_bands, overhead_by_band, per_length_median
from benchmarks.results import machine
from benchmarks.tools.instantiate_cost import capture_graphs
from tendril.cuda import graph_exec
from tendril.graphs.cuda_backend import CudaExecutables, ExecutableChain, ManagedGraph, segment_sizes

MIB = 1 << 20

Executable = list[int]
"""The executables of one graph's segments (one for a whole graph), launched in order."""


def make(segments: Sequence[int]) -> Executable:
    return [graph_exec.instantiate(segment) for segment in segments]


def launch(executable: Executable, stream: int) -> None:
    for handle in executable:
        graph_exec.launch(handle, stream)


def drop(executable: Executable) -> None:
    for handle in executable:
        graph_exec.destroy(handle)


class Rotation:
    """Executables of `order`'s lengths made on one worker thread in that order, at most `ahead` before they are
    taken, uploaded on a side stream; `release` queues one for destruction (the worker destroys before it makes)."""

    def __init__(self, graphs: dict[int, Sequence[int]], order: list[int], ahead: int) -> None:
        self.graphs = graphs
        self.order = order
        self.ahead = ahead
        self.ready: dict[int, tuple[Executable, torch.cuda.Event]] = {}
        self.released: list[Executable] = []
        self.closing = False
        self.error: BaseException | None = None
        self.cond = threading.Condition()
        self.side = torch.cuda.Stream()
        self.task_ms: dict[str, list[float]] = {"instantiate": [], "upload": [], "destroy": []}
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _timed(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        begin = time.perf_counter()
        value = fn(*args)
        self.task_ms[name].append((time.perf_counter() - begin) * 1e3)
        return value

    def _run(self) -> None:
        try:
            self._work()
        except BaseException as error:
            with self.cond:
                self.error = error
                self.cond.notify_all()

    def _work(self) -> None:
        torch.cuda.set_device(0)
        graph_exec.relax_capture_mode()
        position = 0
        while True:
            with self.cond:
                while not self.released and not self.closing and (
                    position >= len(self.order) or len(self.ready) >= self.ahead
                ):
                    self.cond.wait()
                released, self.released = self.released, []
                closing = self.closing
            for executable in released:
                self._timed("destroy", drop, executable)
            if closing:
                return
            if position < len(self.order) and len(self.ready) < self.ahead:
                length = self.order[position]
                position += 1
                executable = self._timed("instantiate", make, self.graphs[length])
                self._timed("upload", lambda e: [graph_exec.upload(h, self.side.cuda_stream) for h in e], executable)
                uploaded = torch.cuda.Event()
                uploaded.record(self.side)
                with self.cond:
                    self.ready[length] = (executable, uploaded)
                    self.cond.notify_all()

    def take(self, length: int) -> tuple[Executable, torch.cuda.Event, bool]:
        with self.cond:
            waited = length not in self.ready
            while length not in self.ready and self.error is None:
                self.cond.wait()
            if self.error is not None:
                raise RuntimeError("the rotation's worker failed") from self.error
            executable, uploaded = self.ready.pop(length)
            self.cond.notify_all()
        return executable, uploaded, waited

    def release(self, executable: Executable) -> None:
        with self.cond:
            self.released.append(executable)
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closing = True
            self.cond.notify_all()
        self.thread.join()
        for executable, _ in self.ready.values():
            drop(executable)


def timed_call(run: Callable[[], None]) -> float:
    begin = time.perf_counter()
    run()
    torch.cuda.synchronize()
    return (time.perf_counter() - begin) * 1e3


def dedicated_pass(executables: dict[int, Executable], order: list[int], stream: torch.cuda.Stream) -> list[float]:
    return [timed_call(lambda n=n: launch(executables[n], stream.cuda_stream)) for n in order]


class FreshRotation:
    """The shortest `pinned` lengths keep executables; the others are made fresh ahead of their calls (`Rotation`)."""

    def __init__(
        self, graphs: dict[int, Sequence[int]], pinned: int, ahead: int, lengths: list[int], stream: torch.cuda.Stream
    ) -> None:
        self.graphs, self.ahead, self.stream = graphs, ahead, stream
        self.pinned = {n: make(graphs[n]) for n in lengths[:pinned]}
        for executable in self.pinned.values():
            launch(executable, stream.cuda_stream)
        torch.cuda.synchronize()
        self.task_ms: dict[str, list[float]] = {}

    def run(self, order: list[int]) -> tuple[list[float], list[bool]]:
        rotation = Rotation(self.graphs, [n for n in order if n not in self.pinned], self.ahead)
        times, waits = [], []
        for n in order:
            begin = time.perf_counter()
            if n in self.pinned:
                launch(self.pinned[n], self.stream.cuda_stream)
                waited = False
            else:
                executable, uploaded, waited = rotation.take(n)
                self.stream.wait_event(uploaded)
                launch(executable, self.stream.cuda_stream)
                rotation.release(executable)  # CUDA frees it once the launch completes
            torch.cuda.synchronize()
            times.append((time.perf_counter() - begin) * 1e3)
            waits.append(waited)
        rotation.close()
        self.task_ms = rotation.task_ms
        return times, waits

    def details(self) -> dict[str, Any]:
        return {
            "pinned": len(self.pinned),
            "ahead": self.ahead,
            "worker_ms_median": {k: statistics.median(v) for k, v in self.task_ms.items() if v},
        }

    def close(self) -> None:
        for executable in self.pinned.values():
            drop(executable)


class UpdateAtLaunch:
    """One executable per topology family, switched at launch segment by segment by tendril's own driver
    (`CudaExecutables.launch`); the shortest `pinned` lengths keep executables of their own."""

    def __init__(
        self, managed: dict[int, ManagedGraph], families: dict[int, str], pinned: int, lengths: list[int],
        stream: torch.cuda.Stream,
    ) -> None:
        self.managed, self.families, self.stream = managed, families, stream
        self.driver = CudaExecutables(torch.device("cuda", torch.cuda.current_device()))
        self.pinned = {n: self.driver.instantiate(managed[n])[0] for n in lengths[:pinned]}
        self.current: dict[str, tuple[ExecutableChain, int]] = {}
        """Each family's executable and the length it runs now."""
        for n in lengths:
            if n not in self.pinned and families[n] not in self.current:
                self.current[families[n]] = (self.driver.instantiate(managed[n])[0], n)

    def run(self, order: list[int]) -> tuple[list[float], list[bool]]:
        return [timed_call(lambda n=n: self._launch(n)) for n in order], [False] * len(order)

    def _launch(self, n: int) -> None:
        if n in self.pinned:
            self.driver.launch(self.pinned[n], self.stream)
            return
        chain, running = self.current[self.families[n]]
        self.driver.launch(chain, self.stream, None if running == n else self.managed[n])
        self.current[self.families[n]] = (chain, n)

    def details(self) -> dict[str, Any]:
        return {
            "pinned": len(self.pinned),
            "families": len(self.current),
            "refused_segments": self.driver.refused_segments,
        }

    def close(self) -> None:
        for chain in [*self.pinned.values(), *(chain for chain, _ in self.current.values())]:
            self.driver.destroy(chain)


def contention_pass(
    executables: dict[int, Executable], graphs: dict[int, Sequence[int]], order: list[int],
    stream: torch.cuda.Stream,
) -> list[float]:
    """Dedicated executables while the worker makes, uploads and destroys another length's executable per call."""
    rotation = Rotation(graphs, list(reversed(order)), 1)
    times = []
    for index, n in enumerate(order):
        times.append(timed_call(lambda n=n: launch(executables[n], stream.cuda_stream)))
        executable, _, _ = rotation.take(order[-1 - index])
        rotation.release(executable)
    rotation.close()
    return times


def bytes_per_executable(graphs: list[Sequence[int]], stream: torch.cuda.Stream) -> float:
    """Driver memory of instantiated and uploaded executables, per executable (cudaMemGetInfo)."""
    torch.cuda.synchronize()
    free_before, _ = torch.cuda.mem_get_info()
    made = [make(g) for g in graphs]
    for executable in made:
        for handle in executable:
            graph_exec.upload(handle, stream.cuda_stream)
    torch.cuda.synchronize()
    free_after, _ = torch.cuda.mem_get_info()
    for executable in made:
        drop(executable)
    torch.cuda.synchronize()
    return (free_before - free_after) / len(made)


def compare(
    run: Callable[[list[int]], tuple[list[float], list[bool]]], dedicated: dict[int, Executable], order: list[int],
    passes: int, stream: torch.cuda.Stream,
) -> tuple[dict[str, Any], list[list[float]]]:
    """`run` against the dedicated executables over calls in `order`, passes alternating after a warm-up pass of
    `run`; also returns the dedicated passes' times."""
    run(order)
    ours_ms, theirs_ms, waits = [], [], []
    for _ in range(passes):
        theirs_ms.append(dedicated_pass(dedicated, order, stream))
        times, waited = run(order)
        ours_ms.append(times)
        waits.append(waited)
    bands = length_bands(order)
    return {
        "ratio": statistics.median(sum(o) / sum(t) for o, t in zip(ours_ms, theirs_ms, strict=True)),
        "ratio_by_band": overhead_by_band(
            per_length_median(ours_ms, order), per_length_median(theirs_ms, order), bands
        ),
        "waits_per_pass_by_band": {
            f"{low}-{high}": [sum(w for n, w in zip(order, p, strict=True) if low <= n <= high) for p in waits]
            for low, high in bands
        },
    }, theirs_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--lengths", type=int, default=1024)
    parser.add_argument("--budget-mib", type=float, default=90.0)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--ahead", type=int, nargs="+", default=[24, 8])
    args = parser.parse_args()
    torch.cuda.set_device(0)
    captured, raw = capture_graphs(args.lengths)  # the torch graphs own the raw handles: alive to the end
    lengths = list(range(1, len(raw) + 1))
    shuffled = list(lengths)
    random.Random(0).shuffle(shuffled)
    topologies = {n: graph_exec.topology(raw[n - 1]) for n in lengths}
    families = {n: topology.digest for n, topology in topologies.items()}
    managed = {n: ManagedGraph(captured[n - 1], segment_sizes(topologies[n].nodes)) for n in lengths}
    whole = {n: (raw[n - 1],) for n in lengths}
    cut = {n: managed[n].segments for n in lengths}
    stream = torch.cuda.current_stream()
    sample = lengths[len(lengths) // 4 :][:64]
    per_exec = {form: bytes_per_executable([graphs[n] for n in sample], stream)
                for form, graphs in (("whole", whole), ("segments", cut))}
    fits = {form: int(args.budget_mib * MIB // value) for form, value in per_exec.items()}
    result: dict[str, Any] = {
        "command": f"python -m benchmarks.tools.switching_floor --out {args.out} --lengths {args.lengths} "
        f"--budget-mib {args.budget_mib} --passes {args.passes} --ahead {' '.join(map(str, args.ahead))}",
        **machine(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "lengths": len(lengths),
        "nodes": topologies[lengths[-1]].nodes,
        "segment_sizes": list(segment_sizes(topologies[lengths[-1]].nodes)),
        "topology_families": len(set(families.values())),
        "driver_mib_per_executable": {form: value / MIB for form, value in per_exec.items()},
        "executables_in_budget": fits,
    }
    dedicated = {n: make(whole[n]) for n in lengths}
    dedicated_pass(dedicated, lengths, stream)  # uploads each once

    spare = max(fits["segments"] - result["topology_families"], 0)
    variants: list[tuple[str, Callable[[], FreshRotation | UpdateAtLaunch], list[tuple[str, list[int]]]]] = [
        *(
            (f"fresh whole ahead {a}", lambda a=a: FreshRotation(whole, fits["whole"] - a - 2, a, lengths, stream),
             [("growing", lengths)])
            for a in args.ahead
        ),
        (f"fresh segments ahead {args.ahead[0]}",
         lambda: FreshRotation(cut, fits["segments"] - args.ahead[0] - 2, args.ahead[0], lengths, stream),
         [("growing", lengths)]),
        (f"fresh whole ahead {args.ahead[0]} unpinned",
         lambda: FreshRotation(whole, 0, args.ahead[0], lengths, stream), [("growing", lengths)]),
        ("update at launch", lambda: UpdateAtLaunch(managed, families, spare, lengths, stream),
         [("growing", lengths), ("random", shuffled)]),
        ("update at launch unpinned", lambda: UpdateAtLaunch(managed, families, 0, lengths, stream),
         [("growing", lengths), ("random", shuffled)]),
    ]
    reference_ms: dict[str, list[list[float]]] = {"growing": [], "random": []}
    for name, build, orders in variants:
        mechanism = build()
        result[name] = {}
        for order_name, order in orders:
            result[name][order_name], theirs_ms = compare(mechanism.run, dedicated, order, args.passes, stream)
            reference_ms[order_name].extend(theirs_ms)
        result[name].update(mechanism.details())
        mechanism.close()
        print(name, json.dumps(result[name]), flush=True)

    result["contention"], theirs_ms = compare(
        lambda order: (contention_pass(dedicated, whole, order, stream), [False] * len(order)),
        dedicated, lengths, args.passes, stream,
    )
    reference_ms["growing"].extend(theirs_ms)
    print("contention", json.dumps(result["contention"]), flush=True)
    result["dedicated_ms_by_length"] = {
        str(n): ms for n, ms in per_length_median(reference_ms["growing"], lengths).items()
    }
    for executable in dedicated.values():
        drop(executable)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "switching_floor.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
