"""Attention of one query token per row over tendril's static KV cache, with the cache write, in one kernel.

The unfused step builds a [rows, 1, 1, max_len] mask from the cache's `key_valid` and the query slot, writes the new
key and value with two `index_copy_`s and calls SDPA: several kernels per layer. Here one program per (row, query
head) loads its query and its kv head's new key and value (from the projection's output, in place), applies the
rotary embedding when there is one, stores the key and value at the slot (the first query head of each kv group
does; the others use the values in registers, so no program reads a slot another is writing), and runs an online
softmax over the valid slots before the query's, in blocks of `BLOCK_S`, seeded with its own key. The slot is read
on the device: the loop covers only slots written so far, and one compiled kernel serves every step. A block's keys,
values and validity flags load at once (the flags mask the scores and values afterwards, not the loads), and by
default a block is the whole cache up to `MAX_BLOCK_S` slots, and a short tail block (`MAX_TAIL_S`) holds the next
slots: one memory round trip per step for caches of up to both. Under programmatic dependent launch (`pdl.py`) the
kernel starts during the projection before it, and before waiting for it loads what no kernel of the step writes:
the slot (`slot + slot_offset`, from a slot tensor computed before the step's kernels or from the loop's step
counter) and the first block and the tail of earlier slots with their flags and row table (earlier steps wrote
those; this step writes only the slot at `slot`, which the blocks exclude). After the wait it loads the projection's
q, k and v with the rotary embedding's cos and sin, so a cache of up to a block and its tail costs one memory round
trip after the wait.

The kernel is compiled with `enable_fp_fusion=False`: in float32 the compiler would otherwise contract the
rotary embedding's `x * cos + rotate(x) * sin` into a fused multiply-add, one rounding where HF's eager ops
(separate multiply and add kernels) round twice, and the key written to the cache would differ from HF's in
the last bit. (In fp16/bf16 the explicit rounding of each product already keeps them apart.)

With a row table (`source_rows`, beam search's reorder by indirection, see `StaticKVCache`) slot `s` of
row `r` is read from row `source_rows[r, s]`: the table's entries load with the validity flags and only
offset the key/value loads, so greedy decoding (no table) compiles the kernel without them.

One program walks all earlier slots of its (row, head): right for the short caches of a decode step at
batch 1 (a few hundred slots); long contexts would want the slots split across programs (flash decoding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tendril.generation.kernels import pdl as programmatic

_ROTARY = {None: 0, "half": 1, "interleaved": 2}


@triton.jit
def _decode_attention_kernel(
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
    table_ptr,
    stride_table,
    slot_ptr,
    slot_offset,
    out_ptr,
    stride_om,
    scale,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    TAIL_S: tl.constexpr,
    ROTARY: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
    INDIRECT: tl.constexpr,
    PDL: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    DTYPE = out_ptr.dtype.element_ty
    CACHE_DTYPE = keys_ptr.dtype.element_ty
    d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    d_mask = d < HEAD_DIM
    cache_row = row * stride_cr + kv_head * stride_ch

    # before the wait, what no kernel of the step writes (module docstring): the slot, the first block of earlier
    # slots with their flags (and row table), and the tail block after it
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    slot = tl.load(slot_ptr) + slot_offset
    valid, keys, values = _earlier_slots(keys_ptr, values_ptr, stride_cr, stride_ch, stride_cs, valid_ptr,
                                         stride_valid, table_ptr, stride_table, row, kv_head, cache_row, slot, 0,
                                         d, d_mask, BLOCK_S, INDIRECT)
    tail_valid, tail_keys, tail_values = valid, keys, values
    if TAIL_S > 0:
        tail_valid, tail_keys, tail_values = _earlier_slots(keys_ptr, values_ptr, stride_cr, stride_ch, stride_cs,
                                                            valid_ptr, stride_valid, table_ptr, stride_table, row,
                                                            kv_head, cache_row, slot, BLOCK_S, d, d_mask, TAIL_S,
                                                            INDIRECT)
    if PDL:
        tl.extra.cuda.gdc_wait()  # q, k and v are the projection's; cos and sin the step's inputs

    q_base = q_ptr + row * stride_qm + head * HEAD_DIM
    k_base = k_ptr + row * stride_km + kv_head * HEAD_DIM
    q = tl.load(q_base + d, mask=d_mask, other=0.0).to(tl.float32)
    k_new = tl.load(k_base + d, mask=d_mask, other=0.0).to(tl.float32)
    v_new = tl.load(v_ptr + row * stride_vm + kv_head * HEAD_DIM + d, mask=d_mask, other=0.0).to(tl.float32)
    if ROTARY != 0:
        r_mask = d < ROTARY_DIM
        cos = tl.load(cos_ptr + row * stride_tm + d, mask=r_mask, other=1.0).to(tl.float32)
        sin = tl.load(sin_ptr + row * stride_tm + d, mask=r_mask, other=0.0).to(tl.float32)
        if ROTARY == 1:  # rotate_half: pairs (i, i + R/2)
            first_half = d < ROTARY_DIM // 2
            partner = tl.where(first_half, d + ROTARY_DIM // 2, d - ROTARY_DIM // 2)
            sign = tl.where(first_half, -1.0, 1.0)
        else:  # rotate_every_two: pairs (2i, 2i + 1)
            partner = d ^ 1
            sign = tl.where(d % 2 == 0, -1.0, 1.0)
        # HF's x * cos + rotate(x) * sin, each product and the sum rounded to DTYPE (inline: the interpreter
        # re-patches triton.language on every nested jit call)
        q_other = tl.load(q_base + partner, mask=r_mask, other=0.0).to(tl.float32) * sign
        q_rot = (q * cos).to(DTYPE).to(tl.float32) + (q_other * sin).to(DTYPE).to(tl.float32)
        q = tl.where(r_mask, q_rot.to(DTYPE).to(tl.float32), q)
        k_other = tl.load(k_base + partner, mask=r_mask, other=0.0).to(tl.float32) * sign
        k_rot = (k_new * cos).to(DTYPE).to(tl.float32) + (k_other * sin).to(DTYPE).to(tl.float32)
        k_new = tl.where(r_mask, k_rot.to(DTYPE).to(tl.float32), k_new)
    k_new = k_new.to(CACHE_DTYPE).to(tl.float32)
    v_new = v_new.to(CACHE_DTYPE).to(tl.float32)

    if head % GROUP == 0:
        tl.store(keys_ptr + cache_row + slot * stride_cs + d, k_new.to(CACHE_DTYPE), mask=d_mask)
        tl.store(values_ptr + cache_row + slot * stride_cs + d, v_new.to(CACHE_DTYPE), mask=d_mask)

    # online softmax, seeded with the query's own key (always visible, so every running max is finite), over the
    # first block (loaded above), then over the later ones (caches longer than a block) as they load
    m = tl.sum(q * k_new, axis=0) * scale
    denominator = m * 0.0 + 1.0
    acc = v_new
    m, acc, denominator = _softmax_block(q, valid, keys, values, scale, m, acc, denominator)
    if TAIL_S > 0:  # noqa: SIM102 (a compile-time test, then a run-time one)
        if slot > BLOCK_S:  # earlier steps skip the tail's arithmetic (its loads were masked: no memory traffic)
            m, acc, denominator = _softmax_block(q, tail_valid, tail_keys, tail_values, scale, m, acc, denominator)
    for start in range(BLOCK_S + TAIL_S, slot, BLOCK_S):
        valid, keys, values = _earlier_slots(keys_ptr, values_ptr, stride_cr, stride_ch, stride_cs, valid_ptr,
                                             stride_valid, table_ptr, stride_table, row, kv_head, cache_row, slot,
                                             start, d, d_mask, BLOCK_S, INDIRECT)
        m, acc, denominator = _softmax_block(q, valid, keys, values, scale, m, acc, denominator)
    tl.store(out_ptr + row * stride_om + head * HEAD_DIM + d, (acc / denominator).to(DTYPE), mask=d_mask)


@triton.jit
def _earlier_slots(keys_ptr, values_ptr, stride_cr, stride_ch, stride_cs, valid_ptr, stride_valid, table_ptr,
                   stride_table, row, kv_head, cache_row, slot, start, d, d_mask, BLOCK_S: tl.constexpr,
                   INDIRECT: tl.constexpr):
    """The validity flags, keys and values (float32) of slots [start, start + BLOCK_S) before `slot`.

    The flags, keys and values load independently (masking the cache reads by the flags would wait for them);
    with a row table the keys and values wait for the table's entries, loaded alongside the flags. Slots at
    or past `slot` are not read."""
    s = start + tl.arange(0, BLOCK_S)  # [BLOCK_S]
    valid = tl.load(valid_ptr + row * stride_valid + s, mask=s < slot, other=0) != 0
    if INDIRECT:  # each slot from the row its table entry names
        source = tl.load(table_ptr + row * stride_table + s, mask=s < slot, other=0).to(tl.int64)
        slot_rows = source * stride_cr + kv_head * stride_ch + s * stride_cs  # [BLOCK_S]
    else:
        slot_rows = cache_row + s * stride_cs
    offsets = slot_rows[:, None] + d[None, :]  # [BLOCK_S, BLOCK_D]
    tile_mask = (s < slot)[:, None] & d_mask[None, :]
    keys = tl.load(keys_ptr + offsets, mask=tile_mask, other=0.0).to(tl.float32)
    values = tl.load(values_ptr + offsets, mask=tile_mask, other=0.0).to(tl.float32)
    return valid, keys, values


@triton.jit
def _softmax_block(q, valid, keys, values, scale, m, acc, denominator):
    """The online softmax's running max `m`, weighted sum `acc` and `denominator` after one block of slots."""
    scores = tl.where(valid, tl.sum(keys * q[None, :], axis=1) * scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=0))
    alpha = tl.exp(m - m_new)
    p = tl.exp(scores - m_new)  # [BLOCK_S]
    values = tl.where(valid[:, None], values, 0.0)  # a slot never written may hold anything
    acc = acc * alpha + tl.sum(p[:, None] * values, axis=0)
    denominator = denominator * alpha + tl.sum(p, axis=0)
    return m_new, acc, denominator


