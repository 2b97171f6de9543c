"""Benchmarks: ``python -m nvrx_lab.bench NAME [flags]`` prints a table and writes JSON.

Each benchmark is a module ``nvrx_lab.bench.NAME`` with ``main(argv) -> int``; peers run side by
side in the same run and results are reported as medians and ratios (the machine is noisy).
"""
