"""tendril's static KV cache: preallocated per-layer key/value tensors indexed by absolute slot.

Slot `s` of every row holds the token at position `s` of the padded sequence: slots `0..P-1` hold the
(left-padded) prompt, slot `P + i` the `i`-th generated token, so the cache is sized once from the prompt
length and `max_new_tokens` and its addresses never change. Which slots a query may attend to is a
boolean mask computed on the device from `key_valid` (the prompt's attention mask, then all ones) and
the query's slot, so the same captured kernels serve every step: no host decision, no reallocation.

Writes use `index_copy_` with slot indices held in device tensors. Beam search reorders rows in one of two
ways, both keeping the cache's storage (and a graph's placeholders) fixed:

- physically (the default): every layer's keys and values are gathered by source row and copied back in
  place, several layers per kernel (`REORDER_GROUP_BYTES`), which `attend` (the eager and compiled steps,
  PyTorch's SDPA over whole rows) needs;
- through a row table (`row_table=True`, FasterTransformer's indirection): `source_rows[r, s]` names the
  physical row holding slot `s` of the sequence now in row `r`. A reorder gathers that small int32 table
  instead of the cache, each row writes its new token's key and value in its own row, and attention reads
  slot `s` of row `r` from row `source_rows[r, s]`. Only the fused decode kernels read through the table
  (`kernels.decode_attention(source_rows=...)`); `attend` refuses a cache that has been reordered this way.

`key_valid` is a property of the sequence, not of the storage: it is reordered physically in both modes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

REORDER_GROUP_BYTES = 64 << 20
"""A physical reorder gathers as many layers at once as fit in this many bytes: two kernels per group instead of
two per layer's keys and values, for a temporary copy of at most one group."""


class StaticKVCache:
    """Keys and values of every layer for `rows` sequences of up to `max_len` tokens."""

    def __init__(
        self,
        num_layers: int,
        rows: int,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        key_valid: torch.Tensor,
        row_table: bool = False,
    ) -> None:
        if key_valid.shape != (rows, max_len) or key_valid.dtype != torch.bool:
            raise ValueError(f"key_valid must be a bool tensor of shape ({rows}, {max_len}), got {key_valid.dtype} "
                             f"{tuple(key_valid.shape)}")
        self.storage = torch.zeros((num_layers, 2, rows, kv_heads, max_len, head_dim), dtype=dtype, device=device)
        """Every layer's keys and values in one tensor, so that a physical reorder gathers many layers at once."""
        self.keys = [self.storage[layer, 0] for layer in range(num_layers)]
        self.values = [self.storage[layer, 1] for layer in range(num_layers)]
        self.key_valid = key_valid
        """[rows, max_len] bool: slots that hold real tokens (False for left padding)."""
        self.slots = torch.arange(max_len, device=device)
        self.row_ids = torch.arange(rows, dtype=torch.int32, device=device)
        self.source_rows: torch.Tensor | None = (
            self.row_ids[:, None].expand(rows, max_len).contiguous() if row_table else None)
        """[rows, max_len] int32 with `row_table`: the physical row holding each (row, slot); None otherwise.
        Invariant after `reorder_rows(..., rows, written)`: entries of slots up to `written` are the sources, entries
        of later slots name their own row (where that row's next token is written)."""
        self._reordered = False

    def reset_order(self) -> None:
        """Every row reads its own storage again (a prompt pass writes every row's prompt slots itself)."""
        if self.source_rows is not None:
            self.source_rows.copy_(self.row_ids[:, None].expand_as(self.source_rows))
        self._reordered = False

    @property
    def max_len(self) -> int:
        return self.key_valid.shape[1]

    def attention_mask(self, query_slots: torch.Tensor) -> torch.Tensor:
        """[rows, 1, T, max_len] bool: query at slot q sees valid keys at slots <= q.

        A query always sees its own slot, so the rows of padding queries are never fully masked (a fully
        masked row would make attention NaN, and NaN keys poison every later layer through 0 * NaN).
        """
        causal = self.slots[None, :] <= query_slots[:, None]  # [T, max_len]
        own = self.slots[None, :] == query_slots[:, None]
        return ((self.key_valid[:, None, :] & causal[None]) | own[None])[:, None]

    def attend(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        query_slots: torch.Tensor,
        mask: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Write `key`/`value` ([rows, kv_heads, T, head_dim]) at `query_slots`, attend `query` over the cache.

        `query` is [rows, heads, T, head_dim]; heads may be a multiple of kv_heads (grouped-query attention).
        Returns [rows, heads, T, head_dim].
        """
        if self._reordered:
            raise ValueError("attend reads whole physical rows, but this cache was reordered through its row table "
                             "(only the fused decode kernels read through it); call reset_order() first")
        keys, values = self.keys[layer], self.values[layer]
        keys.index_copy_(2, query_slots, key.to(keys.dtype))
        values.index_copy_(2, query_slots, value.to(values.dtype))
        grouped = query.shape[1] != keys.shape[1]
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=grouped)

    def reorder_storage(self, rows: torch.Tensor) -> None:
        """Row `i` becomes old row `rows[i]` in the storage, the half of a beam reorder that `reorder_rows` leaves:
        without a row table, every layer's keys and values copied in place; with one, the note that the rows now
        read through it (`attend` refuses them)."""
        if self.source_rows is not None:
            self._reordered = True
            return
        per_layer = self.storage[0].numel() * self.storage.element_size()
        group = max(1, REORDER_GROUP_BYTES // per_layer)
        for first in range(0, self.storage.shape[0], group):
            layers = self.storage[first : first + group]
            layers.copy_(layers.index_select(2, rows))


def reorder_rows(
    table: torch.Tensor | None,
    key_valid: torch.Tensor,
    slots: torch.Tensor,
    row_ids: torch.Tensor,
    rows: torch.Tensor,
    written: torch.Tensor | None,
) -> None:
    """Row `i` becomes old row `rows[i]` (beam search) in a cache's row table (None: the cache has none) and
    `key_valid`, in place; `slots` and `row_ids` are the cache's, and `StaticKVCache.reorder_storage` does the
    rest. Through a row table, `written` (0-d long, required then) is the last slot the rows wrote themselves:
    slots before it keep their sources' sources, slot `written` comes from row `rows[i]`, and later slots point at
    row `i` again (so stale entries of an earlier, longer run never leak into this one). A function of tensors
    alone, so that beam search's compiled bookkeeping fuses these gathers and copies with its own operations."""
    if table is not None:
        if written is None:
            raise ValueError("written (the last slot the rows wrote) is required to reorder through a row table")
        grid = slots[None, :]
        later = torch.where(grid == written, rows.to(torch.int32)[:, None], row_ids[:, None])
        table.copy_(torch.where(grid < written, table.index_select(0, rows), later))
    key_valid.copy_(key_valid.index_select(0, rows))
