"""Host cost of zero-copy's function mode per producer op, on the CPU (a diagnostic behind `graphs-zero-copy`).

The host side of the case's beam-search decode step (`graphs_zero_copy.host_step`), with GPT-2's 24 cache
tensors (12 layers, keys and values) made small (`[4, 2, 4, 8]` float32) so the ops' own work is next to
nothing and what is timed is host overhead: the beam update (`log_softmax`, `topk`, `div`, the `sub` whose
whole view `tokens[:, None]` is the next ids, ...), the 24 cache `index_select`s and `positions + 1`. The
graphed step is a stand-in (`torch._foreach_add` of the cache, on the null backend, so no GPU is needed).
Four variants, interleaved, under `torch.inference_mode()` as the case runs:

- `plain`: no mode, the call copies its inputs;
- `observing`: under another callable's `zero_copy()` block, so every op passes through a predictor that
  never links a producer (what an op that feeds no input pays); its call runs under that mode too, so only
  its producer ops compare with the others;
- `auto`: under the callable's own `zero_copy()` block after a warm-up, with every prediction holding (26
  redirects per step: 24 `index_select`s, `sub`, `add`; checked, as is every step's answer against `plain`);
- `manual`: the case's (d), the same ops written by hand into the next call's placeholders (`inputs_for`
  and `out=`), so nothing is copied and no mode runs.

Reported per step, medians over `--reps` repetitions of `--steps` steps, in microseconds: the whole step, the
call, the producer ops between calls (`section`) and the 24 `index_select`s among them (`reorder`), and per
`index_select` its time and the extra over `plain`'s. `--profile` runs `auto` under cProfile and lists its
costliest functions.

    PYTHONPATH=src:. python3 -m benchmarks.tools.zero_copy_host_cost [--reps 30] [--steps 50] [--profile]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from benchmarks.cases.graphs_zero_copy import beam_update
from tendril.config import Config
from tendril.graphs.backend import NullBackend
from tendril.graphs.callable import GraphedCallable, graphed

BEAMS = 4
LAYERS = 12
CACHE_SHAPE = (BEAMS, 2, 4, 8)
VOCAB = 64


def make_step(weights: torch.Tensor) -> Callable[..., Any]:
    def step(ids: torch.Tensor, positions: torch.Tensor, *past: torch.Tensor) -> tuple[torch.Tensor, Any]:
        logits = weights[ids[:, 0] % VOCAB] + positions.float()
        return logits, tuple(torch._foreach_add(past, 1.0))

    return step


State = tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]
"""ids, positions, scores and the cache."""

Timed = tuple[State, torch.Tensor, float]
"""The next state, the beams chosen, and the time of the reordering (the 24 `index_select`s) in seconds."""


def produce(fast: GraphedCallable, logits: torch.Tensor, present: tuple[torch.Tensor, ...], state: State) -> Timed:
    """The host side of `graphs_zero_copy.host_step`: beam update, cache reordering, next positions."""
    ids, positions, scores, _ = state
    ids, scores, beam_idx = beam_update(logits, scores)
    began = time.perf_counter()
    past = tuple(p.index_select(0, beam_idx) for p in present)
    reordered = time.perf_counter() - began
    return (ids, positions + 1, scores, past), beam_idx, reordered


def produce_manually(
    fast: GraphedCallable, logits: torch.Tensor, present: tuple[torch.Tensor, ...], state: State
) -> Timed:
    """`graphs_zero_copy.manual_step`'s host side: the same ops written by hand into the next call's placeholders."""
    ids, positions, scores, _ = state
    ids, scores, beam_idx = beam_update(logits, scores)
    (next_ids, next_positions, *next_past), _ = fast.inputs_for(ids, positions, *present)
    next_ids.copy_(ids)
    torch.add(positions, 1, out=next_positions)
    began = time.perf_counter()
    for source, target in zip(present, next_past, strict=True):
        torch.index_select(source, 0, beam_idx, out=target)
    reordered = time.perf_counter() - began
    return (next_ids, next_positions, scores, tuple(next_past)), beam_idx, reordered


class Loop:
    """One variant's decode loop; `run` times each step's call, its producer ops and their reordering part."""

    def __init__(
        self,
        fast: GraphedCallable,
        context: Callable[[], Any],
        step: Callable[[GraphedCallable, torch.Tensor, tuple[torch.Tensor, ...], State], Timed] = produce,
    ) -> None:
        self.fast = fast
        self.context = context
        self.step = step
        self.times: dict[str, list[float]] = {"call": [], "section": [], "reorder": []}

    @staticmethod
    def start() -> State:
        generator = torch.Generator().manual_seed(0)
        past = tuple(torch.randn(CACHE_SHAPE, generator=generator) for _ in range(2 * LAYERS))
        ids = torch.randint(0, VOCAB, (BEAMS, 1), generator=generator)
        return ids, torch.full((BEAMS, 1), 5), torch.zeros(BEAMS), past

    def run(self, steps: int, record: bool = True) -> list[torch.Tensor]:
        """`steps` steps; returns each step's beam indices (to compare variants)."""
        state = self.start()
        chosen = []
        clock = time.perf_counter
        totals = dict.fromkeys(self.times, 0.0)
        with self.context():
            for _ in range(steps):
                began = clock()
                logits, present = self.fast(state[0], state[1], *state[3])
                called = clock()
                state, beam_idx, reordered = self.step(self.fast, logits, present, state)
                totals["section"] += clock() - called
                totals["call"] += called - began
                totals["reorder"] += reordered
                chosen.append(beam_idx.clone())
            del state
        if record:
            for name, total in totals.items():
                self.times[name].append(total * 1e6 / steps)
        return chosen


