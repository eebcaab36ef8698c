"""The register-tiled sparse-weight dataflow in CUDA C++: `tiling.py` (layout and plans), `planner.py` (choice
of plan), `source.py` with `sparse_weight_conv.cu` (source and per-plan defines), `kernel.py` (compile and
launch), `emulation.py` (CPU mirror) and `dataflow.py` (the `"register"` kernel as layers and `tune` run it)."""
