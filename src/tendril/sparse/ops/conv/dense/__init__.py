"""Dense fallbacks on the pruned weights in the network's dtype: `dataflow.py` (cuDNN's `"dense"` and
`"dense-fused"`, and the base of every kernel that reads the dense weight copy; the cuBLAS one is `ops/conv/gemm`)."""
