"""The Triton compressor under the Triton interpreter (run by test_triton_interpreted.py in a subprocess with
TRITON_INTERPRET=1): both launch plans (one segment per plane: one kernel; several: count + compress) against the
reference with every output buffer poisoned beforehand, the overflow flag, and what each plan launches."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tendril.sparse.activations import ActivationLayout, CompressedActivations
from tendril.sparse.ops.compress import reference as compress_reference
from tendril.sparse.ops.compress import triton as compress_triton
from tests.sparse.checks import assert_same_compression

SINGLE = {"block": 8, "segment_blocks": 8}  # one segment of several blocks
MULTI = {"block": 4, "segment_blocks": 2}  # 2 to 5 segments of 2 blocks
LAYOUTS = tuple(  # capacity: the whole plane
    ActivationLayout(c, hw, stride, padding, 1).with_capacity(1.0)
    for c, hw, stride, padding in (
        (3, (5, 7), (1, 1), (0, 0)),
        (2, (7, 6), (2, 2), (1, 1)),  # stride phases, padding
        (2, (6, 8), (1, 2), (2, 0)),
    )
)
_ORIGINAL_EMPTY = CompressedActivations.empty


def _poisoned_empty(layout: ActivationLayout, device: torch.device, dtype: torch.dtype = torch.float32):
    out = _ORIGINAL_EMPTY(layout, device, dtype)
    out.values.fill_(float("nan"))
    for buffer in (out.positions, out.row_ptr, out.counts):
        buffer.fill_(-7)
    return out


def _activation(layout: ActivationLayout, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """ReLU of normal noise, with an all-zero and (where there are three channels) an all-nonzero channel."""
    x = torch.randn(layout.channels, *layout.in_hw, generator=torch.Generator().manual_seed(seed)).relu()
    x[0] = 0.0
    if layout.channels > 2:
        x[2] = x[2].abs() + 0.5
    return x.to(dtype)


def _plans(layout: ActivationLayout) -> tuple[dict[str, int], ...]:
    assert _segments(layout, SINGLE) == 1 and _segments(layout, MULTI) > 1
    return SINGLE, MULTI


def _segments(layout: ActivationLayout, plan: dict[str, int]) -> int:
    block = min(plan["block"], 1 << (layout.plane_size - 1).bit_length())
    return -(-layout.plane_size // (block * plan["segment_blocks"]))


def check_against_the_reference() -> None:
    """Every layout, dtype and plan, poisoned buffers; the flag stays 0 without overflow and 1 once set."""
    with mock.patch.object(CompressedActivations, "empty", _poisoned_empty):
        for seed, layout in enumerate(LAYOUTS):
            for before, dtype in enumerate((torch.float32, torch.float16)):
                x = _activation(layout, dtype, seed)
                expected = compress_reference.compress(x, layout)
                for plan in _plans(layout):
                    flag = torch.full((1,), before, dtype=torch.int32)
                    assert_same_compression(compress_triton.compress(x, layout, flag, **plan), expected)
                    assert flag.item() == before, (layout, plan, before)


def check_overflow() -> None:
    """A capacity below some channels' counts: only what fits is stored, the true counts kept, the flag raised."""
    full = LAYOUTS[1]
    layout = ActivationLayout(full.channels, full.in_hw, full.stride, full.padding, 3)
    x = _activation(layout, torch.float32, 5)
    expected = compress_reference.compress(x, layout)
    assert expected.overflowed() and (expected.counts <= layout.capacity).any()  # some channels fit, some do not
    with mock.patch.object(CompressedActivations, "empty", _poisoned_empty):
        for plan in _plans(layout):
            for before in (0, 1):
                flag = torch.full((1,), before, dtype=torch.int32)
                assert_same_compression(compress_triton.compress(x, layout, flag, **plan), expected)
                assert flag.item() == 1, (plan, before)


class _TorchOps(TorchDispatchMode):
    """Records the torch ops run outside Triton launches (the interpreter's own copies are not the wrapper's)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.in_kernel = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not self.in_kernel:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@contextmanager
def _recorded(launches: list[str]) -> Iterator[_TorchOps]:
    kernel_type = type(compress_triton._compress_kernel)
    original_run = kernel_type.run
    mode = _TorchOps()

    def run(kernel: Any, *args: Any, **kwargs: Any) -> Any:
        launches.append(kernel.__name__)
        mode.in_kernel = True
        try:
            return original_run(kernel, *args, **kwargs)
        finally:
            mode.in_kernel = False

    with mock.patch.object(kernel_type, "run", run), mode:
        yield mode


def check_launches() -> None:
    """One segment: the compress kernel alone; several: the count kernel first. Besides the launches the
    wrapper only allocates (no torch kernel runs on the device)."""
    layout = LAYOUTS[1]
    x, flag = _activation(layout, torch.float32, 0), torch.zeros(1, dtype=torch.int32)
    cases: tuple[tuple[dict[str, int], list[str]], ...] = (
        (SINGLE, ["_compress_kernel"]),
        (MULTI, ["_count_kernel", "_compress_kernel"]),
    )
    for plan, kernels in cases:
        launches: list[str] = []
        with _recorded(launches) as mode:
            compress_triton.compress(x, layout, flag, **plan)
        assert launches == kernels, launches
        assert mode.ops and set(mode.ops) == {"aten.empty.memory_format"}, mode.ops


CHECKS: tuple[Callable[[], None], ...] = (check_against_the_reference, check_overflow, check_launches)


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    for check in CHECKS:
        check()
    print("interpreted compress checks passed")


if __name__ == "__main__":
    main()
