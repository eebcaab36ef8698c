import pytest
import torch

from tendril.cuda import graph_nodes
from tendril.cuda.graph_nodes import ConditionalKind


@pytest.mark.gpu
def test_capture_info_is_none_outside_a_capture():
    assert graph_nodes.capture_info(torch.cuda.current_stream()) is None


@pytest.mark.gpu
def test_a_hand_built_while_node_counts_on_the_device():
    """The raw recipe: handle, initial test, WHILE node, body captured on a side stream, test at the end."""
    counter = torch.zeros((), dtype=torch.int32, device="cuda")
    limit = torch.tensor(7, dtype=torch.int32, device="cuda")
    flag = torch.empty((), dtype=torch.bool, device="cuda")  # no allocation inside the raw body capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        stream = torch.cuda.current_stream()
        info = graph_nodes.capture_info(stream)
        assert info is not None
        handle = graph_nodes.create_conditional_handle(info.graph)
        graph_nodes.set_condition(handle, torch.lt(counter, limit, out=flag))
        info = graph_nodes.capture_info(stream)
        node, (body,) = graph_nodes.add_conditional_node(info, handle, ConditionalKind.WHILE)
        graph_nodes.set_capture_dependencies(stream, [node])
        with torch.cuda.stream(side), graph_nodes.capture_to_graph(side, body):
            counter.add_(1)
            graph_nodes.set_condition(handle, torch.lt(counter, limit, out=flag))
        assert graph_nodes.count_nodes(body) >= 2
    for start, expected in [(0, 7), (5, 7), (9, 9)]:
        counter.fill_(start)
        graph.replay()
        torch.cuda.synchronize()
        assert counter.item() == expected
