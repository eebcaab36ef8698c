"""What a growing pass costs when every executable it runs is made fresh ahead of its call (never updated).

A diagnostic behind `graphs-memory`'s `latency_overhead_growing_len`. An executable switched by
`cudaGraphExecUpdate` runs about 1.065x as long on the GPU as a fresh one (`update_cost.py`), so a budgeted cache
that updates at every call of a growing pass cannot reach 1.05x. This tool measures the other way, in a bare loop
(no tendril dispatch): GPT-2 fp16 forward graphs at lengths 1..N (one shared pool), lengths growing by one per call
with a device synchronisation after each (as the case), against dedicated executables (all instantiated), passes
alternating. In a variant `(pinned P, ahead A)` the shortest P lengths keep executables for good (a short call is
the hardest to hide a switch behind); the others are instantiated on one worker thread in call order, at most A
before their call, uploaded on a side stream (the call's stream waits for the upload's event) and destroyed after
their call. So at most P + A + 2 executables live at a time (the one running, one queued for destruction), sized to
`--budget-mib` from the driver memory per executable measured here. `contention` runs the dedicated executables
while the worker instantiates, uploads and destroys another length's graph once per call (what the rotation costs
the calling thread, without waits). Reports per-call time ratios (total over a pass, median over passes), by band
of lengths, the calls that waited for their executable and the worker's host time per operation.

    PYTHONPATH=src:. python3 -m benchmarks.tools.rotation_cost --out OUT [--lengths 1024] [--budget-mib 90]

Writes OUT/rotation_cost.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
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
from tendril.graphs.cuda_backend import segment_sizes

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


def rotation_pass(
    graphs: dict[int, Sequence[int]], pinned: dict[int, Executable], order: list[int], ahead: int,
    stream: torch.cuda.Stream,
) -> tuple[list[float], list[bool], dict[str, list[float]]]:
    rotation = Rotation(graphs, [n for n in order if n not in pinned], ahead)
    times, waits = [], []
    for n in order:
        begin = time.perf_counter()
        if n in pinned:
            launch(pinned[n], stream.cuda_stream)
            waited = False
        else:
            executable, uploaded, waited = rotation.take(n)
            stream.wait_event(uploaded)
            launch(executable, stream.cuda_stream)
            rotation.release(executable)  # destroyed after the launch completes (CUDA frees it then)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - begin) * 1e3)
        waits.append(waited)
    rotation.close()
    return times, waits, rotation.task_ms


def contention_pass(
    executables: dict[int, Executable], graphs: dict[int, Sequence[int]], order: list[int],
    stream: torch.cuda.Stream,
) -> list[float]:
    """Dedicated executables while the worker makes, uploads and destroys another length's executable per call."""
    rotation = Rotation(graphs, list(reversed(order)), 1)
    times = []
    for index, n in enumerate(order):
        times.append(timed_call(lambda n=n: launch(executables[n], stream.cuda_stream)))
        other = order[-1 - index]
        executable, _, _ = rotation.take(other)
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


