"""The device-length CTC loss equals torch.nn.functional.ctc_loss (values and gradients) and reads nothing on the
host, so a step using it can be captured."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tendril.graphs.syncs import find_host_syncs
from tendril.graphs.training.ctc import ctc_loss


def example(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    frames, batch, classes, labels = 14, 4, 6, 5
    logits = torch.randn(frames, batch, classes, generator=generator, dtype=torch.float64)
    targets = torch.randint(1, classes, (batch, labels), generator=generator)
    targets[1, 1] = targets[1, 0]  # a repeated label needs a blank between
    target_lengths = torch.tensor([5, 3, 0, 4])
    input_lengths = torch.tensor([14, 9, 6, 11])
    targets[1, 3:] = -100  # padding, as HF pads labels
    return logits, targets, input_lengths, target_lengths


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_values_and_gradients_equal_torch_ctc_loss(reduction):
    logits, targets, input_lengths, target_lengths = example()
    ours_in = logits.clone().requires_grad_(True)
    theirs_in = logits.clone().requires_grad_(True)
    ours = ctc_loss(ours_in.log_softmax(-1), targets, input_lengths, target_lengths, reduction=reduction)
    theirs = F.ctc_loss(
        theirs_in.log_softmax(-1), targets.clamp(min=0), input_lengths, target_lengths, reduction=reduction
    )
    torch.testing.assert_close(ours.double(), theirs, rtol=1e-5, atol=1e-5)
    ours.sum().backward()
    theirs.sum().backward()
    torch.testing.assert_close(ours_in.grad, theirs_in.grad, rtol=1e-4, atol=1e-5)


def test_impossible_alignments_are_zeroed_with_zero_infinity():
    logits, targets, _, target_lengths = example()
    too_short = torch.tensor([3, 9, 6, 11])  # 5 labels cannot fit in 3 frames
    log_probs = logits.log_softmax(-1)
    loss = ctc_loss(log_probs, targets, too_short, target_lengths, reduction="none", zero_infinity=True)
    expected = F.ctc_loss(
        log_probs, targets.clamp(min=0), too_short, target_lengths, reduction="none", zero_infinity=True
    )
    assert loss[0] == 0
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-5)


def test_no_host_syncs_and_bad_shapes_name_the_argument():
    logits, targets, input_lengths, target_lengths = example()
    log_probs = logits.float().log_softmax(-1).requires_grad_(True)

    def loss_and_backward():
        ctc_loss(log_probs, targets, input_lengths, target_lengths).backward()

    assert not find_host_syncs(loss_and_backward)
    with pytest.raises(ValueError, match="log_probs"):
        ctc_loss(log_probs[0], targets, input_lengths, target_lengths)
    with pytest.raises(ValueError, match="targets"):
        ctc_loss(log_probs, targets[0], input_lengths, target_lengths)
    with pytest.raises(ValueError, match="reduction"):
        ctc_loss(log_probs, targets, input_lengths, target_lengths, reduction="avg")
