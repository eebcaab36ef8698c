"""Fixtures shared by the graphs tests."""

import pytest
import torch


@pytest.fixture
def fresh_dynamo(monkeypatch):
    """The test compiles afresh, and Inductor's cache dir (set in the environment) is put back afterwards."""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
