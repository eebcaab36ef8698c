"""Graphed execution of dynamic DNNs: CUDA graphs keyed by input shapes, sharing one memory pool."""
