"""`tendril.graphed(fn, compile=...)` through the null backend on the CPU: answers equal eager over random length
orders, compiles stay at the dynamic-shape minimum, a failing compile falls back with its reason and one warning,
and a background compile switches the plain graphs to compiled ones, recorded in stats.

Dynamo's `aot_eager` backend traces as Inductor does without generating code, so these run in CI time; one tiny
test runs Inductor itself (C++ on the CPU)."""

from __future__ import annotations

import os
import random
import warnings

import pytest
import torch

from tendril.config import Config
from tendril.graphs import compiled as compiled_module
from tendril.graphs.backend import NullBackend
from tendril.graphs.callable import graphed
from tendril.graphs.compiled import CompileFallbackWarning, enable_persistent_caches, inductor_cache_dir
from tendril.graphs.options import CompileMode, CompileOptions, GraphOptions
from tendril.graphs.stats import Fallback

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 8)
        self.mix = torch.nn.Linear(8, 8)
        self.out = torch.nn.Linear(8, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = h + torch.softmax(h @ h.transpose(-1, -2) / 8**0.5, dim=-1) @ self.mix(h)
        return self.out(torch.nn.functional.gelu(h))


def make(model, tmp_path, **compile_options):
    options = CompileOptions(**{"backend": "aot_eager", **compile_options})
    return graphed(model, compile=options, backend=NullBackend(), config=Config(cache_dir=tmp_path))


def ids(length: int) -> torch.Tensor:
    return torch.randint(0, 50, (1, length))


def test_results_equal_eager_over_a_random_length_order_and_compiles_stay_at_the_minimum(tmp_path):
    model = Tiny().eval()
    fast = make(model, tmp_path)
    lengths = random.Random(0).sample(range(2, 40), 20)
    with torch.inference_mode():
        x = ids(lengths[0])
        torch.testing.assert_close(fast(x), model(x))
        first = fast.stats.compile.compiles
        for length in lengths[1:] + lengths[:5]:
            x = ids(length)
            torch.testing.assert_close(fast(x), model(x))
    stats = fast.stats.compile
    assert first >= 1 and stats.compiles == first, "a new length recompiled"
    assert stats.recompiles == first - stats.compiled_by_first_call and "compile ready" in fast.stats.table()
    assert (stats.state, stats.switched_at_call, stats.compiled_keys, stats.failure) == ("ready", 1, 20, None)
    assert fast.stats.captures == 20 and fast.stats.eager_calls == 0 and fast.stats.replays == 25


def test_calls_in_inference_mode_compile_no_more_than_calls_under_no_grad(tmp_path):
    """Compiling runs on normal-tensor copies of the call, as the placeholders are, so inference tensors add no
    recompile for their dispatch keys."""
    counts = []
    for mode in (torch.no_grad, torch.inference_mode):
        torch._dynamo.reset()
        fast = make(Tiny().eval(), tmp_path)
        with mode():
            fast(ids(6))
            fast(ids(11))
        counts.append(fast.stats.compile.compiles)
    assert counts[0] == counts[1], counts


def test_a_compile_failure_falls_back_to_plain_graphs_with_the_reason_and_one_warning(tmp_path, monkeypatch):
    def broken(options):
        def backend(graph, example_inputs):
            raise RuntimeError("no kernels today")

        return backend

    monkeypatch.setattr(compiled_module, "_backend", broken)
    model = Tiny().eval()
    fast = make(model, tmp_path)
    with torch.no_grad(), pytest.warns(CompileFallbackWarning, match="no kernels today"):
        x = ids(7)
        torch.testing.assert_close(fast(x), model(x))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        for length in (3, 7, 11):
            x = ids(length)
            torch.testing.assert_close(fast(x), model(x))
    stats = fast.stats.compile
    assert stats.state == "failed" and "no kernels today" in stats.failure
    assert stats.compiled_keys == 0 and stats.switched_at_call is None
    assert fast.stats.captures == 3 and fast.stats.eager_calls == 0
    assert "compile failed" in fast.stats.table() and "no kernels today" in fast.stats.table()


def test_background_compile_serves_plain_graphs_then_recaptures_each_key_from_compiled_code(tmp_path):
    model = Tiny().eval()
    fast = make(model, tmp_path, background=True)
    with torch.inference_mode():
        fast.capture([ids(4), ids(9)], progress=False)
        assert fast.stats.compile.state == "pending" and fast.stats.compile.compiled_keys == 0
        x = ids(4)
        torch.testing.assert_close(fast(x), model(x))  # starts compiling; the plain graph replays meanwhile
        assert fast.wait_compiled(timeout=120)
        x = ids(4)
        torch.testing.assert_close(fast(x), model(x))
        first = fast.stats.compile.compiles
        for length in (9, 6, 4):
            x = ids(length)
            torch.testing.assert_close(fast(x), model(x))
    stats = fast.stats.compile
    assert (stats.state, stats.switched_at_call, stats.recaptured_keys, stats.compiled_keys) == ("ready", 2, 2, 3)
    assert stats.compiles == first, "a call after the switch recompiled (the side thread compiled for other inputs)"
    assert fast.stats.captures == 3 and fast.stats.eager_calls == 0


def test_new_keys_run_eagerly_while_the_background_compile_runs(tmp_path, monkeypatch):
    gate = __import__("threading").Event()
    real = compiled_module._backend

    def slow(options):
        inner = real(options)

        def backend(graph, example_inputs):
            gate.wait(60)
            return inner(graph, example_inputs)

        return backend

    monkeypatch.setattr(compiled_module, "_backend", slow)
    model = Tiny().eval()
    fast = make(model, tmp_path, background=True)
    with torch.no_grad(), pytest.warns(match="compiles in the background"):
        for length in (5, 6):
            x = ids(length)
            torch.testing.assert_close(fast(x), model(x))
    assert fast.stats.fallbacks[Fallback.COMPILING] == 2 and fast.stats.compile.state == "compiling"
    gate.set()
    assert fast.wait_compiled(timeout=120)
    with torch.no_grad():
        x = ids(5)
        torch.testing.assert_close(fast(x), model(x))
    assert fast.stats.compile.switched_at_call == 3 and fast.stats.compile.compiled_keys == 1


def test_persistent_caches_are_on_and_under_the_tendril_cache_dir(tmp_path, monkeypatch):
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(inductor_config, "fx_graph_cache", False)
    monkeypatch.setattr(functorch_config, "enable_autograd_cache", False)
    config = Config(cache_dir=tmp_path)
    assert enable_persistent_caches(config) == tmp_path / "inductor" == inductor_cache_dir(config)
    assert inductor_config.fx_graph_cache and functorch_config.enable_autograd_cache
    mine = Config.from_env({"TENDRIL_CACHE_DIR": str(tmp_path), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "mine")})
    assert enable_persistent_caches(mine) == tmp_path / "mine"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")


