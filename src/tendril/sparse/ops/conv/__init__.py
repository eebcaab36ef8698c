"""The conv operator, one folder per dataflow, each with its kernel, its CPU reference or emulation and its
`ConvKernel` (`dataflow.py`): `cartesian_triton/`, `cartesian_cuda/`, `register/`, `ell/` (sparse weights ×
dense input, work following the nonzeros), `dense/` (cuDNN), `gemm/` (cuBLAS) and `cpu/` (the CPU backend).
`interface.py` defines what a kernel provides, `registry.py` lists them, `reference.py` is the plain-PyTorch
reference."""
