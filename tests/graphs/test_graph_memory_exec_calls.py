"""`tendril.cuda.graph_exec` against a fake cuda-python runtime: how results are unpacked, what the topology
digest covers, how a refused update is reported (the real calls run in the GPU tests)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from cuda.bindings import driver, runtime

from tendril.cuda import graph_exec
from tendril.cuda.runtime import CudaError

OK = runtime.cudaError_t.cudaSuccess
KERNEL = runtime.cudaGraphNodeType.cudaGraphNodeTypeKernel
MEMSET = runtime.cudaGraphNodeType.cudaGraphNodeTypeMemset
CHILD = runtime.cudaGraphNodeType.cudaGraphNodeTypeGraph


class FakeGraphs:
    """Graphs as node-type lists and edge lists, keyed by handle."""

    def __init__(self) -> None:
        self.graphs = {
            1: ([KERNEL, KERNEL, MEMSET], [(0, 1), (1, 2)]),
            2: ([KERNEL, KERNEL, MEMSET], [(0, 1), (1, 2)]),
            3: ([KERNEL, MEMSET, KERNEL], [(0, 1), (1, 2)]),
            4: ([KERNEL, KERNEL, MEMSET], [(0, 2), (1, 2)]),
            5: ([KERNEL, KERNEL, MEMSET], [(0, 1), (1, 2)]),
            9: ([KERNEL, KERNEL, MEMSET], [(0, 1), (1, 2)]),
            6: ([KERNEL, CHILD], [(0, 1)]),
            7: ([KERNEL, CHILD], [(0, 1)]),
            8: ([KERNEL, CHILD], [(0, 1)]),
            61: ([KERNEL], []),
            71: ([KERNEL], []),
            81: ([KERNEL], []),
        }
        self.children = {6: 61, 7: 71, 8: 81}
        """Graph -> the graph its child-graph node (node 1) holds."""
        self.functions = {(5, 1): 9999, (81, 0): 8888}
        """(graph, node index) -> kernel function where it differs from the default `7000 + index`."""
        self.clusters = {(9, 1): (2, 2, 1)}
        """(graph, node index) -> cluster dimensions where they differ from the default (1, 1, 1)."""
        self.cooperative: set[tuple[int, int]] = set()
        """(graph, node index) of cooperative launches."""
        self.required_clusters: dict[int, tuple[int, int, int]] = {}
        """Function -> the cluster dimensions it was compiled with (default none: 0, 0, 0)."""
        self.unreadable_functions: set[int] = set()
        """Graphs whose kernel nodes' parameters cannot be read."""
        self.unreadable_requirements: set[int] = set()
        """Functions whose attributes cannot be read."""
        self.programmatic_edges: set[tuple[int, int]] = set()
        """(graph, edge index) of programmatic (PDL) edges."""
        self.lossy_edges = False
        self.launched: list[tuple[int, int]] = []
        self.uploaded: list[tuple[int, int]] = []
        self.capture_modes: list[object] = []
        self.destroyed: list[int] = []
        self.last_error_cleared = False

    @staticmethod
    def node(graph: int, index: int) -> int:
        return graph * 100 + index

    def get_nodes(self, graph, count=0):
        types, _ = self.graphs[int(graph)]
        if count == 0:
            return OK, None, len(types)
        return OK, [self.node(int(graph), i) for i in range(len(types))], len(types)

    def node_type(self, node):
        types, _ = self.graphs[int(node) // 100]
        return OK, types[int(node) % 100]

    def kernel_params(self, node):
        graph, index = int(node) // 100, int(node) % 100
        assert self.graphs[graph][0][index] == KERNEL, "only kernel nodes have kernel parameters"
        if graph in self.unreadable_functions:
            return driver.CUresult.CUDA_ERROR_INVALID_VALUE, None
        return driver.CUresult.CUDA_SUCCESS, SimpleNamespace(func=self.functions.get((graph, index), 7000 + index))

    def kernel_attribute(self, node, attribute):
        assert attribute.name in graph_exec.LAUNCH_ATTRIBUTES, f"{attribute.name} is not read"
        where = (int(node) // 100, int(node) % 100)
        x, y, z = self.clusters.get(where, (1, 1, 1))
        value = SimpleNamespace(
            clusterDim=SimpleNamespace(x=x, y=y, z=z),
            clusterSchedulingPolicyPreference=0,
            cooperative=int(where in self.cooperative),
        )
        return driver.CUresult.CUDA_SUCCESS, value

    def function_attribute(self, attribute, function):
        if int(function) in self.unreadable_requirements:
            return driver.CUresult.CUDA_ERROR_INVALID_HANDLE, None
        dims = self.required_clusters.get(int(function), (0, 0, 0))
        names = graph_exec.FUNCTION_CLUSTER_ATTRIBUTES
        return driver.CUresult.CUDA_SUCCESS, (*dims, 0, 0)[names.index(attribute.name)]

    def child_graph(self, node):
        return OK, runtime.cudaGraph_t(init_value=self.children[int(node) // 100])

    def get_edges(self, graph, count=0):
        _, edges = self.graphs[int(graph)]
        if self.lossy_edges:
            return runtime.cudaError_t.cudaErrorLossyQuery, None, None, None, None
        if count == 0:
            return OK, None, None, None, len(edges)
        g = int(graph)
        data = [
            SimpleNamespace(type=int((g, i) in self.programmatic_edges), from_port=0, to_port=0)
            for i in range(len(edges))
        ]
        return OK, [self.node(g, a) for a, _ in edges], [self.node(g, b) for _, b in edges], data, count

    def instantiate(self, graph, flags):
        assert flags == graph_exec.INSTANTIATE_FLAGS
        return OK, runtime.cudaGraphExec_t(init_value=1000 + int(graph))

    def update(self, executable, graph):
        source = int(executable) - 1000
        if self.graphs[source] == self.graphs[int(graph)]:
            return OK, SimpleNamespace(result=runtime.cudaGraphExecUpdateResult.cudaGraphExecUpdateSuccess)
        failed = runtime.cudaGraphExecUpdateResult.cudaGraphExecUpdateErrorTopologyChanged
        return runtime.cudaError_t.cudaErrorGraphExecUpdateFailure, SimpleNamespace(result=failed)

    def launch(self, executable, stream):
        self.launched.append((int(executable), int(stream)))
        return (OK,)

    def upload(self, executable, stream):
        self.uploaded.append((int(executable), int(stream)))
        return (OK,)

    def exchange_capture_mode(self, mode):
        self.capture_modes.append(mode)
        return OK, runtime.cudaStreamCaptureMode.cudaStreamCaptureModeGlobal

    def destroy(self, executable):
        self.destroyed.append(int(executable))
        return (OK,)

    def get_last_error(self):
        self.last_error_cleared = True
        return (OK,)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeGraphs:
    graphs = FakeGraphs()
    for name, fn in {
        "cudaGraphGetNodes": graphs.get_nodes,
        "cudaGraphNodeGetType": graphs.node_type,
        "cudaGraphChildGraphNodeGetGraph": graphs.child_graph,
        "cudaGraphGetEdges": graphs.get_edges,
        "cudaGraphInstantiateWithFlags": graphs.instantiate,
        "cudaGraphExecUpdate": graphs.update,
        "cudaGraphLaunch": graphs.launch,
        "cudaGraphUpload": graphs.upload,
        "cudaThreadExchangeStreamCaptureMode": graphs.exchange_capture_mode,
        "cudaGraphExecDestroy": graphs.destroy,
        "cudaGetLastError": graphs.get_last_error,
    }.items():
        monkeypatch.setattr(runtime, name, fn)
    monkeypatch.setattr(driver, "cuGraphKernelNodeGetParams", graphs.kernel_params)
    monkeypatch.setattr(driver, "cuGraphKernelNodeGetAttribute", graphs.kernel_attribute)
    monkeypatch.setattr(driver, "cuFuncGetAttribute", graphs.function_attribute)
    return graphs


def test_topology_digest_tells_node_kinds_order_and_edges_apart(fake: FakeGraphs):
    first, same, reordered, rewired = (graph_exec.topology(g) for g in (1, 2, 3, 4))
    assert first == same and first.nodes == 3
    assert len({first.digest, reordered.digest, rewired.digest}) == 3


def test_graphs_running_other_kernels_are_one_family_while_their_launches_match(fake: FakeGraphs):
    """cuBLAS picks other kernels at other sizes and CUDA's update swaps kernel functions, so the function is not
    part of the family; how it is launched (and the clusters it was compiled for) is."""
    assert graph_exec.topology(5).digest == graph_exec.topology(1).digest
    fake.required_clusters[9999] = (2, 1, 1)
    assert graph_exec.topology(5).digest != graph_exec.topology(1).digest
    fake.required_clusters.clear()
    fake.cooperative.add((5, 1))
    assert graph_exec.topology(5).digest != graph_exec.topology(1).digest


def test_unreadable_kernels_get_families_of_their_own(fake: FakeGraphs):
    fake.unreadable_functions = {1, 2}
    assert graph_exec.topology(1).digest != graph_exec.topology(2).digest
    fake.unreadable_functions.clear()
    fake.unreadable_requirements = {9999}  # then only that very function matches
    assert graph_exec.topology(5).digest != graph_exec.topology(1).digest
    fake.functions[(1, 1)] = 9999
    assert graph_exec.topology(5).digest == graph_exec.topology(1).digest


def test_one_function_launched_with_other_clusters_is_another_family(fake: FakeGraphs):
    """cuBLAS ran one function with clusters (5, 1, 1) and (2, 2, 1) at two Wav2Vec2-base lengths; updating an
    executable between them ended in an illegal instruction on the H200."""
    assert graph_exec.topology(9).digest != graph_exec.topology(1).digest
    fake.clusters[(1, 1)] = (2, 2, 1)
    assert graph_exec.topology(9).digest == graph_exec.topology(1).digest


def test_programmatic_edges_are_part_of_the_family(fake: FakeGraphs):
    fake.programmatic_edges.add((2, 1))
    assert graph_exec.topology(2).digest != graph_exec.topology(1).digest


def test_kernels_inside_child_graphs_decide_the_family_too(fake: FakeGraphs):
    """cuDNN captures its work as a child graph: its kernels' launches must match as the top level's do."""
    same_child, other_child = graph_exec.topology(7), graph_exec.topology(8)
    assert graph_exec.topology(6) == same_child and same_child.nodes == 2
    assert other_child == same_child  # another function, launched alike
    fake.required_clusters[8888] = (4, 1, 1)
    assert graph_exec.topology(8).digest != same_child.digest


def test_unreadable_edges_give_a_coarser_digest_not_an_error(fake: FakeGraphs):
    fake.lossy_edges = True
    digest = graph_exec.topology(1).digest
    assert digest == graph_exec.topology(4).digest  # only node kinds are compared now; CUDA's update decides
    assert digest != graph_exec.topology(3).digest


def test_instantiate_update_launch_destroy(fake: FakeGraphs):
    executable = graph_exec.instantiate(1)
    assert executable == 1001
    assert graph_exec.update(executable, 2) == graph_exec.UpdateOutcome(True)
    refused = graph_exec.update(executable, 3)
    assert not refused.ok and refused.reason == "cudaGraphExecUpdateErrorTopologyChanged"
    assert fake.last_error_cleared
    graph_exec.launch(executable, 77)
    graph_exec.destroy(executable)
    assert fake.launched == [(1001, 77)] and fake.destroyed == [1001]


def test_upload_and_relaxed_capture_mode(fake: FakeGraphs):
    graph_exec.upload(1001, 77)
    graph_exec.relax_capture_mode()
    assert fake.uploaded == [(1001, 77)]
    assert fake.capture_modes == [runtime.cudaStreamCaptureMode.cudaStreamCaptureModeRelaxed]


def test_errors_name_the_call(fake: FakeGraphs, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(runtime, "cudaGraphLaunch", lambda e, s: (runtime.cudaError_t.cudaErrorInvalidValue,))
    with pytest.raises(CudaError, match="cudaGraphLaunch failed: cudaErrorInvalidValue"):
        graph_exec.launch(1001, 0)
    monkeypatch.setattr(runtime, "cudaGraphUpload", lambda e, s: (runtime.cudaError_t.cudaErrorInvalidValue,))
    with pytest.raises(CudaError, match="cudaGraphUpload failed: cudaErrorInvalidValue"):
        graph_exec.upload(1001, 0)
