import pytest
import torch

from tendril.cuda import runtime


class _Err(int):
    name = "cudaErrorInvalidValue"


def test_check_unpacks_values_and_names_the_failing_call():
    assert runtime.check((0,), "f") is None
    assert runtime.check((0, 7), "f") == 7
    assert runtime.check((0, 1, 2), "f") == (1, 2)
    with pytest.raises(runtime.CudaError, match=r"cudaMalloc failed: cudaErrorInvalidValue \(1\)"):
        runtime.check((_Err(1), None), "cudaMalloc")


@pytest.mark.skipif(torch.cuda.is_available(), reason="describes a machine without a driver")
def test_without_a_driver_features_are_reported_unavailable():
    assert runtime.driver_version() == 0
    assert runtime.driver_version_text() == "no NVIDIA driver"
    support = runtime.conditional_nodes()
    assert not support.available and support.reason == "no NVIDIA driver"


@pytest.mark.gpu
def test_on_a_gpu_machine_the_driver_is_found():
    assert runtime.driver_version() >= 12000
    assert runtime.runtime_version() >= 12000
