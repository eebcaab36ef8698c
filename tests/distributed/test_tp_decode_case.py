"""The `tp-decode` benchmark case imports anywhere and refuses, saying why, on a host with fewer than 2 GPUs."""

from __future__ import annotations

import pytest
import torch

from benchmarks.registry import CASES, Context, discover


def test_the_case_is_registered_and_says_it_needs_two_gpus():
    discover()
    case = CASES["tp-decode"]
    assert case.needs_gpu and "needs 2 GPUs" in case.description


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="the host has 2 GPUs: the case would run")
def test_the_case_refuses_hosts_with_fewer_than_two_gpus():
    discover()
    with pytest.raises(SystemExit, match="needs 2 GPUs on one host"):
        CASES["tp-decode"].run(Context(device=torch.device("cpu"), quick=True))
