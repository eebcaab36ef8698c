"""Attention of a whole prompt, a few tokens per row, with the cache write, in one kernel (the fused prompt pass).

A prompt of P tokens fills slots 0..P-1 of an empty cache, and token p attends to the valid tokens before it and to
itself: exactly what P decode steps at slots 0..P-1 would compute (`reference.prompt_attention` says it that way).
All of the keys and values it needs are the projection's outputs of this very pass, so one program per (query
token, query head) reads them from there, not from the cache: no program reads a slot another is writing, and one
launch serves the whole prompt. The program applies the rotary embedding to its query and, block by block, to the
keys of the tokens it attends to (the first query head of each kv group also stores its own token's rotated key and
value at the token's slot), rounding each key and value to the cache's dtype as the stored copy is, then runs an
online softmax over the blocks, latest block first: that block holds the query's own key, always visible, so the
running max is finite from the first block on. Rotation and roundings are the decode kernel's (`attention.py`), so
the cache holds what decode steps would have written.

Each program rotates the keys of every earlier token again; that is little work for the prompts the fused prompt
pass takes (`loop.FUSED_PROMPT_TOKENS`), and it keeps the pass to one kernel a layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tendril.generation.kernels import pdl as programmatic
from tendril.generation.kernels.attention import _ROTARY, _softmax_block, check_operands, check_rotary

MAX_BLOCK_S = 64
"""Largest block of key tokens a program reads at once."""


@triton.jit
def _load_rotated(ptrs, partner_ptrs, cos_ptrs, sin_ptrs, mask, rotary_mask, sign, ROTARY: tl.constexpr, dtype_ptr):
    """The values at `ptrs` in float32, rotated where `rotary_mask` holds as HF rotates them: `x * cos + rotate(x) *
    sin` with each product and the sum rounded to `dtype_ptr`'s element type (the partner values at `partner_ptrs`,
    times `sign`, are `rotate(x)`). Any shape: the pointers and masks broadcast."""
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    if ROTARY != 0:
        DTYPE = dtype_ptr.dtype.element_ty
        rotating = mask & rotary_mask
        cos = tl.load(cos_ptrs, mask=rotating, other=1.0).to(tl.float32)
        sin = tl.load(sin_ptrs, mask=rotating, other=0.0).to(tl.float32)
        other = tl.load(partner_ptrs, mask=rotating, other=0.0).to(tl.float32) * sign
        rotated = (x * cos).to(DTYPE).to(tl.float32) + (other * sin).to(DTYPE).to(tl.float32)
        x = tl.where(rotary_mask, rotated.to(DTYPE).to(tl.float32), x)
    return x


@triton.jit
def _prompt_attention_kernel(
    q_ptr,
    stride_qm,
    k_ptr,
    stride_km,
    v_ptr,
    stride_vm,
    cos_ptr,
    sin_ptr,
    stride_tm,
    keys_ptr,
    values_ptr,
    stride_cr,
    stride_ch,
    stride_cs,
    valid_ptr,
    stride_valid,
    out_ptr,
    stride_om,
    tokens,
    scale,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    ROTARY: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
    PDL: tl.constexpr,
):
    query = tl.program_id(0)  # row * tokens + token
    head = tl.program_id(1)
    row = query // tokens
    token = query % tokens
    kv_head = head // GROUP
    CACHE_DTYPE = keys_ptr.dtype.element_ty
    d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    d_mask = d < HEAD_DIM
    rotary_mask = d < ROTARY_DIM
    if ROTARY == 1:  # rotate_half: pairs (i, i + R/2)
        first_half = d < ROTARY_DIM // 2
        partner = tl.where(first_half, d + ROTARY_DIM // 2, d - ROTARY_DIM // 2)
        sign = tl.where(first_half, -1.0, 1.0)
    else:  # rotate_every_two: pairs (2i, 2i + 1); unused without a rotary embedding
        partner = d ^ 1
        sign = tl.where(d % 2 == 0, -1.0, 1.0)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()  # everything read here is the projection's output or a PyTorch kernel's

    q_base = q_ptr + query * stride_qm + head * HEAD_DIM
    table = query * stride_tm
    q = _load_rotated(q_base + d, q_base + partner, cos_ptr + table + d, sin_ptr + table + d, d_mask, rotary_mask,
                      sign, ROTARY, out_ptr)
    if head % GROUP == 0:  # this token's key and value into its slot
        k_base = k_ptr + query * stride_km + kv_head * HEAD_DIM
        k_own = _load_rotated(k_base + d, k_base + partner, cos_ptr + table + d, sin_ptr + table + d, d_mask,
                              rotary_mask, sign, ROTARY, out_ptr)
        v_own = tl.load(v_ptr + query * stride_vm + kv_head * HEAD_DIM + d, mask=d_mask, other=0.0)
        slot = row * stride_cr + kv_head * stride_ch + token * stride_cs + d
        tl.store(keys_ptr + slot, k_own.to(CACHE_DTYPE), mask=d_mask)
        tl.store(values_ptr + slot, v_own.to(CACHE_DTYPE), mask=d_mask)

    first = row * tokens  # the row's first token among the queries
    denominator = tl.sum(q, axis=0) * 0.0
    m = denominator - float("inf")
    acc = q * 0.0
    blocks = token // BLOCK_S + 1
    for i in range(0, blocks):
        s = (blocks - 1 - i) * BLOCK_S + tl.arange(0, BLOCK_S)  # [BLOCK_S] key tokens, latest block first
        attended = s <= token
        flags = tl.load(valid_ptr + row * stride_valid + s, mask=attended, other=0) != 0
        visible = attended & (flags | (s == token))
        tile_mask = attended[:, None] & d_mask[None, :]
        k_rows = k_ptr + (first + s)[:, None] * stride_km + kv_head * HEAD_DIM
        t_rows = (first + s)[:, None] * stride_tm
        keys = _load_rotated(k_rows + d[None, :], k_rows + partner[None, :], cos_ptr + t_rows + d[None, :],
                             sin_ptr + t_rows + d[None, :], tile_mask, rotary_mask[None, :], sign[None, :], ROTARY,
                             out_ptr)
        values = tl.load(v_ptr + (first + s)[:, None] * stride_vm + kv_head * HEAD_DIM + d[None, :], mask=tile_mask,
                         other=0.0)
        keys = keys.to(CACHE_DTYPE).to(tl.float32)
        values = values.to(CACHE_DTYPE).to(tl.float32)
        m, acc, denominator = _softmax_block(q, visible, keys, values, scale, m, acc, denominator)
    tl.store(out_ptr + query * stride_om + head * HEAD_DIM + d, (acc / denominator).to(out_ptr.dtype.element_ty),
             mask=d_mask)


def prompt_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_valid: torch.Tensor,
    scale: float,
    rotary: tuple[str, torch.Tensor, torch.Tensor] | None = None,
    *,
    out: torch.Tensor | None = None,
    block_s: int | None = None,
    num_warps: int = 4,
    pdl: bool | None = None,
) -> torch.Tensor:
    """The Triton kernel of `reference.prompt_attention` (same arguments and result), writing into `out`
    ([rows * P, heads * head_dim], contiguous rows) when given. `block_s` key tokens per block default to the
    prompt's length up to `MAX_BLOCK_S`; `pdl` as in `pdl.enabled`."""
    rows, kv_heads, max_len, head_dim = keys.shape
    queries = q.shape[0]
    if queries == 0 or queries % rows:
        raise ValueError(f"q holds {queries} tokens: expected the same number of tokens for each of {rows} rows")
    tokens = queries // rows
    if tokens > max_len:
        raise ValueError(f"a prompt of {tokens} tokens does not fit a cache of {max_len} slots")
    heads = check_operands(q, k, v, keys, values, key_valid, queries)
    kind, cos, sin = rotary if rotary is not None else (None, q, q)
    rotary_dim = check_rotary(rotary, queries, head_dim)
    if block_s is None:
        block_s = min(triton.next_power_of_2(tokens), MAX_BLOCK_S)
    pdl = programmatic.resolve(pdl, q.device, _prompt_attention_kernel)
    if out is None:
        out = torch.empty(queries, heads * head_dim, dtype=q.dtype, device=q.device)
    elif out.shape != (queries, heads * head_dim) or out.stride(1) != 1 or out.dtype != q.dtype:
        raise ValueError(f"out must be a {q.dtype} [{queries}, {heads * head_dim}] tensor with contiguous rows")
    _prompt_attention_kernel[(queries, heads)](
        q, q.stride(0), k, k.stride(0), v, v.stride(0),
        cos, sin, cos.stride(0),
        keys, values, keys.stride(0), keys.stride(1), keys.stride(2),
        key_valid.view(torch.uint8), key_valid.stride(0),
        out, out.stride(0),
        tokens, float(scale),
        GROUP=heads // kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_S=block_s,
        ROTARY=_ROTARY[kind],
        ROTARY_DIM=rotary_dim,
        PDL=pdl,
        num_warps=num_warps,
        enable_fp_fusion=False,
        launch_pdl=pdl,
    )
    return out
