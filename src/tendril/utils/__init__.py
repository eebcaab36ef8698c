"""Small helpers shared by the package, its demo and the benchmarks."""
