"""Tensor-parallel decoding on the CPU: two ranks over gloo decode the tokens of one process, and HF's."""

from __future__ import annotations

import pytest
import torch

from tendril.generation import loop
from tests.distributed.ranks import MAX_NEW_TOKENS, RUNS, decode, prompt, run_ranks
from tests.generation.models import hf_generate, tiny_model


@pytest.fixture(autouse=True)
def _compile_without_code_generation(monkeypatch):
    monkeypatch.setattr(loop, "COMPILE_BACKEND", "eager")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, torch.Tensor]]:
    return run_ranks(2, "gloo", tmp_path_factory.mktemp("ranks"))


@pytest.mark.parametrize("name", list(RUNS))
def test_two_ranks_decode_the_tokens_of_one_process(ranks, name):
    family, options = RUNS[name]
    single = decode(tiny_model(family), options)
    assert torch.equal(ranks[0][name], ranks[1][name])
    assert torch.equal(ranks[0][name], single)


@pytest.mark.parametrize("name", ["llama fused", "qwen2 fused"])
def test_two_ranks_decode_hf_greedy_tokens(ranks, name):
    family, _ = RUNS[name]
    ids, mask = prompt()
    expected = hf_generate(tiny_model(family), ids, mask, None, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    assert torch.equal(ranks[0][name], expected)
