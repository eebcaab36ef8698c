"""The linear operator: reference, Triton kernel and CPU implementation."""
