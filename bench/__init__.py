"""Benchmarks of onnxfuse, run from the repository root as `python -m bench.NAME`; reports go to bench/results/."""
