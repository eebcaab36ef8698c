"""SCNN's Cartesian-product dataflow in CUDA C++ with shared-memory output tiles: `kernel.py` (launch),
`scnn_conv_tiled.cu` (source), `tiling.py` (tiles and weight order), `emulation.py` (CPU mirror) and
`dataflow.py` (the `"cuda"` kernel as layers and `tune` run it)."""
