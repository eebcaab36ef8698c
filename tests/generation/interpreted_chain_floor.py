"""`benchmarks.tools.decode_chain_floor`'s streaming kernel on the CPU through Triton's interpreter; run by
test_chain_floor_tool.py in a subprocess with TRITON_INTERPRET=1 (set before the kernel is defined)."""

from __future__ import annotations

import os

import torch

from benchmarks.tools.decode_chain_floor import _stream_kernel


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    lanes, vectors = 32, 2
    for n_vectors in (1, 63, 64, 65, 200):  # a partial last program, one exactly full, several
        src = torch.randint(-1000, 1000, (n_vectors * 4,), dtype=torch.int32)
        prev = torch.tensor([7], dtype=torch.int32)
        grid = -(-n_vectors // (lanes * vectors))
        out = torch.full((grid,), -1, dtype=torch.int32)
        _stream_kernel[(grid,)](src, prev, out, n_vectors, VECTORS=vectors, LANES=lanes, PDL=False)
        sums = torch.nn.functional.pad(src, (0, grid * lanes * vectors * 4 - src.numel())).view(grid, -1).sum(1)
        assert torch.equal(out, (sums + 7).to(torch.int32)), (n_vectors, out, sums)
    print("interpreted chain floor checks passed")


if __name__ == "__main__":
    main()