def test_compile_options_are_typed_and_checked():
    assert CompileOptions.of(False) is None and CompileOptions.of(None) is None
    assert CompileOptions.of(True) == CompileOptions()
    assert CompileOptions.of("max-autotune-no-cudagraphs").mode is CompileMode.MAX_AUTOTUNE
    with pytest.raises(ValueError, match="compile mode 'reduce-overhead'"):
        CompileOptions.of("reduce-overhead")
    with pytest.raises(ValueError, match="compile backend 'cudagraphs'"):
        CompileOptions(backend="cudagraphs")
    with pytest.raises(TypeError, match="compile=3"):
        CompileOptions.of(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="background"):
        CompileOptions(background=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="warmup >= 1"):
        GraphOptions(warmup=0, compile=CompileOptions())


def test_inductor_itself_on_a_tiny_function(tmp_path):
    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x) * 2 + 1

    fast = graphed(fn, compile=True, backend=NullBackend(), config=Config(cache_dir=tmp_path))
    for length in (3, 8, 5):
        x = torch.randn(length)
        torch.testing.assert_close(fast(x), fn(x))
    assert fast.stats.compile.state == "ready" and fast.stats.compile.compiles == 1
    assert any((tmp_path / "inductor").iterdir())


class Scaled(torch.nn.Module):
    """Python floats a compiled model reads: a scale, LayerNorm's eps and Dropout's p."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.drop = torch.nn.Dropout(0.1)
        self.scale = 0.125

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.drop(self.norm(self.mix(ids.float().unsqueeze(-1).expand(-1, -1, 8)) * self.scale))


def test_a_model_with_float_attributes_compiles_once(tmp_path):
    """Under dynamic shapes dynamo would trace such floats as symbols, then restart its analysis when the compiler
    turns them back into constants, and the backend would compile the frame twice (the first time for nothing)."""
    model = Scaled().eval()
    fast = make(model, tmp_path)
    with torch.inference_mode():
        for length in (5, 9):
            x = ids(length)
            torch.testing.assert_close(fast(x), model(x))
    assert fast.stats.compile.compiles == 1, fast.stats.table()


def test_the_default_backend_keeps_pytorchs_attention_choice_only_when_compiling(tmp_path):
    """Compiled code bakes in the attention kernel it traced with: a compiled callable's default backend leaves the
    choice to PyTorch (cuDNN attention where it is fastest), plain graphs keep cuDNN attention's host plans out."""
    from tendril.graphs.capture import GRAPH_SDPA_BACKENDS
    from tendril.graphs.cuda_backend import CudaBackend

    config = Config(cache_dir=tmp_path)
    compiled, plain = graphed(Tiny(), compile=True, config=config), graphed(Tiny(), config=config)
    assert isinstance(compiled._backend, CudaBackend) and compiled._backend.sdpa_backends is None
    assert compiled._compiler is not None and compiled._compiler.sdpa_backends is None
    assert isinstance(plain._backend, CudaBackend) and plain._backend.sdpa_backends == GRAPH_SDPA_BACKENDS
    chosen = graphed(Tiny(), compile=True, backend=CudaBackend(), config=config)
    assert chosen._compiler is not None and chosen._compiler.sdpa_backends == GRAPH_SDPA_BACKENDS


def test_the_compile_traces_under_the_backends_attention_restriction_and_restores_the_flags(tmp_path, monkeypatch):
    from tendril.graphs.capture import GRAPH_SDPA_BACKENDS

    seen = []

    def recording(options):
        def backend(graph, example_inputs):
            seen.append(torch.backends.cuda.cudnn_sdp_enabled())
            return graph.forward

        return backend

    monkeypatch.setattr(compiled_module, "_backend", recording)
    restricted = NullBackend()
    restricted.sdpa_backends = GRAPH_SDPA_BACKENDS  # as CudaBackend's default: cuDNN attention left out
    model = Tiny().eval()
    for backend, cudnn_while_tracing in ((restricted, False), (NullBackend(), True)):
        torch._dynamo.reset()
        seen.clear()
        fast = graphed(model, compile=CompileOptions(), backend=backend, config=Config(cache_dir=tmp_path))
        with torch.no_grad():
            x = ids(7)
            torch.testing.assert_close(fast(x), model(x))
        assert seen == [cudnn_while_tracing]
        assert torch.backends.cuda.cudnn_sdp_enabled()
