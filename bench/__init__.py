"""Benchmarks run side by side in one process: `make bench`."""
