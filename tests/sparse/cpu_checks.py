"""Checks shared by the CPU backend's tests: a network's forward against the unprepared path, bit for bit."""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence

import pytest
import torch

from tendril.sparse.network import SparseNetwork
from tendril.sparse.ops import cpu_threads
from tendril.sparse.ops.conv.cpu.dataflow import run_unprepared
from tendril.sparse.ops.linear import cpu as linear_cpu
from tendril.sparse.steps import RunState, SparseConvStep, SparseLinearStep


def unprepared_forward(net: SparseNetwork, x: torch.Tensor) -> tuple[torch.Tensor, RunState]:
    """The network's forward with every sparse layer run as the engine ran it before preparation: convolutions by
    `run_unprepared`, FC layers by `linear_dense_input` per sample; returns the output and the state it counted in."""
    state = RunState(
        "cpu", net.threads, torch.zeros(1, dtype=torch.int32), count_inputs=net.count_activations,
        library=net.cpu_library,
    )
    values = {net.input_name: x}
    with torch.no_grad():
        for step in net.steps:
            args = [values[name] for name in step.inputs]
            if isinstance(step, SparseConvStep):
                values[step.output] = run_unprepared(step, args[0], args[1] if step.residual else None, state)
            elif isinstance(step, SparseLinearStep):
                y = torch.empty(args[0].shape[0], step.weights.out_features)
                for b in range(y.shape[0]):
                    counts = linear_cpu.linear_dense_input(
                        args[0][b], step.weights, step.bias, out=y[b], relu=step.relu, threads=net.threads
                    )
                    state.count(step.name, counts, step.layout)
                values[step.output] = y
            else:
                values[step.output] = step.run(args, state)
    return values[net.output_name], state


def assert_same_run(net: SparseNetwork, x: torch.Tensor) -> torch.Tensor:
    """`net(x)` equals the unprepared forward bit for bit, with the same counts and overflow flag."""
    with torch.no_grad():
        y = net(x)
    expected, state = unprepared_forward(net, x)
    assert torch.equal(y, expected)
    assert net.state.last_counts.keys() == state.last_counts.keys()
    for name, counts in state.last_counts.items():
        assert torch.equal(net.state.last_counts[name], counts), name
    assert torch.equal(net.state.overflow, state.overflow)
    return y


def count_kernel_calls(monkeypatch: pytest.MonkeyPatch, names: Sequence[str]) -> collections.Counter[str]:
    """Calls of the compiled kernels `names` from now on (the operators look each kernel up on the module at its
    call, so a patched module attribute sees every call)."""
    calls: collections.Counter[str] = collections.Counter()
    module = cpu_threads.kernels()
    for name in names:
        original = getattr(module, name)

        def counted(*args: object, name: str = name, original: Callable[..., object] = original) -> object:
            calls[name] += 1
            return original(*args)

        monkeypatch.setattr(module, name, counted)
    return calls
