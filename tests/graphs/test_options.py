"""Typed options of a graphed callable (`tendril.graphs.options`): validation where a value is written, what
`graphed(...)` builds from its keywords, and the memory policy reaching only the default backend."""

import pytest
import torch

import tendril
import tendril.graphs
from tendril.config import Config
from tendril.graphs.admission import GraphFallbackWarning
from tendril.graphs.backend import NullBackend
from tendril.graphs.buckets import sequence_buckets
from tendril.graphs.callable import GraphedCallable, graphed
from tendril.graphs.options import GraphMemoryPolicy, GraphOptions, MemoryStrategy
from tendril.graphs.stats import Fallback

MIB = 1 << 20


def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_graph_options_refuse_negative_bounds_and_values_of_another_type():
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="max_graphs must be an integer"):
            GraphOptions(max_graphs=bad)
        with pytest.raises(ValueError, match="warmup must be an integer"):
            GraphOptions(warmup=bad)
    with pytest.raises(TypeError, match="clone_outputs must be True or False"):
        GraphOptions(clone_outputs="yes")
    with pytest.raises(TypeError, match=r"tendril.Buckets \(e.g. tendril.sequence_buckets\(\[4, 8\]\)\)"):
        GraphOptions(buckets=[4, 8])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="fn must be callable"):
        tendril.graphed(5)  # type: ignore[arg-type]
    assert GraphOptions().memory == GraphMemoryPolicy()


def test_memory_policies_validate_strategy_budget_and_prefetch():
    with pytest.raises(ValueError, match="expected one of"):
        GraphMemoryPolicy(strategy="smart")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="expected one of"):
        GraphMemoryPolicy(strategy="lru")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cannot hold a budget"):
        GraphMemoryPolicy(budget="64MiB", strategy="dedicated")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="prefetch"):
        GraphMemoryPolicy(prefetch="no")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="memory size"):
        GraphMemoryPolicy(budget="a lot")  # type: ignore[arg-type]
    assert GraphMemoryPolicy(strategy="update").strategy is MemoryStrategy.UPDATE  # type: ignore[arg-type]


def test_of_reads_a_policy_a_budget_or_nothing():
    assert GraphMemoryPolicy.of("64MiB") == GraphMemoryPolicy(budget=64 * MIB)
    assert GraphMemoryPolicy.of(4096).budget == 4096
    assert GraphMemoryPolicy.of(None) == GraphMemoryPolicy()
    policy = GraphMemoryPolicy(budget=MIB, prefetch=False)
    assert GraphMemoryPolicy.of(policy) is policy


def test_auto_resolves_by_budget_and_the_process_default_fills_a_missing_budget():
    assert GraphMemoryPolicy().resolved is MemoryStrategy.DEDICATED
    assert GraphMemoryPolicy.of("1MiB").resolved is MemoryStrategy.UPDATE
    config = Config(graph_memory_budget="2MiB")
    assert GraphMemoryPolicy().with_default_budget(config).budget == 2 * MIB
    assert GraphMemoryPolicy.of("1MiB").with_default_budget(config).budget == MIB
    dedicated = GraphMemoryPolicy(strategy=MemoryStrategy.DEDICATED)
    assert dedicated.with_default_budget(config) is dedicated


def test_graphed_builds_the_options_from_its_keywords():
    buckets = sequence_buckets((8, 16))
    fast = graphed(double, buckets=buckets, max_graphs=3, clone_outputs=True, warmup=2, backend=NullBackend())
    assert fast.options == GraphOptions(buckets, 3, True, 2, GraphMemoryPolicy())
    with pytest.raises(ValueError, match="max_graphs"):
        graphed(double, max_graphs=-1, backend=NullBackend())
    with pytest.raises(ValueError, match="memory size"):
        graphed(double, memory="a lot", backend=NullBackend())


@pytest.mark.parametrize("memory", ["1MiB", 4096, GraphMemoryPolicy(prefetch=False)])
def test_a_memory_policy_with_an_explicit_backend_is_refused(memory):
    with pytest.raises(ValueError, match="default CUDA backend"):
        graphed(double, memory=memory, backend=NullBackend())
    assert graphed(double, memory=GraphMemoryPolicy(), backend=NullBackend()).options.memory == GraphMemoryPolicy()


def test_a_graphed_callable_made_from_options_follows_them():
    fast = GraphedCallable(double, GraphOptions(max_graphs=1), backend=NullBackend(), config=Config(), name="twice")
    torch.testing.assert_close(fast(torch.ones(2)), torch.full((2,), 2.0))
    with pytest.warns(GraphFallbackWarning, match="max_graphs=1"):
        torch.testing.assert_close(fast(torch.ones(3)), torch.full((3,), 2.0))
    assert len(fast.keys()) == 1 and fast.stats.fallbacks[Fallback.LIMIT] == 1
    assert repr(fast) == "GraphedCallable(twice, graphs=1/1)"


def test_the_options_are_public_names():
    assert tendril.GraphOptions is tendril.graphs.GraphOptions is GraphOptions
    assert tendril.GraphMemoryPolicy is tendril.graphs.GraphMemoryPolicy is GraphMemoryPolicy
    assert tendril.graphs.MemoryStrategy is MemoryStrategy
