"""A convolution layer's CPU call with everything that does not depend on the input worked out once.

`kernel.conv_dense_input` checks its operands, derives the layer's geometry and the kernels' arguments, allocates
its counts and converts every tensor to a numpy array on each call: host work that is serial whatever the thread
count, so on many threads it is much of a small layer's time. A `PreparedConv` does that once per layer, thread
count and batch size (`RunState.prepared` keeps it, so `SparseNetwork.set_backend` drops it with the old state) and
then, per call, compares the input's shape with a tuple, looks up its numpy view and runs the kernels: the same
kernels on the same operands as `conv_dense_input`'s `auto` method, so the outputs are bit-identical.

What it reuses between calls:
- the numpy views of the weights, bias and plan, the counts buffer (`RunState.last_counts` holds it: each forward
  that counts rewrites it), and the plan's phase planes (as `conv_dense_input` does);
- the views of the last input and residual tensors it saw (the previous layers' outputs, the same buffers every
  forward), checked by identity and data pointer, so it holds on to the last ones until the next call;
- its output buffer, when the state lists the layer in `RunState.reused_outputs` (a network lists the layers whose
  output never reaches its caller): each call then overwrites the previous call's output. Otherwise every call
  writes a new tensor.
So a prepared layer serves one call at a time: a network runs from one Python thread at a time on the CPU.

Counts passed between layers: an unpadded 1×1 stride-1 layer reads its input directly, so no pass over it counts
its nonzeros on the way (the cost model and the layer report need them) and it would count them with a pass of its
own, one more parallel region per layer. Where the layer that writes that input does so by the direct kernel into a
reused buffer (a network lists those layers in `RunState.counted_outputs`), the kernel counts what it writes per
band and output channel, and the layer publishes the counts in `RunState.output_counts` beside the tensor they
describe; a reading layer handed that very tensor sums them (a serial call) instead of counting. A publishing layer
drops its entry before it rewrites the buffer and publishes again only where every sample went through the direct
kernel. The counts are the same numbers either way, so outputs and reports stay bit-identical.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from tendril.sparse.ops import cpu_threads
from tendril.sparse.ops.conv.cpu import kernel

if TYPE_CHECKING:
    from tendril.sparse.steps import RunState, SparseConvStep

NO_RESIDUAL = np.empty((0, 0, 0), dtype=np.float32)
"""The direct kernel's residual operand for a layer without one."""
NO_RESIDUAL_ROWS = np.empty((0, 0), dtype=np.float32)
"""The `spmm` epilogue's residual operand for a layer without one."""


class TensorViews:
    """Per sample, the numpy view of one operand (`[N, ...]`, contiguous) and its `[rows, -1]` views (numpy, and
    with `flat_tensors` torch, for the library product), kept for the last tensor seen: the next call with the same
    tensor (by identity and data pointer) reuses them."""

    def __init__(self, rows: int, flat_tensors: bool) -> None:
        self.rows, self.flat_tensors = rows, flat_tensors
        self.tensor: torch.Tensor | None = None
        self.pointer = 0
        self.arrays: list[np.ndarray] = []
        self.flat_arrays: list[np.ndarray] = []
        self.flat: list[torch.Tensor] = []

    def of(self, tensor: torch.Tensor) -> TensorViews:
        """These views, rebuilt for `tensor` unless they are `tensor`'s already."""
        if tensor is not self.tensor or tensor.data_ptr() != self.pointer:
            array = tensor.numpy()
            self.arrays = list(array)
            self.flat_arrays = [a.reshape(self.rows, -1) for a in self.arrays]
            self.flat = [t.view(self.rows, -1) for t in tensor] if self.flat_tensors else []
            self.tensor, self.pointer = tensor, tensor.data_ptr()
        return self


