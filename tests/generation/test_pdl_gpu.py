"""On the GPU: the premise of `pdl.py`'s rule for reads before `gdc_wait`, checked on captured decode steps.

Decode attention loads the slot index and the cache's earlier slots before it waits (`attention.py`). That is
safe only because every step begins with PyTorch kernels launched without PDL, after the slot is computed: the
slot's writer then finishes before the last of them starts, and every kernel of the PDL chain starts after
that. This test reads the edges CUDA recorded for one captured loop body (the real one, `decode_step`).
"""

from __future__ import annotations

import pytest
import torch
import triton

from tendril.cuda import graph_exec
from tendril.generation import decode_step
from tendril.generation.kernels import argmax_kernel, attention, linear, topk_kernel
from tests.generation.models import tiny_model

pytestmark = pytest.mark.gpu
TENDRIL_KERNELS = {value.fn.__name__ for module in (argmax_kernel, attention, linear, topk_kernel)
                   for value in vars(module).values() if isinstance(value, triton.runtime.JITFunction)}


def _kernel_name(node) -> str | None:
    """The function a kernel node runs, or None for other nodes."""
    from cuda.bindings import driver

    handle = driver.CUgraphNode(init_value=int(node))
    err, kind = driver.cuGraphNodeGetType(handle)
    assert int(err) == 0
    if kind != driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL:
        return None
    err, params = driver.cuGraphKernelNodeGetParams(handle)
    assert int(err) == 0
    err, name = driver.cuFuncGetName(params.func)
    assert int(err) == 0
    return name.decode() if isinstance(name, bytes) else str(name)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("num_beams", [1, 3])
def test_a_decode_step_reaches_its_pdl_chain_through_pytorch_kernels(family, num_beams):
    model = tiny_model(family, device="cuda", dtype=torch.float16)
    prompt = torch.randint(4, 100, (1, 5), device="cuda")
    state = decode_step(model, prompt, max_new_tokens=8, num_beams=num_beams, step="fused")
    state.step()  # compiles the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        state.step()
    handle = graph.raw_cuda_graph()
    names = {int(node): _kernel_name(node) for node in graph_exec._nodes(handle)}
    programmatic_into: dict[int, bool] = {}
    for _source, target, data in graph_exec._edges(handle):
        assert data is not None, "the CUDA bindings return no edge types"
        pdl = int(data.type) != 0 or int(data.from_port) != 0
        programmatic_into[int(target)] = programmatic_into.get(int(target), False) or pdl
    order = [node for node in names if names[node] is not None]  # kernels, in capture order
    attention_nodes = [node for node in order if "_decode_attention_kernel" in names[node]]
    assert len(attention_nodes) == 2 and all(programmatic_into.get(node) for node in attention_nodes), (
        "attention must run in the PDL chain for this test to check anything")
    first_pdl = next(index for index, node in enumerate(order) if programmatic_into.get(node))
    leading = order[:first_pdl]
    assert len(leading) >= 2, f"the step's PDL chain starts after {len(leading)} plain kernels: {leading}"
    assert not {names[node] for node in leading} & TENDRIL_KERNELS  # tendril's kernels trigger their dependents
