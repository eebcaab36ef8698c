"""Buckets pad calls up to a declared size and cut outputs back; pure Python on CPU tensors."""

import numpy as np
import pytest
import torch

from tendril.graphs.buckets import (
    Buckets,
    Pad,
    cut_back,
    follow_length,
    parameter_positions,
    pow2_sizes,
    probe_length,
    sequence_buckets,
)


def test_bucket_is_the_smallest_size_that_holds_the_call():
    buckets = Buckets((8, 16, 32), (("x", Pad(1)),))
    assert [buckets.bucket_for(n) for n in (1, 8, 9, 32, 33)] == [8, 8, 16, 32, None]


def test_invalid_sizes_and_missing_pads_are_rejected():
    with pytest.raises(ValueError, match="ascending"):
        Buckets((16, 8), (("x", Pad(1)),))
    with pytest.raises(ValueError, match="at least one padded argument"):
        Buckets((8,), ())
    for sizes in ((4.5, 8), (True, 8)):  # a length is padded to a whole number of positions
        with pytest.raises(ValueError, match="positive integers"):
            sequence_buckets(sizes)
    assert sequence_buckets(np.array([4, 8])).sizes == (4, 8)
    for how in (dict(dim="a"), dict(dim=1.5), dict(dim=1, value="x"), dict(dim=1, rank=0), dict(dim=3, rank=2)):
        with pytest.raises(ValueError, match="Pad"):
            Pad(**how)
    with pytest.raises(ValueError, match="each pad is"):
        Buckets((8,), (("x", 1),))
    assert Buckets((8,), [("x", Pad(1))]).pads == (("x", Pad(1)),)  # a list of pads is kept as a tuple


def test_sequence_buckets_pad_ids_and_create_the_mask():
    buckets = sequence_buckets((4, 8), pad_token_id=7)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    padded = buckets.pad((), {"input_ids": ids})
    assert padded is not None and padded.bucket == 8 and padded.length == 5
    assert padded.kwargs["input_ids"].tolist() == [[1, 2, 3, 4, 5, 7, 7, 7]]
    assert padded.kwargs["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0, 0, 0]]


def test_an_existing_mask_is_padded_with_zeros_and_positional_names_resolve():
    def forward(input_ids, attention_mask=None):
        return input_ids

    buckets = sequence_buckets((8,))
    ids, mask = torch.ones(1, 3, dtype=torch.long), torch.tensor([[0, 1, 1]])
    padded = buckets.pad((ids, mask), {}, parameter_positions(forward))
    assert padded is not None and not padded.kwargs
    assert padded.args[1].tolist() == [[0, 1, 1, 0, 0, 0, 0, 0]]
    assert padded.args[0].shape == (1, 8)


def test_traced_dimensions_are_cut_back_and_a_dimension_that_merely_equals_the_bucket_is_not():
    logits, pooled, attention = torch.randn(1, 8, 8), torch.randn(1, 8), torch.randn(1, 2, 8, 8)
    probe = {"logits": torch.randn(1, 7, 8), "pooled": torch.randn(1, 8), "attention": torch.randn(1, 2, 7, 7)}
    axes = follow_length({"logits": logits, "pooled": pooled, "attention": attention}, probe, 8, 7)
    assert axes == ((1,), (), (2, 3))  # leaves in insertion order: logits, pooled, attention
    out = cut_back({"logits": logits, "pooled": pooled, "attention": attention}, axes, 5)
    assert torch.equal(out["logits"], logits[:, :5]) and out["pooled"] is pooled
    assert torch.equal(out["attention"], attention[:, :, :5, :5])


def test_outputs_that_change_with_the_length_other_than_one_to_one_cannot_be_cut():
    assert "one to one" in follow_length(torch.randn(1, 4), torch.randn(1, 3), 8, 7)
    assert "structure" in follow_length((torch.randn(8),), [torch.randn(7)], 8, 7)
    assert "rank" in follow_length(torch.randn(8, 1), torch.randn(7), 8, 7)


def test_resize_cuts_or_pads_every_padded_argument_and_the_created_mask():
    buckets = sequence_buckets((8,), pad_token_id=9)
    padded = buckets.pad((), {"input_ids": torch.ones(1, 5, dtype=torch.long)})
    assert padded is not None
    _, kwargs = buckets.resize(padded.args, padded.kwargs, {}, probe_length(padded.bucket))
    assert kwargs["input_ids"].shape == kwargs["attention_mask"].shape == (1, 4)
    assert probe_length(1) == 2
    _, kwargs = buckets.resize(padded.args, padded.kwargs, {}, 10)
    assert kwargs["input_ids"][0, 8:].tolist() == [9, 9] and kwargs["attention_mask"][0, 8:].tolist() == [0, 0]


def test_calls_longer_than_every_bucket_or_without_padded_arguments_are_not_padded():
    buckets = sequence_buckets((4,))
    assert buckets.pad((), {"input_ids": torch.ones(1, 5, dtype=torch.long)}) is None
    assert buckets.pad((torch.ones(3),), {}) is None


def test_padded_arguments_must_agree_on_the_length():
    buckets = sequence_buckets((8,))
    with pytest.raises(ValueError, match="disagree"):
        buckets.pad((), {"input_ids": torch.ones(1, 3), "attention_mask": torch.ones(1, 4)})


def test_pow2_sizes():
    assert pow2_sizes(64, 8) == (8, 16, 32, 64)
    assert pow2_sizes(65, 32) == (32, 64, 128)
    with pytest.raises(ValueError):
        pow2_sizes(4, 8)
    for maximum in (8.5, True):
        with pytest.raises(ValueError, match="integers"):
            pow2_sizes(maximum)


def test_empty_calls_and_arguments_of_another_rank_than_declared_are_not_padded():
    buckets = sequence_buckets((8,))
    assert buckets.pad((), {"input_ids": torch.ones(1, 0, dtype=torch.long)}) is None
    assert buckets.pad((), {"input_ids": torch.ones(1, 1, 6, dtype=torch.long)}) is None
    assert buckets.pad((), {"input_ids": torch.ones(1, 6, dtype=torch.long)}) is not None
    anything = Buckets((8,), (("x", Pad(0)),))
    assert anything.pad((), {"x": torch.ones(3, 2, 2)}) is not None
