"""Plain-PyTorch references of the fused decode kernels, with the kernels' numerics.

Each computes in float32 and rounds to the tensor dtype exactly where its kernel does, which is where
Hugging Face's eager fp16 forward rounds too: a norm's output, a projection's output (bias added before
rounding, as cuBLAS's epilogue), each product and sum of the rotary embedding, an activation's output, a
residual sum. They are the oracle of the kernel tests and the CPU path of `step="fused"`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from tendril.generation.kernels.layers import Norm, Projection


def _round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype).float()


def normalize(x: torch.Tensor, norm: Norm | None) -> torch.Tensor:
    """`norm(x)` in x's dtype, as HF's LayerNorm / Llama's RMSNorm compute it."""
    if norm is None:
        return x
    if norm.kind == "layer":
        return F.layer_norm(x.float(), (x.shape[-1],), norm.weight.float(),
                            None if norm.bias is None else norm.bias.float(), norm.eps).to(x.dtype)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.eps)
    return (norm.weight.float() * _round(h, x.dtype)).to(x.dtype)


def activate(y: torch.Tensor, activation: str) -> torch.Tensor:
    """The activation of float32 `y`, in float32 (callers round)."""
    if activation == "none":
        return y
    if activation == "gelu_tanh":
        return 0.5 * y * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (y + 0.044715 * y * y * y)))
    if activation == "gelu":
        return 0.5 * y * (1.0 + torch.erf(y * (1.0 / math.sqrt(2.0))))
    if activation == "silu":
        return y * torch.sigmoid(y)
    if activation == "relu":
        return torch.relu(y)
    raise ValueError(f"unknown activation {activation!r}")


def _project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.float() @ weight.float().t()
    return y if bias is None else y + bias.float()


def fused_linear(
    x: torch.Tensor,
    projection: Projection,
    *,
    norm: Norm | None = None,
    activation: str = "none",
    gated: bool = False,
    addends: Sequence[torch.Tensor] = (),
) -> torch.Tensor:
    """[rows, in] -> [rows, out] in x's dtype: `norm`, the projection, then the activation (on the first
    of two segments times the second when `gated`), then each addend added in order."""
    dtype = x.dtype
    xn = normalize(x, norm)
    outputs = [_round(_project(xn, w, b), dtype) for w, b in zip(projection.weights, projection.biases, strict=True)]
    if gated:
        gate, up = outputs
        y = _round(activate(gate, activation), dtype) * up
    else:
        y = activate(torch.cat(outputs, dim=-1), activation)
    y = _round(y, dtype)
    for addend in addends:
        y = _round(y + addend.float(), dtype)
    return y.to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kind: str) -> torch.Tensor:
    """Rotary embedding of [rows, heads, head_dim] over the first `cos.shape[-1]` channels ([rows, R] tables).

    `kind` "half" is Llama's `x * cos + rotate_half(x) * sin`, "interleaved" GPT-J's with
    `rotate_every_two`; each product and the sum are rounded to x's dtype, as HF's fp16 ops do.
    """
    dims = cos.shape[-1]
    part = x[..., :dims].float()
    if kind == "half":
        first, second = part[..., : dims // 2], part[..., dims // 2 :]
        partner = torch.cat([-second, first], dim=-1)
    elif kind == "interleaved":
        partner = torch.stack([-part[..., 1::2], part[..., 0::2]], dim=-1).flatten(-2)
    else:
        raise ValueError(f"unknown rotary kind {kind!r}")
    c, s = cos[:, None, :].float(), sin[:, None, :].float()
    rotated = _round(_round(part * c, x.dtype) + _round(partner * s, x.dtype), x.dtype)
    return torch.cat([rotated.to(x.dtype), x[..., dims:]], dim=-1)


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
) -> torch.Tensor:
    """One query token per row over a static cache, writing its own key and value first.

    q: [rows, heads * D]; k, v: [rows, kv_heads * D]; keys/values: [rows, kv_heads, max_len, D] (written at `slot +
    slot_offset`, `slot` a one-element long tensor); key_valid: [rows, max_len] bool. The query sees valid slots
    before its own and its own. `rotary`: (kind, cos, sin) applied to q and k. `source_rows` ([rows, max_len] int,
    `StaticKVCache`'s row table): slot `s < slot` of row `r` is read from row `source_rows[r, s]` (the own slot
    always from row `r`, where it is written). Returns [rows, heads * D].
    """
    rows, kv_heads, _, head_dim = keys.shape
    q = q.reshape(rows, -1, head_dim)
    k = k.reshape(rows, kv_heads, head_dim)
    v = v.reshape(rows, kv_heads, head_dim)
    if rotary is not None:
        kind, cos, sin = rotary
        q, k = rotate(q, cos, sin, kind), rotate(k, cos, sin, kind)
    slot = slot.reshape(1) + slot_offset
    keys.index_copy_(2, slot, k[:, :, None].to(keys.dtype))
    values.index_copy_(2, slot, v[:, :, None].to(values.dtype))
    slots = torch.arange(keys.shape[2], device=keys.device)
    visible = (key_valid & (slots < slot)) | (slots == slot)  # [rows, max_len]
    if source_rows is not None:
        keys, values = _read_rows(keys, source_rows, slot), _read_rows(values, source_rows, slot)
    group = q.shape[1] // kv_heads
    scores = torch.einsum("rhd,rhsd->rhs", q.float(), keys.float().repeat_interleave(group, dim=1)) * scale
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    out = torch.einsum("rhs,rhsd->rhd", scores.softmax(-1), values.float().repeat_interleave(group, dim=1))
    return out.to(q.dtype).reshape(rows, -1)


