"""The compress operator: reference, Triton kernel and CPU implementation."""
