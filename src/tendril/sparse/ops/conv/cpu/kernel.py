"""Sparse×sparse convolution on the CPU: two compiled dataflows, chosen per call by a cost model.

`cartesian` is SCNN's dataflow, as on the GPU: within each virtual input channel, every nonzero
weight meets every stored activation, and the product is added at `weight base + activation
address` in an accumulator with a top-left halo of `r' - 1` rows and `s' - 1` columns (so no
product needs a bounds check; the halo is cropped at the end). Output channels are processed in
blocks whose accumulators fit in `CARTESIAN_ACC_FLOATS` (the L2 cache), at least
`CARTESIAN_MIN_BLOCKS` blocks so that every thread gets some.

`direct` is output-stationary over the same compressed weights: the input sits in zero-padded phase
planes of row width `R = max(plane_w, out_w + s' - 1)`, and for every output channel and band of
output rows (about `BAND_FLOATS` accumulators on a grid of row width R, whose extra columns are
cropped) each nonzero weight `(v, r', s')` adds `w × planes[v, r'R + s' + band]`, a contiguous
vectorized FMA stream (eight weights per pass over the accumulators, then four). A work unit is (band,
block of output channels), enough units for `direct_call.UNITS_PER_THREAD` per thread, the blocks of about
equal work (`direct_call.channel_blocks`); the band's input rows stay in the L2 cache across the block.
(Dropping the weights of channels with no nonzero activation costs more in the gather than it
saves: few channels are empty in real networks' layers.)

Work: cartesian does `nnz(w) × nnz(a)` products, but each is a scalar read-modify-write at a
scattered address; direct does `nnz(w) × output pixels` multiply-adds, vectorized with the
accumulators in L1, so it wins unless activations are very sparse. With `method="auto"` (the
default) both work counts are computed from the true nonzero counts and the cheaper by
`NS_PER_PRODUCT` (fitted on one core, the `sparse-cpu` benchmark) is taken.

`spmm` is the direct dataflow's product as one library call, for unpadded 1×1 layers without groups: the
weights as a `[K, C]` sparse CSR matrix (built once, in the plan) times the input as a dense `[C, OH·OW]`
matrix (the input itself at stride 1, else its first phase planes or a subsampled copy), by torch's
sparse-dense `addmm` (MKL's sparse BLAS on x86) written straight into the output; bias, residual and ReLU
follow in one compiled pass, and the input's nonzeros are counted only when asked. Whether it beats the compiled
loop on these shapes depends on the host's library and cores (the `sparse-cpu` benchmark's per-layer `extra` times
MKL beside each dataflow), so `auto` takes it on one thread only where the caller says so (`library`; a network's
`SparseNetwork.cpu_library`, which `tune` measures); on several threads `auto` keeps the compiled loops, because
MKL's OpenMP pool and numba's, alternating between layers, contend for the cores. Elsewhere the library loses: on
im2col columns it pays the unfold, and per kernel tap it is no faster than the compiled loop.

Two entry points:
- `conv(acts, weights, init)`: from compressed activations (the op as the GPU kernels see it;
  `direct` scatters them into the planes);
- `conv_dense_input(x, plan, bias, out=...)`: what a CPU network runs per layer. The dense input
  goes straight into the planes (counting nonzeros per virtual channel on the way), bias, residual
  and ReLU are fused into the write-out, and the activations are compressed only when the cost model
  picks `cartesian`, so the common case makes one pass over the input and one over the output.
A CPU network runs `conv_dense_input`'s `auto` method through `prepared.PreparedConv`, which makes the same kernel
calls on operands worked out once per layer (`DirectCall`, the numpy views, the buffers).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from tendril.sparse.activations import ActivationLayout, CompressedActivations
from tendril.sparse.format import ConvGeometry, SparseConvWeights
from tendril.sparse.ops.compress import cpu as compress_cpu
from tendril.sparse.ops.conv.cpu.direct_call import DirectCall
from tendril.sparse.ops.cpu_threads import kernel_threads, kernels

CARTESIAN_ACC_FLOATS = 1 << 16
CARTESIAN_MIN_BLOCKS = 16
BAND_FLOATS = 1024
DIRECT_PAD = 4
"""Each output channel's weight list in the direct dataflow is padded with zero weights to a multiple of this: its
loop takes eight weights per pass, then four."""
NS_PER_PRODUCT = {"cartesian": 1.0, "direct": 0.08}
METHODS = ("auto", "cartesian", "direct", "spmm")


@dataclass(frozen=True)
class CpuConvPlan:
    """One layer's weights re-ordered for both dataflows (built once per layer by `prepare`), and the
    layer's plane buffer (so a plan serves one call at a time)."""

    weights: SparseConvWeights
    row: int
    """Row width R of the direct dataflow's planes and output grid."""
    plane_rows: int
    planes: torch.Tensor
    """`[virtual channels, plane_rows × R + s' - 1]`: the direct dataflow's input, rewritten each call."""
    reads_input: bool
    """Whether the planes would equal the input (an unpadded 1×1 stride-1 layer): the direct dataflow then
    reads the input itself and only counts its nonzeros, and `planes` stays empty."""
    csr: torch.Tensor | None
    """The `[K, C]` sparse CSR weights of the `spmm` product (unpadded 1×1 layers without groups)."""
    direct_values: torch.Tensor
    direct_base: torch.Tensor
    """Where each weight's slice starts in the flat planes: `v × plane_stride + r' × R + s'`."""
    k_ptr: torch.Tensor
    """Output channel k's weights are `direct_*[k_ptr[k] : k_ptr[k + 1]]`, padded with zero weights (at the
    channel's first slice) to a multiple of `DIRECT_PAD`."""
    direct_reach: torch.Tensor
    """Per output channel, the largest base of its direct weights (0 for a channel without any): the direct kernel
    rounds a channel's band up to `direct_call.VECTOR_FLOATS` only where its reads stay inside the planes."""
    band_rows: int
    """Output rows per band of the direct dataflow: as many as fit `BAND_FLOATS`, then evened out over the bands
    that takes (`_even_band_rows`)."""
    acc_hw: tuple[int, int]
    k_block: int
    cartesian_values: torch.Tensor
    cartesian_base: torch.Tensor
    block_ptr: torch.Tensor
    weights_per_channel: torch.Tensor
    direct_macs: float
    """The direct dataflow's multiply-adds, whatever the input: nonzero weights × output rows × R."""

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
        direct_values, direct_base, k_ptr = _padded_by_channel(
            weights.values[direct], (v * plane_stride + rp * row + sp)[direct], k[direct], g.out_channels
        )

        acc_h, acc_w = kh - 1 + max(hv, oh), kw - 1 + max(wv, ow)
        plane = acc_h * acc_w
        k_block = max(1, min(CARTESIAN_ACC_FLOATS // plane, -(-g.out_channels // CARTESIAN_MIN_BLOCKS)))
        blocks = -(-g.out_channels // k_block)
        block_key = (k // k_block) * channels + v
        cartesian = torch.argsort(block_key, stable=True)
        block_ptr = torch.zeros(blocks * channels + 1, dtype=torch.int64)
        block_ptr[1:] = torch.cumsum(torch.bincount(block_key, minlength=blocks * channels), 0)
        block_ptr = torch.cat([block_ptr[:-1].view(blocks, channels), block_ptr[channels::channels, None]], 1)
        base = (k % k_block) * plane - rp * acc_w - sp + (kh - 1) * acc_w + (kw - 1)
        direct_input = reads_input(g)
        return cls(
            weights,
            row,
            plane_rows,
            torch.empty(0 if direct_input else channels, plane_stride),
            direct_input,
            _csr_weights(weights) if has_library_product(g) else None,
            direct_values,
            direct_base,
            k_ptr,
            _reach(direct_base, k_ptr),
            _even_band_rows(oh, max(1, min(oh, BAND_FLOATS // row))),
            (acc_h, acc_w),
            k_block,
            weights.values[cartesian].contiguous(),
            base[cartesian].contiguous(),
            block_ptr.contiguous(),
            per_channel,
            float(weights.nnz) * oh * row,
        )

    def input_grid(self) -> tuple[int, int]:
        """Where the input lies in the planes of a layer that `holds_input`: `(at, R)`, input row `y` of channel `c`
        at `planes[c, at + y × R :][:W]`; everything else in the planes is padding, zero after every fill."""
        g = self.weights.geometry
        if not holds_input(g):
            raise ValueError("only the planes of a stride-1 layer that does not read its input itself hold the input")
        return g.padding[0] * self.row + g.padding[1], self.row

    def products(self, counts: torch.Tensor) -> int:
        """The cartesian dataflow's products for activations with these stored counts per virtual channel."""
        return int((counts.long() * self.weights_per_channel).sum())

    def work(self, counts: torch.Tensor) -> dict[str, float]:
        """Estimated nanoseconds on one core of each dataflow for activations with these stored counts."""
        cartesian = float(self.products(counts)) * NS_PER_PRODUCT["cartesian"]
        return {"cartesian": cartesian, "direct": self.direct_macs * NS_PER_PRODUCT["direct"]}

    def choose(self, counts: torch.Tensor) -> str:
        """The dataflow the cost model predicts faster for these counts."""
        return self.choose_for(self.products(counts))

    def choose_for(self, products: int) -> str:
        """`choose` given the products (`products(counts)`): `cartesian` where it costs no more than `direct`."""
        cartesian = float(products) * NS_PER_PRODUCT["cartesian"]
        return "cartesian" if cartesian <= self.direct_macs * NS_PER_PRODUCT["direct"] else "direct"


def has_library_product(geometry: ConvGeometry) -> bool:
    """Whether a layer can run as the library's sparse product (`spmm`): an unpadded 1×1 layer without groups."""
    return geometry.kernel == (1, 1) and geometry.padding == (0, 0) and geometry.groups == 1


def holds_input(geometry: ConvGeometry) -> bool:
    """Whether a layer's phase planes hold its input as it is, one zero-padded plane per channel (a stride-1 layer that
    does not read its input itself): its input can be written straight into them (`CpuConvPlan.input_grid`)."""
    return geometry.stride == (1, 1) and not reads_input(geometry)


def reads_input(geometry: ConvGeometry) -> bool:
    """Whether a layer's direct dataflow reads its input itself, its phase planes being the input (an unpadded 1×1
    stride-1 layer): `CpuConvPlan.reads_input`."""
    return geometry.kernel == (1, 1) and geometry.stride == (1, 1) and geometry.padding == (0, 0)


def _reach(base: torch.Tensor, k_ptr: torch.Tensor) -> torch.Tensor:
    """`CpuConvPlan.direct_reach`: the largest of each channel's `base[k_ptr[k] : k_ptr[k + 1]]` (0 if empty)."""
    channels = k_ptr.numel() - 1
    owner = torch.repeat_interleave(torch.arange(channels), k_ptr.diff())
    return torch.zeros(channels, dtype=torch.int64).scatter_reduce_(0, owner, base.long(), "amax")


def _padded_by_channel(
    values: torch.Tensor, base: torch.Tensor, k: torch.Tensor, out_channels: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The direct dataflow's weights (sorted by output channel `k`) with each channel's list padded to a multiple
    of `DIRECT_PAD` by zero weights reading the channel's first slice; returns values, bases and `k_ptr`."""
    counts = torch.bincount(k, minlength=out_channels)
    ptr = torch.zeros(out_channels + 1, dtype=torch.int64)
    ptr[1:] = torch.cumsum(counts, 0)
    padded = -(-counts // DIRECT_PAD) * DIRECT_PAD
    k_ptr = torch.zeros(out_channels + 1, dtype=torch.int64)
    k_ptr[1:] = torch.cumsum(padded, 0)
    slot = k_ptr[k] + torch.arange(k.numel()) - ptr[k]
    padded_values = torch.zeros(int(k_ptr[-1]))
    padded_values[slot] = values
    first = base[ptr[:-1].clamp(max=max(k.numel() - 1, 0))] if k.numel() else torch.zeros(out_channels)
    padded_base = torch.repeat_interleave(first.long(), padded)
    padded_base[slot] = base
    return padded_values, padded_base, k_ptr


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
    `method` is `"auto"`, `"cartesian"` or `"direct"` (see the module docstring). `direct` returns a
    new contiguous tensor, `cartesian` a view of its accumulators (cropped of the halo).
    """
    _check_method(method)
    if plan is None:
        plan = CpuConvPlan.prepare(weights)
    elif plan.weights is not weights:
        raise ValueError("the plan was prepared for other weights; pass CpuConvPlan.prepare(weights)")
    counts = acts.stored_counts
    if method == "auto":
        method = "spmm" if plan.csr is not None and threads == 1 else plan.choose(counts)
    _check_supported(plan, method)
    with kernel_threads(threads) as used:
        if method == "cartesian":
            return _cartesian(acts, plan, counts, init)
        g = plan.weights.geometry
        planes = torch.empty(g.virtual_channels, plan.planes.shape[1]) if plan.reads_input else plan.planes
        kernels().scatter_planes(
            planes.numpy(), acts.values.numpy(), acts.positions.numpy(), counts.numpy(), g.plane_hw[1], plan.row
        )
        out = torch.empty(g.out_channels, *g.out_hw)
        if method == "spmm":
            _spmm(plan, columns_of(plan, planes), out, torch.zeros(g.out_channels), init.contiguous(), relu=False)
        else:
            _direct(plan, planes, out, torch.zeros(g.out_channels), init.contiguous(), relu=False, threads=used)
        return out


def conv_dense_input(
    x: torch.Tensor,
    plan: CpuConvPlan,
    bias: torch.Tensor,
    *,
    out: torch.Tensor,
    layout: ActivationLayout,
    residual: torch.Tensor | None = None,
    relu: bool = False,
    threads: int = 1,
    method: str = "auto",
    count: bool = True,
    library: bool = True,
) -> torch.Tensor | None:
    """`out = [relu](bias + residual + conv(x))` for a dense `[C, H, W]` input; returns its true nonzero
    counts per virtual channel. `out` is a contiguous `[K, OH, OW]` tensor. `layout` is used only
    when `cartesian` compresses `x`: a count above its capacity means nonzeros were dropped there, and
    the caller must report it (`SparseNetwork` raises its overflow flag for any such count, whichever
    dataflow ran, so that a capacity too small fails alike on every backend).

    `count=False` lets unpadded 1×1 layers skip the pass that only counts (a whole read of the input beside a
    product that is itself short; a strided one then reads a subsampled copy of the input instead of its phase
    planes); they then return None, every other layer its counts (they count on the way, for free). Pass it only
    where no count can overflow and none is reported. `library=False` keeps `auto` from taking `spmm` (which it takes
    on one thread for the layers that have it, otherwise)."""
    _check_method(method)
    g = plan.weights.geometry
    if tuple(x.shape) != (g.in_channels, *g.in_hw):
        raise ValueError(f"activation shape {tuple(x.shape)}: the layout expects {(g.in_channels, *g.in_hw)}")
    if tuple(out.shape) != (g.out_channels, *g.out_hw) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous tensor of shape {(g.out_channels, *g.out_hw)}")
    if method == "auto" and plan.csr is not None and threads == 1 and library:
        method = "spmm"
    _check_supported(plan, method)
    x = x.contiguous()
    counts = torch.empty(g.virtual_channels, dtype=torch.int32)
    resid = torch.empty(0, 0, 0) if residual is None else residual.contiguous()
    with kernel_threads(threads) as used:
        if method == "spmm" and not count:
            columns = x[:, :: g.stride[0], :: g.stride[1]].reshape(g.in_channels, -1)
            _spmm(plan, columns, out, bias, resid, relu=relu)
            return None
        planes = x.view(g.in_channels, -1) if plan.reads_input else plan.planes
        counted = method == "auto" or count or not plan.reads_input
        products = 0
        if method != "cartesian" and plan.reads_input:
            if counted:
                products = kernels().count_channels(x.numpy(), counts.numpy(), plan.weights_per_channel.numpy())
        elif method != "cartesian":
            products = kernels().fill_planes(
                x.numpy(), *g.stride, *g.padding, planes.numpy(), plan.row, plan.plane_rows, counts.numpy(),
                plan.weights_per_channel.numpy(),
            )  # fmt: skip
        if method == "auto":
            method = plan.choose_for(products)
        if method == "spmm":
            _spmm(plan, columns_of(plan, planes), out, bias, resid, relu=relu)
            return counts
        if method == "direct":
            _direct(plan, planes, out, bias, resid, relu=relu, threads=used)
            return counts if counted else None
        return cartesian_dense_input(x, plan, bias, out, layout, residual, relu=relu, threads=used)


def cartesian_dense_input(
    x: torch.Tensor,
    plan: CpuConvPlan,
    bias: torch.Tensor,
    out: torch.Tensor,
    layout: ActivationLayout,
    residual: torch.Tensor | None,
    *,
    relu: bool,
    threads: int,
) -> torch.Tensor:
    """`conv_dense_input` by the cartesian dataflow: `x` compressed for `layout`, then convolved; returns the true
    counts."""
    g = plan.weights.geometry
    acts = compress_cpu.compress(x, layout, threads=threads)
    init = bias.view(-1, 1, 1).expand(g.out_channels, *g.out_hw)
    y = _cartesian(acts, plan, acts.stored_counts, init if residual is None else init + residual)
    out.copy_(y.relu_() if relu else y)
    return acts.counts


def _check_method(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"method {method!r}: expected one of {METHODS}")


def _check_supported(plan: CpuConvPlan, method: str) -> None:
    if method == "spmm" and plan.csr is None:
        raise ValueError("method 'spmm' runs only 1×1 convolutions without padding or groups")


def columns_of(plan: CpuConvPlan, planes: torch.Tensor) -> torch.Tensor:
    """The `[C, OH·OW]` input of the `spmm` product: the input itself where the plan reads it, else (a strided
    1×1 layer) every channel's first phase plane, which holds exactly the pixels the layer reads."""
    g = plan.weights.geometry
    if plan.reads_input:
        return planes
    phases = g.stride[0] * g.stride[1]
    return planes.view(g.in_channels, phases, -1)[:, 0].contiguous()


def _csr_weights(weights: SparseConvWeights) -> torch.Tensor:
    """The `[K, C]` sparse CSR matrix of a 1×1 convolution without groups."""
    g = weights.geometry
    with warnings.catch_warnings():  # torch's notice that its sparse CSR layout is in beta
        warnings.filterwarnings("ignore", "Sparse CSR tensor support is in beta", UserWarning)
        return weights.to_dense().view(g.out_channels, g.in_channels).to_sparse_csr()


def _spmm(
    plan: CpuConvPlan,
    columns: torch.Tensor,
    out: torch.Tensor,
    bias: torch.Tensor,
    residual: torch.Tensor,
    *,
    relu: bool,
) -> None:
    """`out = [relu](bias + residual + csr @ columns)` (`columns` is `[C, H·W]`): the library's product written
    into `out` alone (`beta=0`: adding a bias matrix there costs it a pass more), then bias, residual and ReLU in
    one compiled pass."""
    assert plan.csr is not None  # `_check_supported` ran
    flat = out.view(out.shape[0], -1)
    torch.addmm(flat, plan.csr, columns, beta=0, out=flat)
    rows = residual.view(out.shape[0], -1) if residual.numel() else torch.empty(0, 0)
    kernels().bias_residual_relu(flat.numpy(), bias.contiguous().numpy(), rows.numpy(), relu)


def _direct(
    plan: CpuConvPlan,
    planes: torch.Tensor,
    out: torch.Tensor,
    bias: torch.Tensor,
    residual: torch.Tensor,
    *,
    relu: bool,
    threads: int,
) -> None:
    """The direct dataflow over `planes` (`plan.planes` filled, or the input where the plan reads it) into `out`."""
    call = DirectCall.of(plan, threads, bias.contiguous().numpy(), relu)
    call.run(out.view(out.shape[0], -1).numpy(), residual.numpy(), planes.reshape(-1).numpy())


def _even_band_rows(rows: int, most: int) -> int:
    """Rows per band for `rows` output rows in bands of at most `most` rows, as even as the bands allow: the threads
    split the direct kernel's units statically, so a short last band (17, 17, 17, 5 for 56 rows) leaves the threads
    that get it idle while the others work (14, 14, 14, 14)."""
    bands = -(-rows // most)
    return -(-rows // bands)


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
