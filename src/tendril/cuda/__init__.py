"""The only part of tendril that talks to cuda-python: driver queries, NVRTC, graph-node building."""
