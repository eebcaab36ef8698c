"""The conv operator: `reference.py`, the Triton kernel (`triton.py`), the CPU loops (`cpu.py`), the shared-memory
CUDA kernel (`cuda.py`, with `tiling.py` and its CPU mirror `cuda_emulation.py`), the register-tiled
sparse-weight kernel (`register_tiling.py` layout, `register_planner.py` choice of plan, `register_source*.py`
CUDA source, `register_cuda.py` compile and launch, `register_emulation.py` CPU mirror) and the dense GEMM
fallback (`gemm.py`)."""
