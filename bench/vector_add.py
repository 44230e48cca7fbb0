"""Bandwidth of kernels/steps/vector_add.cu (chapter 00) against the device's copy bandwidth, cupy.add and torch.add.

    python -m bench.vector_add       on a machine with an NVIDIA GPU and CuPy

Writes bench/vector_add.json: for each n (float32 elements per array), the GB/s of each version, counting
12 bytes per element (two 4-byte reads and one 4-byte write), next to benchmark.copy_bandwidth(), the
device-to-device copy that is the memory's ceiling.
"""

import sys

import numpy as np

from gpt2_cupy import backend, benchmark, kernels
from gpt2_cupy.testing import torch_or_none

SIZES = [2**k for k in range(12, 29, 2)]  # 4096 to 268 million elements (1 GiB per array)
THREADS_PER_BLOCK = 256
GRID_STRIDE_BLOCKS_PER_MULTIPROCESSOR = 4
BYTES_PER_ELEMENT = 12


def versions(cupy, n, a, b, out):
    """{name: function that runs one launch} for arrays of n elements."""
    vector_add = kernels.function("steps/vector_add", "vector_add")
    vector_add_grid_stride = kernels.function("steps/vector_add", "vector_add_grid_stride")
    blocks = (n + THREADS_PER_BLOCK - 1) // THREADS_PER_BLOCK
    multiprocessors = cupy.cuda.Device().attributes["MultiProcessorCount"]
    grid_stride_blocks = GRID_STRIDE_BLOCKS_PER_MULTIPROCESSOR * multiprocessors
    runs = {
        "vector_add": lambda: vector_add((blocks,), (THREADS_PER_BLOCK,), (out, a, b, np.int32(n))),
        "vector_add_grid_stride": lambda: vector_add_grid_stride(
            (grid_stride_blocks,), (THREADS_PER_BLOCK,), (out, a, b, np.int32(n))),
        "cupy.add": lambda: cupy.add(a, b, out=out),
    }
    torch = torch_or_none()
    if torch is None:
        return runs
    # Views of the same memory; torch's default stream is the legacy default stream CuPy's events record on.
    a_torch, b_torch, out_torch = (torch.as_tensor(x, device="cuda") for x in (a, b, out))
    runs["torch.add"] = lambda: torch.add(a_torch, b_torch, out=out_torch)
    return runs


def check(cupy, n, a, b, out):
    """The kernels' results equal cupy's a + b (float32 addition rounds once, the same everywhere)."""
    expected = cupy.asnumpy(a + b)
    for name, run in versions(cupy, n, a, b, out).items():
        out.fill(np.nan)
        run()
        if not np.array_equal(cupy.asnumpy(out), expected):
            raise AssertionError(f"{name} differs from a + b at n = {n}")


def measure(sizes=SIZES):
    cupy = backend.xp
    results = {}
    for n in sizes:
        a = cupy.random.standard_normal(n, dtype=cupy.float32)
        b = cupy.random.standard_normal(n, dtype=cupy.float32)
        out = cupy.empty_like(a)
        check(cupy, n, a, b, out)
        for name, run in versions(cupy, n, a, b, out).items():
            seconds = benchmark.seconds_per_call(run)
            results.setdefault(name, []).append(
                {"n": n, "seconds": seconds,
                 "gigabytes_per_second": benchmark.gigabytes_per_second(BYTES_PER_ELEMENT * n, seconds)})
        del a, b, out
        cupy.get_default_memory_pool().free_all_blocks()
    return results


def main():
    benchmark.require_gpu()
    results = measure()
    copy = benchmark.copy_bandwidth()
    report = {
        "bytes_per_element": BYTES_PER_ELEMENT,
        "threads_per_block": THREADS_PER_BLOCK,
        "grid_stride_blocks_per_multiprocessor": GRID_STRIDE_BLOCKS_PER_MULTIPROCESSOR,
        "copy_gigabytes_per_second": copy / 1e9,
        "results": results,
    }
    table = [f"{backend.device_name()}: device-to-device copy {copy / 1e9:.0f} GB/s",
             f"{'n':>10} " + " ".join(f"{name:>23}" for name in results)]
    table += [f"{n:>10} " + " ".join(f"{rows[index]['gigabytes_per_second']:>18.0f} GB/s" for rows in results.values())
              for index, n in enumerate(SIZES)]
    benchmark.report("vector_add", report, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
