"""How a call's tensor arguments reach the placeholders its graph reads.

Each graph reads one placeholder per tensor argument: a view of the callable's buffer for that argument
position (`memory.PlaceholderArena`), shared by every shape. Before a replay, the call copies each
argument into its placeholder, all in one batch, except an argument that already *is* its placeholder
(same address and strides; the key already fixed shape, dtype and device): one written there through
`static_inputs`/`inputs_for`, or by a zero-copy redirect.

`InputPlacement` is that plain policy, and the hooks the dispatcher calls on it are where the zero-copy
plug-in (`tendril.graphs.zero_copy.plugin.ZeroCopy`) adds placeholder lanes, redirects and carried
state. A callable that never uses zero-copy keeps the plain policy for life.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tendril.graphs.key import Flattened, GraphKey, Unkeyable
from tendril.graphs.memory import PlaceholderArena
from tendril.graphs.stats import GraphStats


@dataclass(frozen=True)
class Staging:
    """What staging a graph's inputs needs about its placeholders, computed once per graph."""

    positions: list[int]
    placeholders: list[torch.Tensor]
    addresses: list[int]
    strides: list[tuple[int, ...]]
    storages: list[int]
    """Start address of each placeholder's storage (a source in one of them may need a clone first)."""
    nbytes: list[int]
    total_bytes: int

    @classmethod
    def of(cls, positions: Sequence[int], placeholders: Sequence[torch.Tensor]) -> Staging:
        nbytes = [placeholder.numel() * placeholder.element_size() for placeholder in placeholders]
        return cls(
            list(positions),
            list(placeholders),
            [placeholder.data_ptr() for placeholder in placeholders],
            [placeholder.stride() for placeholder in placeholders],
            [placeholder.untyped_storage().data_ptr() for placeholder in placeholders],
            nbytes,
            sum(nbytes),
        )


def stage_inputs(staging: Staging, leaves: Sequence[Any], stats: GraphStats) -> None:
    """Copy a call's tensor arguments into the placeholders they are not already in, in one batch."""
    addresses, strides = staging.addresses, staging.strides
    pending = [
        i
        for i, position in enumerate(staging.positions)
        if leaves[position].data_ptr() != addresses[i] or leaves[position].stride() != strides[i]
    ]
    copy_pending(staging, leaves, pending, stats)


def copy_pending(staging: Staging, leaves: Sequence[Any], pending: Sequence[int], stats: GraphStats) -> None:
    """Copy the arguments of placeholders `pending` (indices into `staging`) and count every argument.

    A source that lives in another argument's placeholder (or partly in its own) would be overwritten by
    the batch before it is read, so it is cloned first: the answer stays the eager one.
    """
    copied = sum(staging.nbytes[i] for i in pending)
    stats.input_copies_avoided += len(staging.positions) - len(pending)
    stats.input_bytes_avoided += staging.total_bytes - copied
    if not pending:
        return
    written = {staging.storages[i] for i in pending}
    sources = [leaves[staging.positions[i]] for i in pending]
    sources = [source.clone() if source.untyped_storage().data_ptr() in written else source for source in sources]
    torch._foreach_copy_([staging.placeholders[i] for i in pending], sources)
    stats.input_copies += len(pending)
    stats.input_bytes_copied += copied


class InputPlacement:
    """Plain placement: one placeholder per argument position, and a copy into it at each call.

    The dispatcher calls these hooks; each returns what it was given where the plain policy has nothing
    to add.
    """

    def __init__(self, arena: PlaceholderArena, stats: GraphStats) -> None:
        self.arena = arena
        self.stats = stats

    def key_for(self, key: GraphKey | Unkeyable, flat: Flattened, indices: Sequence[int]) -> GraphKey | Unkeyable:
        """The key of the graph that serves a call with key `key` (`indices`: its tensor leaves)."""
        return key

    def placeholders(
        self, key: GraphKey, flat: Flattened, indices: Sequence[int]
    ) -> tuple[GraphKey, list[torch.Tensor]]:
        """The placeholders a new graph for `key` reads, holding the call's values, and the key to file it under."""
        leaves = flat.leaves
        return key, [
            self.arena.placeholder(index, spec, leaves[index]) for index, spec in zip(indices, key.tensors, strict=True)
        ]

    def wrap(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        key: GraphKey,
        indices: Sequence[int],
        placeholders: Sequence[torch.Tensor],
    ) -> Callable[..., Any]:
        """The function to capture for `key`, called with `args`/`kwargs` (which hold the placeholders)."""
        return fn

    def captured(
        self, key: GraphKey, indices: Sequence[int], placeholders: Sequence[torch.Tensor], outputs: Any
    ) -> Any:
        """The outputs a new graph's calls return, given what its capture returned."""
        return outputs

    def stage(self, staging: Staging, key: GraphKey, leaves: Sequence[Any]) -> None:
        """Put a call's tensor arguments where the graph of `key` reads them, before it replays."""
        stage_inputs(staging, leaves, self.stats)
