"""How the executor runs a block's threads: in rounds, each thread running until it finishes or reaches a
barrier, in the order of threadIdx. A thread that stops at a barrier switches straight to the next one; a
thread that finishes lends its stack to the next thread that has not started. Neither may change what a
kernel computes, nor the order the threads run in; and the threads compute with a GPU's floating-point
control (round to nearest, subnormals kept) whatever the launching thread has set.
"""

import ctypes
import subprocess

import numpy as np
import pytest

from gpt2_cupy import backend

pytestmark = pytest.mark.cpu_only

if backend.name == "cpu":
    from gpt2_cupy.cpu import RawKernel, toolchain


# Each thread writes its index into the next free place of the round it is in, then waits at a barrier (or,
# one thread in five after the first round, returns). The executor runs threads in threadIdx order, so each
# round's list is the threads still there, in increasing order.
RUN_ORDER = r"""
extern "C" __global__ void run_order(int* order, int* taken, int rounds)
{
    for (int round = 0; round < rounds; ++round) {
        int place = atomicAdd(&taken[round], 1);
        order[round * blockDim.x + place] = threadIdx.x;
        if (round > 0 && threadIdx.x % 5 == 0) return;
        if (round % 2 == 0) {
            __syncthreads();
        } else {
            __syncwarp();
        }
    }
}
"""


def test_threads_run_in_threadidx_order_in_every_round():
    threads, rounds = 96, 4
    order = np.full(rounds * threads, -1, dtype=np.int32)
    taken = np.zeros(rounds, dtype=np.int32)
    RawKernel(RUN_ORDER, "run_order")((1,), (threads,), (order, taken, np.int32(rounds)))
    everyone = np.arange(threads)
    survivors = everyone[everyone % 5 != 0]
    np.testing.assert_array_equal(taken, [threads, threads, len(survivors), len(survivors)])
    order = order.reshape(rounds, threads)
    np.testing.assert_array_equal(order[0], everyone)
    np.testing.assert_array_equal(order[1], everyone)
    for round in (2, 3):
        np.testing.assert_array_equal(order[round, :len(survivors)], survivors)
        assert (order[round, len(survivors):] == -1).all()


# Every thread keeps 64 values of its own on its stack. Odd threads finish at once (the next thread may start
# on their stack); even ones meet at a barrier and a shuffle in between, so their values must survive while
# other threads run.
STACK_VALUES = r"""
extern "C" __global__ void stack_values(long long* out, const int* x)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    volatile int values[64];
    for (int k = 0; k < 64; ++k) values[k] = x[i] * (k + 1);
    long long sum = 0;
    if (threadIdx.x % 2 == 1) {
        for (int k = 0; k < 64; ++k) sum += values[k];
        out[i] = sum;
        return;
    }
    __syncthreads();
    int neighbour = __shfl_xor_sync(0x55555555, x[i], 2);
    __syncthreads();
    for (int k = 0; k < 64; ++k) sum += values[k];
    out[i] = sum + neighbour;
}
"""


def test_threads_that_finish_and_threads_that_wait_keep_their_own_locals():
    blocks, threads = 6, 128
    n = blocks * threads
    x = np.random.default_rng(0).integers(-1000, 1000, n).astype(np.int32)
    out = np.zeros(n, dtype=np.int64)
    RawKernel(STACK_VALUES, "stack_values")((blocks,), (threads,), (out, x))
    expected = x.astype(np.int64) * (64 * 65 // 2)
    index = np.arange(n)
    even = index % 2 == 0
    expected[even] += x[index[even] ^ 2]
    np.testing.assert_array_equal(out, expected)


# x * 0.5 for x the smallest normal float: a subnormal, which flush-to-zero (FTZ, as CuPy compiles for a GPU)
# makes 0; and 1 + 2^-24 (half an ulp), which rounds to 1 to nearest and to 1 + 2^-23 upward.
FLOATING_POINT = r"""
extern "C" __global__ void floating_point(float* out, const float* x, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        out[2 * i] = x[0] * x[1];
        out[2 * i + 1] = x[2] + x[3];
    }
}
"""

# MXCSR: rounding toward +inf (bits 13-14 = 10), with and without flush-to-zero (bit 15) and denormals-are-zero (bit 6)
SET_MXCSR = r"""
extern "C" unsigned int swap_mxcsr(unsigned int value)
{
    unsigned int previous;
    __asm__ volatile("stmxcsr %0" : "=m"(previous));
    __asm__ volatile("ldmxcsr %0" : : "m"(value));
    return previous;
}
"""
ROUND_UP = 0x1F80 | (2 << 13)


@pytest.fixture
def swap_mxcsr(tmp_path):
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("sets the x86-64 MXCSR register")
    source, library = tmp_path / "mxcsr.cpp", tmp_path / "mxcsr.so"
    source.write_text(SET_MXCSR)
    subprocess.run([toolchain.compiler(), "-O1", "-shared", "-fPIC", "-o", str(library), str(source)],
                   check=True, capture_output=True)
    function = ctypes.CDLL(str(library)).swap_mxcsr
    function.argtypes, function.restype = [ctypes.c_uint], ctypes.c_uint
    return function


def test_threads_round_to_nearest_and_flush_subnormals_whatever_the_launching_thread_has_set(swap_mxcsr):
    smallest_normal = np.finfo(np.float32).tiny
    x = np.array([smallest_normal, 0.5, 1.0, 2.0**-24], dtype=np.float32)
    n = 4096
    out = np.zeros(2 * n, dtype=np.float32)
    kernel = RawKernel(FLOATING_POINT, "floating_point")
    kernel.compile()
    previous = swap_mxcsr(ROUND_UP)
    try:
        kernel(((n + 127) // 128,), (128,), (out, x, np.int32(n)))
        during = swap_mxcsr(ROUND_UP)   # what the launch left this thread with
    finally:
        swap_mxcsr(previous)
    assert during == ROUND_UP
    products, sums = out[0::2], out[1::2]
    np.testing.assert_array_equal(products.view(np.uint32), np.zeros(n, dtype=np.uint32))
    np.testing.assert_array_equal(sums, np.ones(n, dtype=np.float32))
