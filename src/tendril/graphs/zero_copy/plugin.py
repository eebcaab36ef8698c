"""`ZeroCopy`: the zero-copy plug-in of one graphed callable.

Made on the callable's first `zero_copy()` or `carry(...)`, never before: until then the callable places
its inputs the plain way (`tendril.graphs.inputs.InputPlacement`). The plug-in extends that placement
with placeholder lanes (`lanes`), the predictor that redirects producers into them (`predictor`, driven by
`mode.ZeroCopyMode` inside `zero_copy()` blocks) and loop-carried state (`carry`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from tendril.graphs.inputs import InputPlacement, Staging, copy_pending, stage_inputs
from tendril.graphs.key import Flattened, GraphKey, Unkeyable
from tendril.graphs.memory import PlaceholderArena
from tendril.graphs.stats import GraphStats
from tendril.graphs.zero_copy.carry import CarryPlan
from tendril.graphs.zero_copy.lanes import Lanes, lane_of
from tendril.graphs.zero_copy.mode import ZeroCopyMode
from tendril.graphs.zero_copy.predictor import ZeroCopyPredictor

CapturedGraph = tuple[Sequence[int], Sequence[torch.Tensor], Any]
"""A graph captured before the plug-in existed: its tensor leaf indices, placeholders and outputs."""


class ZeroCopy(InputPlacement):
    """Placeholder lanes, the zero-copy predictor and the carry plan of one callable."""

    def __init__(self, arena: PlaceholderArena, stats: GraphStats, captured: Iterable[CapturedGraph] = ()) -> None:
        """`captured`: the callable's graphs so far, whose positions a redirect must avoid when they return a
        view of their placeholder (`Lanes.pinned`), as every graph captured from now on is checked."""
        super().__init__(arena, stats)
        self.lanes = Lanes(arena)
        self.predictor = ZeroCopyPredictor(self.lanes, stats)
        self.carry = CarryPlan(self.lanes, stats)
        for indices, placeholders, outputs in captured:
            self.lanes.pin_aliased_outputs(indices, placeholders, outputs)

    def call(
        self, run: Callable[[tuple[Any, ...], dict[str, Any]], Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """`run(args, kwargs)`, one call of the callable: inside a `zero_copy()` block its own ops are no
        producers and the next interval starts after it."""
        predictor = self.predictor
        if not predictor.active:
            return run(args, kwargs)
        lifted = predictor.enter_call()
        try:
            return run(args, kwargs)
        finally:
            predictor.exit_call(lifted)

    @contextlib.contextmanager
    def block(self) -> Iterator[None]:
        """One `zero_copy()` block: torch calls go through the predictor until it ends."""
        predictor = self.predictor
        predictor.active += 1
        try:
            with ZeroCopyMode(predictor):
                yield
        finally:
            predictor.active -= 1
            predictor.end_interval(count=False)

    def key_for(self, key: GraphKey | Unkeyable, flat: Flattened, indices: Sequence[int]) -> GraphKey | Unkeyable:
        """The key of the graph reading the call's arguments where they are (`Lanes.key_for`)."""
        if isinstance(key, GraphKey):
            return self.lanes.key_for(key, flat, indices, self.stats)
        return key

    def placeholders(
        self, key: GraphKey, flat: Flattened, indices: Sequence[int]
    ) -> tuple[GraphKey, list[torch.Tensor]]:
        """The placeholders of `key`'s lane; the key then has the lane's generation as it is now (making them
        may have grown a lane buffer)."""
        lane = lane_of(key)
        leaves = flat.leaves
        placeholders = [
            self.lanes.placeholder(lane, index, spec, leaves[index])
            for index, spec in zip(indices, key.tensors, strict=True)
        ]
        return self.lanes.current(key), placeholders

    def wrap(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        key: GraphKey,
        indices: Sequence[int],
        placeholders: Sequence[torch.Tensor],
    ) -> Callable[..., Any]:
        """`fn` writing its carried outputs into the next call's lane (`CarryPlan.prepare`), if any are declared."""
        if self.carry.carries:
            return self.carry.prepare(fn, args, kwargs, key, indices, placeholders)
        return fn

    def captured(
        self, key: GraphKey, indices: Sequence[int], placeholders: Sequence[torch.Tensor], outputs: Any
    ) -> Any:
        """Carried outputs as views of the lane buffers the graph writes them to; positions whose placeholder
        the graph returns are pinned (never redirected)."""
        outputs = self.carry.rebind(key, outputs)
        self.lanes.pin_aliased_outputs(indices, placeholders, outputs)
        return outputs

    def stage(self, staging: Staging, key: GraphKey, leaves: Sequence[Any]) -> None:
        """Copy the arguments that are not in place; inside a `zero_copy()` block the predictor observes each
        argument first (`ZeroCopyPredictor.observe`). Carried outputs a graph copies inside itself count as
        copied input bytes."""
        predictor = self.predictor
        if predictor.active:
            pending = []
            addresses, strides = staging.addresses, staging.strides
            for i, position in enumerate(staging.positions):
                source = leaves[position]
                in_place = source.data_ptr() == addresses[i] and source.stride() == strides[i]
                predictor.observe(position, source, in_place)
                if not in_place:
                    pending.append(i)
            copy_pending(staging, leaves, pending, self.stats)
        else:
            stage_inputs(staging, leaves, self.stats)
        if self.carry.carries:
            self.stats.input_bytes_copied += self.carry.in_graph_bytes.get(key, 0)
