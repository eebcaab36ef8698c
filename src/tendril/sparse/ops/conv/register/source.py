"""CUDA C++ source of the register-tiled sparse-weight convolution (`kernel.py` compiles and launches it):
`sparse_weight_conv.cu`, beside this module, and the `-D` defines that specialise it per plan.

Why not SCNN's Cartesian product here: at the activation densities ReLU leaves in networks like VGG-16
(mostly nonzero), each product of the Cartesian kernel (`cartesian_cuda`) costs a shared-memory atomic at a
scattered address and several instructions for one FMA. Skipping only zero *weights* and reading activations
densely turns each nonzero weight into `ph × pw` register FMAs fed by one broadcast weight load, with
each lane's input window read from shared memory once per channel and shared by the warp's `kt` output
channels and all their taps.

Where the time goes, and why the kernel looks as it does: per staged channel a warp issues its
window loads, `kt × R` record tests per row of taps, one weight load and `ph × pw` FMAs per nonzero
weight. Every index into the per-thread arrays (`acc`, `win`, the records) is a compile-time
constant after unrolling (a runtime index would put them in local memory), the plan's constants
come in as `-D` defines (`compile_options`), and the staging of the next channel chunk (`cp.async`,
zero-filled where the padding is) overlaps this chunk's FMAs. The shared-memory row pitch is chosen
by the planner to avoid bank conflicts of the window loads.

One source holds both layouts; a plan's `PIXEL_RUN` define selects the kernel it compiles. Pixel runs serve
1×1 convolutions (ResNet's bottleneck reduce/expand and downsample layers), which are sparse × dense matrix
products: same arguments, buffers, splits, tickets and epilogue as the tiles, but a block stages `32 × pw`
flattened output pixels per input channel (16-byte `cp.async` copies at stride 1 when the input is aligned,
gathered 4-byte ones when strided), a warp reads one record per channel (its `kt` output channels' mask,
skipping the channel when it is empty), each lane loads its `pw` pixels as `pw / vector` conflict-free
vectors, and each nonzero weight is one broadcast load and `pw` FMAs; outputs leave as coalesced vector stores.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from tendril.sparse.ops.conv.register.tiling import RegisterTilePlan

KERNEL_NAME = "sparse_weight_conv"
SOURCE_FILE = f"{KERNEL_NAME}.cu"


@cache
def source() -> str:
    """The kernel's CUDA C++ (`sparse_weight_conv.cu`, package data beside this module), as NVRTC compiles it."""
    return Path(__file__).with_name(SOURCE_FILE).read_text(encoding="utf-8")


def compile_options(plan: RegisterTilePlan) -> tuple[str, ...]:
    """The NVRTC `-D` options that specialise `source()` for this plan (each plan compiles to its own kernel)."""
    g = plan.geometry
    values = {
        "R": g.kernel[0],
        "S": g.kernel[1],
        "SH": g.stride[0],
        "SW": g.stride[1],
        "PADH": g.padding[0],
        "PADW": g.padding[1],
        "PH": plan.ph,
        "PW": plan.pw,
        "KT": plan.kt,
        "LANES_X": plan.lanes_x,
        "LANES_Y": plan.lanes_y,
        "WARPS": plan.warps,
        "C_CHUNK": plan.c_chunk,
        "RECORD_ROWS": plan.record_rows,
        "IN_H": plan.in_hw[0],
        "IN_W": plan.in_hw[1],
        "PITCH": plan.pitch,
        "VEC": plan.vector,
        "VAL_CAP": plan.value_capacity,
        "CHAN_CAP": plan.split_channels + 1,
        "MIN_BLOCKS": plan.blocks_per_sm,
        "PIXEL_RUN": int(plan.pixel_run),
    }
    return tuple(f"-D{k}={v}" for k, v in values.items())
