import ctypes

import pytest
import torch

from tendril.cuda import nvrtc

SAXPY = r"""
extern "C" __global__ void saxpy(float a, const float* x, float* y, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
"""


def _unloaded_kernel() -> nvrtc.Kernel:
    return nvrtc.Kernel.__new__(nvrtc.Kernel)


def test_launch_dimensions_are_padded_to_three_and_validated():
    assert nvrtc._dim3(7, "grid") == (7, 1, 1)
    assert nvrtc._dim3((2, 3), "grid") == (2, 3, 1)
    with pytest.raises(ValueError, match="block must be 1 to 3 positive sizes"):
        nvrtc._dim3((1, 0), "block")
    with pytest.raises(ValueError, match="grid must be 1 to 3"):
        nvrtc._dim3((1, 1, 1, 1), "grid")


def test_bare_python_numbers_are_refused_with_the_fix_named():
    kernel = _unloaded_kernel()
    kernel.name = "k"
    assert kernel._c_value(0, ctypes.c_int32(3), 0).value == 3
    with pytest.raises(TypeError, match=r"argument 1: .*ctypes.c_int32\(n\)"):
        kernel._c_value(1, 3, 0)
    with pytest.raises(ValueError, match="argument 2: expected a tensor on cuda:0, got one on cpu"):
        kernel._c_value(2, torch.zeros(1), 0)


@pytest.mark.gpu
def test_compiled_kernel_matches_torch_and_is_cached():
    kernel = nvrtc.compile_kernel(SAXPY, "saxpy")
    before = nvrtc.cache_stats()
    assert nvrtc.compile_kernel(SAXPY, "saxpy") is kernel
    assert nvrtc.cache_stats().memory_hits == before.memory_hits + 1
    n = 1000
    x = torch.randn(n, device="cuda")
    y = torch.randn(n, device="cuda")
    expected = 2.5 * x + y
    kernel.launch((n + 127) // 128, 128, [ctypes.c_float(2.5), x, y, ctypes.c_int64(n)])
    torch.testing.assert_close(y, expected)


@pytest.mark.gpu
def test_launch_is_captured_into_a_cuda_graph_without_host_sync():
    kernel = nvrtc.compile_kernel(SAXPY, "saxpy")
    n = 257
    x = torch.randn(n, device="cuda")
    y = torch.zeros(n, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernel.launch(3, 128, [ctypes.c_float(1.0), x, y, ctypes.c_int64(n)])
    torch.cuda.synchronize()
    assert torch.count_nonzero(y).item() == 0  # capture records, does not run
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            graph.replay()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(y, 3 * x)


@pytest.mark.gpu
def test_compile_errors_carry_the_nvrtc_log():
    with pytest.raises(nvrtc.CompileError, match="undefined_name"):
        nvrtc.compile_kernel('extern "C" __global__ void bad() { undefined_name = 1; }', "bad")


@pytest.mark.gpu
def test_compiled_code_is_reused_from_the_disk_cache(tmp_path, monkeypatch):
    from tendril import config

    monkeypatch.setattr(config, "settings", config.Config(cache_dir=tmp_path))
    source = SAXPY.replace("saxpy", "saxpy_disk")
    nvrtc.compile_kernel(source, "saxpy_disk")
    assert list((tmp_path / "nvrtc").glob("saxpy_disk-*.cubin"))
    nvrtc._CACHE.kernels.clear()
    before = nvrtc.cache_stats()
    nvrtc.compile_kernel(source, "saxpy_disk")
    assert nvrtc.cache_stats().disk_hits == before.disk_hits + 1
