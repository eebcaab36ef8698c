"""The CPU-runnable parts of benchmarks/tools/decode_chain_floor.py: a decode step's stages and their bytes (as
`decode-roofline` counts them), the streaming kernel under Triton's interpreter, and the report's markdown."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from benchmarks.cases import decode_models
from benchmarks.cases.decode_roofline import step_bytes
from benchmarks.tools import decode_chain_floor as tool
from tests.utils.interpreter import run_interpreted

CPU = torch.device("cpu")
LAYER = ["qkv", "attention", "o_proj", "up", "down"]


@pytest.mark.parametrize("model", [
    decode_models.tiny_gpt2(CPU, torch.float16),
    decode_models.tiny_llama(CPU, torch.bfloat16),
    decode_models.tiny_llama(CPU, torch.bfloat16, tie_word_embeddings=False),
    tool.build("gpt2"),
    tool.build("llama1b"),
], ids=["tiny-gpt2", "tiny-llama", "tiny-llama-untied", "gpt2", "llama1b"])
def test_stages_read_every_byte_decode_roofline_counts_once(model):
    stages = tool.decode_stages(model, prompt_len=16, new_tokens=129)
    layers = model.config.num_hidden_layers
    assert [s.name for s in stages] == LAYER * layers + ["norm+head", "token choice"]
    vocab = model.get_output_embeddings().weight.shape[0]
    assert stages[-1].nbytes == 4 * vocab  # the float32 logits the token choice reads
    assert sum(s.nbytes for s in stages[:-1]) == step_bytes(model, prompt_len=16, new_tokens=129).total
    by_name = {name: {s.nbytes for s in stages if s.name == name} for name in LAYER}
    assert all(len(sizes) == 1 and min(sizes) > 0 for sizes in by_name.values())  # every layer alike, none empty


def test_a_parameter_of_no_stage_is_an_error():
    model = decode_models.tiny_gpt2(CPU, torch.float16)
    model.transformer.h[1].register_parameter("adapter", nn.Parameter(torch.zeros(4, dtype=torch.float16)))
    with pytest.raises(ValueError, match=r"parameters in no stage: \['transformer.h.1.adapter'\]"):
        tool.decode_stages(model)


def test_unknown_model_is_an_error():
    with pytest.raises(ValueError, match="unknown model 'bert'"):
        tool.build("bert")


def test_stream_kernel_sums_its_share_and_adds_the_previous_value():
    run_interpreted("tests.generation.interpreted_chain_floor", "interpreted chain floor checks passed")


def test_markdown_reports_floors_stages_and_every_configuration():
    configs = [{"warps": w, "vectors": v, "us": 10.0 + i} for i, (w, v) in enumerate(tool.CONFIGS)]
    chain = {"best": configs[0], "configs": configs}
    report = {"command": "python3 -m benchmarks.tools.decode_chain_floor --out o", "date": "d", "device": "test",
              "torch": torch.__version__, "triton": "t",
              "models": [{"model": "gpt2", "stages": 62, "bytes": 250e6, "one_read_us": 5.0, "read_gb_per_s": 50000.0,
                          "stage_bytes": {"qkv": [3546624], "norm+head": [77197824]},
                          "empty_chain_us": {"True": 1.5, "False": 2.5}, "chain": {"True": chain, "False": chain}}]}
    text = tool.markdown(report)
    assert "| gpt2 | 62 | 250.0 | 5.00 | 50000 | 1.50 / 2.50 | 10.00 (4w×4) | 10.00 (4w×4) | 0.500 |" in text
    assert "- gpt2: qkv 3.55 MB, norm+head 77.20 MB" in text
    assert "| gpt2 | yes | 10.00 | 11.00 | 12.00 | 13.00 | 14.00 |" in text
