"""A convolution layer's CPU call with everything that does not depend on the input worked out once.

`kernel.conv_dense_input` checks its operands, derives the layer's geometry and the kernels' arguments, allocates
its counts and converts every tensor to a numpy array on each call: host work that is serial whatever the thread
count, so on many threads it is much of a small layer's time. A `PreparedConv` does that once per layer, thread
count and batch size (`RunState.prepared` keeps it, so `SparseNetwork.set_backend` drops it with the old state) and
then, per call, compares the input's shape with a tuple, looks up its numpy view and runs the kernels: the same
kernels on the same operands as `conv_dense_input`'s `auto` method (`library` as the state's), so the outputs are
bit-identical.

What it reuses between calls:
- the numpy views of the weights, bias and plan, the counts buffer (`RunState.last_counts` holds it: each forward
  that counts rewrites it), and the plan's phase planes (as `conv_dense_input` does);
- the views of the last input and residual tensors it saw (the previous layers' outputs, the same buffers every
  forward), checked by identity and data pointer, so it holds on to the last ones until the next call;
- its output buffer, when the state lists the layer in `RunState.reused_outputs` (a network lists the layers whose
  output never reaches its caller): each call then overwrites the previous call's output. Otherwise every call
  writes a new tensor.
So a prepared layer serves one call at a time: a network's calls take turns (`SparseNetwork._turn`).

Counts passed between layers: an unpadded 1×1 stride-1 layer reads its input directly, so no pass over it counts
its nonzeros on the way (the cost model and the layer report need them) and it would count them with a pass of its
own, one more parallel region per layer. Where the layer that writes that input does so by the direct kernel into a
reused buffer (a network lists those layers in `RunState.counted_outputs`), the kernel counts what it writes per
band and output channel, and the layer publishes the counts in `RunState.output_counts` beside the tensor they
describe; a reading layer handed that very tensor sums them (a serial call) instead of counting. A publishing layer
drops its entry before it rewrites the buffer and publishes again only where every sample went through the direct
kernel. The counts are the same numbers either way, so outputs and reports stay bit-identical.

Outputs written into the next layer's planes: a layer whose phase planes hold its input as is (`kernel.holds_input`:
stride 1, one zero-padded plane per channel) fills them from its input with a pass of its own. Where a convolution
writes that input into a reused buffer that only this layer reads (a network maps such writers to their reader in
`RunState.planes_readers`), the writer's call at batch 1 on the compiled dataflows makes its output buffer a
`PlanesOutput`: planes laid out as the reader's plan lays out its own, zero but where the writer writes (their
interior, `DirectCall`'s `grid`; the cartesian dataflow copies into the same view), and returns the strided
`[1, C, H, W]` view of that interior. It lists the planes in `RunState.output_planes` and publishes its band counts
as above. The reader handed that very tensor (by identity) runs the direct kernel on those planes: no fill, its counts
by `sum_band_counts`, or by a pass over the planes where the writer went cartesian (the padding is zero, so it counts
the input). Any other input, a copy of that tensor included, fills the reader's own planes, which the writer never
touches; so the writer's output changes only when the writer runs again, as every reused output. The planes hold
the very values a fill would copy there, so the outputs stay bit-identical.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from tendril.sparse.ops import cpu_threads
from tendril.sparse.ops.conv.cpu import direct_call, kernel

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

    def holding(self, planes: PlanesOutput) -> TensorViews:
        """These views for the tensor `planes` returns, whose `[rows, -1]` numpy view is the planes themselves."""
        self.tensor, self.pointer = planes.tensor, planes.tensor.data_ptr()
        self.arrays, self.flat_arrays, self.flat = list(planes.tensor.numpy()), [planes.rows], []
        return self

    def of(self, tensor: torch.Tensor) -> TensorViews:
        """These views, rebuilt for `tensor` unless they are `tensor`'s already."""
        if tensor is not self.tensor or tensor.data_ptr() != self.pointer:
            array = tensor.numpy()
            self.arrays = list(array)
            self.flat_arrays = [a.reshape(self.rows, -1) for a in self.arrays]
            self.flat = [t.view(self.rows, -1) for t in tensor] if self.flat_tensors else []
            self.tensor, self.pointer = tensor, tensor.data_ptr()
        return self


