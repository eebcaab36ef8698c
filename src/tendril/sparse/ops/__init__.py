"""Sparse operators, one folder each: `reference.py` (plain PyTorch), `triton.py` (GPU kernel and
launcher, also runnable under `TRITON_INTERPRET=1`) and `cpu.py` (the same algorithm, vectorized with
torch ops on the CPU, single- or multi-threaded)."""
