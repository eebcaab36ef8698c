"""The `"cpu"` backend's convolution: `kernel.py` (SCNN's Cartesian product and an output-stationary dataflow
in compiled numba loops, chosen per call by a cost model) and `dataflow.py` (the kernel as layers run it)."""