class PreparedConv:
    """`CpuKernel`'s call for one layer (`SparseConvStep`) at one thread count and batch size (module docstring)."""

    def __init__(self, step: SparseConvStep, state: RunState, batch: int) -> None:
        if step.cpu_plan is None:
            step.cpu_plan = kernel.CpuConvPlan.prepare(step.weights)
        plan = self.plan = step.cpu_plan
        g = plan.weights.geometry
        self.step = step
        """Held, so that the step's `id`, `RunState.prepared`'s key, stays its own."""
        self.name, self.layout, self.relu = step.name, step.layout, step.relu
        self.input_name, self.output_name = step.inputs[0], step.output
        self.threads, self.used = state.threads, cpu_threads.usable(state.threads)
        self.in_shape = (batch, g.in_channels, *g.in_hw)
        self.out_shape = (batch, g.out_channels, *g.out_hw)
        self.spmm = plan.csr is not None and state.threads == 1
        self.csr = plan.csr if plan.csr is not None else torch.empty(0)
        self.kernels = cpu_threads.kernels()
        """The compiled kernels' module (each looked up there at its call, as everywhere)."""
        self.may_overflow = step.layout.capacity < step.layout.plane_size
        self.capacity = step.layout.capacity if self.may_overflow else None
        self.bias = step.bias.contiguous()
        self.bias_array = self.bias.numpy()
        self.counts = torch.empty(g.virtual_channels, dtype=torch.int32)
        self.counts_array = self.counts.numpy()
        self.count_arguments = (self.counts_array, plan.weights_per_channel.numpy())
        """The counting kernels' last arguments: the counts buffer and the plan's weights per channel."""
        self.direct = kernel.DirectCall.of(plan, self.used, self.bias_array, step.relu)
        self.fill = (*g.stride, *g.padding, plan.planes.numpy(), plan.row, plan.plane_rows, *self.count_arguments)
        self.planes = plan.planes.view(-1).numpy()
        self.stride = g.stride
        strided_spmm = self.spmm and not plan.reads_input
        oh, ow = g.out_hw if strided_spmm else (0, 0)
        self.columns = torch.empty(g.in_channels, oh * ow)
        self.subsampled = self.columns.numpy().reshape(g.in_channels, oh, ow)
        self.inputs = TensorViews(g.in_channels, flat_tensors=self.spmm and plan.reads_input)
        self.residuals = TensorViews(g.out_channels, flat_tensors=False)
        self.output = TensorViews(g.out_channels, flat_tensors=self.spmm)
        self.reuse = step.name in state.reused_outputs
        if self.reuse:
            self.output.of(torch.empty(self.out_shape))
        self.publishes = self.reuse and step.name in state.counted_outputs
        """Whether the direct kernel keeps this layer's output nonzeros for the next layers (`RunState.output_counts`):
        only into a reused buffer, which no one else writes."""
        bands = self.direct.bands if self.publishes else 0
        self.band_counts = np.zeros((batch, bands, g.out_channels if bands else 0), dtype=np.int32)
        self.sample_band_counts = list(self.band_counts)

    def accepts(self, x: torch.Tensor) -> bool:
        """Whether `x` is an input this call was prepared for (the batch size and shape it expects, fp32)."""
        return x.shape == self.in_shape and x.dtype is torch.float32

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None, state: RunState) -> torch.Tensor:
        """The layer's output for `x` (which `accepts`) and its residual, on the prepared thread count (set here,
        then this call again, unless a `kernel_threads` around it, a network's forward, set it)."""
        if residual is not None and residual.shape != self.out_shape:
            raise ValueError(f"{self.name}: residual shape {tuple(residual.shape)}, expected {self.out_shape}")
        if cpu_threads.held() != self.used:
            with cpu_threads.kernel_threads(self.threads):
                return self(x, residual, state)
        out = self.output if self.reuse else TensorViews(self.output.rows, self.spmm).of(torch.empty(self.out_shape))
        inputs = self.inputs.of(_contiguous(x))
        residuals = None if residual is None else self.residuals.of(_contiguous(residual))
        count = state.count_inputs or self.may_overflow
        published = self._published_counts(x, state)
        if self.publishes:  # the counts published last describe the buffer only until it is rewritten
            state.output_counts.pop(self.output_name, None)
        publish = self.publishes
        for b in range(self.in_shape[0]):
            if self.spmm:
                counts = self._spmm(inputs, residuals, out, b, count, published)
                publish = False
            else:
                counts, direct = self._compiled(inputs, residuals, out, b, published)
                publish = publish and direct
            if counts is not None:
                state.count_host(self.name, counts, self.capacity)
        assert out.tensor is not None
        if publish:
            state.output_counts[self.output_name] = (out.tensor, self.band_counts)
        return out.tensor

    def _published_counts(self, x: torch.Tensor, state: RunState) -> np.ndarray | None:
        """The band counts the layer that wrote `x` published for it (`[N, bands, C]`), where this layer reads its
        input directly and they describe `x`; else None."""
        if not self.plan.reads_input:
            return None
        entry = state.output_counts.get(self.input_name)
        return entry[1] if entry is not None and entry[0] is x else None

    def _spmm(
        self,
        inputs: TensorViews,
        residuals: TensorViews | None,
        out: TensorViews,
        b: int,
        count: bool,
        published: np.ndarray | None,
    ) -> torch.Tensor | None:
        """Sample `b` by the library product, as `conv_dense_input(..., count=count)` on one thread (the calls of
        `kernel._spmm`); returns the counts where it counts."""
        plan, x = self.plan, inputs.arrays[b]
        if count:
            self._count(x, b, published)
            columns = inputs.flat[b] if plan.reads_input else kernel.columns_of(plan, plan.planes)
        else:
            columns = inputs.flat[b] if plan.reads_input else self._subsample(x)
        flat = out.flat[b]
        torch.addmm(flat, self.csr, columns, beta=0, out=flat)
        resid = NO_RESIDUAL_ROWS if residuals is None else residuals.flat_arrays[b]
        self.kernels.bias_residual_relu(out.flat_arrays[b], self.bias_array, resid, self.relu)
        return self.counts if count else None

    def _compiled(
        self, inputs: TensorViews, residuals: TensorViews | None, out: TensorViews, b: int, published: np.ndarray | None
    ) -> tuple[torch.Tensor, bool]:
        """Sample `b` by the compiled dataflow the cost model picks, as `conv_dense_input(..., method="auto")`;
        returns the counts and whether the direct kernel ran (keeping the output's band counts where it publishes)."""
        products, planes = self._count(inputs.arrays[b], b, published)
        if self.plan.choose_for(products) == "direct":
            resid = NO_RESIDUAL if residuals is None else residuals.arrays[b]
            self.direct.run(out.arrays[b], resid, planes, self.sample_band_counts[b])
            return self.counts, True
        assert inputs.tensor is not None and out.tensor is not None
        counts = kernel.cartesian_dense_input(
            inputs.tensor[b],
            self.plan,
            self.bias,
            out.tensor[b],
            self.layout,
            None if residuals is None or residuals.tensor is None else residuals.tensor[b],
            relu=self.relu,
            threads=self.used,
        )
        return counts, False

    def _count(self, x: np.ndarray, b: int, published: np.ndarray | None) -> tuple[int, np.ndarray]:
        """Count sample `b`'s input nonzeros per virtual channel into the counts buffer: from the band counts its
        writer published, else by a pass, which fills the phase planes unless the plan reads the input itself.
        Returns the cartesian dataflow's products for these counts and the flat planes the direct dataflow reads."""
        if not self.plan.reads_input:
            return self.kernels.fill_planes(x, *self.fill), self.planes
        if published is not None:
            return self.kernels.sum_band_counts(published[b], *self.count_arguments), x.reshape(-1)
        return self.kernels.count_channels(x, *self.count_arguments), x.reshape(-1)

    def _subsample(self, x: np.ndarray) -> torch.Tensor:
        """The pixels a strided 1×1 layer reads, as `[C, OH·OW]` columns (a buffer rewritten each call)."""
        np.copyto(self.subsampled, x[:, :: self.stride[0], :: self.stride[1]])
        return self.columns


def _contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor.contiguous()`, without its dispatch where the tensor already is (the common case: a layer's output)."""
    return tensor if tensor.is_contiguous() else tensor.contiguous()
