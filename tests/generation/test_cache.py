"""tendril's static KV cache: masks from device lengths, writes at device slots, in-place reordering, by copy or
through a row table."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tendril.generation.cache import StaticKVCache, reorder_rows
from tendril.generation.kernels import reference


def _cache(rows: int = 2, max_len: int = 6) -> StaticKVCache:
    key_valid = torch.ones(rows, max_len, dtype=torch.bool)
    key_valid[1, :2] = False  # row 1 has two padding slots
    return StaticKVCache(1, rows, 2, max_len, 4, torch.float32, torch.device("cpu"), key_valid)


def reorder(cache: StaticKVCache, rows: torch.Tensor, written: torch.Tensor | None = None) -> None:
    """A beam step's whole reorder, as beam search makes it: the table and `key_valid`, then the storage."""
    reorder_rows(cache.source_rows, cache.key_valid, cache.slots, cache.row_ids, rows, written)
    cache.reorder_storage(rows)


def test_mask_is_causal_skips_padding_and_never_masks_a_whole_row():
    cache = _cache()
    mask = cache.attention_mask(torch.arange(4))[:, 0]
    assert mask[0, 2].tolist() == [True, True, True, False, False, False]
    assert mask[1, 3].tolist() == [False, False, True, True, False, False]
    assert mask[1, 0].tolist() == [True, False, False, False, False, False]  # a padding query sees itself
    assert mask.any(-1).all()


def test_attend_writes_the_slots_and_matches_dense_attention():
    torch.manual_seed(0)
    cache = _cache()
    q, k, v = (torch.randn(2, 2, 3, 4) for _ in range(3))
    slots = torch.arange(3)
    out = cache.attend(0, q, k, v, slots, cache.attention_mask(slots), 0.5)
    assert torch.equal(cache.keys[0][:, :, :3], k) and torch.equal(cache.values[0][:, :, :3], v)
    dense_mask = cache.attention_mask(slots)[..., :3]
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask, scale=0.5))
    # one more token at slot 3 attends over slots 0..3
    q1, k1, v1 = (torch.randn(2, 2, 1, 4) for _ in range(3))
    slot = torch.tensor([3])
    out1 = cache.attend(0, q1, k1, v1, slot, cache.attention_mask(slot), 0.5)
    keys, values = torch.cat([k, k1], 2), torch.cat([v, v1], 2)
    mask = cache.attention_mask(slot)[..., :4]
    expected = F.scaled_dot_product_attention(q1, keys, values, attn_mask=mask, scale=0.5)
    torch.testing.assert_close(out1, expected)


def test_grouped_query_attention_repeats_kv_heads():
    torch.manual_seed(1)
    cache = _cache()
    q, k, v = torch.randn(2, 4, 2, 4), torch.randn(2, 2, 2, 4), torch.randn(2, 2, 2, 4)
    slots = torch.arange(2)
    mask = cache.attention_mask(slots)
    out = cache.attend(0, q, k, v, slots, mask, 0.5)
    expected = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                              attn_mask=mask[..., :2], scale=0.5)
    torch.testing.assert_close(out, expected)


def test_reorder_moves_rows_in_place():
    cache = _cache(rows=3)
    for i in range(3):
        cache.keys[0][i] = i
        cache.values[0][i] = 10 + i
    address = cache.keys[0].data_ptr()
    reorder(cache, torch.tensor([2, 2, 0]))
    assert cache.keys[0][:, 0, 0, 0].tolist() == [2, 2, 0]
    assert cache.values[0][:, 0, 0, 0].tolist() == [12, 12, 10]
    assert cache.keys[0].data_ptr() == address


def test_reorder_gathers_layers_in_groups_and_moves_every_layer(monkeypatch):
    from tendril.generation import cache as cache_module

    cache = StaticKVCache(3, 3, 2, 5, 4, torch.float32, torch.device("cpu"), torch.ones(3, 5, dtype=torch.bool))
    monkeypatch.setattr(cache_module, "REORDER_GROUP_BYTES", 2 * cache.storage[0].numel() * 4)  # 2 layers, then 1
    for layer in range(3):
        for row in range(3):
            cache.keys[layer][row] = 100 * layer + row
            cache.values[layer][row] = 100 * layer + 10 + row
    reorder(cache, torch.tensor([1, 0, 1]))
    for layer in range(3):
        assert cache.keys[layer][:, 0, 0, 0].tolist() == [100 * layer + r for r in (1, 0, 1)]
        assert cache.values[layer][:, 1, 4, 3].tolist() == [100 * layer + 10 + r for r in (1, 0, 1)]


def test_reorder_through_the_row_table_reads_what_the_copying_reorder_holds():
    """Beam steps (write each row's token at the slot, attend, reorder by random sources) give the same
    attention with the cache copied and with only its row table gathered; the table cache's storage keeps
    every row's own writes."""
    torch.manual_seed(3)
    rows, max_len, prompt = 4, 9, 3
    key_valid = torch.ones(rows, max_len, dtype=torch.bool)
    copied, indirect = (StaticKVCache(1, rows, 2, max_len, 4, torch.float32, torch.device("cpu"), key_valid.clone(),
                                      row_table=table) for table in (False, True))
    k, v = torch.randn(rows, 2, prompt, 4), torch.randn(rows, 2, prompt, 4)
    for cache in (copied, indirect):
        cache.reset_order()
        cache.attend(0, k, k, v, torch.arange(prompt), cache.attention_mask(torch.arange(prompt)), 0.5)
    for slot_value in range(prompt, max_len):
        slot = torch.tensor([slot_value])
        q, k, v = torch.randn(rows, 8), torch.randn(rows, 8), torch.randn(rows, 8)
        outs = [reference.decode_attention(q, k, v, c.keys[0], c.values[0], c.key_valid, slot, 0.5,
                                           source_rows=c.source_rows) for c in (copied, indirect)]
        torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
        assert torch.equal(indirect.keys[0][:, :, slot_value], k.view(rows, 2, 4))
        sources = torch.randint(0, rows, (rows,))
        for cache in (copied, indirect):
            reorder(cache, sources, slot.view(()))
    assert indirect.source_rows is not None and indirect.source_rows.dtype == torch.int32
    with pytest.raises(ValueError, match="row table"):
        indirect.attend(0, q.view(rows, 2, 1, 4), k.view(rows, 2, 1, 4), v.view(rows, 2, 1, 4), slot,
                        indirect.attention_mask(slot), 0.5)
    with pytest.raises(ValueError, match="written"):
        reorder(indirect, sources)
    indirect.reset_order()
    assert torch.equal(indirect.source_rows, torch.arange(rows, dtype=torch.int32)[:, None].expand(rows, max_len))
