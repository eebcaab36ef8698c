"""The nonzero-stationary sparse-weight dataflow in Triton, whose work follows the weight nonzeros: `planes.py`
(how the kernel reads the input: reading modes, input planes, offsets), `packing.py` (output channels sorted by
nonzero count, tiled and packed in ELL chunks, once per layer and tile config), `kernel.py` (the kernel and its
launcher; runs under `TRITON_INTERPRET=1` too), `emulation.py` (its algorithm in PyTorch ops, for CPU tensors)
and `dataflow.py` (the `"ell"` kernel as layers and `tune` run it)."""
