"""Training steps of HF models written for graphed steps (used by the `graphs-training` benchmark case and the GPU
tests of `tendril.graphed_step`): what a user writes so that no step synchronises with the host.

- GPT-2 LM fine-tuning: right-padded `input_ids` with labels -100 on the padding and no attention mask (a causal
  model's real positions never attend to later, padded ones); HF's loss ignores the -100 labels on the device.
- Wav2Vec2 CTC: the model is called without `labels` (its label check reads a value on the host and its loss packs
  the targets with `masked_select`) and without `attention_mask`, as HF's feature extractor for the base
  (group-norm) models gives none: the audio is zero-padded. (With a mask, HF's encoder zeroes the padded frames by
  boolean indexing and asks whether any position is masked, both on the host.) The frame lengths come from the
  sample mask on the device and the loss is `tendril.graphs.training.ctc.ctc_loss`. SpecAugment (`mask_time_prob`)
  draws its masks with numpy on the host, and layerdrop decides on the host which layers to skip, so both are 0 in
  graphed steps (a graph would freeze one draw).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.attention import SDPBackend

from tendril.graphs.buckets import Buckets, Pad
from tendril.graphs.training.ctc import ctc_loss

IGNORE = -100
SAMPLES_PER_LABEL = 1000
"""About 16 labels (characters) per second of 16 kHz audio."""


def gpt2_buckets(sizes: tuple[int, ...]) -> Buckets:
    """Pad `input_ids` with token 0 and `labels` with -100 along the sequence."""
    return Buckets(sizes, (("input_ids", Pad(1, 0, rank=2)), ("labels", Pad(1, IGNORE, rank=2))), cut_outputs=False)


def wav2vec2_buckets(sizes: tuple[int, ...]) -> Buckets:
    """Pad the audio with silence and its sample mask with zeros (the CTC labels keep their own padded width)."""
    return Buckets(sizes, (("audio", Pad(1, 0.0, rank=2)), ("mask", Pad(1, 0, rank=2))), cut_outputs=False)


def gpt2_step(
    model: Any, optimizer: torch.optim.Optimizer, scaler: Any = None, amp: bool = False, keep_grads: bool = True
) -> Callable:
    def step(input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", torch.float16, enabled=amp):
            loss = model(input_ids=input_ids, labels=labels).loss
        backward_and_update(loss, optimizer, scaler, keep_grads)
        return loss.detach()

    return step


def wav2vec2_step(
    model: Any, optimizer: torch.optim.Optimizer, scaler: Any = None, amp: bool = False, keep_grads: bool = True
) -> Callable:
    def step(audio: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", torch.float16, enabled=amp):
            logits = model(audio).logits
        frames = model._get_feat_extract_output_lengths(mask.sum(-1))
        log_probs = logits.float().log_softmax(-1).transpose(0, 1)
        loss = ctc_loss(log_probs, labels, frames, (labels >= 0).sum(-1), zero_infinity=True)
        backward_and_update(loss, optimizer, scaler, keep_grads)
        return loss.detach()

    return step


def wav2vec2_hf_loss_step(
    model: Any, optimizer: torch.optim.Optimizer, scaler: Any = None, amp: bool = False
) -> Callable:
    """The eager step users write today: HF's loss from `labels` (torch's CTC; it syncs with the host), the sample
    mask giving it the audio lengths."""

    def step(audio: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", torch.float16, enabled=amp):
            loss = model(audio, attention_mask=mask, labels=labels).loss
        backward_and_update(loss, optimizer, scaler)
        return loss.detach()

    return step


def backward_and_update(
    loss: torch.Tensor, optimizer: torch.optim.Optimizer, scaler: Any, keep_grads: bool = True
) -> None:
    """Backward, optimizer step (through `scaler` when given) and `zero_grad`. With `keep_grads` the gradients stay
    allocated (`set_to_none=False`), so a graphed step's replays find them where its capture wrote them; without,
    they are dropped, as torch.compile's CUDA-graph trees need: a first backward's gradient is that graph's output,
    which its next replay overwrites."""
    if scaler is None:
        loss.backward()
        optimizer.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    optimizer.zero_grad(set_to_none=not keep_grads)


def gpt2_model(
    layers: int = 2, width: int = 64, vocab: int = 1000, positions: int = 512, dropout: float = 0.0,
    device: str = "cuda",
) -> Any:  # fmt: skip
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=layers, n_embd=width, n_head=4, vocab_size=vocab, n_positions=positions, use_cache=False,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
    )  # fmt: skip
    return GPT2LMHeadModel(config).to(device).train()


def wav2vec2_model(tiny: bool = True, vocab: int = 32, dropout: float = 0.0, device: str = "cuda") -> Any:
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    sizes: dict[str, Any] = {}
    if tiny:  # small layers, the base config's feature encoder strides (one frame per 320 samples)
        sizes = dict(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, conv_dim=(32,) * 7,
            num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
        )  # fmt: skip
    config = Wav2Vec2Config(
        vocab_size=vocab, layerdrop=0.0, mask_time_prob=0.0, hidden_dropout=dropout, attention_dropout=dropout,
        activation_dropout=dropout, feat_proj_dropout=dropout, final_dropout=dropout, **sizes,
    )  # fmt: skip
    return Wav2Vec2ForCTC(config).to(device).train()


def gpt2_batch(
    length: int, batch: int, vocab: int, generator: torch.Generator, device: str = "cuda"
) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, vocab, (batch, length), generator=generator)
    return ids.to(device), ids.to(device, copy=True)


def wav2vec2_batch(
    samples: int, batch: int, labels: int, vocab: int, generator: torch.Generator, device: str = "cuda"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Audio of `samples` (the longest of the batch; the others shorter, masked), labels padded with -100 to
    `labels` columns: at most one label per `SAMPLES_PER_LABEL` samples of the item's audio, so that an alignment
    exists (one frame per 320 samples)."""
    audio = torch.randn(batch, samples, generator=generator)
    lengths = torch.randint(samples // 2, samples + 1, (batch,), generator=generator)
    lengths[0] = samples
    mask = (torch.arange(samples) < lengths.unsqueeze(1)).long()
    audio = audio * mask
    label_lengths = torch.randint(1, labels + 1, (batch,), generator=generator)
    label_lengths = torch.minimum(label_lengths, (lengths // SAMPLES_PER_LABEL).clamp(min=1))
    targets = torch.randint(1, vocab, (batch, labels), generator=generator)
    targets = torch.where(torch.arange(labels) < label_lengths.unsqueeze(1), targets, IGNORE)
    return audio.to(device), mask.to(device), targets.to(device)


ONE_ATTENTION_KERNEL = (SDPBackend.MATH,)
"""The attention kernel for comparing graphed fp16 steps of HF models with eager ones: SDPA's math backend, plain
matrix products and a softmax, alone. Two reasons rule out the fused kernels.
- Some transformers releases (5.17 among them) skip GPT-2's causal mask, passing `is_causal` to SDPA, except while a
  CUDA graph is being captured, which their mask shortcut takes for tracing: there they build an explicit mask. The
  fused kernels round the two forms differently (flash attention is not even used for the masked one); the math
  backend turns both into the same additive mask.
- Memory-efficient attention's backward accumulates the query gradient with atomics when it splits the keys, so it
  is not deterministic even under `torch.use_deterministic_algorithms(True, warn_only=True)`, and a graph's replay
  may order those atomics differently from an eager launch.
With the math backend under deterministic algorithms two eager runs agree exactly, and the graphed run differs only
by what the graphs do."""

ZERO_GRADIENT = {"attention.k_proj.bias": (0, 1), "attn.c_attn.bias": (1, 3)}
"""Parameters whose gradient is zero in exact arithmetic, by name part: the share `(index, parts)` of the tensor
that is a key projection's bias (Wav2Vec2's whole `k_proj.bias`; the middle third of GPT-2's fused q/k/v
`c_attn.bias`). A key bias adds the same score to every key of a query, which softmax ignores. Adam scales the
rounding noise of that gradient up to full-size updates, so two correct runs (eager twice, with atomics in the
backward) disagree there by about the parameter's own size; the comparisons leave these shares and their
optimizer state out."""


def _without_zero_gradient(name: str, value: torch.Tensor) -> torch.Tensor | None:
    """`value` less its `ZERO_GRADIENT` share (None when that is all of it)."""
    for part, (index, parts) in ZERO_GRADIENT.items():
        if part in name:
            if parts == 1:
                return None
            if value.dim() == 0:  # the optimizer's step count
                return value
            size = value.shape[0] // parts
            return torch.cat([value[: index * size], value[(index + 1) * size :]])
    return value


def state_of(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Parameters and optimizer state tensors by name, less their `ZERO_GRADIENT` shares."""
    found = {f"param {name}": p.detach() for name, p in model.named_parameters()}
    names = {id(p): name for name, p in model.named_parameters()}
    for parameter, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                found[f"state {names[id(parameter)]} {key}"] = value.detach()
    kept = {name: _without_zero_gradient(name, value) for name, value in found.items()}
    return {name: value for name, value in kept.items() if value is not None}


def rel_diffs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    """|a - b| / max(|b|) per named tensor (float64), largest first."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    diffs = {}
    for name in a:
        x, y = a[name].double(), b[name].double()
        scale = max(y.abs().max().item(), 1e-30)
        diffs[name] = (x - y).abs().max().item() / scale
    return dict(sorted(diffs.items(), key=lambda item: item[1], reverse=True))


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest of `rel_diffs`."""
    return max(rel_diffs(a, b).values(), default=0.0)
