"""The conv operator: reference, Triton kernel and CPU implementation."""
