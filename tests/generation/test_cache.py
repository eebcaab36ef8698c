"""tendril's static KV cache: masks from device lengths, writes at device slots, in-place reordering."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tendril.generation.cache import StaticKVCache


def _cache(rows: int = 2, max_len: int = 6) -> StaticKVCache:
    key_valid = torch.ones(rows, max_len, dtype=torch.bool)
    key_valid[1, :2] = False  # row 1 has two padding slots
    return StaticKVCache(1, rows, 2, max_len, 4, torch.float32, torch.device("cpu"), key_valid)


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
    cache.reorder(torch.tensor([2, 2, 0]))
    assert cache.keys[0][:, 0, 0, 0].tolist() == [2, 2, 0]
    assert cache.values[0][:, 0, 0, 0].tolist() == [12, 12, 10]
    assert cache.keys[0].data_ptr() == address