def loops() -> dict[str, Loop]:
    weights = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(1))

    def make() -> GraphedCallable:
        return graphed(make_step(weights), backend=NullBackend(), config=Config())

    auto, bystander, manual = make(), make(), make()
    return {
        "plain": Loop(make(), contextlib.nullcontext),
        "observing": Loop(make(), bystander.zero_copy),
        "auto": Loop(auto, auto.zero_copy),
        "manual": Loop(manual, contextlib.nullcontext, produce_manually),
    }


@contextlib.contextmanager
def inference() -> Iterator[None]:
    with torch.inference_mode():
        yield


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--profile", action="store_true", help="run `auto` under cProfile and list its hot spots")
    args = parser.parse_args()
    torch.set_num_threads(1)
    variants = loops()
    auto = variants["auto"].fast
    with inference():
        reference = variants["plain"].run(args.steps, record=False)
        for loop in variants.values():
            for _ in range(2):  # warm up; `auto` confirms its predictions
                loop.run(args.steps, record=False)
        redirects, misses = auto.stats.redirects, auto.stats.mispredictions
        for _ in range(args.reps):
            for name, loop in variants.items():
                chosen = loop.run(args.steps)
                if any(not torch.equal(a, b) for a, b in zip(chosen, reference, strict=True)):
                    raise AssertionError(f"{name} chose other beams than plain")
        per_step = (auto.stats.redirects - redirects) / (args.reps * args.steps)
        if auto.stats.mispredictions != misses or per_step < 2 * LAYERS + 2:
            raise AssertionError(f"auto's predictions did not hold: {per_step} redirects per step, {auto.stats}")
        print(
            f"torch {torch.__version__}, {args.reps} reps x {args.steps} steps, medians; auto: {per_step:.0f} "
            f"redirects per step, none refused\n"
        )
        print(f"{'variant':<10} {'step':>7} {'call':>7} {'section':>8} {'reorder':>8} {'per index_select':>17}")
        plain = statistics.median(variants["plain"].times["reorder"]) / (2 * LAYERS)
        for name, loop in variants.items():
            call, section, reorder = (statistics.median(loop.times[part]) for part in ("call", "section", "reorder"))
            per_op = reorder / (2 * LAYERS)
            print(
                f"{name:<10} {call + section:>7.1f} {call:>7.1f} {section:>8.1f} {reorder:>8.1f} "
                f"{per_op:>8.2f} ({per_op - plain:+.2f})"
            )
        if args.profile:
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(10):
                variants["auto"].run(args.steps, record=False)
            profiler.disable()
            print()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
