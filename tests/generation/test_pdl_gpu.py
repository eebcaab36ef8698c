"""On the GPU: the premise of `pdl.py`'s rule for reads before `gdc_wait`, checked on captured decode steps.

Decode attention loads its slot and the cache's earlier slots before it waits (`attention.py`). In a decode loop
the slot is the loop's step counter plus an offset, and the step's PDL chain begins with its first kernel, the
step-inputs kernel (`step_inputs_kernel.py`), which reads the loop's state after its own wait. That is safe only
because no kernel of the step writes the counter: the loop copies the step's new state into its buffers after the
step. This test reads the nodes and edges CUDA recorded for one captured loop body (the real one, `decode_step`).
"""

from __future__ import annotations

import pytest
import torch

from tendril.cuda import graph_exec
from tendril.generation import decode_step
from tests.generation.models import tiny_model

pytestmark = pytest.mark.gpu


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


def _copied_to(node) -> int | None:
    """The device address a memcpy node writes, or None for other nodes."""
    from cuda.bindings import runtime

    err, kind = runtime.cudaGraphNodeGetType(node)
    assert int(err) == 0
    if kind != runtime.cudaGraphNodeType.cudaGraphNodeTypeMemcpy:
        return None
    err, params = runtime.cudaGraphMemcpyNodeGetParams(node)
    assert int(err) == 0
    return int(params.dstPtr.ptr)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("num_beams", [1, 3])
def test_a_decode_step_starts_its_pdl_chain_with_its_inputs_and_copies_its_counter_after_it(family, num_beams):
    model = tiny_model(family, device="cuda", dtype=torch.float16)
    prompt = torch.randint(4, 100, (1, 5), device="cuda")
    state = decode_step(model, prompt, max_new_tokens=8, num_beams=num_beams, step="fused")
    state.step()  # compiles the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        state.step()
    handle = graph.raw_cuda_graph()
    nodes = graph_exec._nodes(handle)  # in capture order
    names = {int(node): _kernel_name(node) for node in nodes}
    programmatic_into: dict[int, bool] = {}
    for _source, target, data in graph_exec._edges(handle):
        assert data is not None, "the CUDA bindings return no edge types"
        pdl = int(data.type) != 0 or int(data.from_port) != 0
        programmatic_into[int(target)] = programmatic_into.get(int(target), False) or pdl
    kernels = [int(node) for node in nodes if names[int(node)] is not None]
    assert "_step_inputs_kernel" in names[kernels[0]], f"the step begins with {names[kernels[0]]}"
    assert programmatic_into.get(kernels[1]), "the step's first projection does not follow its inputs in the chain"
    attention_at = [i for i, node in enumerate(nodes) if "_decode_attention_kernel" in (names[int(node)] or "")]
    assert len(attention_at) == 2 and all(programmatic_into.get(int(nodes[i])) for i in attention_at), (
        "attention must run in the PDL chain for this test to check anything")
    counter = state.buffers[0].data_ptr()  # the step count (greedy) or the length (beams) the slot is read from
    copies = [i for i, node in enumerate(nodes) if _copied_to(node) == counter]
    assert copies and min(copies) > max(attention_at), (copies, attention_at)
