"""The CPU-runnable parts of benchmarks/tools/profile_generation.py: the decode step's state, stepped and reset
outside inference mode as the tool's timing loop does, against `generate`; and the report's markdown."""

from __future__ import annotations

import pytest
import torch

from benchmarks.tools.profile_generation import StepState, decode_loop, markdown
from tendril.generation import generate
from tendril.generation.api import release_graphs
from tests.generation.models import tiny_model

NEW = 6


@pytest.mark.parametrize("compile_step", [False, "fused"])
def test_step_state_steps_and_resets_like_generate(compile_step):
    model = tiny_model("gpt2")
    prompt = torch.randint(4, 96, (1, 5), generator=torch.Generator().manual_seed(3))
    expected = generate(model, prompt, max_new_tokens=NEW, eos_token_id=[], pad_token_id=0, compile_step=compile_step)
    state = StepState(decode_loop(model), prompt)
    assert torch.is_inference(state.buffers[0]) and not torch.is_inference_mode_enabled()
    for _ in range(2):  # the second round starts from `reset`, which must undo the first round's steps
        for _ in range(NEW - 1):  # the state after prefill holds the first token: NEW - 1 steps remain
            state.step()
        step, sequences, unfinished = state.buffers
        assert int(step) == NEW and bool(unfinished.all())
        assert torch.equal(sequences, expected)
        state.reset()
        for buffer, start in zip(state.buffers, state.start, strict=True):
            assert torch.equal(buffer, start) and buffer.data_ptr() != start.data_ptr()
    release_graphs(model)
    with pytest.raises(RuntimeError, match="expected one decode loop"):
        decode_loop(model)


def test_markdown_reports_variants_failures_and_sweep():
    kernel = {"name": "triton_|fused", "per_step": 2.0, "mean_us": 1.5, "total_us": 3.0}
    report = {
        "device": "test", "torch": torch.__version__, "new_tokens": 8, "prompt_len": 4,
        "variants": [
            {"variant": "fused", "tok_per_s": 1000.0, "ms_per_token": 1.0, "warmup_s": 0.5, "matches_hf": True,
             "step_graph_ms": 0.9, "loop_operations_per_call": 12.0,
             "step": {"operations": 5.0, "busy_us": 3.0, "gap_us": 1.0, "kernels": [kernel]}},
            {"variant": "inductor", "error": "RuntimeError: boom"},
        ],
        "sweep": [{"shape": "ln_1+c_attn", "cublas_us": 5.0, "best": {"us": 4.0, "block_n": 16, "block_k": 256,
                                                                       "split_k": 3, "warps": 4},
                   "configs": [{"us": 4.5, "default": True}]}],
    }
    text = markdown(report)
    assert "| fused | 1000 | 1.0000 | 0.50 | yes | 0.9000 |" in text
    assert "| inductor | failed: RuntimeError: boom |" in text
    assert "`triton_\\|fused`" in text
    assert "| ln_1+c_attn | 5.00 | 4.50 | 4.00 | n=16 k=256 split=3 warps=4 |" in text
