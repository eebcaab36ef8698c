"""Counter-based random numbers for sampling inside a device loop.

A generator's state advances on the host: a graph replays the same philox offset on every iteration
of a device-side WHILE loop, so `torch.multinomial` inside the loop body would draw identical numbers
each step. Instead, one random key per call is drawn from a `torch.Generator` (seeded by the caller, or
torch's default generator) before the loop, and each step's numbers are a hash of (key, step, row,
index) computed with integer tensor ops, with the step read from a device tensor: reproducible, distinct
per step, and capturable. Sampling then uses the Gumbel-max trick: `argmax(scores + Gumbel)` draws
from `softmax(scores)`, and the top-k of `scores + Gumbel` draws k items without replacement
(the same distributions as `torch.multinomial`).

The hash is Chris Wellons' `lowbias32`, with each 32x32-bit product split in 16-bit halves so every
intermediate fits in int64 (no reliance on signed overflow).
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x * constant) mod 2**32 for x in [0, 2**32) held in int64."""
    low = x * (constant & 0xFFFF)
    high = ((x * (constant >> 16)) & 0xFFFF) << 16
    return (low + high) & _MASK32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def draw_key(device: torch.device, seed: int | None) -> torch.Tensor:
    """A 0-d int64 key in [0, 2**32) from a generator seeded with `seed` (torch's default one if None)."""
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
    return torch.randint(0, 2**32, (), generator=generator, device=device, dtype=torch.int64)


def uniform(key: torch.Tensor, step: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
    """[rows, columns] float32 in (0, 1), a pure function of (key, step, row, column).

    Each row gets its own 32-bit key; a column's bits hash the row key plus a Weyl sequence in the
    column, hashed again with the row key (one hash round alone showed a heavy chi-square tail).
    """
    device = key.device
    row_keys = hash32((hash32(key ^ ((step * _GOLDEN) & _MASK32)) + torch.arange(rows, device=device)) & _MASK32)
    weyl = (torch.arange(columns, device=device) * _GOLDEN) & _MASK32
    first = hash32((row_keys[:, None] + weyl[None, :]) & _MASK32)
    bits = hash32(first ^ row_keys[:, None])
    return ((bits >> 8).to(torch.float32) + 0.5) * (2.0**-24)


def gumbel(key: torch.Tensor, step: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
    """Standard Gumbel noise [rows, columns] (float32)."""
    return -torch.log(-torch.log(uniform(key, step, rows, columns)))
