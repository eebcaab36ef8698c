"""Fully graphed generation: greedy, sampling and beam search decoded by a device-side loop.

Layout: `cache.py` (tendril's static KV cache), `architectures/` (graph-safe forwards reusing HF modules:
GPT-2, GPT-J, Llama/Mistral/Qwen2), `kernels/` (tendril's fused Triton decode kernels), `processors.py` (HF's
logits processors on the device), `noise.py` (counter-based sampling noise), `greedy.py` and `beam.py` (the loop
bodies), `loop.py` (a call's plan and its loop, run by `tendril.graphs.control.while_loop`; how the one-token
forward runs), `compile_limit.py` (compiled functions past torch._dynamo's recompile limit), `api.py` (`generate`,
every plan's loop in one function graphed per plan and input shape on CUDA), `streaming.py` (tokens streamed to an
HF streamer while the loop runs), `stepping.py` (`decode_step`: the loop's body alone, for profiling).
"""

from __future__ import annotations

from tendril.generation.api import generate
from tendril.generation.architectures import UnsupportedModelError, supported_model_types
from tendril.generation.compile_limit import CompileLimitWarning
from tendril.generation.loop import STEPS, Step
from tendril.generation.stepping import DecodeStep, decode_step
from tendril.generation.streaming import StreamerWarning

__all__ = ["STEPS", "CompileLimitWarning", "DecodeStep", "Step", "StreamerWarning", "UnsupportedModelError",
           "decode_step", "generate", "supported_model_types"]
