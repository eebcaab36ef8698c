"""Case `launch-overhead`: eager PyTorch against one replayed CUDA graph at batch 1.

A 50-layer MLP and a GPT-2 (124M, random weights, fp16) forward at sequence length 32: the gap
tendril exists to close for dynamic models. Inputs rotate among several sets; the graph's
placeholders are refilled before each replay, as a user of `torch.cuda.graph` must.
"""

from __future__ import annotations

import torch
from torch import nn

from benchmarks.registry import Context, Goal, register
from tendril.graphs.capture import capture
from tendril.utils.timing import time_callable


def _mlp(device: torch.device) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(50):
        layers += [nn.Linear(256, 256), nn.ReLU()]
    return nn.Sequential(*layers).to(device).eval()


def _gpt2(device: torch.device) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(use_cache=False))
    return model.to(device=device, dtype=torch.float16).eval()


def _compare(ctx: Context, name: str, model: nn.Module, inputs: list[torch.Tensor]) -> float:
    reps = 30 if ctx.quick else 300
    eager = time_callable(model, [(x,) for x in inputs], device=ctx.device, warmup=5, reps=reps)
    placeholder = inputs[0].clone()
    captured = capture(model, placeholder)

    def replay(x: torch.Tensor) -> None:
        placeholder.copy_(x)
        captured.graph.replay()

    graphed = time_callable(replay, [(x,) for x in inputs], device=ctx.device, warmup=5, reps=reps)
    ctx.add_timing(f"{name} eager", eager)
    ctx.add_timing(f"{name} CUDA graph", graphed)
    return eager.median_ms / graphed.median_ms


@register("launch-overhead", "eager vs one replayed CUDA graph: 50-layer MLP, GPT-2 forward (batch 1)")
def run(ctx: Context) -> None:
    torch.manual_seed(0)
    with torch.inference_mode():
        mlp_inputs = [torch.randn(1, 256, device=ctx.device) for _ in range(8)]
        ctx.target("speedup_graph_vs_eager_mlp50", _compare(ctx, "mlp50", _mlp(ctx.device), mlp_inputs), Goal(">", 1))
        ids = [torch.randint(0, 50257, (1, 32), device=ctx.device) for _ in range(8)]
        ctx.target(
            "speedup_graph_vs_eager_gpt2_seq32", _compare(ctx, "gpt2 fp16", _gpt2(ctx.device), ids), Goal(">", 1)
        )
