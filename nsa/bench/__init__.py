"""Benchmarks (attention kernels, training step, decode) that return rows; the CLI renders them."""
