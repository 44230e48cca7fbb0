"""The GPU benchmarks: `python -m bench.NAME` from the repository root writes bench/NAME.json, which the
chapters plot on a machine without a GPU. `from bench.matmul import measure` reuses one from Python."""
