"""The `host_syncs` tool on the CPU: each piece of a training step is watched and reported."""

import torch

from benchmarks.tools.host_syncs import _markdown, step_syncs


def test_a_gpt2_training_step_reads_only_the_optimizers_step_counters_on_the_cpu():
    pieces = step_syncs("gpt2-lm", torch.device("cpu"))
    assert list(pieces) == ["forward and loss", "backward", "AdamW step"]
    assert pieces["forward and loss"] == [] and pieces["backward"] == []
    (counter_reads,) = pieces["AdamW step"]  # not capturable on the CPU: one read per parameter
    assert counter_reads["op"] == "_local_scalar_dense" and "torch/optim" in counter_reads["via"]
    result = {"command": "c", "device": "cpu", "torch": "t", "transformers": "x", "date": "d"}
    result["models"] = {"gpt2": pieces}
    assert "| gpt2 | backward | none |" in _markdown(result)
