"""Conformance of `__shared__` declarations as public kernels write them.

- `static __shared__ float partial[32];` in a __device__ function: the block-reduction idiom of many softmax,
  LayerNorm and RMSNorm kernels. A __shared__ variable is one per block wherever it is declared, `static` or not,
  and in either order (`__shared__ static ...` too); every block of the launch reduces its own row.
- `__shared__` arrays of __half, __half2 and __nv_bfloat16, one thread writing one element and another thread
  reading it after a __syncthreads(): correct code, which the race check must leave alone (as it does arrays of
  unsigned short or float2).

Each kernel runs on the active backend, under the bounds and race checks where they exist (the CPU executor's; on
a GPU the block runs unchecked), and its results are compared with numpy's.
"""

import numpy as np
import pytest

from gpt2_cupy import backend

BLOCK_REDUCTION = r"""
// The sum of v over the block's threads (blockDim.x a multiple of 32, at most 1024), returned to every thread.
__device__ float block_sum(float v)
{
    static __shared__ float partial[32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = lane < blockDim.x / 32 ? partial[lane] : 0.0f;
    for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
    __syncthreads();  // partial is read before any thread's next call writes it
    return v;
}

// The largest |v| of the block, through an array declared `__shared__ static`, in the other order.
__device__ float block_max_magnitude(float v)
{
    __shared__ static float largest[32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    v = fabsf(v);
    for (int offset = 16; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    if (lane == 0) largest[warp] = v;
    __syncthreads();
    v = lane < blockDim.x / 32 ? largest[lane] : 0.0f;
    for (int offset = 16; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    __syncthreads();
    return v;
}

// One block per row: out[row] = (sum of the row, sum of squares, largest magnitude), the sums called twice so
// that the static array is reused within the block.
extern "C" __global__ void row_statistics(float* out, const float* x, int columns)
{
    static __shared__ int rows_done;  // a static __shared__ scalar in the kernel itself
    const float* row = x + (size_t)blockIdx.x * columns;
    float sum = 0.0f, squares = 0.0f, largest = 0.0f;
    for (int c = threadIdx.x; c < columns; c += blockDim.x) {
        sum += row[c];
        squares += row[c] * row[c];
        largest = fmaxf(largest, fabsf(row[c]));
    }
    sum = block_sum(sum);
    squares = block_sum(squares);
    largest = block_max_magnitude(largest);
    if (threadIdx.x == 0) rows_done = 1;
    __syncthreads();
    if (threadIdx.x == 0) {
        out[3 * blockIdx.x] = sum * rows_done;
        out[3 * blockIdx.x + 1] = squares;
        out[3 * blockIdx.x + 2] = largest;
    }
}
"""


@pytest.mark.parametrize("threads", [32, 256, 1024])
def test_static_shared_in_a_device_function_is_one_per_block(to_device, to_host, rng, threads):
    rows, columns = 5, 3000
    x = rng.standard_normal((rows, columns)).astype(np.float32)
    kernel = backend.RawModule(code=BLOCK_REDUCTION).get_function("row_statistics")
    out = to_device(np.zeros(3 * rows, np.float32))
    with backend.checks(bounds=True, races=True):
        kernel((rows,), (threads,), (out, to_device(x), np.int32(columns)))
    got = to_host(out).reshape(rows, 3)
    x64 = x.astype(np.float64)
    bound = columns * np.finfo(np.float32).eps * 2
    np.testing.assert_allclose(got[:, 0], x64.sum(1), atol=bound * np.abs(x64).sum(1).max())
    np.testing.assert_allclose(got[:, 1], (x64 ** 2).sum(1), rtol=bound)
    assert got[:, 2].tolist() == np.abs(x).max(1).tolist()


# One thread writes one element of each array, a barrier, another thread reads it back: every element type a
# kernel stages in shared memory, the 16-bit floats among them. (A block of 64: writer and reader in two warps.)
SMALL_TYPES = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>
extern "C" __global__ void stage(float* out, const float* x)
{
    __shared__ __half halves[8];
    __shared__ __half2 pairs[8];
    __shared__ __nv_bfloat16 brains[8];
    __shared__ __nv_bfloat162 brain_pairs[4], more_brain_pairs[4];
    __shared__ unsigned short bits[8];
    __shared__ float2 twos[8];
    __shared__ __half one_half;
    if (threadIdx.x == 3) {
        halves[5] = __float2half(x[0]);
        pairs[2] = __floats2half2_rn(x[1], x[2]);
        brains[7] = __float2bfloat16(x[3]);
        brain_pairs[1] = __floats2bfloat162_rn(x[4], x[5]);
        more_brain_pairs[3] = __floats2bfloat162_rn(x[6], x[7]);
        bits[0] = 9;
        twos[4] = make_float2(x[8], x[9]);
        one_half = __float2half(x[10]);
    }
    __syncthreads();
    if (threadIdx.x == 60) {
        out += 11 * blockIdx.x;  // each block its own 11 results
        out[0] = __half2float(halves[5]);
        out[1] = __low2float(pairs[2]);
        out[2] = __high2float(pairs[2]);
        out[3] = __bfloat162float(brains[7]);
        out[4] = __low2float(brain_pairs[1]);
        out[5] = __high2float(brain_pairs[1]);
        out[6] = __low2float(more_brain_pairs[3]);
        out[7] = __high2float(more_brain_pairs[3]);
        out[8] = bits[0];
        out[9] = twos[4].x + twos[4].y;
        out[10] = __half2float(one_half);
    }
}
"""


def test_shared_arrays_of_half_and_bfloat16_are_not_a_race(to_device, to_host):
    # values every type holds exactly
    x = np.array([1.5, -2.0, 0.25, 3.0, -0.5, 8.0, 6.0, -7.0, 0.0, 2.5, -1.25], np.float32)
    kernel = backend.RawModule(code=SMALL_TYPES).get_function("stage")
    out = to_device(np.zeros(2 * 11, np.float32))
    with backend.checks(bounds=True, races=True):
        kernel((2,), (64,), (out, to_device(x)))
    expected = x.copy()
    expected[8], expected[9] = 9.0, x[8] + x[9]
    assert to_host(out).tolist() == expected.tolist() * 2


# The same arrays, written by every thread of the block with nothing ordering the writes: a real race, which the
# race check reports on the 16-bit types as on any other.
RACING_HALVES = r"""
#include <cuda_fp16.h>
extern "C" __global__ void racing(float* out)
{
    __shared__ __half total[1];
    total[0] = __float2half((float)threadIdx.x);
    __syncthreads();
    if (threadIdx.x == 0) out[0] = __half2float(total[0]);
}
"""


@pytest.mark.cpu_only
def test_a_real_race_on_a_half_array_is_reported(to_device):
    from gpt2_cupy.cpu import RaceError
    kernel = backend.RawModule(code=RACING_HALVES).get_function("racing")
    with pytest.raises(RaceError, match="two writes|race"):
        with backend.checks(races=True):
            kernel((1,), (64,), (to_device(np.zeros(1, np.float32)),))
