"""Graphed training steps: forward, loss, backward and optimizer step replayed as one CUDA graph per key.

`tendril.graphed_step(fn, model=..., optimizer=..., scaler=..., buckets=..., accumulate=..., memory=...)` (`step`)
keys calls by shape like `tendril.graphed`, warms each key with one eager step, captures it into the pool shared by
all keys and replays it, one optimizer step per call. What it relies on and checks:

- fixed addresses of gradients and optimizer state, capturable optimizers, settings baked into the graphs
  (`invariants`);
- fp16 loss scaling with inf/NaN checks and step skipping on the device (`scaler`: torch's GradScaler with a fused
  optimizer, or `DeviceGradScaler`);
- host syncs: judged by the capture; a capture that fails runs its key eagerly from then on, with the reason in
  `stats`, and the syncs `find_host_syncs` found on the first of those eager steps, with their places
  (`stats.host_syncs`). Splitting a step around a sync that cannot be removed is left to the user (two graphed
  steps, e.g. `accumulate`'s two parts);
- on CPU test backends, a capture that records without running (`simulated`).

Random numbers. Dropout stays on and draws new masks at every replay. PyTorch's `CUDAGraph.capture_begin`
registers the default CUDA generator of the capturing device with the graph (aten/src/ATen/cuda/CUDAGraph.cpp;
Note [CUDA Graph-safe RNG states] in CUDAGeneratorImpl.h): while capturing, each random kernel reads its Philox
seed and offset from device tensors plus an offset fixed within the graph, and the generator counts the graph's
total offset increment; every `replay()` first writes the generator's current seed and offset into those device
tensors and advances the generator's offset by that total. So each replay continues the generator's stream where the
previous step left it, as eager steps do, and later eager random ops continue after it. Only generators registered
with the graph are handled: dropout on the default generator is; a `torch.Generator` of the user's own would repeat
its numbers at every replay unless registered (`CUDAGraph.register_generator_state`). LayerDrop as HF's models do
it draws on the host, which a graph freezes: `layerdrop_on_device(model)` draws it on the device (`layerdrop`), and
`graphed_step` warns of a model that still draws it on the host (`HostLayerDropWarning`).
"""

from __future__ import annotations

from tendril._lazy import lazy_attributes

_LAZY: dict[str, str] = {
    "graphed_step": "tendril.graphs.training.step",
    "GraphedStep": "tendril.graphs.training.step",
    "StepStats": "tendril.graphs.training.step",
    "DeviceGradScaler": "tendril.graphs.training.scaler",
    "check_optimizer": "tendril.graphs.training.invariants",
    "HostLayerDropWarning": "tendril.graphs.training.layerdrop",
    "layerdrop_on_device": "tendril.graphs.training.layerdrop",
    "host_layerdrop": "tendril.graphs.training.layerdrop",
    "DeviceLayerDrop": "tendril.graphs.training.layerdrop",
}

__all__ = list(_LAZY)

__getattr__ = lazy_attributes(__name__, _LAZY, globals())
