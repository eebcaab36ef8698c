"""Dense fallbacks on the pruned weights in fp32: `dataflow.py` (cuDNN's `"dense"` and `"dense-fused"`, and the
base of every kernel that reads the dense weight copy; the cuBLAS one is `ops/conv/gemm`)."""
