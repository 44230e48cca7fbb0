"""Find the bug the check reports: four mistakes seen in public CUDA kernels, each caught by a check, and the
corrected kernel passing the same check with the right numbers.

Each buggy kernel gives the right answer on the CPU without the checks (its threads run one after another)
and a wrong one, now and then, on a GPU: only the check shows it.
"""

import numpy as np
import pytest

from gpt2_cupy import backend

pytestmark = pytest.mark.cpu_only

if backend.name == "cpu":
    from gpt2_cupy.cpu import OutOfBoundsError, RaceError, RawKernel


# A block's sum through shared memory; its first thread stores it, and the last block to finish (by an atomic
# ticket) adds the blocks' sums. Without __threadfence() a block's sum may not have reached memory when the
# last block reads it.
LAST_BLOCK_SUM = r"""
extern "C" __global__ void last_block_sum(float* total, float* block_sums, unsigned int* tickets, const float* x, int n)
{
    __shared__ float partial[128];
    __shared__ bool is_last;
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    partial[threadIdx.x] = i < n ? x[i] : 0.0f;
    __syncthreads();
    for (int half = blockDim.x / 2; half > 0; half /= 2) {
        if (threadIdx.x < half) partial[threadIdx.x] += partial[threadIdx.x + half];
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        block_sums[blockIdx.x] = partial[0];
        FENCE
        is_last = atomicInc(tickets, gridDim.x) == gridDim.x - 1;
    }
    __syncthreads();
    if (is_last && threadIdx.x == 0) {
        float sum = 0.0f;
        for (int b = 0; b < gridDim.x; ++b) sum += ((volatile float*)block_sums)[b];
        total[0] = sum;
    }
}
"""


def last_block_sum(fence):
    n = 1000
    x = np.arange(n, dtype=np.float32) % 7
    total, tickets = np.zeros(1, dtype=np.float32), np.zeros(1, dtype=np.uint32)
    RawKernel(LAST_BLOCK_SUM.replace("FENCE", fence), "last_block_sum")(
        (8,), (128,), (total, np.zeros(8, dtype=np.float32), tickets, x, np.int32(n)), check_races=True)
    return total[0], float(x.sum())


def test_a_last_block_reduction_without_threadfence():
    with pytest.raises(RaceError, match=r"'block_sums' element \d.*Call __threadfence\(\)"):
        last_block_sum(fence="")
    total, expected = last_block_sum(fence="__threadfence();")
    assert total == expected


# One thread starts the block's shared total at zero; without a barrier after it, threads of other warps may
# add before it is zeroed, and their additions are lost.
SHARED_TOTAL = r"""
extern "C" __global__ void block_totals(float* out, const float* x)
{
    __shared__ float total;
    if (threadIdx.x == 0) total = 0.0f;
    BARRIER
    atomicAdd(&total, x[blockIdx.x * blockDim.x + threadIdx.x]);
    __syncthreads();
    if (threadIdx.x == 0) out[blockIdx.x] = total;
}
"""


def block_totals(barrier):
    x = np.arange(2 * 128, dtype=np.float32)
    out = np.zeros(2, dtype=np.float32)
    RawKernel(SHARED_TOTAL.replace("BARRIER", barrier), "block_totals")((2,), (128,), (out, x), check_races=True)
    return out, x.reshape(2, 128).sum(axis=1)


def test_a_shared_total_zeroed_without_a_barrier_before_the_others_add():
    with pytest.raises(RaceError, match=r"race on shared memory.*one through an atomic operation"):
        block_totals(barrier="")
    out, expected = block_totals(barrier="__syncthreads();")
    np.testing.assert_array_equal(out, expected)


# Each thread adds into the columns threadIdx.x, threadIdx.x + blockDim.x, ...; stepping by 1 instead, threads
# add into each other's columns, each column as many times as threads reach it, in an order nothing fixes.
# (Stepping by 1 in a loop that only stores, each thread the same value, is wasted work but no race:
# tests/test_cpu_executor_races.py.)
COLUMN_SCALE = r"""
extern "C" __global__ void scale_columns(float* out, const float* x, int columns)
{
    for (int c = threadIdx.x; c < columns; c += STEP) out[blockIdx.x * columns + c] += 2.0f * x[blockIdx.x * columns + c];
}
"""


def launch_on_floats(code, name, grid, size, **checks):
    """Launch a kernel(out, x, int) on x = 0, 1, 2, ... of `size` floats with blocks of 32 threads; returns out, x."""
    x = np.arange(size, dtype=np.float32)
    out = np.zeros_like(x)
    RawKernel(code, name)(grid, (32,), (out, x, np.int32(100)), **checks)
    return out, x


def scale_columns(step):
    out, x = launch_on_floats(COLUMN_SCALE.replace("STEP", step), "scale_columns", (3,), 3 * 100, check_races=True)
    return out, 2 * x


def test_a_tail_loop_stepping_by_one_instead_of_the_block_size():
    with pytest.raises(RaceError, match=r"race on 'out' element \d+.*both read it and write it back"):
        scale_columns(step="1")
    out, expected = scale_columns(step="blockDim.x")
    np.testing.assert_array_equal(out, expected)


GUARDED_COPY = r"""
extern "C" __global__ void guarded_copy(float* out, const float* x, int n)
{
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (GUARD) return;
    out[idx] = x[idx];
}
"""


def guarded_copy(guard):
    return launch_on_floats(GUARDED_COPY.replace("GUARD", guard), "guarded_copy", (4,), 100, check_bounds=True)


def test_an_off_by_one_bound():
    with pytest.raises(OutOfBoundsError, match=r"'(out|x)' at element 100; it has 100 elements"):
        guarded_copy("idx > n")
    out, expected = guarded_copy("idx >= n")
    np.testing.assert_array_equal(out, expected)
