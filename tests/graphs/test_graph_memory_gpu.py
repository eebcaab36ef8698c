"""Graph memory on the GPU: budgeted executables give the results of dedicated ones, hold the budget, and
switch an executable only in stream order (never disturbing a replay still running); prefetched executables
(instantiated, or under `update` updated, and uploaded on the background thread) give the same results as
dedicated ones."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from tendril.graphs.options import GraphMemoryPolicy
from tests.graphs.gpu_models import fast, gpt2, tensors, tight, wav2vec2

pytestmark = pytest.mark.gpu

MIB = 1 << 20
SLEEP_CYCLES = 50_000_000  # ~25 ms of torch.cuda._sleep on an H200: long enough to still run when the host moves on


def _device_used() -> int:
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return total - free


@pytest.mark.parametrize("strategy", ["update", "auto"])
def test_budgeted_executables_equal_dedicated_ones_under_random_call_orders(strategy):
    model = gpt2()
    dedicated = fast(model, max_graphs=64)
    budgeted = fast(model, max_graphs=64, memory=GraphMemoryPolicy(budget="2MiB", strategy=strategy))
    rng = random.Random(7)
    with torch.inference_mode():
        for _ in range(150):
            n = rng.randint(1, 40)
            ids = torch.randint(0, 1000, (1, n), device="cuda")
            expected = dedicated(ids).logits.clone()
            got = budgeted(ids).logits
            assert torch.equal(got, expected), f"length {n}: budgeted executable differs from a dedicated one"
            tight(got, model(ids).logits)
            got.fill_(float("nan"))  # the next replay must overwrite the graph's outputs
    memory = [record.memory for record in budgeted.stats.graphs.values()]
    switches = sum(m.updates for m in memory) + sum(m.instantiations for m in memory)
    print(
        f"{strategy}: {budgeted.stats.captures} graphs, {sum(m.instantiations for m in memory)} instantiations, "
        f"{sum(m.updates for m in memory)} updates, {sum(m.update_failures for m in memory)} refused, "
        f"{sum(m.evictions for m in memory)} evictions, switching {budgeted.stats.switch_ms:.1f} ms"
    )
    assert switches > budgeted.stats.captures, "the budget never forced a switch: the test exercised nothing"
    assert all(m.segments >= 2 for m in memory), "the graphs ran unsegmented: the chains were not exercised"
    assert sum(m.updates for m in memory) > 0  # auto is update under a budget


def test_wav2vec2_under_a_budget_matches_eager():
    model = wav2vec2()
    budgeted = fast(model, memory="1MiB")
    rng = random.Random(3)
    with torch.inference_mode():
        for _ in range(40):
            samples = rng.choice([4000, 5600, 8000, 12000, 16000])
            audio = torch.randn(1, samples, device="cuda")
            got = tensors(budgeted(audio))[0]
            tight(got, tensors(model(audio))[0])
            got.fill_(float("nan"))


def test_the_budget_holds_in_device_memory():
    """Device memory outside the pool grows by at most the budget from the first graph to the last.

    Measured from after the first capture: that capture also brings memory that is not the executables'
    (cuBLAS's workspace for the capture stream, 32 MiB on an H200, which alone would exceed the budget)."""
    model = gpt2(torch.float16)
    lengths = list(range(48, 0, -1))  # largest first, as `capture` orders them
    budget = 8 * MIB
    examples = [(torch.randint(0, 1000, (1, n), device="cuda"),) for n in lengths]
    with torch.inference_mode():
        before = _device_used()
        budgeted = fast(model, max_graphs=64, memory=budget)
        budgeted.capture(examples[:1], progress=False)
        stats = budgeted.stats
        first = _device_used() - before - stats.pool_bytes - stats.placeholder_bytes
        budgeted.capture(examples[1:], progress=False)
        rng = random.Random(1)
        for _ in range(200):
            budgeted(examples[rng.randrange(len(examples))][0])
        (cache,) = budgeted._backend.executable_caches().values()  # type: ignore[attr-defined]
        cache.wait_idle()  # destructions queued on the background thread have run
        used = _device_used() - before
    stats = budgeted.stats
    growth = used - stats.pool_bytes - stats.placeholder_bytes - first
    print(
        f"48 graphs under {budget / MIB:.0f} MiB: device {used / MIB:.1f} MiB, pool {stats.pool_bytes / MIB:.1f} MiB, "
        f"outside the pool {first / MIB:.1f} MiB after the first graph, +{growth / MIB:.1f} MiB after all; "
        f"{cache.executables} executables charged {cache.live_bytes / MIB:.2f} MiB "
        f"at {cache.accounting.bytes_per_node:.0f} B/node"
    )
    assert cache.accounting.over_budget == 0 and cache.live_bytes <= budget
    assert growth <= budget + 4 * MIB, "executables (and kept graphs) use more device memory than the budget"


def _slow_scale(x: torch.Tensor, scale: float) -> torch.Tensor:
    torch.cuda._sleep(SLEEP_CYCLES)  # the replay is still running when the host issues the next call
    return x * scale + 1


def test_an_update_does_not_disturb_the_replay_still_running():
    # a budget smaller than one executable: `update` switches at every miss instead of instantiating
    budgeted = fast(_slow_scale, memory=GraphMemoryPolicy(budget="1KiB", strategy="update"))
    x = torch.randn(1 << 16, device="cuda")
    with torch.inference_mode():
        budgeted.capture([(x, 2.0), (x, 3.0)], progress=False)
        torch.cuda.synchronize()
        for _ in range(5):
            first = budgeted(x, 2.0).clone()  # enqueued; the graph sleeps ~25 ms on the GPU
            second = budgeted(x, 3.0)  # the host updates the same executable at once, then launches it
            torch.cuda.synchronize()
            torch.testing.assert_close(first, x * 2.0 + 1)
            torch.testing.assert_close(second, x * 3.0 + 1)
    memory = [record.memory for record in budgeted.stats.graphs.values()]
    assert sum(m.instantiations for m in memory) == 1, "both graphs should share one executable"
    assert sum(m.updates for m in memory) >= 10
    (cache,) = budgeted._backend.executable_caches().values()  # type: ignore[attr-defined]
    assert cache.driver.waits >= 5, "each update found the sleeping launch running and waited for it"


def _slow_when_doubling(x: torch.Tensor, scale: float) -> torch.Tensor:
    if scale == 2.0:  # a constant of the key: the doubling graph sleeps, the other does not
        torch.cuda._sleep(SLEEP_CYCLES)
    return x * scale + 1


def test_a_call_on_another_stream_waits_for_the_previous_launch():
    budgeted = fast(_slow_when_doubling, memory=GraphMemoryPolicy(budget="1MiB", strategy="update"))
    x = torch.randn(1 << 16, device="cuda")
    side = torch.cuda.Stream()
    with torch.inference_mode():
        budgeted.capture([(x, 2.0), (x, 3.0)], progress=False)
        probe_a = budgeted(x, 2.0)
        probe_b = budgeted(x, 3.0)
        assert probe_a.data_ptr() == probe_b.data_ptr(), "precondition: both graphs write the same output memory"
        torch.cuda.synchronize()
        for _ in range(5):
            budgeted(x, 2.0)  # slow, on the default stream
            side.wait_stream(torch.cuda.current_stream())  # x is ready for the side stream
            with torch.cuda.stream(side):
                second = budgeted(x, 3.0)  # fast; were it not ordered after the slow one, that would write last
            torch.cuda.synchronize()
            torch.testing.assert_close(second, x * 3.0 + 1)


def test_graphs_drawing_random_numbers_keep_dedicated_executables():
    def noisy(x: torch.Tensor) -> torch.Tensor:
        return x + torch.rand_like(x)

    budgeted = fast(noisy, memory=GraphMemoryPolicy(budget="1MiB", strategy="update"))
    x = torch.zeros(1024, device="cuda")
    with torch.inference_mode():
        first = budgeted(x).clone()
        second = budgeted(x).clone()
    (record,) = budgeted.stats.graphs.values()
    assert record.memory.strategy.startswith("dedicated")
    assert not torch.equal(first, second), "replays repeated the same random numbers"
    assert float(first.min()) >= 0 and float(first.max()) < 1


def _kept_graph(fn, *args):
    """`fn(*args)` captured with torch, kept uninstantiated; returns the graph and its outputs."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        out = fn(*args)
    return graph, out


def test_graph_exec_instantiates_updates_and_refuses_other_topologies():
    from tendril.cuda import graph_exec

    x = torch.randn(4096, device="cuda")
    doubled, out_doubled = _kept_graph(lambda t: t * 2 + 1, x)
    tripled, out_tripled = _kept_graph(lambda t: t * 3 + 1, x)
    sined, out_sined = _kept_graph(lambda t: t.sin() + 1, x)  # another kernel function, launched alike
    other, out_other = _kept_graph(lambda t: (t * 2).sin().cos(), x)
    same = graph_exec.topology(doubled.raw_cuda_graph())
    assert same == graph_exec.topology(tripled.raw_cuda_graph()) and same.nodes >= 2
    assert same == graph_exec.topology(sined.raw_cuda_graph())
    assert same.digest != graph_exec.topology(other.raw_cuda_graph()).digest
    stream = torch.cuda.current_stream().cuda_stream
    executable = graph_exec.instantiate(doubled.raw_cuda_graph())
    try:
        graph_exec.launch(executable, stream)
        torch.cuda.synchronize()
        torch.testing.assert_close(out_doubled, x * 2 + 1)
        assert graph_exec.update(executable, tripled.raw_cuda_graph()).ok
        graph_exec.launch(executable, stream)
        torch.cuda.synchronize()
        torch.testing.assert_close(out_tripled, x * 3 + 1)
        out_sined.fill_(float("nan"))
        assert graph_exec.update(executable, sined.raw_cuda_graph()).ok
        graph_exec.launch(executable, stream)
        torch.cuda.synchronize()
        torch.testing.assert_close(out_sined, x.sin() + 1)
        refused = graph_exec.update(executable, other.raw_cuda_graph())
        assert not refused.ok and refused.reason, "an update across topologies must be refused with a reason"
        torch.ones(1, device="cuda").sum().item()  # the refusal left no error behind for torch to trip on
    finally:
        graph_exec.destroy(executable)
    del out_other


def test_graphs_with_device_side_loops_switch_under_a_budget():
    from tendril.graphs.control import while_loop

    weights = [torch.randn(16, 16, device="cuda") / 4 for _ in range(2)]

    def fn(limit: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        def body(i: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            for w in weights:
                h = torch.tanh(h @ w)
            return i + 1, h

        i, h = while_loop(lambda i, h: i < limit, body, (torch.zeros((), dtype=torch.long, device="cuda"), v))
        return i, h * 1.0

    budgeted = fast(fn, clone_outputs=True, memory=GraphMemoryPolicy(budget="1KiB", strategy="update"))
    rng = random.Random(5)
    for _ in range(30):
        limit = torch.tensor(rng.choice([0, 3, 5]), device="cuda")
        v = torch.randn(rng.choice([1, 4, 9]), 16, device="cuda")
        for got, expected in zip(budgeted(limit, v), fn(limit, v), strict=True):
            torch.testing.assert_close(got, expected)
    assert not budgeted.stats.fallbacks, budgeted.stats.fallback_details
    memory = [record.memory for record in budgeted.stats.graphs.values()]
    assert sum(m.updates + m.instantiations for m in memory) > len(memory), "no switch happened"


def _poisoned_equal(budgeted, dedicated, ids: torch.Tensor) -> None:
    expected = dedicated(ids).logits.clone()
    got = budgeted(ids).logits
    assert torch.equal(got, expected), f"length {ids.shape[1]}: budgeted executable differs from a dedicated one"
    got.fill_(float("nan"))  # the next replay of this graph must overwrite all of it


def _captured_twice(lengths: list[int], **options):
    """A small GPT-2 captured at `lengths` (longest first) with dedicated executables and under a 2 MiB budget
    (`options` for the budgeted one); returns both callables, the budgeted one's cache and the charge of its
    largest executable."""
    model = gpt2()
    dedicated = fast(model, max_graphs=64)
    budgeted = fast(model, max_graphs=64, memory=GraphMemoryPolicy(budget="2MiB", **options))
    with torch.inference_mode():
        examples = [(torch.randint(0, 1000, (1, n), device="cuda"),) for n in reversed(lengths)]
        dedicated.capture(examples, progress=False)
        budgeted.capture(examples, progress=False)
    (cache,) = budgeted._backend.executable_caches().values()  # type: ignore[attr-defined]
    largest = cache.accounting.charge(max(r.memory.nodes or 0 for r in budgeted.stats.graphs.values()))
    return dedicated, budgeted, cache, largest


def test_prefetched_executables_equal_dedicated_ones():
    """Lengths growing 1..40 then shrinking 40..1, twice, under a budget of a few executables: after the first
    steps every call finds its executable prefetched; results equal dedicated executables' bit for bit. Then a
    random order (which rarely prefetches) still gives the same results."""
    lengths = list(range(1, 41))
    dedicated, budgeted, cache, largest = _captured_twice(lengths)
    with torch.inference_mode():
        assert cache.accounting.budget >= 2 * largest, "the budget must hold the executable called and a prefetch"
        hits = []
        for order in (lengths, lengths[::-1], lengths, lengths[::-1]):
            before = cache.prefetcher.hits
            for n in order:
                _poisoned_equal(budgeted, dedicated, torch.randint(0, 1000, (1, n), device="cuda"))
            hits.append(cache.prefetcher.hits - before)
        growing = (cache.prefetcher.prefetches, cache.prefetcher.hits, cache.prefetcher.waits, cache.prefetcher.wasted)
        rng = random.Random(4)
        for _ in range(120):
            _poisoned_equal(budgeted, dedicated, torch.randint(0, 1000, (1, rng.choice(lengths)), device="cuda"))
        cache.wait_idle()
    print(
        f"prefetch hits per pass {hits}; growing/shrinking: {growing[0]} prefetches, {growing[1]} hits, "
        f"{growing[2]} waits, {growing[3]} wasted; after the random order: {cache.prefetcher.prefetches} prefetches, "
        f"{cache.prefetcher.wasted} wasted; {cache.executables} executables, {cache.live_bytes / MIB:.2f} MiB charged; "
        f"background destroys that waited for a launch: {cache.driver.background_waits}"
    )
    assert hits[0] > 0, "the growing pass never found a prefetched executable"
    # a pass starts on the lengths the previous one left held (no prefetch needed), then steps into the others
    nodes = max(r.memory.nodes or 0 for r in budgeted.stats.graphs.values())
    held = max(
        cache.accounting.budget // largest, cache.accounting.budget // cache.accounting.charge(nodes)
    )  # the learnt rate moved meanwhile
    assert min(hits) >= len(lengths) - held - 3, f"prefetch hits per pass {hits}: expected all but the first calls"
    assert cache.accounting.over_budget == 0 and cache.live_bytes <= cache.accounting.budget
    assert cache.prefetcher.prefetches - growing[0] <= 12, "random order prefetched more than a handful"


def test_update_with_prefetching_equals_dedicated_executables():
    """`update` under a budget of a few executables: growing and shrinking lengths prefetch by updating an
    executable of the family on the background thread (after its last launch, then uploaded in the call's stream),
    a random order switches at launch on the calling thread, segment by segment; results equal dedicated
    executables' bit for bit."""
    lengths = list(range(1, 41))
    dedicated, budgeted, cache, largest = _captured_twice(lengths, strategy="update")
    with torch.inference_mode():
        assert cache.accounting.budget < len(lengths) * largest, "a budget that holds every executable never updates"
        background_updates = _count_calls(cache.driver, "update_async")
        for order in (lengths, lengths[::-1], lengths, lengths[::-1]):
            for n in order:
                _poisoned_equal(budgeted, dedicated, torch.randint(0, 1000, (1, n), device="cuda"))
        stepping = (len(background_updates), cache.prefetcher.prefetches, cache.prefetcher.hits, cache.prefetcher.waits)
        launches = _count_calls(cache.driver, "launch")
        rng = random.Random(6)
        for _ in range(120):
            _poisoned_equal(budgeted, dedicated, torch.randint(0, 1000, (1, rng.choice(lengths)), device="cuda"))
        cache.wait_idle()
    foreground_updates = [args for args in launches if len(args) > 2 and args[2] is not None]  # switched at launch
    memory = [record.memory for record in budgeted.stats.graphs.values()]
    print(
        f"update: {len({m.family for m in memory})} families; growing/shrinking: {stepping[0]} background updates "
        f"of {stepping[1]} prefetches, {stepping[2]} hits, {stepping[3]} waits; random: {len(foreground_updates)} "
        f"updates on the calling thread; in all {sum(m.updates for m in memory)} updates, "
        f"{sum(m.update_failures for m in memory)} refused, {sum(m.instantiations for m in memory)} instantiations, "
        f"{sum(m.evictions for m in memory)} evictions; background waits for a launch: {cache.driver.background_waits}"
    )
    assert stepping[0] > 0, "no prefetch updated an executable in the background: the test exercised nothing"
    assert stepping[2] > 0, "no call found its executable prefetched"
    assert foreground_updates, "no miss of the random order updated an executable: the test exercised nothing"
    assert cache.accounting.over_budget == 0 and cache.live_bytes <= cache.accounting.budget


def _count_calls(driver, method: str) -> list[tuple]:
    """The arguments of every later call of `driver.<method>` (which still runs as before)."""
    calls: list[tuple] = []
    original = getattr(driver, method)

    def counted(*args):
        calls.append(args)
        return original(*args)

    setattr(driver, method, counted)
    return calls


def _slow_double(x: torch.Tensor) -> torch.Tensor:
    torch.cuda._sleep(SLEEP_CYCLES // 5)  # ~5 ms: launches still run when their executables are evicted
    return x * 2 + 1


def test_background_destruction_waits_for_a_running_launch():
    budgeted = fast(_slow_double, memory="1GiB")
    xs = [torch.randn(n, device="cuda") for n in range(1, 13)]
    with torch.inference_mode():
        budgeted.capture([(x,) for x in reversed(xs)], progress=False)
        (cache,) = budgeted._backend.executable_caches().values()  # type: ignore[attr-defined]
        charge = cache.accounting.charge(max(r.memory.nodes or 0 for r in budgeted.stats.graphs.values()))
        # two executables (with room for the learnt rate to move), never three
        cache.accounting.budget = 5 * charge // 2
        cache.reserve(0)  # evicts down to the two executables acquired last at capture (lengths 2 and 1)
        cache.wait_idle()
        torch.cuda.synchronize()
        results = [budgeted(x).clone() for x in xs]  # no synchronisation: evictions meet running launches
        torch.cuda.synchronize()
        for x, got in zip(xs, results, strict=True):
            torch.testing.assert_close(got, x * 2 + 1)
        cache.wait_idle()
    assert cache.prefetcher.hits >= 8 and cache.executables <= 2
    assert cache.driver.background_waits > 0, "no background destruction found its launch still running"
