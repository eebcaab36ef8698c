"""A convolution as one cuBLAS matrix product on the dense pruned weights: `kernel.py` (columns, product and
Triton epilogue, with a PyTorch epilogue on the CPU) and `dataflow.py` (the `"gemm"` kernel)."""
