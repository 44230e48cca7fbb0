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


# Barriers and warp shuffles are where a block's threads hand over to one another: each is a switch
# from one thread's stack to the next. Every softmax, LayerNorm and cross-entropy kernel pays for them,
# so their cost is bounded at the largest block, 1024 threads, where the scheduler has the most to track;
# also when one warp shuffles while the block's other 992 threads wait (the last step of a block's
# reduction), which must not cost a look at every waiting thread.
SHUFFLES_AND_BARRIERS = r"""
extern "C" __global__ void shuffle_rounds(unsigned int* out, int rounds)
{
    unsigned int v = threadIdx.x;
    for (int r = 0; r < rounds; ++r)
        for (int offset = 16; offset > 0; offset /= 2) v = 3u * v + __shfl_xor_sync(0xffffffff, v, offset);
    out[threadIdx.x] = v;
}

extern "C" __global__ void barrier_rounds(unsigned int* out, int rounds)
{
    __shared__ unsigned int neighbours[1024];
    unsigned int v = threadIdx.x;
    for (int r = 0; r < rounds; ++r) {
        neighbours[threadIdx.x] = v;
        __syncthreads();
        v = 3u * v + neighbours[threadIdx.x ^ 1];
        __syncthreads();
    }
    out[threadIdx.x] = v;
}

extern "C" __global__ void first_warp_shuffle_rounds(unsigned int* out, int rounds)
{
    unsigned int v = threadIdx.x;
    if (threadIdx.x < 32)
        for (int r = 0; r < rounds; ++r)
            for (int offset = 16; offset > 0; offset /= 2) v = 3u * v + __shfl_xor_sync(0xffffffff, v, offset);
    __syncthreads();
    out[threadIdx.x] = v;
}
"""


def seconds_per_python_loop_step(steps=200_000):
    """The time of one step of an empty Python loop: this machine's speed, right now, as a yardstick."""
    def loop():
        for _ in range(steps):
            pass
    return best_time(loop, repeats=5) / steps


def expected_rounds(threads, rounds, offsets, active_threads):
    """What the kernels compute, in numpy: unsigned arithmetic wraps around there as in C."""
    lanes = np.arange(threads)
    v = lanes.astype(np.uint32)
    active = lanes < active_threads
    for _ in range(rounds):
        for offset in offsets:
            v = np.where(active, np.uint32(3) * v + v[lanes ^ offset], v)
    return v


@pytest.mark.parametrize("kernel_name, rounds, active_threads, operations_per_round, offsets", [
    ("shuffle_rounds", 40, 1024, 5, (16, 8, 4, 2, 1)),              # every thread shuffles
    ("barrier_rounds", 100, 1024, 2, (1,)),                         # 2 barriers, 1 update per round
    ("first_warp_shuffle_rounds", 200, 32, 5, (16, 8, 4, 2, 1)),   # 32 threads shuffle, 992 wait
])
def test_a_barrier_or_shuffle_in_a_1024_thread_block_costs_a_few_python_loop_steps(
        kernel_name, rounds, active_threads, operations_per_round, offsets):
    """One block (so one OS thread, like the yardstick) of 1024 threads: the time per thread and operation
    stays under 6 steps of an empty Python loop. Measured on a 2-core machine: about 3.5 (50 ns against
    15 ns); 10 to 13 when the threads' stacks shared cache sets, or a shuffle looked at every thread."""
    threads = 1024
    out = np.zeros(threads, dtype=np.uint32)
    kernel = RawKernel(SHUFFLES_AND_BARRIERS, kernel_name)

    def launch():
        kernel((1,), (threads,), (out, np.int32(rounds)))

    launch()  # warm-up: compiles
    np.testing.assert_array_equal(out, expected_rounds(threads, rounds, offsets, active_threads))
    # Other work on the machine slows the kernel (which needs the caches) more than the loop: a few tries.
    for _ in range(3):
        per_operation = best_time(launch, repeats=10) / (active_threads * rounds * operations_per_round)
        yardstick = seconds_per_python_loop_step()
        ratio = per_operation / yardstick
        if ratio < 6:
            break
    assert ratio < 6, (f"{kernel_name}: {per_operation * 1e9:.1f} ns per thread and operation, "
                       f"{ratio:.1f} steps of an empty Python loop ({yardstick * 1e9:.1f} ns)")
