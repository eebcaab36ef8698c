"""Helpers shared by the multi-threaded CPU operators: work splitting and intra-op thread control."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch


def balanced_ranges(work: Sequence[int], parts: int) -> list[tuple[int, int]]:
    """Split `range(len(work))` into at most `parts` contiguous ranges of about equal total work."""
    total = sum(work)
    ranges: list[tuple[int, int]] = []
    first, done = 0, 0
    for i, cost in enumerate(work):
        done += cost
        if done * parts >= total * (len(ranges) + 1) and len(ranges) < parts - 1:
            ranges.append((first, i + 1))
            first = i + 1
    ranges.append((first, len(work)))
    return [r for r in ranges if r[0] < r[1]] or [(0, len(work))]


@contextlib.contextmanager
def single_intraop_thread() -> Iterator[None]:
    """Run worker threads with one intra-op thread each, so they do not oversubscribe the cores."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
