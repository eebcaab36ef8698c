"""The conv operator, one folder per dataflow, each with its kernel, its CPU reference or emulation and its
`ConvKernel` (`dataflow.py`): `cartesian_triton/`, `cartesian_cuda/`, `register/`, `dense/` (cuDNN), `gemm/`
(cuBLAS) and `cpu/` (the CPU backend). `interface.py` defines what a kernel provides, `registry.py` lists them,
`reference.py` is the plain-PyTorch reference."""
