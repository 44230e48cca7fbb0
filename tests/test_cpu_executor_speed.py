"""The CPU executor is fast enough to teach with: launches of the course's sizes take well under a second.

Budgets are for a small 2-core machine and are measured after a warm-up launch, so compilation is not
counted. Each test also checks the result, so that a launch that does nothing cannot pass.
"""

import statistics
import time

import numpy as np
import pytest

from gpt2_cupy import backend
from kernel_sources import TILED_MATMUL

pytestmark = pytest.mark.cpu_only

if backend.name == "cpu":
    from gpt2_cupy.cpu import RawKernel


def best_time(launch, repeats=3):
    """The fastest of a few timed calls of launch() (the least disturbed by other work on the machine)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        launch()
        times.append(time.perf_counter() - start)
    return min(times)


VECTOR_ADD = r"""
extern "C" __global__ void vector_add(const float* a, const float* b, float* out, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        out[i] = a[i] + b[i];
    }
}
"""


def test_million_element_vector_add_takes_under_a_second(rng):
    """1M-element vector add, blocks of 256 threads (3907 blocks): < 1 s once compiled."""
    n = 1_000_000 + 3
    a = rng.standard_normal(n, dtype=np.float32)
    b = rng.standard_normal(n, dtype=np.float32)
    out = np.zeros(n, dtype=np.float32)
    kernel = RawKernel(VECTOR_ADD, "vector_add")
    grid = ((n + 255) // 256,)

    def launch():
        kernel(grid, (256,), (a, b, out, np.int32(n)))

    launch()  # warm-up: compiles
    out[:] = 0
    seconds = best_time(launch)
    np.testing.assert_array_equal(out, a + b)
    assert seconds < 1.0, f"vector add of 1M elements took {seconds:.3f} s"




def test_tiled_matmul_256_cubed_takes_under_two_seconds(rng):
    """A 256x256x256 matmul with 16x16 shared-memory tiles (256 blocks, 32 barriers per thread): < 2 s."""
    size = 256
    A = rng.standard_normal((size, size), dtype=np.float32)
    B = rng.standard_normal((size, size), dtype=np.float32)
    C = np.zeros((size, size), dtype=np.float32)
    kernel = RawKernel(TILED_MATMUL, "tiled_matmul")
    n = np.int32(size)

    def launch():
        kernel((size // 16, size // 16), (16, 16), (A, B, C, n, n, n))

    launch()  # warm-up: compiles
    C[:] = 0
    seconds = best_time(launch, repeats=2)
    np.testing.assert_allclose(C, A.astype(np.float64) @ B.astype(np.float64), rtol=1e-4, atol=1e-3)
    assert seconds < 2.0, f"256^3 tiled matmul took {seconds:.3f} s"


SMALL = r"""
extern "C" __global__ void add_one(int* x)
{
    x[threadIdx.x] += 1;
}
"""


def test_launch_overhead_of_a_small_kernel_is_under_100_microseconds():
    """One block of 32 threads: the median of 200 launches of a compiled kernel is < 100 µs."""
    x = np.zeros(32, dtype=np.int32)
    kernel = RawKernel(SMALL, "add_one")
    args = (x,)
    kernel((1,), (32,), args)  # warm-up: compiles
    times = []
    for _ in range(200):
        start = time.perf_counter()
        kernel((1,), (32,), args)
        times.append(time.perf_counter() - start)
    np.testing.assert_array_equal(x, np.full(32, 201))  # every one of the 201 launches ran every thread
    median = statistics.median(times)
    assert median < 100e-6, f"median launch took {median * 1e6:.1f} µs"
