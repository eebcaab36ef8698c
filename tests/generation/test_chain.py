"""The persistent projection chain's checks that need no kernel run: its layout and validation, and its kernel
compiled for sm_90 (the interpreter checks its numbers with one program: interpreted_kernels.py; the GPU with a
program per SM: test_kernels_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from tendril.generation.kernels import chain


def test_the_table_links_each_phase_to_the_outputs_before_it():
    weights = [torch.zeros(40, 24), torch.zeros(33, 40), torch.zeros(9, 20)]
    laid = chain.ProjectionChain(weights)
    assert laid.table.tolist() == [[0, 0, 24, 40, 24], [960, 24, 64, 33, 40], [2280, 64, 97, 9, 20]]
    assert laid.acts.numel() == 24 + 40 + 33 + 9 and laid.weights.numel() == 960 + 1320 + 180
    assert laid.bytes_read == 4 * (960 + 1320 + 180)


def test_bad_chains_and_inputs_are_refused():
    with pytest.raises(ValueError, match="at least one weight"):
        chain.ProjectionChain([])
    with pytest.raises(ValueError, match="weight 1 reads 41 inputs, but phase 0 makes only 40"):
        chain.ProjectionChain([torch.zeros(40, 24), torch.zeros(33, 41)])
    with pytest.raises(ValueError, match=r"weight 1: expected a 2-D torch\.float32 tensor"):
        chain.ProjectionChain([torch.zeros(40, 24), torch.zeros(33, 40, dtype=torch.float16)])
    laid = chain.ProjectionChain([torch.zeros(40, 24)])
    with pytest.raises(ValueError, match=r"x must be a torch\.float32 vector of 24"):
        laid.run(torch.zeros(23))
    with pytest.raises(ValueError, match="programs must be between 1 and 1"):
        laid.run(torch.zeros(24), programs=2)
    with pytest.raises(ValueError, match="block_k must be a power of two of at least 16, got 24"):
        laid.run(torch.zeros(24), block_k=24)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_kernel_compiles_for_hopper_without_spills(dtype):
    from tests.generation.hopper_compile import hopper_compile

    weights = [torch.empty(3072, 2048, dtype=dtype, device="meta"), torch.empty(2048, 2048, dtype=dtype, device="meta")]
    laid = chain.ProjectionChain(weights)
    x = torch.empty(2048, dtype=dtype, device="meta")
    for block_k, warps in ((512, 4), (512, 8), (1024, 8)):  # the benchmark tool's tiles
        assert hopper_compile(chain._chain_kernel, lambda k=block_k, w=warps: laid.run(x, block_k=k, num_warps=w)) == 1