INTERPRETED = not isinstance(_decode_attention_kernel, triton.runtime.JITFunction)
"""True when Triton runs kernels in its interpreter (`tendril.settings.triton_interpret`, TRITON_INTERPRET=1, when
this module was imported): told by what Triton made of the kernel, not by reading the variable again."""

MAX_BLOCK_S = 128
"""Largest default slot block. Every slot of a block costs registers and arithmetic whether or not it is written yet
(slots at or past the query's are masked, not skipped), so a block sized for a long cache slows every early step;
past this size that costs more than walking a second block (one more memory round trip)."""
MAX_TAIL_S = 32
"""Largest default tail block: the slots just past the first block, loaded with it before the wait, so that a cache
a little longer than a block costs no second round trip after the wait. Steps before the tail skip its arithmetic
but hold its registers, so it stays short."""


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_valid: torch.Tensor,
    slot: torch.Tensor,
    scale: float,
    rotary: tuple[str, torch.Tensor, torch.Tensor] | None = None,
    *,
    source_rows: torch.Tensor | None = None,
    slot_offset: int = 0,
    out: torch.Tensor | None = None,
    block_s: int | None = None,
    tail_s: int | None = None,
    num_warps: int = 4,
    pdl: bool | None = None,
) -> torch.Tensor:
    """The Triton kernel of `reference.decode_attention` (same arguments and result), writing into `out`
    ([rows, heads * head_dim], contiguous rows) when given. `block_s` slots per block default to the cache
    length up to `MAX_BLOCK_S`; `tail_s` slots of a tail block (a power of two, 0 for none) to the rest of the
    cache up to `MAX_TAIL_S`; `pdl` as in `pdl.enabled`; `source_rows` and `slot_offset` as in the reference."""
    rows, kv_heads, max_len, head_dim = keys.shape
    heads = check_operands(q, k, v, keys, values, key_valid, rows)
    if source_rows is not None and (source_rows.shape != (rows, max_len) or source_rows.dtype != torch.int32
                                    or source_rows.stride(1) != 1):
        raise ValueError(f"source_rows must be an int32 [{rows}, {max_len}] tensor with contiguous rows, got "
                         f"{source_rows.dtype} {tuple(source_rows.shape)} strides {source_rows.stride()}")
    if slot.numel() != 1 or slot.dtype != torch.long:
        raise ValueError(f"slot must be a one-element int64 tensor, got {slot.dtype} {tuple(slot.shape)}")
    kind, cos, sin = rotary if rotary is not None else (None, q, q)
    rotary_dim = check_rotary(rotary, rows, head_dim)
    if block_s is None:
        block_s = min(triton.next_power_of_2(max_len), MAX_BLOCK_S)
    if tail_s is None:
        tail_s = min(triton.next_power_of_2(max_len - block_s), MAX_TAIL_S) if max_len > block_s else 0
    elif tail_s < 0 or tail_s & (tail_s - 1):
        raise ValueError(f"tail_s must be 0 or a power of two, got {tail_s}")
    pdl = programmatic.resolve(pdl, q.device, _decode_attention_kernel)
    if out is None:
        out = torch.empty(rows, heads * head_dim, dtype=q.dtype, device=q.device)
    elif out.shape != (rows, heads * head_dim) or out.stride(1) != 1 or out.dtype != q.dtype:
        raise ValueError(f"out must be a {q.dtype} [{rows}, {heads * head_dim}] tensor with contiguous rows")
    _decode_attention_kernel[(rows, heads)](
        q, q.stride(0), k, k.stride(0), v, v.stride(0),
        cos, sin, cos.stride(0),
        keys, values, keys.stride(0), keys.stride(1), keys.stride(2),
        key_valid.view(torch.uint8), key_valid.stride(0),
        source_rows if source_rows is not None else slot, source_rows.stride(0) if source_rows is not None else 0,
        slot, slot_offset,
        out, out.stride(0),
        float(scale),
        GROUP=heads // kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_S=block_s,
        TAIL_S=tail_s,
        ROTARY=_ROTARY[kind],
        ROTARY_DIM=rotary_dim,
        INDIRECT=source_rows is not None,
        PDL=pdl,
        num_warps=num_warps,
        enable_fp_fusion=False,
        launch_pdl=pdl,
    )
    return out