def measure_variant(
    graphs: dict[int, Sequence[int]], pinned_count: int, ahead: int, dedicated: dict[int, Executable],
    lengths: list[int], passes: int, stream: torch.cuda.Stream,
) -> tuple[dict[str, Any], list[list[float]]]:
    """One rotation variant against the dedicated executables, passes alternating; also returns the dedicated
    passes' times."""
    pinned = {n: make(graphs[n]) for n in lengths[:pinned_count]}
    for executable in pinned.values():
        launch(executable, stream.cuda_stream)
    torch.cuda.synchronize()
    ours_ms, theirs_ms, waits, tasks = [], [], [], {}
    rotation_pass(graphs, pinned, lengths, ahead, stream)  # warm-up
    for _ in range(passes):
        theirs_ms.append(dedicated_pass(dedicated, lengths, stream))
        times, waited, tasks = rotation_pass(graphs, pinned, lengths, ahead, stream)
        ours_ms.append(times)
        waits.append(waited)
    for executable in pinned.values():
        drop(executable)
    bands = length_bands(lengths)
    return {
        "pinned": pinned_count,
        "ahead": ahead,
        "ratio": statistics.median(sum(o) / sum(t) for o, t in zip(ours_ms, theirs_ms, strict=True)),
        "ratio_by_band": overhead_by_band(
            per_length_median(ours_ms, lengths), per_length_median(theirs_ms, lengths), bands
        ),
        "waits_per_pass_by_band": {
            f"{low}-{high}": [sum(w for n, w in zip(lengths, p, strict=True) if low <= n <= high) for p in waits]
            for low, high in bands
        },
        "worker_ms_median": {k: statistics.median(v) for k, v in tasks.items() if v},
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
    captured, raw = capture_graphs(args.lengths)  # the torch graphs own the raw handles: keep them alive
    lengths = list(range(1, len(raw) + 1))
    whole = {n: (raw[n - 1],) for n in lengths}
    nodes = graph_exec.topology(raw[-1]).nodes
    made = {n: graph_exec.split(raw[n - 1], segment_sizes(graph_exec.topology(raw[n - 1]).nodes)) for n in lengths}
    cut = {n: tuple(made[n]) if made[n] else whole[n] for n in lengths}
    stream = torch.cuda.current_stream()
    sample = lengths[len(lengths) // 4 :][:64]
    per_exec = {form: bytes_per_executable([graphs[n] for n in sample], stream)
                for form, graphs in (("whole", whole), ("segments", cut))}
    fits = {form: int(args.budget_mib * MIB // value) for form, value in per_exec.items()}
    result: dict[str, Any] = {
        "command": f"python -m benchmarks.tools.rotation_cost --out {args.out} --lengths {args.lengths} "
        f"--budget-mib {args.budget_mib} --passes {args.passes} --ahead {' '.join(map(str, args.ahead))}",
        **machine(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "lengths": len(lengths),
        "nodes": nodes,
        "segment_sizes": list(segment_sizes(nodes)),
        "driver_mib_per_executable": {form: value / MIB for form, value in per_exec.items()},
        "executables_in_budget": fits,
    }
    dedicated = {n: make(whole[n]) for n in lengths}
    dedicated_pass(dedicated, lengths, stream)  # uploads each once

    variants = [("whole", ahead, fits["whole"] - ahead - 2) for ahead in args.ahead]
    variants += [("segments", args.ahead[0], fits["segments"] - args.ahead[0] - 2), ("whole", args.ahead[0], 0)]
    reference_ms: list[list[float]] = []
    for form, ahead, pinned_count in variants:
        graphs = whole if form == "whole" else cut
        name = f"{form} pinned {max(pinned_count, 0)} ahead {ahead}"
        result[name], theirs_ms = measure_variant(
            graphs, max(pinned_count, 0), ahead, dedicated, lengths, args.passes, stream
        )
        reference_ms.extend(theirs_ms)
        print(name, json.dumps(result[name]), flush=True)

    ours_ms, theirs_ms = [], []
    for _ in range(args.passes):
        theirs_ms.append(dedicated_pass(dedicated, lengths, stream))
        ours_ms.append(contention_pass(dedicated, whole, lengths, stream))
    reference_ms.extend(theirs_ms)
    result["contention"] = {
        "ratio": statistics.median(sum(o) / sum(t) for o, t in zip(ours_ms, theirs_ms, strict=True)),
        "ratio_by_band": overhead_by_band(
            per_length_median(ours_ms, lengths), per_length_median(theirs_ms, lengths), length_bands(lengths)
        ),
    }
    print("contention", json.dumps(result["contention"]), flush=True)
    result["dedicated_ms_by_length"] = {str(n): ms for n, ms in per_length_median(reference_ms, lengths).items()}
    for executable in dedicated.values():
        drop(executable)
    for segments in made.values():
        for segment in segments or ():
            graph_exec.destroy_graph(segment)
    del captured
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "rotation_cost.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
