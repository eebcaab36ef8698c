"""SCNN's Cartesian-product dataflow in Triton, accumulating by global atomics: `kernel.py` (also runs under
`TRITON_INTERPRET=1`; its CPU reference is `ops/conv/reference.py`) and `dataflow.py` (the `"triton"` kernel)."""
