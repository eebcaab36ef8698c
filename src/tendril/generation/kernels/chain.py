"""A chain of matrix-vector products in one persistent kernel: weights streamed across operation boundaries.

A decode step at batch 1 is a chain of projections, each waiting for the one before. Launched as one kernel each,
every projection pays a launch's ramp beyond its bytes over bandwidth: its programs start, their first loads cross
the memory system, and its last programs finish alone while the next kernel waits. Here one grid of at most one
program per SM (so that all are resident at once and may wait for each other) walks the chain's phases in order.
In each phase program p takes the column blocks p, p + programs, ...: it reads the first weight tile of its first
block into L2 *before* waiting for the phase before to finish (weights never depend on it), waits on that phase's
arrival counter, then computes its blocks, stores them and counts each one's arrival (an acq_rel atomic after a
CTA barrier). So a phase's first weight reads overlap the previous phase's tail, and no launch separates them.

`ProjectionChain` lays the chain out for the kernel: every weight ([out, in], K contiguous) in one flat buffer, the
input and every phase's output in one flat activation buffer, and a table of offsets and sizes per phase. Phase i
reads the first `in_i` values of phase i - 1's output (phase 0 reads the input). Products accumulate in float32;
each output is rounded to the buffers' dtype.

The interpreter runs a grid's programs one after another, so a program that waited for another would wait for
ever: there (and whenever `programs` is 1) one program runs every phase in order, and each wait finds its phase
already done. This is the experiment of the decode-roofline issue's persistent-kernel design: projections only
(no norm, activation, residual or attention), measured against the same chain as separate launches by
`benchmarks/tools/gemv_chain.py`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

BLOCK_N = 16
BLOCK_K = 512
"""Default columns and depth of a weight tile: 16 KiB of a 16-bit dtype, read as 16 runs of 1 KiB (a program has
two tiles' loads in flight, the next one's while it sums this one, so deeper tiles, with more warps, keep more bytes
in flight per SM)."""


@triton.jit
def _chain_kernel(weights_ptr, acts_ptr, table_ptr, counters_ptr, phases, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    depth = tl.arange(0, BLOCK_K)
    for phase in range(phases):
        row = table_ptr + phase * 5
        w_off = tl.load(row)
        x_off = tl.load(row + 1)
        y_off = tl.load(row + 2)
        n_out = tl.load(row + 3)
        n_in = tl.load(row + 4)
        tasks = tl.cdiv(n_out, BLOCK_N)
        first_cols = pid * BLOCK_N + cols
        first = tl.load(weights_ptr + w_off + first_cols[:, None].to(tl.int64) * n_in + depth[None, :],
                        mask=(first_cols < n_out)[:, None] & (depth < n_in)[None, :], other=0.0)
        # the first tile's bytes arrive in L2 before the wait; a store that never happens (n_out >= 1) keeps the
        # compiler from dropping the load, whose registers are free again once it is summed
        tl.store(counters_ptr + phase, tl.sum(first.to(tl.float32)).to(tl.int32), mask=n_out < 0)
        if phase > 0:  # wait until every block of the phase before has arrived
            before = tl.cdiv(tl.load(table_ptr + (phase - 1) * 5 + 3), BLOCK_N)
            arrived = tl.atomic_add(counters_ptr + phase - 1, 0, sem="acquire", scope="gpu")
            while arrived < before:
                arrived = tl.atomic_add(counters_ptr + phase - 1, 0, sem="acquire", scope="gpu")
            tl.debug_barrier()
        for task in range(pid, tasks, programs):
            n_idx = task * BLOCK_N + cols
            n_mask = n_idx < n_out
            w_rows = weights_ptr + w_off + n_idx[:, None].to(tl.int64) * n_in
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            w = tl.load(w_rows + depth[None, :], mask=n_mask[:, None] & (depth < n_in)[None, :], other=0.0)
            for k0 in tl.range(0, n_in, BLOCK_K, num_stages=STAGES):
                k_idx = k0 + depth
                k_mask = k_idx < n_in
                k_next = k_idx + BLOCK_K  # the next tile's loads are in flight while this one is summed
                w_next = tl.load(w_rows + k_next[None, :], mask=n_mask[:, None] & (k_next < n_in)[None, :], other=0.0)
                x = tl.load(acts_ptr + x_off + k_idx, mask=k_mask, other=0.0, cache_modifier=".cg")
                acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
                w = w_next
            tl.store(acts_ptr + y_off + n_idx, acc.to(acts_ptr.dtype.element_ty), mask=n_mask)
            tl.debug_barrier()  # every thread's outputs stored before the release below
            tl.atomic_add(counters_ptr + phase, 1, sem="acq_rel", scope="gpu")


class ProjectionChain:
    """`y_0 = W_0 x`, `y_i = W_i y_{i-1}[:in_i]`, run by one persistent kernel (`run`); see the module docstring.

    The weights are copied into one flat buffer at construction; `in_i` must not exceed `out_{i-1}`. `table` holds
    a row per phase: weight offset, input offset, output offset (elements), out features, in features."""

    def __init__(self, weights: Sequence[torch.Tensor]) -> None:
        if not weights:
            raise ValueError("a chain needs at least one weight")
        first = weights[0]
        for index, w in enumerate(weights):
            if w.dim() != 2 or w.dtype != first.dtype or w.device != first.device:
                raise ValueError(f"weight {index}: expected a 2-D {first.dtype} tensor on {first.device}, got "
                                 f"{w.dtype} {tuple(w.shape)} on {w.device}")
            if index and w.shape[1] > weights[index - 1].shape[0]:
                raise ValueError(f"weight {index} reads {w.shape[1]} inputs, but phase {index - 1} makes only "
                                 f"{weights[index - 1].shape[0]}")
        self.device, self.dtype = first.device, first.dtype
        self.in_features = first.shape[1]
        self.out_features = weights[-1].shape[0]
        self.weights = torch.cat([w.reshape(-1) for w in weights])
        rows, w_off, y_off, x_off = [], 0, first.shape[1], 0
        for w in weights:
            out, inp = w.shape
            rows.append([w_off, x_off, y_off, out, inp])
            w_off, x_off, y_off = w_off + out * inp, y_off, y_off + out
        self.acts = torch.zeros(y_off, dtype=self.dtype, device=self.device)
        self.table = torch.tensor(rows, dtype=torch.int64, device=self.device)
        self.counters = torch.zeros(len(weights), dtype=torch.int32, device=self.device)
        self.bytes_read = sum(w.numel() * w.element_size() for w in weights)

    def run(self, x: torch.Tensor, programs: int | None = None, *, block_k: int = BLOCK_K, num_warps: int = 4,
            stages: int = 1, per_sm: int = 1) -> torch.Tensor:
        """The chain's last output for input `x` ([in_features]), a view of the activation buffer (overwritten by
        the next run). `programs`: the persistent grid, at most `per_sm` per SM (all must be resident at once:
        the caller answers for `per_sm` > 1); default one per SM on CUDA, and 1 elsewhere (the interpreter runs
        programs one after another). `block_k`: the tiles' depth (a power of two, at least 16); `stages`: the
        software pipeline's depth over each tile's K loop (1: none)."""
        if x.shape != (self.in_features,) or x.dtype != self.dtype:
            raise ValueError(f"x must be a {self.dtype} vector of {self.in_features}, got {x.dtype} {tuple(x.shape)}")
        if block_k < 16 or block_k & (block_k - 1):
            raise ValueError(f"block_k must be a power of two of at least 16, got {block_k}")
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count if self.device.type == "cuda" else 1
        limit = sms * per_sm
        programs = limit if programs is None else programs
        if not 1 <= programs <= limit:
            raise ValueError(f"programs must be between 1 and {limit} ({per_sm} per SM, every program resident at once), "
                             f"got {programs}")
        self.acts[: self.in_features].copy_(x)
        self.counters.zero_()
        _chain_kernel[(programs,)](self.weights, self.acts, self.table, self.counters, self.table.shape[0],
                                   BLOCK_N=BLOCK_N, BLOCK_K=block_k, STAGES=stages, num_warps=num_warps)
        return self.acts[-self.out_features:]


def reference_chain(weights: Sequence[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """`ProjectionChain.run` in plain PyTorch: each product in float32, rounded to the dtype."""
    y = x
    for w in weights:
        y = (w.float() @ y[: w.shape[1]].float()).to(x.dtype)
    return y
