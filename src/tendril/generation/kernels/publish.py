"""The device side of token streaming on CUDA, one small kernel each: publishing a chosen token into the ring
(`streaming.TokenRing`), and reading the device clock.

`publish` does what `TokenRing.publish` describes, in one kernel where PyTorch's operations take several
(select the slot, form the word, index the store): slot = (count - 1) % slots while the loop runs, else the
discard slot `slots`; then `stamps[slot]` = the device's global timer (`%globaltimer`, nanoseconds) and
`words[slot]` = `count << 32 | token`. The stamp is stored before the word but nothing orders the two stores
as the host sees them, so a stamp is only certain to be visible once the launch has returned; it says when
the device chose the token, for measuring how long the token took to reach the host.

`device_clock(out)` stores the global timer into `out[0]`: read from mapped memory, it relates device stamps
to a host clock.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _publish_kernel(words_ptr, stamps_ptr, live_ptr, count_ptr, token_ptr, slots, TOKEN_BITS: tl.constexpr):
    live = tl.load(live_ptr) != 0
    count = tl.load(count_ptr)
    token = tl.load(token_ptr)
    slot = tl.where(live, (count - 1) % slots, slots)
    tl.store(stamps_ptr + slot, tl.extra.cuda.globaltimer())
    tl.store(words_ptr + slot, (count << TOKEN_BITS) + token)


@triton.jit
def _clock_kernel(out_ptr):
    tl.store(out_ptr, tl.extra.cuda.globaltimer())


def publish(words: torch.Tensor, stamps: torch.Tensor, live: torch.Tensor, count: torch.Tensor,
            token: torch.Tensor, token_bits: int) -> None:
    """Token number `count` (0-d long) is `token` ([1] long): the word `count << token_bits | token` and the
    time, into slot (count - 1) % R of `words` and `stamps` ([R + 1] int64 each) if `live` (0-d bool), else
    into their last (discard) slot."""
    if words.shape != stamps.shape or words.dtype != torch.int64 or stamps.dtype != torch.int64:
        raise ValueError(f"words and stamps must be int64 tensors of one shape, got {words.dtype} "
                         f"{tuple(words.shape)} and {stamps.dtype} {tuple(stamps.shape)}")
    _publish_kernel[(1,)](words, stamps, live, count, token, words.shape[0] - 1, TOKEN_BITS=token_bits,
                          num_warps=1)


def device_clock(out: torch.Tensor) -> None:
    """Store the device's global timer (nanoseconds) into `out[0]` (an int64 CUDA tensor)."""
    if out.dtype != torch.int64 or not out.is_cuda or out.numel() < 1:
        raise ValueError(f"out must be a non-empty int64 CUDA tensor, got {out.dtype} {tuple(out.shape)} on "
                         f"{out.device}")
    _clock_kernel[(1,)](out, num_warps=1)