def check_operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   key_valid: torch.Tensor, queries: int) -> int:
    """The query heads; a ValueError unless q, k and v hold `queries` query tokens ([queries, heads * head_dim] and
    [queries, kv_heads * head_dim], contiguous rows) over the cache `keys`/`values` ([rows, kv_heads, max_len,
    head_dim], one layout) with its `key_valid` flags (bool [rows, max_len])."""
    rows, kv_heads, max_len, head_dim = keys.shape
    if values.shape != keys.shape or values.stride() != keys.stride() or keys.stride(3) != 1:
        raise ValueError(f"keys and values must share shape and strides with contiguous head_dim, got "
                         f"{tuple(keys.shape)} {keys.stride()} and {tuple(values.shape)} {values.stride()}")
    heads = q.shape[1] // head_dim
    for name, t, width in (("q", q, heads * head_dim), ("k", k, kv_heads * head_dim), ("v", v, kv_heads * head_dim)):
        if t.shape != (queries, width) or t.stride(1) != 1:
            raise ValueError(f"{name} must be [{queries}, {width}] with contiguous rows, got {tuple(t.shape)} "
                             f"strides {t.stride()}")
    if heads % kv_heads != 0:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} kv heads")
    if key_valid.shape != (rows, max_len) or key_valid.dtype != torch.bool or key_valid.stride(1) != 1:
        raise ValueError(f"key_valid must be a bool [{rows}, {max_len}] tensor, got {key_valid.dtype} "
                         f"{tuple(key_valid.shape)}")
    return heads


def check_rotary(rotary: tuple[str, torch.Tensor, torch.Tensor] | None, queries: int, head_dim: int) -> int:
    """The rotary embedding's width R (0 without one); a ValueError unless its cos and sin are [queries, R] with
    equal strides and contiguous rows, R even and at most `head_dim`."""
    if rotary is None:
        return 0
    _, cos, sin = rotary
    rotary_dim = cos.shape[-1]
    if (cos.shape != (queries, rotary_dim) or sin.stride() != cos.stride() or cos.stride(1) != 1
            or rotary_dim > head_dim or rotary_dim % 2):
        raise ValueError(f"rotary cos/sin must be [{queries}, R] (R even, <= {head_dim}) with equal strides, got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    return rotary_dim
