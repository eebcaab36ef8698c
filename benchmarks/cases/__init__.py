"""Benchmark cases, one module each; `benchmarks.registry.discover` imports them all."""
