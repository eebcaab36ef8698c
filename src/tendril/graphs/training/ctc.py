"""`ctc_loss`: a CTC loss whose lengths stay on the device, so a training step using it can be captured.

`torch.nn.functional.ctc_loss` reads the input and target lengths on the host (it copies length tensors to the CPU to
size its work), and HF's `Wav2Vec2ForCTC` loss also checks the labels' range with a host read and packs the targets
with `masked_select` (an output shape that depends on values). A graphed step calls the model without `labels`, takes
its logits and computes the loss here instead:

    logits = model(input_values, attention_mask=mask).logits
    frames = model._get_feat_extract_output_lengths(mask.sum(-1))   # device tensor, no host read
    log_probs = logits.float().log_softmax(-1).transpose(0, 1)         # [T, batch, classes]
    loss = tendril.graphs.training.ctc.ctc_loss(log_probs, labels, frames, (labels >= 0).sum(-1))

It is the standard forward recursion over the extended label sequence (blanks between labels), in log space, run for
the full padded `T` with every sequence's state frozen past its own length; autograd gives the gradient. All shapes
depend only on the padded sizes, so one graph serves every batch of a bucket. Unreachable states hold `NEG`, a large
finite negative number rather than -inf, so that their gradients are 0 rather than NaN; a loss at or above `-NEG / 2`
means no alignment exists (an infinite loss for `torch.nn.functional.ctc_loss`), which `zero_infinity` zeroes.
Its cost is a few small kernels per frame, which one graph replay launches at once.
"""

from __future__ import annotations

import torch

NEG = -1e30
"""Log-probability of an unreachable state (finite: see the module docstring)."""


def ctc_loss(
    log_probs: torch.Tensor,
    targets: torch.Tensor,
    input_lengths: torch.Tensor,
    target_lengths: torch.Tensor,
    *,
    blank: int = 0,
    reduction: str = "mean",
    zero_infinity: bool = False,
) -> torch.Tensor:
    """CTC loss as `torch.nn.functional.ctc_loss` (padded `targets` `[batch, S]`; positions past a sequence's target
    length are ignored, whatever they hold), with lengths as device tensors and no host synchronisation."""
    if log_probs.dim() != 3:
        raise ValueError(f"log_probs must be [T, batch, classes], got shape {tuple(log_probs.shape)}")
    if targets.dim() != 2 or targets.shape[0] != log_probs.shape[1]:
        raise ValueError(f"targets must be [batch, S] with batch {log_probs.shape[1]}, got {tuple(targets.shape)}")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    frames, batch, _ = log_probs.shape
    device = log_probs.device
    log_probs = log_probs.float()
    extended = _extended_labels(targets, target_lengths, blank)
    states = extended.shape[1]
    emit = log_probs.gather(2, extended.unsqueeze(0).expand(frames, batch, states))
    skip = _skip_allowed(extended, blank)
    position = torch.arange(states, device=device)
    alpha = torch.where(position < 2, emit[0], torch.full_like(emit[0], NEG))
    lengths = input_lengths.to(device=device, dtype=torch.long).unsqueeze(1)
    neg1 = torch.full((batch, 1), NEG, device=device)
    neg2 = torch.full((batch, 2), NEG, device=device)
    for t in range(1, frames):
        stay = alpha
        step = torch.cat([neg1, alpha[:, :-1]], dim=1)
        jump = torch.where(skip, torch.cat([neg2, alpha[:, :-2]], dim=1), NEG)
        moved = torch.logsumexp(torch.stack([stay, step, jump]), dim=0) + emit[t]
        alpha = torch.where(t < lengths, moved, alpha)
    last = 2 * target_lengths.to(device=device, dtype=torch.long).unsqueeze(1)
    ends = torch.cat([alpha.gather(1, last), alpha.gather(1, (last - 1).clamp(min=0))], dim=1)
    ends[:, 1:] = torch.where(last > 0, ends[:, 1:], NEG)
    loss = -torch.logsumexp(ends, dim=1)
    if zero_infinity:
        loss = torch.where(loss >= -NEG / 2, torch.zeros_like(loss), loss)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return (loss / target_lengths.to(loss.dtype).clamp(min=1)).mean()


def _extended_labels(targets: torch.Tensor, target_lengths: torch.Tensor, blank: int) -> torch.Tensor:
    """`[batch, 2S + 1]`: blank, l1, blank, l2, ..., blank; labels past a sequence's length become blanks."""
    batch, labels = targets.shape
    valid = torch.arange(labels, device=targets.device) < target_lengths.to(targets.device).unsqueeze(1)
    clean = torch.where(valid, targets.long(), blank)
    extended = torch.full((batch, 2 * labels + 1), blank, dtype=torch.long, device=targets.device)
    extended[:, 1::2] = clean
    return extended


def _skip_allowed(extended: torch.Tensor, blank: int) -> torch.Tensor:
    """Where a path may jump two states (from label to the next, different label, over a blank)."""
    previous = torch.cat([torch.full_like(extended[:, :2], blank), extended[:, :-2]], dim=1)
    return (extended != blank) & (extended != previous)
