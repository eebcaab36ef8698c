import subprocess
import sys
import textwrap

import pytest

import tendril


def _run(code: str) -> str:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], check=True, capture_output=True, text=True
    ).stdout


def test_import_is_cheap_and_does_not_touch_cuda():
    out = _run(
        """
        import sys, time
        start = time.perf_counter()
        import tendril
        elapsed = time.perf_counter() - start
        heavy = [m for m in ("torch", "triton", "transformers", "cuda.bindings") if m in sys.modules]
        print(heavy, elapsed < 0.5)
        """
    )
    assert out.split() == ["[]", "True"]


def test_lazy_public_names_resolve_and_unknown_names_raise():
    assert tendril.settings.debug in (True, False)
    assert set(tendril.__all__) <= set(dir(tendril))
    for name in tendril.__all__:
        assert getattr(tendril, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        tendril.nonexistent  # noqa: B018


def test_using_the_package_does_not_initialise_cuda():
    out = _run(
        """
        import torch, tendril
        from tendril.info import collect
        collect()
        print(torch.cuda.is_initialized() and not torch.cuda.is_available())
        """
    )
    assert out.strip() == "False"


def test_every_public_name_of_the_graphs_package_resolves():
    import tendril.graphs

    for name in tendril.graphs.__all__:
        assert getattr(tendril.graphs, name) is not None
