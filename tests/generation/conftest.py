"""Shared fixtures of the generation tests."""

from __future__ import annotations

import pytest
import torch

from tests.generation.models import tiny_model


@pytest.fixture(scope="session")
def gpt2() -> torch.nn.Module:
    return tiny_model("gpt2")
