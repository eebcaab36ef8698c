"""What the fused decode steps of every architecture share: the embedding in front of their layers.

A `FusedStep` is an architecture's fused forward split in two: its `Embedding` (token ids and positions to the first
hidden state, plus the rotary embedding's cos and sin rows where the family has one) and its layers (everything
after). Called as a `StepForward` it embeds with the model's own modules, for prompts and one-token steps alike.
Its `step_at` is the decode loops' entry: it reads the step's tokens and positions straight from the loop's state in
one kernel (`kernels.step_inputs`), where the loop would otherwise gather the tokens, add up slots and positions and
look up the tables in five or six PyTorch kernels at the head of every step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from tendril.generation.architectures.base import require
from tendril.generation.cache import StaticKVCache
from tendril.generation.kernels import Projection, step_inputs
from tendril.graphs.capture import capturing

Rotary = tuple[str, torch.Tensor, torch.Tensor]
"""(kind, cos, sin) as the attention kernels take it: cos and sin [tokens, R]."""

RotaryRows = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]
"""(x, length) -> cos and sin [length, R] for positions 0..length-1, in x's dtype and on its device."""

Layers = Callable[[torch.Tensor, Rotary | None, torch.Tensor, int, StaticKVCache, int], torch.Tensor]
"""(hidden [rows * T, width], rotary, query_slots, slot_offset, cache, rows) -> float32 logits of each row's last
token: a fused step after its embedding. A decode step (T = 1) writes the cache at `query_slots + slot_offset`."""


class RotaryTable:
    """A fused step's cos and sin: rows of a table over a cache's positions, gathered in one kernel a step.

    A model computes them from the positions in several kernels, each a launch the step waits for. Its operations
    are elementwise per position and, for the RoPE types the architectures accept, do not depend on the length, so
    the table `rows` computes once for positions `0..length - 1` holds, row for row, what it computes per step.
    Tables are built outside a CUDA graph capture (the decode loop runs its step once before capturing it) and never
    freed: a graph captured with one keeps reading it, so a longer cache adds a table instead of replacing one."""

    def __init__(self, rows: RotaryRows) -> None:
        self.rows = rows
        self.tables: list[torch.Tensor] = []
        """Every table built, [positions, 2, R] each: cos then sin, in the activations' dtype."""

    def table(self, x: torch.Tensor, length: int) -> torch.Tensor:
        """A table of at least `length` positions in `x`'s dtype and on its device (built if there is none yet)."""
        table = next((t for t in self.tables if t.shape[0] >= length and t.dtype == x.dtype and t.device == x.device),
                     None)
        if table is None:
            if capturing():
                raise RuntimeError(f"the fused step's rotary table for {length} positions is built outside a "
                                   f"CUDA graph capture: run the step once before capturing it")
            cos, sin = self.rows(x, length)
            table = torch.stack([cos, sin], dim=1)
            self.tables.append(table)
        return table

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [rows * T, R] for `positions` ([rows, T] long, each below `length`), in `x`'s dtype."""
        rows = self.table(x, length).index_select(0, positions.reshape(-1))
        return rows[:, 0], rows[:, 1]


@dataclass(frozen=True)
class Embedding:
    """Token ids (and positions) -> a fused step's first hidden state and rotary rows."""

    tokens: nn.Embedding
    positions: nn.Embedding | None = None
    """Learned positions, added to the token embedding (GPT-2)."""
    rotary: tuple[str, RotaryTable] | None = None
    """The rotary embedding's kind (`attention.py`'s) and table."""

    def __post_init__(self) -> None:
        for module in (self.tokens, self.positions):
            require(module is None or (type(module) is nn.Embedding and module.max_norm is None),
                    f"step='fused' reads embedding tables as they are and needs plain nn.Embedding modules, got "
                    f"{type(module).__name__}; use step='compiled'")

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor,
                 length: int) -> tuple[torch.Tensor, Rotary | None]:
        """`tokens` and `positions` ([rows, T] long, positions below `length`): hidden [rows * T, width] through the
        model's modules, and the rotary rows of the positions."""
        hidden = self.tokens(tokens)
        if self.positions is not None:
            hidden = hidden + self.positions(positions)
        rotary = None
        if self.rotary is not None:
            kind, table = self.rotary
            rotary = (kind, *table(hidden, positions, length))
        return hidden.view(-1, hidden.shape[-1]), rotary

    def at(self, sequences: torch.Tensor, counter: torch.Tensor, offset: int, position_base: torch.Tensor,
           length: int) -> tuple[torch.Tensor, Rotary | None]:
        """What `self(tokens, positions, length)` returns for one token a row: the token at column `counter + offset`
        of `sequences`, at position `position_base + counter + offset` (`kernels.step_inputs`)."""
        weight = self.tokens.weight
        kind, table = self.rotary if self.rotary is not None else ("", None)
        hidden, rows = step_inputs(sequences, counter, offset, position_base, weight,
                                   None if self.positions is None else self.positions.weight,
                                   None if table is None else table.table(weight, length))
        return hidden, None if rows is None else (kind, rows[:, 0], rows[:, 1])


class FusedStep:
    """A fused forward: `embedding`, then `layers`. Called as a `StepForward`; `step_at` for decode loops.

    `copied` lists the layers' projections that hold copies of the model's weights
    (`Projection.with_copies`): `refresh` writes those copies again, at the start of the prompt pass of every
    decode call whose rows read them (`Decoder.prefill`)."""

    def __init__(self, embedding: Embedding, layers: Layers, copied: Sequence[Projection] = ()) -> None:
        self.embedding = embedding
        self.layers = layers
        self.copied = tuple(p for p in copied if p.copies is not None)

    def refresh(self, rows: int) -> None:
        """Copy the model's weights into the copies, if launches of `rows` rows read them (capturable)."""
        for projection in self.copied:
            projection.refresh(rows)

    def __call__(
        self, tokens: torch.Tensor, positions: torch.Tensor, query_slots: torch.Tensor, cache: StaticKVCache
    ) -> torch.Tensor:
        hidden, rotary = self.embedding(tokens, positions, cache.max_len)
        return self.layers(hidden, rotary, query_slots, 0, cache, tokens.shape[0])

    def step_at(self, sequences: torch.Tensor, counter: torch.Tensor, offset: int, position_base: torch.Tensor,
                cache: StaticKVCache) -> torch.Tensor:
        """A decode step over the token at column `slot = counter + offset` of each row of `sequences` ([rows,
        width] long; `counter` a one-element long tensor), at cache slot `slot` and position `position_base + slot`:
        what `self(tokens, positions, slot, cache)` returns for them, with no PyTorch kernel before the first
        projection."""
        hidden, rotary = self.embedding.at(sequences, counter, offset, position_base, cache.max_len)
        return self.layers(hidden, rotary, counter.view(1), offset, cache, sequences.shape[0])
