"""Memory on the GPU: smaller graphs reuse the largest one's pool, outputs included; failed captures free."""

import gc

import pytest
import torch

from tendril.graphs.callable import graphed
from tendril.graphs.stats import Fallback
from tendril.utils.device_memory import device_memory_in_use
from tests.graphs.gpu_models import fast, gpt2

pytestmark = pytest.mark.gpu

MIB = 1 << 20


def test_smaller_graphs_reuse_the_largest_graphs_memory():
    model = gpt2(torch.float16)
    graphed_model = fast(model)
    examples = [(torch.randint(0, 1000, (1, n), device="cuda"),) for n in range(1, 65)]
    with torch.inference_mode():
        graphed_model.capture(examples, progress=False)
    records = list(graphed_model.stats.graphs.values())
    assert len(records) == 64 and records[0].key.tensors[0].shape == (1, 64)
    largest, rest = records[0].pool_growth_bytes, sum(r.pool_growth_bytes for r in records[1:])
    print(f"largest graph's pool {largest / MIB:.1f} MiB, 63 smaller graphs added {rest / MIB:.1f} MiB")
    assert largest > 0
    assert rest <= 0.25 * largest, f"smaller graphs grew the shared pool by {rest / MIB:.1f} MiB"
    assert all(r.driver_bytes is not None for r in records)


def test_one_pool_is_much_smaller_than_a_pool_per_shape():
    model = gpt2(torch.float16, vocab=50257)  # GPT-2's vocabulary: logits are the large tensors
    lengths = range(8, 40)
    with torch.inference_mode():
        before = device_memory_in_use()
        graphs = []
        for n in lengths:
            ids = torch.randint(0, 50257, (1, n), device="cuda")
            model(ids)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = model(ids)
            graphs.append((graph, ids, out))
        separate = device_memory_in_use() - before
        del graphs, out
        before = device_memory_in_use()
        graphed_model = fast(model)
        graphed_model.capture([(torch.randint(0, 50257, (1, n), device="cuda"),) for n in lengths], progress=False)
        shared = device_memory_in_use() - before
    print(f"separate pools {separate / MIB:.0f} MiB, tendril {shared / MIB:.0f} MiB")
    assert shared * 4 < separate


def test_outputs_released_to_the_pool_still_hold_the_results():
    model = gpt2()
    graphed_model = fast(model)
    with torch.inference_mode():
        ids = torch.randint(0, 1000, (1, 24), device="cuda")
        graphed_model.capture([(ids,), (ids[:, :5],)], progress=False)
        torch.testing.assert_close(graphed_model(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)
        short = ids[:, :5]
        torch.testing.assert_close(graphed_model(short).logits, model(short).logits, rtol=1e-4, atol=1e-4)


def _private_pools() -> set[tuple[int, int]]:
    """Ids of the graph pools that hold device memory now (the allocator's own pool is (0, 0))."""
    device_memory_in_use()
    segments = torch.cuda.memory_snapshot()
    assert all("segment_pool_id" in s for s in segments), "this torch's memory snapshot does not name pools"
    return {tuple(s["segment_pool_id"]) for s in segments if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0)}


def _syncs_when_long(x):
    y = (x @ x.T).relu()
    if x.shape[0] > 1000:
        y = y * y.sum().item()
    return y


def _queries_when_long(x):
    y = (x @ x.T).relu()
    if x.shape[0] > 1000:
        torch.cuda.current_stream().query()
    return y


@pytest.mark.parametrize(
    "fn", [_syncs_when_long, _queries_when_long], ids=["sync raised before CUDA", "capture invalidated by CUDA"]
)
def test_a_failed_capture_returns_its_memory_and_leaves_the_callable_usable(fn):
    """`.item()` raises under the sync debug mode before it reaches CUDA; a stream query, which that mode does not
    see, reaches CUDA and invalidates the capture, which PyTorch then cannot end normally: it leaves the generator
    in capture mode and the pool taking allocations (PyTorch's pinned-host allocator included), so later captures
    into the pool the first graph holds would fail."""
    graphed_fn = fast(fn)
    with torch.inference_mode():
        small = torch.randn(64, 64, device="cuda")
        torch.testing.assert_close(graphed_fn(small), fn(small))
        pools_before = _private_pools()
        big = torch.randn(2048, 2048, device="cuda")
        with pytest.warns(UserWarning, match="synchronises"):
            out = graphed_fn(big)
        torch.testing.assert_close(out, fn(big))
        del out
        assert _private_pools() <= pools_before, "the failed capture's pool still holds device memory"
        medium = torch.randn(256, 256, device="cuda")
        torch.testing.assert_close(graphed_fn(medium), fn(medium))
        torch.testing.assert_close(graphed_fn(small), fn(small))
        assert graphed_fn.stats.captures == 2 and graphed_fn.stats.replays == 3, graphed_fn.stats.table()
        assert graphed_fn.stats.fallbacks[Fallback.HOST_SYNC] == 1
        torch.rand(4, device="cuda")  # the default generator is out of capture mode


def test_callables_share_one_capture_stream_so_a_deleted_callable_leaves_nothing_behind():
    """PyTorch keeps a cuBLAS workspace per stream a product ran on; a capture stream per callable left one
    behind each deleted callable."""
    model = torch.nn.Linear(64, 64).cuda()
    x = torch.randn(4, 64, device="cuda")

    def graph_and_delete() -> None:
        linear = graphed(model)
        with torch.inference_mode():
            linear(x)
            linear(x)
        assert linear.stats.captures == 1
        del linear
        gc.collect()
        torch.cuda.synchronize()

    graph_and_delete()  # the first capture gives the shared capture stream its workspace
    baseline = torch.cuda.memory_allocated()
    for _ in range(3):
        graph_and_delete()
    assert torch.cuda.memory_allocated() == baseline
