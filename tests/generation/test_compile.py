"""`step="compiled"`: the one-token forward traces as a single graph (fullgraph, no host code) and gives
HF's tokens. Dynamo's "eager" backend checks the tracing quickly; code generation is exercised on the GPU."""

from __future__ import annotations

import warnings

import pytest
import torch

from tendril.generation import CompileLimitWarning, generate, loop
from tests.generation.models import hf_generate, left_padded, tiny_model


@pytest.mark.parametrize("family", ["gpt2", "gptj", "llama"])
def test_compiled_step_traces_in_one_graph_and_matches_hf(family, monkeypatch):
    monkeypatch.setattr(loop, "COMPILE_BACKEND", "eager")
    torch._dynamo.reset()
    model = tiny_model(family)
    ids, mask = left_padded([5, 3])
    for options in (dict(), dict(num_beams=3)) if family == "gpt2" else (dict(),):
        expected = hf_generate(model, ids, mask, None, max_new_tokens=6, **options)
        got = generate(model, ids, mask, max_new_tokens=6, eos_token_id=[], pad_token_id=0, step="compiled",
                       **options)
        assert torch.equal(got, expected)


def test_shapes_past_dynamos_recompile_limit_run_uncompiled_with_a_warning_and_hfs_tokens(monkeypatch):
    """Each prompt length compiles the step anew; past dynamo's limit (2 here) a length runs the forward uncompiled,
    warned once per shape, where the compiled call would raise."""
    monkeypatch.setattr(loop, "COMPILE_BACKEND", "eager")
    torch._dynamo.reset()
    model = tiny_model("llama")
    warned = []
    for length in (3, 4, 5, 6, 6):
        ids, mask = left_padded([length])
        expected = hf_generate(model, ids, mask, None, max_new_tokens=4)
        with warnings.catch_warnings(record=True) as caught, torch._dynamo.config.patch(recompile_limit=2):
            warnings.simplefilter("always")
            got = generate(model, ids, mask, max_new_tokens=4, eos_token_id=[], pad_token_id=0, step="compiled")
        assert torch.equal(got, expected), length
        warned.append(sum(issubclass(w.category, CompileLimitWarning) for w in caught))
    assert warned == [0, 0, 1, 1, 0]
    torch._dynamo.reset()
