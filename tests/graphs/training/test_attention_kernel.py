"""The attention kernel the training comparisons run on (`hf_training_steps.ONE_ATTENTION_KERNEL`) must be
deterministic, and must give the same bits for every form in which HF passes a mask: `is_causal`, an explicit
boolean mask or an additive one, and no mask or an all-true one. On CUDA at GPT-2's size, where
memory-efficient attention's backward is not deterministic."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from benchmarks.cases.graphs_training import deterministic_algorithms
from benchmarks.hf_training_steps import ONE_ATTENTION_KERNEL


@pytest.mark.parametrize(
    ("device", "shape"),
    [("cpu", (2, 4, 128, 64)), pytest.param("cuda", (4, 12, 512, 64), marks=pytest.mark.gpu)],
)
def test_one_attention_kernel_is_deterministic_and_serves_every_mask_form_alike(device, shape):
    generator = torch.Generator(device=device).manual_seed(0)
    q, k, v, grad = (torch.randn(shape, device=device, dtype=torch.float16, generator=generator) for _ in range(4))

    def attend(**mask: object) -> list[torch.Tensor]:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*leaves, **mask)
        out.backward(grad)
        return [out.detach(), *(t.grad for t in leaves)]

    length = shape[2]
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    additive = torch.zeros(length, length, dtype=torch.float16, device=device)
    additive.masked_fill_(~causal, torch.finfo(torch.float16).min)
    nondeterministic: list[str] = []
    with deterministic_algorithms(nondeterministic), sdpa_kernel(list(ONE_ATTENTION_KERNEL)):
        causal_forms = [attend(is_causal=True), attend(is_causal=True), attend(attn_mask=causal),
                        attend(attn_mask=additive)]  # fmt: skip
        unmasked_forms = [attend(), attend(), attend(attn_mask=torch.ones_like(causal))]
    assert nondeterministic == []
    for forms in (causal_forms, unmasked_forms):
        for other in forms[1:]:
            assert all(torch.equal(a, b) for a, b in zip(forms[0], other, strict=True))
    assert not torch.equal(causal_forms[0][0], unmasked_forms[0][0])