class PlanesOutput:
    """A layer's output written straight into the phase planes of the one layer that reads it (module docstring):
    a zeroed buffer laid out as the reader's plan lays out its planes, of which the writer writes only the interior
    (so the padding stays zero), and the `[1, C, H, W]` view of that interior the writer returns."""

    def __init__(self, reader: kernel.CpuConvPlan) -> None:
        g = reader.weights.geometry
        at, row = self.grid = reader.input_grid()
        planes = torch.zeros(reader.planes.shape)
        self.tensor = planes.as_strided((1, g.in_channels, *g.in_hw), (planes.numel(), planes.shape[1], row, 1), at)
        """The output the writer returns: a strided view, which anything but the reader copies or reads by strides."""
        self.rows = planes.numpy()
        """`[C, plane stride]`: the direct kernel's output, each channel's grid at `grid`."""
        self.flat = self.rows.reshape(-1)
        """The reader's flat planes operand."""
        self.counted = self.rows.reshape(g.in_channels, 1, -1)
        """The planes as `[C, 1, plane stride]` rows for `count_channels` (the padding is zero: it counts the input)."""


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
        self.spmm = plan.csr is not None and state.threads == 1 and state.library
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
        reader = state.planes_readers.get(step.name)
        self.reuse = step.name in state.reused_outputs
        self.lands = reader is not None and batch == 1 and self.reuse and not self.spmm
        """Whether this layer writes its output into its reader's planes (`PlanesOutput`): only into a reused buffer,
        at batch 1, by the compiled dataflows."""
        if self.lands:
            assert reader is not None
            if reader.cpu_plan is None:
                reader.cpu_plan = kernel.CpuConvPlan.prepare(reader.weights)
            self.output_planes = PlanesOutput(reader.cpu_plan)
            state.output_planes[self.output_name] = self.output_planes
        grid = self.output_planes.grid if self.lands else None
        self.direct = direct_call.DirectCall.of(plan, self.used, self.bias_array, step.relu, grid)
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
        if self.lands:
            self.output.holding(self.output_planes)
        elif self.reuse:
            self.output.of(torch.empty(self.out_shape))
        self.publishes = self.lands or (self.reuse and step.name in state.counted_outputs)
        """Whether the direct kernel keeps this layer's output nonzeros for the next layers (`RunState.output_counts`):
        only into a reused buffer, which no one else writes."""
        self.holds_input = kernel.holds_input(g)
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
        landed = self._landed(x, state)
        inputs = self.inputs.of(_contiguous(x)) if landed is None else None
        residuals = None if residual is None else self.residuals.of(_contiguous(residual))
        count = state.count_inputs or self.may_overflow
        published = self._published_counts(x, state, landed)
        if self.publishes:  # the counts published last describe the buffer only until it is rewritten
            state.output_counts.pop(self.output_name, None)
        publish = self.publishes
        for b in range(self.in_shape[0]):
            if self.spmm:
                assert inputs is not None  # no layer that `holds_input` runs the library product
                counts = self._spmm(inputs, residuals, out, b, count, published)
                publish = False
            else:
                counts, direct = self._compiled(inputs, residuals, out, b, published, landed)
                publish = publish and direct
            if counts is not None:
                state.count_host(self.name, counts, self.capacity)
        assert out.tensor is not None
        if publish:
            state.output_counts[self.output_name] = (out.tensor, self.band_counts)
        return out.tensor

    def _landed(self, x: torch.Tensor, state: RunState) -> PlanesOutput | None:
        """The planes that `x` lies in, where its writer wrote it straight into planes laid out as this layer's (the
        very tensor it returned, by identity); else None (this layer fills its own planes from `x`)."""
        if not self.holds_input:
            return None
        planes = state.output_planes.get(self.input_name)
        if planes is None or planes.tensor is not x or planes.rows.shape != self.plan.planes.shape:
            return None
        return planes

    def _published_counts(self, x: torch.Tensor, state: RunState, landed: PlanesOutput | None) -> np.ndarray | None:
        """The band counts the layer that wrote `x` published for it (`[N, bands, C]`), where this layer reads its
        input directly (from its writer's planes, `landed`, or as it is) and they describe `x`; else None."""
        if not self.plan.reads_input and landed is None:
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
        self,
        inputs: TensorViews | None,
        residuals: TensorViews | None,
        out: TensorViews,
        b: int,
        published: np.ndarray | None,
        landed: PlanesOutput | None,
    ) -> tuple[torch.Tensor, bool]:
        """Sample `b` by the compiled dataflow the cost model picks, as `conv_dense_input(..., method="auto")`, its
        input in `inputs` or, with `landed`, the planes its writer wrote it into; returns the counts and whether the
        direct kernel ran (keeping the output's band counts where it publishes)."""
        if landed is None:
            assert inputs is not None
            products, planes = self._count(inputs.arrays[b], b, published)
        else:
            products, planes = self._count_landed(landed, published)
        if self.plan.choose_for(products) == "direct":
            resid = NO_RESIDUAL if residuals is None else residuals.arrays[b]
            self.direct.run(out.flat_arrays[b], resid, planes, self.sample_band_counts[b])
            return self.counts, True
        x = landed.tensor if landed is not None else inputs.tensor if inputs is not None else None
        assert x is not None and out.tensor is not None
        counts = kernel.cartesian_dense_input(
            x[b],
            self.plan,
            self.bias,
            out.tensor[b],
            self.layout,
            None if residuals is None or residuals.tensor is None else residuals.tensor[b],
            relu=self.relu,
            threads=self.used,
        )
        return counts, False

    def _count_landed(self, landed: PlanesOutput, published: np.ndarray | None) -> tuple[int, np.ndarray]:
        """`_count` for an input its writer wrote into planes laid out as this layer's (batch 1): no fill, the
        counts from the band counts it published, else by a pass over those planes."""
        if published is not None:
            return self.kernels.sum_band_counts(published[0], *self.count_arguments), landed.flat
        return self.kernels.count_channels(landed.counted, *self.count_arguments), landed.flat

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
