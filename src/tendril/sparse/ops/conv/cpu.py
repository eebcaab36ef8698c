"""Sparse×sparse convolution on the CPU: two compiled dataflows, chosen per call by a cost model.

`cartesian` is SCNN's dataflow, as on the GPU: within each virtual input channel, every nonzero
weight meets every stored activation, and the product is added at `weight base + activation
address` in an accumulator with a top-left halo of `r' - 1` rows and `s' - 1` columns (so no
product needs a bounds check; the halo is cropped at the end). Output channels are processed in
blocks whose accumulators fit in `CARTESIAN_ACC_FLOATS` (the L2 cache), one block per thread.

`direct` is output-stationary over the same compressed weights: the stored activations are
scattered back into zero-padded phase planes of row width `R = max(plane_w, out_w + s' - 1)`, and
for every output channel and tile of `DIRECT_TILE` output pixels (on a grid of row width R, whose
extra columns are cropped) each nonzero weight `(v, r', s')` adds `w × planes[v, r'R + s' + tile]`,
a contiguous vectorized FMA stream, eight weights per pass. (Dropping the weights of channels with
no nonzero activation before each call cost more in the gather than it saved: ~5% of the channels
are empty in VGG-16's layers.)

Work: cartesian does `nnz(w) × nnz(a)` products, but each is a scalar read-modify-write at a
scattered address (~1 ns on one core here); direct does `nnz(w) × output pixels` multiply-adds at
~0.06 ns (vectorized, tile in L1), so it wins unless activations are sparser than ~6%. `conv` with
`method="auto"` (the default) computes both work counts from the true nonzero counts and takes the
cheaper by `NS_PER_PRODUCT`, measured on one core (benchmarks/results/sparse-cpu.md).
Multi-threaded: numba's pool over output channels (direct) or output-channel blocks (cartesian).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tendril.sparse.format import CompressedActivations, SparseConvWeights
from tendril.sparse.ops.cpu_threads import kernel_threads, kernels

CARTESIAN_ACC_FLOATS = 1 << 16
DIRECT_TILE = 4096
NS_PER_PRODUCT = {"cartesian": 1.0, "direct": 0.06}
METHODS = ("auto", "cartesian", "direct")


@dataclass(frozen=True)
class CpuConvPlan:
    """One layer's weights re-ordered for both dataflows (built once per layer by `prepare`)."""

    weights: SparseConvWeights
    row: int
    """Row width R of the direct dataflow's planes and output grid."""
    plane_rows: int
    plane_stride: int
    """Floats per plane in the direct dataflow's flat planes (rows × R plus the last row's overhang)."""
    direct_values: torch.Tensor
    direct_base: torch.Tensor
    """Where each weight's slice starts in the flat planes: `v × plane_stride + r' × R + s'`."""
    k_ptr: torch.Tensor
    acc_hw: tuple[int, int]
    k_block: int
    cartesian_values: torch.Tensor
    cartesian_base: torch.Tensor
    block_ptr: torch.Tensor
    weights_per_channel: torch.Tensor

    @classmethod
    def prepare(cls, weights: SparseConvWeights) -> CpuConvPlan:
        g = weights.geometry
        (kh, kw), (hv, wv), (oh, ow) = g.plane_kernel, g.plane_hw, g.out_hw
        channels = g.virtual_channels
        ptr = weights.channel_ptr.long()
        per_channel = ptr[1:] - ptr[:-1]
        v = torch.repeat_interleave(torch.arange(channels), per_channel)
        taps = weights.taps.long()
        k, rp, sp = taps >> 16, (taps >> 8) & 0xFF, taps & 0xFF

        row = max(wv, ow + kw - 1)
        plane_rows = max(hv, oh + kh - 1)
        plane_stride = plane_rows * row + kw - 1
        direct = torch.argsort((k * channels + v) * (1 << 16) + (taps & 0xFFFF))
        k_ptr = torch.zeros(g.out_channels + 1, dtype=torch.int64)
        k_ptr[1:] = torch.cumsum(torch.bincount(k, minlength=g.out_channels), 0)

        acc_h, acc_w = kh - 1 + max(hv, oh), kw - 1 + max(wv, ow)
        plane = acc_h * acc_w
        k_block = max(1, min(g.out_channels, CARTESIAN_ACC_FLOATS // plane))
        blocks = -(-g.out_channels // k_block)
        block_key = (k // k_block) * channels + v
        cartesian = torch.argsort(block_key, stable=True)
        block_ptr = torch.zeros(blocks * channels + 1, dtype=torch.int64)
        block_ptr[1:] = torch.cumsum(torch.bincount(block_key, minlength=blocks * channels), 0)
        block_ptr = torch.cat([block_ptr[:-1].view(blocks, channels), block_ptr[channels::channels, None]], 1)
        base = (k % k_block) * plane - rp * acc_w - sp + (kh - 1) * acc_w + (kw - 1)
        return cls(
            weights,
            row,
            plane_rows,
            plane_stride,
            weights.values[direct].contiguous(),
            (v * plane_stride + rp * row + sp)[direct].contiguous(),
            k_ptr,
            (acc_h, acc_w),
            k_block,
            weights.values[cartesian].contiguous(),
            base[cartesian].contiguous(),
            block_ptr.contiguous(),
            per_channel,
        )

    def work(self, counts: torch.Tensor) -> dict[str, float]:
        """Estimated nanoseconds on one core of each dataflow for activations with these stored counts."""
        g = self.weights.geometry
        products = float((counts.long() * self.weights_per_channel).sum())
        macs = float(self.weights.nnz) * g.out_hw[0] * self.row
        return {"cartesian": products * NS_PER_PRODUCT["cartesian"], "direct": macs * NS_PER_PRODUCT["direct"]}


def conv(
    acts: CompressedActivations,
    weights: SparseConvWeights,
    init: torch.Tensor,
    *,
    threads: int = 1,
    plan: CpuConvPlan | None = None,
    method: str = "auto",
) -> torch.Tensor:
    """`init + conv(acts, weights)` (`init` is `[K, OH, OW]`, left unchanged).

    `plan` (from `CpuConvPlan.prepare(weights)`) saves re-ordering the weights on every call;
    `method` is `"auto"`, `"cartesian"` or `"direct"` (see the module docstring). The accumulators
    start as `init`, and the result is a view of them (cropped of the halo or the grid's extra columns).
    """
    if method not in METHODS:
        raise ValueError(f"method {method!r}: expected one of {METHODS}")
    if plan is None:
        plan = CpuConvPlan.prepare(weights)
    elif plan.weights is not weights:
        raise ValueError("the plan was prepared for other weights; pass CpuConvPlan.prepare(weights)")
    counts = acts.stored_counts
    if method == "auto":
        cost = plan.work(counts)
        method = min(cost, key=lambda m: cost[m])
    with kernel_threads(threads):
        return _direct(acts, plan, counts, init) if method == "direct" else _cartesian(acts, plan, counts, init)


def _direct(acts: CompressedActivations, plan: CpuConvPlan, counts: torch.Tensor, init: torch.Tensor) -> torch.Tensor:
    g = plan.weights.geometry
    (oh, ow), wv = g.out_hw, g.plane_hw[1]
    planes = torch.zeros(g.virtual_channels, plan.plane_stride)
    kernels().scatter_planes(planes.numpy(), acts.values.numpy(), acts.positions.numpy(), counts.numpy(), wv, plan.row)
    out = torch.empty(g.out_channels, oh, plan.row)
    out[:, :, :ow] = init
    out[:, :, ow:] = 0
    kernels().conv_direct(
        out.view(g.out_channels, -1).numpy(),
        plan.direct_values.numpy(),
        plan.direct_base.numpy(),
        plan.k_ptr.numpy(),
        planes.view(-1).numpy(),
        DIRECT_TILE,
    )
    return out[:, :, :ow]


def _cartesian(
    acts: CompressedActivations, plan: CpuConvPlan, counts: torch.Tensor, init: torch.Tensor
) -> torch.Tensor:
    g = plan.weights.geometry
    (kh, kw), (oh, ow), wv = g.plane_kernel, g.out_hw, g.plane_hw[1]
    acc_h, acc_w = plan.acc_hw
    blocks = plan.block_ptr.shape[0]
    stored = torch.arange(acts.layout.capacity)[None, :] < counts[:, None]
    positions = acts.positions.long().where(stored, 0)
    address = (positions // wv) * acc_w + positions % wv
    acc = torch.zeros(blocks * plan.k_block, acc_h, acc_w)
    output = acc[: g.out_channels, kh - 1 : kh - 1 + oh, kw - 1 : kw - 1 + ow]
    output.copy_(init)
    kernels().conv_cartesian(
        acc.view(blocks, -1).numpy(),
        plan.cartesian_values.numpy(),
        plan.cartesian_base.numpy(),
        plan.block_ptr.numpy(),
        acts.values.numpy(),
        address.numpy(),
        counts.numpy(),
    )
    return output
