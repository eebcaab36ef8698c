"""The nonzero-stationary sparse-weight dataflow in Triton, whose work follows the weight nonzeros: `packing.py`
(output channels sorted by nonzero count, tiled and packed in ELL chunks, once per layer and tile config),
`kernel.py` (the kernel and its launcher; runs under `TRITON_INTERPRET=1` too) and `dataflow.py` (the `"ell"`
kernel as layers and `tune` run it)."""