def prompt_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_valid: torch.Tensor,
    scale: float,
    rotary: tuple[str, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """A prompt of P tokens per row into an empty cache: what `decode_attention` computes for each token in turn at
    slots 0..P-1 (token p sees the valid tokens before it and itself, and its key and value are written at slot p).

    q: [rows * P, heads * D]; k, v: [rows * P, kv_heads * D], row r's tokens at r * P .. r * P + P - 1 (so are
    `rotary`'s cos and sin); keys/values and key_valid as in `decode_attention`. Returns [rows * P, heads * D]."""
    rows = keys.shape[0]
    tokens = q.shape[0] // rows
    q, k, v = (t.view(rows, tokens, -1) for t in (q, k, v))
    rotaries: list[tuple[str, torch.Tensor, torch.Tensor] | None] = [None] * tokens
    if rotary is not None:
        kind, cos, sin = rotary[0], rotary[1].view(rows, tokens, -1), rotary[2].view(rows, tokens, -1)
        rotaries = [(kind, cos[:, token], sin[:, token]) for token in range(tokens)]
    outputs = []
    for token in range(tokens):
        slot = torch.tensor(token, device=keys.device)
        outputs.append(decode_attention(q[:, token], k[:, token], v[:, token], keys, values, key_valid, slot, scale,
                                        rotaries[token]))
    return torch.stack(outputs, dim=1).reshape(rows * tokens, -1)


def _read_rows(cache: torch.Tensor, source_rows: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """[rows, kv_heads, max_len, D] with slot `s` of row `r` taken from row `source_rows[r, s]` for `s < slot`
    and from row `r` for later slots (gathered explicitly: the oracle of the kernel's indirection)."""
    rows, _, max_len, _ = cache.shape
    slots = torch.arange(max_len, device=cache.device)
    own = torch.arange(rows, device=cache.device)[:, None]
    table = torch.where(slots < slot, source_rows.long(), own)  # [rows, max_len]
    return cache[table, :, slots[None, :].expand(rows, max_len)].permute(0, 2, 1, 3)


def step_inputs(
    sequences: torch.Tensor,
    counter: torch.Tensor,
    offset: int,
    position_base: torch.Tensor,
    tokens: torch.Tensor,
    positions: torch.Tensor | None,
    rotary: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A one-token step's inputs from a decode loop's state (`step_inputs_kernel.py`): the token at column `slot =
    counter + offset` of each row of `sequences` ([rows, width] long; `counter` one-element long), at position
    `position_base + slot` (`position_base` [rows] long). Returns its embedding `tokens[token]` ([vocab, hidden]
    table), plus `positions[position]` with learned positions (a table like `tokens`, summed as PyTorch adds), and
    the rows `rotary[position]` ([rows, 2, R]: cos then sin) of a rotary table ([positions, 2, R]) when there is
    one. The slot is clamped into the columns, tokens into the vocabulary and positions into the position tables."""
    rows, width = sequences.shape
    slot = (counter.reshape(()) + offset).clamp(0, width - 1)
    token = sequences.gather(1, slot.expand(rows, 1)).squeeze(1).clamp(0, tokens.shape[0] - 1)
    position = (position_base + slot).clamp(0, position_limit(positions, rotary) - 1)
    hidden = tokens[token]
    if positions is not None:
        hidden = hidden + positions[position]
    return hidden, None if rotary is None else rotary[position]


def position_limit(positions: torch.Tensor | None, rotary: torch.Tensor | None) -> int:
    """The positions every given position table of `step_inputs` holds (positions are clamped below it); 1 without
    tables."""
    return min([t.shape[0] for t in (positions, rotary) if t is not None], default=1)


def greedy_choice(
    scores: torch.Tensor,
    step: torch.Tensor,
    sequences: torch.Tensor,
    unfinished: torch.Tensor,
    eos: torch.Tensor,
    pad: int,
    prompt_len: int,
    max_new_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A greedy step's choice in PyTorch ops (`argmax_kernel.greedy_choice` documents the contract): the first
    largest score per row; with eos ids, finished rows take `pad` and rows choosing an eos id stop."""
    tokens = scores.argmax(-1)
    column = (prompt_len + step).clamp(max=sequences.shape[1] - 1)
    still_unfinished = unfinished
    if eos.numel() > 0:
        tokens = torch.where(unfinished, tokens, pad)
        still_unfinished = unfinished & (tokens[:, None] != eos).all(-1)
    written = sequences.scatter(1, column.expand(sequences.shape[0], 1), tokens[:, None])
    return step + 1, written, still_unfinished, tokens, (step + 1 < max_new_tokens) & still_unfinished.any()


def beam_top_k(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest scores of each row of `scores` [rows, n] and their indices, largest first, equal scores in
    index order, NaN above every number (`topk_kernel.beam_top_k`'s contract), without sorting whole rows: the
    k-th largest score, every score ranked above it and as many of the first scores equal to it as complete k,
    then those k sorted stably by score."""
    nan = scores.isnan()
    # one bit pattern for NaN and for zero: the GPU's radix sort and top-k rank by bits, not by value
    ranked = scores.masked_fill(nan, float("nan")).masked_fill(scores == 0, 0.0)
    kth = torch.topk(ranked, k, dim=-1).values[:, -1:]  # torch.topk ranks NaN above every number too
    kth_nan = kth.isnan()
    above = (ranked > kth) | (nan & ~kth_nan)
    at = (ranked == kth) | (nan & kth_nan)
    chosen = above | (at & (at.cumsum(-1) <= k - above.sum(-1, keepdim=True)))  # exactly k a row
    indices = torch.topk(chosen.to(torch.int8), k, dim=-1).indices.sort(dim=-1).values  # in index order
    order = ranked.gather(1, indices).sort(dim=-1, descending=True, stable=True).indices
    indices = indices.gather(1, order)
    return scores.gather(1, indices), indices
