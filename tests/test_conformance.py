"""Conformance: each CUDA feature the course uses, in a small kernel checked against numpy.

These tests run on whatever backend is active, so the same file checks the CPU executor and, on a machine
with an NVIDIA GPU, CuPy itself: a test that passes on the CPU but fails on the GPU (or the reverse) is a
place where the executor does not behave like CUDA.

Sizes are deliberately not multiples of the block size, so that the `if (i < n)` guards matter.
"""

import itertools
import math

import numpy as np
import pytest

from gpt2_cupy import backend
from kernel_sources import BLOCK_SUM, TILED_MATMUL


def blocks_for(n, block):
    """How many blocks of `block` threads cover n elements."""
    return (n + block - 1) // block


# ---------------------------------------------------------------------------------------------------------
# Thread and block coordinates
# ---------------------------------------------------------------------------------------------------------

COORDINATES = r"""
extern "C" __global__ void write_coordinates(int* out)
{
    int block = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
    int thread = (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
    int threads_per_block = blockDim.x * blockDim.y * blockDim.z;
    int* slot = out + 12 * (block * threads_per_block + thread);
    slot[0] = threadIdx.x;  slot[1] = threadIdx.y;  slot[2] = threadIdx.z;
    slot[3] = blockIdx.x;   slot[4] = blockIdx.y;   slot[5] = blockIdx.z;
    slot[6] = blockDim.x;   slot[7] = blockDim.y;   slot[8] = blockDim.z;
    slot[9] = gridDim.x;    slot[10] = gridDim.y;   slot[11] = gridDim.z;
}
"""


@pytest.mark.parametrize("grid, block", [((3, 2, 2), (4, 3, 2)), ((5, 1, 1), (7, 1, 1)), ((2, 3, 1), (1, 5, 3))])
def test_thread_and_block_coordinates_in_three_dimensions(grid, block, to_device, to_host):
    """Every thread sees its own threadIdx/blockIdx and the launch's blockDim/gridDim, in x, y and z."""
    kernel = backend.RawKernel(COORDINATES, "write_coordinates")
    threads = math.prod(grid) * math.prod(block)
    out = to_device(np.full(threads * 12, -1, dtype=np.int32))
    kernel(grid, block, (out,))

    expected = []
    for bz, by, bx in itertools.product(range(grid[2]), range(grid[1]), range(grid[0])):
        for tz, ty, tx in itertools.product(range(block[2]), range(block[1]), range(block[0])):
            expected.append([tx, ty, tz, bx, by, bz, *block, *grid])
    np.testing.assert_array_equal(to_host(out).reshape(threads, 12), np.array(expected, dtype=np.int32))


def test_short_grid_and_block_tuples_are_padded_with_ones(to_device, to_host):
    """grid=(4, 2) and block=(8,) launch a 4x2x1 grid of 8x1x1 blocks (CuPy wants tuples, not plain ints)."""
    kernel = backend.RawKernel(COORDINATES, "write_coordinates")
    out = to_device(np.full(8 * 8 * 12, -1, dtype=np.int32))
    kernel((4, 2), (8,), (out,))
    got = to_host(out).reshape(2, 4, 8, 12)  # blockIdx.y, blockIdx.x, threadIdx.x, field
    np.testing.assert_array_equal(got[..., 0], np.broadcast_to(np.arange(8), (2, 4, 8)))  # threadIdx.x
    np.testing.assert_array_equal(got[..., 3], np.broadcast_to(np.arange(4)[:, None], (2, 4, 8)))  # blockIdx.x
    np.testing.assert_array_equal(got[..., 4], np.broadcast_to(np.arange(2)[:, None, None], (2, 4, 8)))  # blockIdx.y
    np.testing.assert_array_equal(got[..., 6:].reshape(-1, 6), np.tile([8, 1, 1, 4, 2, 1], (64, 1)))  # blockDim, gridDim


# ---------------------------------------------------------------------------------------------------------
# Many blocks, grid-stride loops, scalar arguments
# ---------------------------------------------------------------------------------------------------------

VECTOR_ADD = r"""
extern "C" __global__ void vector_add(const float* a, const float* b, float* out, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        out[i] = a[i] + b[i];
    }
}
"""


def test_vector_add_over_a_million_elements(rng, to_device, to_host):
    """A 1M-element vector add launches about 4000 blocks of 256 threads, the last one partly idle."""
    n = 1_000_003
    a = rng.standard_normal(n, dtype=np.float32)
    b = rng.standard_normal(n, dtype=np.float32)
    out = to_device(np.zeros(n, dtype=np.float32))
    kernel = backend.RawKernel(VECTOR_ADD, "vector_add")
    kernel((blocks_for(n, 256),), (256,), (to_device(a), to_device(b), out, np.int32(n)))
    np.testing.assert_array_equal(to_host(out), a + b)


GRID_STRIDE = r"""
extern "C" __global__ void axpy_grid_stride(float alpha, const float* x, float* y, int n)
{
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) {
        y[i] = alpha * x[i] + y[i];
    }
}
"""


def test_grid_stride_loop_covers_more_elements_than_threads(rng, to_device, to_host):
    """5 blocks of 96 threads walk over 100 003 elements with a grid-stride loop; every element is done once."""
    n = 100_003
    x = rng.standard_normal(n, dtype=np.float32)
    y = rng.standard_normal(n, dtype=np.float32)
    y_device = to_device(y.copy())
    kernel = backend.RawKernel(GRID_STRIDE, "axpy_grid_stride")
    kernel((5,), (96,), (np.float32(2.5), to_device(x), y_device, np.int32(n)))
    expected = np.float32(2.5) * x + y
    np.testing.assert_allclose(to_host(y_device), expected, rtol=1e-6, atol=1e-6)


SCALARS = r"""
extern "C" __global__ void scalar_arguments(float* out, int i, unsigned int u, long long ll, float f, double d)
{
    out[0] = (float)i;
    out[1] = (float)u;
    out[2] = (float)ll;
    out[3] = f;
    out[4] = (float)d;
}
"""


def test_scalar_arguments_of_several_types(to_device, to_host):
    """int, unsigned int, long long, float and double scalars arrive with their values."""
    out = to_device(np.zeros(5, dtype=np.float32))
    kernel = backend.RawKernel(SCALARS, "scalar_arguments")
    kernel((1,), (1,), (out, np.int32(-7), np.uint32(3_000_000_000), np.int64(-(2**40)), np.float32(1.5), np.float64(0.25)))
    np.testing.assert_array_equal(to_host(out), np.array([-7, 3e9, -(2.0**40), 1.5, 0.25], dtype=np.float32))


# ---------------------------------------------------------------------------------------------------------
# __syncthreads() and static shared memory
# ---------------------------------------------------------------------------------------------------------

REVERSE_EACH_BLOCK = r"""
extern "C" __global__ void reverse_each_block(const float* in, float* out, int n)
{
    __shared__ float tile[256];
    int start = blockIdx.x * blockDim.x;
    int count = min((int)blockDim.x, n - start);  // the last block may be partly empty
    int t = threadIdx.x;
    if (t < count) {
        tile[t] = in[start + t];
    }
    __syncthreads();  // thread t reads what thread count-1-t wrote
    if (t < count) {
        out[start + t] = tile[count - 1 - t];
    }
}
"""


def test_syncthreads_lets_a_block_reverse_its_slice_through_shared_memory(rng, to_device, to_host):
    """Each block reverses its own slice; the threads read shared memory that other threads wrote."""
    n, block = 1000, 192
    x = rng.standard_normal(n, dtype=np.float32)
    out = to_device(np.zeros(n, dtype=np.float32))
    kernel = backend.RawKernel(REVERSE_EACH_BLOCK, "reverse_each_block")
    kernel((blocks_for(n, block),), (block,), (to_device(x), out, np.int32(n)))
    expected = np.concatenate([x[s : s + block][::-1] for s in range(0, n, block)])
    np.testing.assert_array_equal(to_host(out), expected)




@pytest.mark.parametrize("block", [256, 64])
def test_shared_memory_tree_reduction(block, rng, to_device, to_host):
    """A classic tree reduction with __syncthreads() between the steps gives each block's sum."""
    n = 100_003
    x = rng.random(n, dtype=np.float32)
    blocks = blocks_for(n, block)
    partial = to_device(np.zeros(blocks, dtype=np.float32))
    kernel = backend.RawKernel(BLOCK_SUM, "block_sum")
    kernel((blocks,), (block,), (to_device(x), partial, np.int32(n)))
    padded = np.zeros(blocks * block, dtype=np.float64)
    padded[:n] = x
    np.testing.assert_allclose(to_host(partial), padded.reshape(blocks, block).sum(axis=1), rtol=1e-5)




def test_tiled_matmul_with_static_two_dimensional_shared_arrays(rng, to_device, to_host):
    """A 16x16-tiled matmul of a 127x65 by a 65x33 matrix (no size a multiple of the tile) matches A @ B."""
    M, K, N = 127, 65, 33
    A = rng.standard_normal((M, K), dtype=np.float32)
    B = rng.standard_normal((K, N), dtype=np.float32)
    C = to_device(np.zeros((M, N), dtype=np.float32))
    kernel = backend.RawKernel(TILED_MATMUL, "tiled_matmul")
    kernel((blocks_for(N, 16), blocks_for(M, 16)), (16, 16), (to_device(A), to_device(B), C, np.int32(M), np.int32(N), np.int32(K)))
    expected = A.astype(np.float64) @ B.astype(np.float64)
    np.testing.assert_allclose(to_host(C), expected, rtol=1e-4, atol=1e-4)


TILED_TRANSPOSE = r"""
#define TILE 32
#define ROWS_PER_PASS 8

// Each 32x8 block moves a 32x32 tile; the +1 column keeps the column reads free of bank conflicts.
extern "C" __global__ void tiled_transpose(const float* in, float* out, int rows, int cols)
{
    __shared__ float tile[TILE][TILE + 1];
    int x = blockIdx.x * TILE + threadIdx.x;
    int y = blockIdx.y * TILE + threadIdx.y;
    for (int j = 0; j < TILE; j += ROWS_PER_PASS) {
        if (x < cols && y + j < rows) {
            tile[threadIdx.y + j][threadIdx.x] = in[(y + j) * cols + x];
        }
    }
    __syncthreads();
    x = blockIdx.y * TILE + threadIdx.x;  // a column of `out` is a row of `in`
    y = blockIdx.x * TILE + threadIdx.y;
    for (int j = 0; j < TILE; j += ROWS_PER_PASS) {
        if (x < rows && y + j < cols) {
            out[(y + j) * rows + x] = tile[threadIdx.x][threadIdx.y + j];
        }
    }
}
"""


def test_tiled_transpose_through_padded_shared_tile(rng, to_device, to_host):
    """A 127x65 matrix transposed through a 32x33 shared tile, each thread moving 4 elements."""
    rows, cols = 127, 65
    x = rng.standard_normal((rows, cols), dtype=np.float32)
    out = to_device(np.zeros((cols, rows), dtype=np.float32))
    kernel = backend.RawKernel(TILED_TRANSPOSE, "tiled_transpose")
    kernel((blocks_for(cols, 32), blocks_for(rows, 32)), (32, 8), (to_device(x), out, np.int32(rows), np.int32(cols)))
    np.testing.assert_array_equal(to_host(out), x.T)


# ---------------------------------------------------------------------------------------------------------
# Dynamic shared memory
# ---------------------------------------------------------------------------------------------------------

ROTATE_DYNAMIC = r"""
extern "C" __global__ void rotate_each_block(const float* in, float* out, int n)
{
    extern __shared__ float buffer[];  // blockDim.x floats, sized at launch by shared_mem
    int start = blockIdx.x * blockDim.x;
    int count = min((int)blockDim.x, n - start);
    int t = threadIdx.x;
    if (t < count) {
        buffer[t] = in[start + t];
    }
    __syncthreads();
    if (t < count) {
        out[start + t] = buffer[(t + 1) % count];
    }
}
"""


def test_dynamic_shared_memory_sized_at_launch(rng, to_device, to_host):
    """`extern __shared__` memory of shared_mem bytes: each block rotates its slice left by one."""
    n, block = 1000, 160
    x = rng.standard_normal(n, dtype=np.float32)
    out = to_device(np.zeros(n, dtype=np.float32))
    kernel = backend.RawKernel(ROTATE_DYNAMIC, "rotate_each_block")
    kernel((blocks_for(n, block),), (block,), (to_device(x), out, np.int32(n)), shared_mem=block * 4)
    expected = np.concatenate([np.roll(x[s : s + block], -1) for s in range(0, n, block)])
    np.testing.assert_array_equal(to_host(out), expected)


ALIASED_EXTERN_SHARED = r"""
extern "C" __global__ void float_bits_through_shared(const float* in, int* bits, float* halves, int n)
{
    // Both names refer to the same dynamic shared memory: every `extern __shared__` array starts at its start.
    extern __shared__ float as_float[];
    extern __shared__ int as_int[];
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    int t = threadIdx.x;
    as_float[t] = (i < n) ? in[i] : 0.0f;
    __syncthreads();
    if (i < n) {
        bits[i] = as_int[t];
    }
    // A second region placed after the first, by pointer arithmetic on the same memory.
    float* second = as_float + blockDim.x;
    second[t] = 0.5f * as_float[blockDim.x - 1 - t];
    __syncthreads();
    if (i < n) {
        halves[i] = second[blockDim.x - 1 - t];
    }
}
"""


def test_two_extern_shared_declarations_alias_the_same_memory(rng, to_device, to_host):
    """`extern __shared__ float a[]` and `extern __shared__ int b[]` share one buffer; offsets carve out a second region."""
    n, block = 300, 64
    x = rng.standard_normal(n, dtype=np.float32)
    bits = to_device(np.zeros(n, dtype=np.int32))
    halves = to_device(np.zeros(n, dtype=np.float32))
    kernel = backend.RawKernel(ALIASED_EXTERN_SHARED, "float_bits_through_shared")
    kernel((blocks_for(n, block),), (block,), (to_device(x), bits, halves, np.int32(n)), shared_mem=2 * block * 4)
    np.testing.assert_array_equal(to_host(bits), x.view(np.int32))
    np.testing.assert_array_equal(to_host(halves), 0.5 * x)


BIG_DYNAMIC_SHARED = r"""
extern "C" __global__ void sum_of_big_shared(const float* in, float* out, int count)
{
    extern __shared__ float big[];  // `count` floats, more than 48 KiB
    for (int j = threadIdx.x; j < count; j += blockDim.x) {
        big[j] = in[j];
    }
    __syncthreads();
    // each thread adds up the slice it did NOT load, to make sure everything was shared
    float acc = 0.0f;
    for (int j = (threadIdx.x + 1) % blockDim.x; j < count; j += blockDim.x) {
        acc += big[j];
    }
    out[threadIdx.x] = acc;
}
"""


def test_dynamic_shared_memory_beyond_48_kib_after_raising_the_limit(rng, to_device, to_host):
    """With max_dynamic_shared_size_bytes raised, a block can use 96 KiB of dynamic shared memory."""
    count, block = 24 * 1024, 128  # 96 KiB of floats
    x = rng.random(count, dtype=np.float32)
    out = to_device(np.zeros(block, dtype=np.float32))
    kernel = backend.RawKernel(BIG_DYNAMIC_SHARED, "sum_of_big_shared")
    kernel.max_dynamic_shared_size_bytes = count * 4
    kernel((1,), (block,), (to_device(x), out, np.int32(count)), shared_mem=count * 4)
    x64 = x.astype(np.float64)
    expected = [x64[(t + 1) % block :: block].sum() for t in range(block)]
    np.testing.assert_allclose(to_host(out), expected, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------
# Warp shuffles and warp votes (32-lane warps)
# ---------------------------------------------------------------------------------------------------------

SHUFFLES = r"""
extern "C" __global__ void shfl_idx(const int* in, int* out, int lane_multiplier, int lane_offset, int width)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    int lane = threadIdx.x % 32;
    out[i] = __shfl_sync(0xffffffff, in[i], lane * lane_multiplier + lane_offset, width);
}

extern "C" __global__ void shfl_xor(const int* in, int* out, int lane_mask, int width)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    out[i] = __shfl_xor_sync(0xffffffff, in[i], lane_mask, width);
}

extern "C" __global__ void shfl_down(const int* in, int* out, unsigned int delta, int width)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    out[i] = __shfl_down_sync(0xffffffff, in[i], delta, width);
}

extern "C" __global__ void shfl_up(const int* in, int* out, unsigned int delta, int width)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    out[i] = __shfl_up_sync(0xffffffff, in[i], delta, width);
}

extern "C" __global__ void shfl_float(const float* in, float* out)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    out[i] = __shfl_sync(0xffffffff, in[i], 31 - threadIdx.x % 32);
}
"""

SHUFFLE_THREADS = 2 * 96  # 2 blocks of 3 warps


@pytest.fixture(scope="module")
def shuffles():
    """The module of shuffle kernels, and the values each thread holds (distinct, so the source lane is visible)."""
    module = backend.RawModule(code=SHUFFLES)
    values = (np.arange(SHUFFLE_THREADS, dtype=np.int32) * 7 + 3)
    return module, values


def lanes():
    """Each thread's global index, its lane, and the index of its warp's lane 0."""
    i = np.arange(SHUFFLE_THREADS)
    lane = i % 32
    return i, lane, i - lane


def run_shuffle(shuffles, name, *scalars):
    module, values = shuffles
    inp = backend.xp.asarray(values)
    out = backend.xp.asarray(np.full(SHUFFLE_THREADS, -1, dtype=np.int32))
    module.get_function(name)((2,), (96,), (inp, out, *scalars))
    backend.synchronize()
    return values, backend.asnumpy(out)


@pytest.mark.parametrize("multiplier, offset, width", [(0, 0, 32), (0, 17, 32), (3, 5, 32), (1, 1, 32), (5, 2, 8), (1, 3, 16), (2, 0, 4)])
def test_shfl_sync_reads_lane_modulo_width(shuffles, multiplier, offset, width):
    """__shfl_sync(mask, v, src, width) reads lane src % width of the thread's own width-lane segment."""
    values, got = run_shuffle(shuffles, "shfl_idx", np.int32(multiplier), np.int32(offset), np.int32(width))
    i, lane, warp_start = lanes()
    segment_start = warp_start + (lane // width) * width
    source = segment_start + (lane * multiplier + offset) % width
    np.testing.assert_array_equal(got, values[source])


@pytest.mark.parametrize("mask, width", [(1, 32), (16, 32), (31, 32), (1, 8), (5, 8), (3, 4), (8, 16)])
def test_shfl_xor_sync_exchanges_with_lane_xor_mask(shuffles, mask, width):
    """__shfl_xor_sync(mask, v, m, width) reads lane (lane ^ m) of the same segment (the butterfly pattern)."""
    values, got = run_shuffle(shuffles, "shfl_xor", np.int32(mask), np.int32(width))
    i, lane, warp_start = lanes()
    np.testing.assert_array_equal(got, values[warp_start + (lane ^ mask)])


@pytest.mark.parametrize("delta, width", [(1, 32), (5, 32), (16, 32), (31, 32), (1, 8), (3, 8), (2, 4), (4, 16)])
def test_shfl_down_sync_keeps_own_value_past_segment_end(shuffles, delta, width):
    """__shfl_down_sync reads lane + delta; a lane whose source would leave its segment keeps its own value."""
    values, got = run_shuffle(shuffles, "shfl_down", np.uint32(delta), np.int32(width))
    i, lane, warp_start = lanes()
    inside = (lane % width) + delta < width
    expected = np.where(inside, values[np.minimum(i + delta, SHUFFLE_THREADS - 1)], values)
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("delta, width", [(1, 32), (5, 32), (16, 32), (31, 32), (1, 8), (3, 8), (2, 4), (4, 16)])
def test_shfl_up_sync_keeps_own_value_before_segment_start(shuffles, delta, width):
    """__shfl_up_sync reads lane - delta; a lane whose source would be before its segment keeps its own value."""
    values, got = run_shuffle(shuffles, "shfl_up", np.uint32(delta), np.int32(width))
    i, lane, warp_start = lanes()
    inside = (lane % width) >= delta
    expected = np.where(inside, values[np.maximum(i - delta, 0)], values)
    np.testing.assert_array_equal(got, expected)


def test_shfl_sync_moves_floats_unchanged(shuffles, rng):
    """A float goes through a shuffle bit for bit (here each warp is reversed)."""
    module, _ = shuffles
    x = rng.standard_normal(SHUFFLE_THREADS, dtype=np.float32)
    out = backend.xp.asarray(np.zeros(SHUFFLE_THREADS, dtype=np.float32))
    module.get_function("shfl_float")((2,), (96,), (backend.xp.asarray(x), out))
    expected = x.reshape(-1, 32)[:, ::-1].reshape(-1)
    np.testing.assert_array_equal(backend.asnumpy(out), expected)


WARP_REDUCTIONS = r"""
__device__ float warp_sum_down(float v)
{
    for (int offset = 16; offset > 0; offset /= 2) {
        v += __shfl_down_sync(0xffffffff, v, offset);
    }
    return v;  // the total is in lane 0
}

__device__ float warp_sum_xor(float v)
{
    for (int mask = 16; mask > 0; mask /= 2) {
        v += __shfl_xor_sync(0xffffffff, v, mask);
    }
    return v;  // every lane holds the total
}

// One sum per block: each warp reduces with shuffles, warp 0 reduces the warps' sums.
extern "C" __global__ void block_sum_with_shuffles(const float* x, float* partial, float* every_lane, int n)
{
    __shared__ float warp_sums[32];
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    int lane = threadIdx.x % 32;
    int warp = threadIdx.x / 32;
    float v = (i < n) ? x[i] : 0.0f;

    every_lane[blockIdx.x * blockDim.x + threadIdx.x] = warp_sum_xor(v);

    float s = warp_sum_down(v);
    if (lane == 0) {
        warp_sums[warp] = s;
    }
    __syncthreads();
    if (warp == 0) {
        int warps = blockDim.x / 32;
        float w = (lane < warps) ? warp_sums[lane] : 0.0f;
        w = warp_sum_down(w);
        if (lane == 0) {
            partial[blockIdx.x] = w;
        }
    }
}
"""


def test_warp_shuffle_reduction(rng, to_device, to_host):
    """Shuffle-down reductions give each block's sum; an xor butterfly leaves each warp's sum in all its lanes."""
    n, block = 10_007, 256
    blocks = blocks_for(n, block)
    x = rng.random(n, dtype=np.float32)
    partial = to_device(np.zeros(blocks, dtype=np.float32))
    every_lane = to_device(np.zeros(blocks * block, dtype=np.float32))
    kernel = backend.RawKernel(WARP_REDUCTIONS, "block_sum_with_shuffles")
    kernel((blocks,), (block,), (to_device(x), partial, every_lane, np.int32(n)))

    padded = np.zeros(blocks * block, dtype=np.float64)
    padded[:n] = x
    np.testing.assert_allclose(to_host(partial), padded.reshape(blocks, block).sum(axis=1), rtol=1e-5)
    warp_sums = padded.reshape(-1, 32).sum(axis=1)
    np.testing.assert_allclose(to_host(every_lane), np.repeat(warp_sums, 32), rtol=1e-5)


WARP_VOTES = r"""
extern "C" __global__ void warp_votes(const float* x, unsigned int* ballots, int* counts, int* any, int* all, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    int warp = i / 32;
    int positive = (i < n) && (x[i] > 0.0f);  // every lane takes part, also those past the end
    unsigned int ballot = __ballot_sync(0xffffffff, positive);
    int some = __any_sync(0xffffffff, positive);
    int every = __all_sync(0xffffffff, positive);
    if (threadIdx.x % 32 == 0) {
        ballots[warp] = ballot;
        counts[warp] = __popc(ballot);
        any[warp] = some;
        all[warp] = every;
    }
}
"""


def test_ballot_any_all_and_popc(rng, to_device, to_host):
    """__ballot_sync puts lane k's predicate in bit k; __popc counts the bits; __any_sync/__all_sync agree."""
    n, block = 1000, 128
    blocks = blocks_for(n, block)
    warps = blocks * block // 32
    x = rng.standard_normal(n).astype(np.float32)
    x[64:96] = np.abs(x[64:96]) + 1  # warp 2: all positive
    x[96:128] = -np.abs(x[96:128]) - 1  # warp 3: none positive
    outputs = [to_device(np.zeros(warps, dtype=dtype)) for dtype in (np.uint32, np.int32, np.int32, np.int32)]
    kernel = backend.RawKernel(WARP_VOTES, "warp_votes")
    kernel((blocks,), (block,), (to_device(x), *outputs, np.int32(n)))
    ballots, counts, any_, all_ = (to_host(o) for o in outputs)

    predicate = np.zeros(warps * 32, dtype=bool)
    predicate[:n] = x > 0
    bits = predicate.reshape(warps, 32)
    expected_ballots = (bits.astype(np.uint64) << np.arange(32, dtype=np.uint64)).sum(axis=1).astype(np.uint32)
    np.testing.assert_array_equal(ballots, expected_ballots)
    np.testing.assert_array_equal(counts, bits.sum(axis=1))
    np.testing.assert_array_equal(any_ != 0, bits.any(axis=1))
    np.testing.assert_array_equal(all_ != 0, bits.all(axis=1))
    assert all_[2] and not any_[3]  # the two planted warps really test both outcomes


POPC = r"""
extern "C" __global__ void count_bits(const unsigned int* x, int* out, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        out[i] = __popc(x[i]);
    }
}
"""


def test_popc_counts_set_bits(rng, to_device, to_host):
    """__popc(x) is the number of 1 bits of a 32-bit unsigned int."""
    x = rng.integers(0, 2**32, size=1000, dtype=np.uint64).astype(np.uint32)
    x[:3] = [0, 0xFFFFFFFF, 0x80000001]
    out = to_device(np.zeros(x.size, dtype=np.int32))
    backend.RawKernel(POPC, "count_bits")((blocks_for(x.size, 128),), (128,), (to_device(x), out, np.int32(x.size)))
    expected = np.unpackbits(x.view(np.uint8)).reshape(x.size, 32).sum(axis=1)
    np.testing.assert_array_equal(to_host(out), expected)


SYNCWARP = r"""
extern "C" __global__ void reverse_each_warp(const int* in, int* out)
{
    __shared__ int lanes[256];
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    int t = threadIdx.x;
    int warp_start = t - t % 32;
    lanes[t] = in[i];
    __syncwarp();  // the warp's 32 writes are visible to the whole warp
    out[i] = lanes[warp_start + 31 - t % 32];
}
"""


def test_syncwarp_orders_shared_memory_within_a_warp(to_device, to_host):
    """After __syncwarp() each lane reads what the mirror lane of its warp wrote to shared memory."""
    values = np.arange(3 * 128, dtype=np.int32) * 3 + 1
    out = to_device(np.zeros_like(values))
    backend.RawKernel(SYNCWARP, "reverse_each_warp")((3,), (128,), (to_device(values), out))
    np.testing.assert_array_equal(to_host(out), values.reshape(-1, 32)[:, ::-1].reshape(-1))


# ---------------------------------------------------------------------------------------------------------
# Atomics
# ---------------------------------------------------------------------------------------------------------

ATOMICS = r"""
extern "C" __global__ void histogram(const int* values, int* counts, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        atomicAdd(&counts[values[i]], 1);
    }
}

// atomicAdd returns the old value: each thread takes a distinct ticket.
extern "C" __global__ void take_tickets(int* next_ticket, int* ticket_of, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        ticket_of[i] = atomicAdd(next_ticket, 1);
    }
}

extern "C" __global__ void float_sums(const float* x, float* sums, int buckets, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        atomicAdd(&sums[i % buckets], x[i]);
    }
}

extern "C" __global__ void bucket_max(const int* values, int* maxima, int buckets, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        atomicMax(&maxima[i % buckets], values[i]);
    }
}

// The first thread to reach a bucket claims it; atomicCAS returns the value it found.
extern "C" __global__ void claim_buckets(const int* bucket_of, int* owner, int* won, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        int previous = atomicCAS(&owner[bucket_of[i]], -1, i);
        won[i] = (previous == -1);
    }
}

// A float maximum built from atomicCAS on the float's bits (the usual compare-and-swap loop).
__device__ float atomic_max_float(float* address, float value)
{
    int* address_as_int = (int*)address;
    int old = *address_as_int;
    int assumed;
    do {
        assumed = old;
        float larger = fmaxf(value, __int_as_float(assumed));
        old = atomicCAS(address_as_int, assumed, __float_as_int(larger));
    } while (assumed != old);
    return __int_as_float(old);
}

extern "C" __global__ void float_max(const float* x, float* result, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        atomic_max_float(result, x[i]);
    }
}
"""


@pytest.fixture(scope="module")
def atomics():
    return backend.RawModule(code=ATOMICS)


def test_atomic_add_int_histogram(atomics, rng, to_device, to_host):
    """Many blocks add 1 to 50 shared counters with atomicAdd; no increment is lost."""
    n = 100_003
    values = rng.integers(0, 50, size=n, dtype=np.int32)
    counts = to_device(np.zeros(50, dtype=np.int32))
    atomics.get_function("histogram")((blocks_for(n, 256),), (256,), (to_device(values), counts, np.int32(n)))
    np.testing.assert_array_equal(to_host(counts), np.bincount(values, minlength=50))


def test_atomic_add_returns_the_old_value(atomics, to_device, to_host):
    """atomicAdd(counter, 1) hands each of 10 000 threads a different ticket: 0, 1, ..., 9999 in some order."""
    n = 10_000
    next_ticket = to_device(np.zeros(1, dtype=np.int32))
    ticket_of = to_device(np.full(n, -1, dtype=np.int32))
    atomics.get_function("take_tickets")((blocks_for(n, 128),), (128,), (next_ticket, ticket_of, np.int32(n)))
    np.testing.assert_array_equal(np.sort(to_host(ticket_of)), np.arange(n))
    assert to_host(next_ticket)[0] == n


def test_atomic_add_float_under_contention(atomics, rng, to_device, to_host):
    """200 003 threads in 782 blocks atomically add floats into 16 sums (order varies, so compare with a tolerance)."""
    n, buckets = 200_003, 16
    x = rng.random(n, dtype=np.float32)
    sums = to_device(np.zeros(buckets, dtype=np.float32))
    atomics.get_function("float_sums")((blocks_for(n, 256),), (256,), (to_device(x), sums, np.int32(buckets), np.int32(n)))
    expected = np.bincount(np.arange(n) % buckets, weights=x.astype(np.float64), minlength=buckets)
    np.testing.assert_allclose(to_host(sums), expected, rtol=1e-4)


def test_atomic_max_int(atomics, rng, to_device, to_host):
    """atomicMax keeps the largest of many (also negative) ints in each of 7 buckets."""
    n, buckets = 50_001, 7
    values = rng.integers(-(2**31), 2**31 - 1, size=n, dtype=np.int64).astype(np.int32)
    maxima = to_device(np.full(buckets, np.iinfo(np.int32).min, dtype=np.int32))
    atomics.get_function("bucket_max")((blocks_for(n, 128),), (128,), (to_device(values), maxima, np.int32(buckets), np.int32(n)))
    expected = [values[b::buckets].max() for b in range(buckets)]
    np.testing.assert_array_equal(to_host(maxima), expected)


def test_atomic_cas_lets_exactly_one_thread_claim_each_bucket(atomics, rng, to_device, to_host):
    """atomicCAS(owner, -1, i) succeeds for one thread per bucket, and the bucket records that thread."""
    n, buckets = 20_000, 37
    bucket_of = rng.integers(0, buckets, size=n, dtype=np.int32)
    owner = to_device(np.full(buckets, -1, dtype=np.int32))
    won = to_device(np.zeros(n, dtype=np.int32))
    atomics.get_function("claim_buckets")((blocks_for(n, 256),), (256,), (to_device(bucket_of), owner, won, np.int32(n)))
    owner, won = to_host(owner), to_host(won).astype(bool)

    winners = np.flatnonzero(won)
    assert sorted(bucket_of[winners]) == list(range(buckets))  # one winner per bucket
    np.testing.assert_array_equal(owner[bucket_of[winners]], winners)


def test_atomic_cas_loop_builds_a_float_maximum(atomics, rng, to_device, to_host):
    """A compare-and-swap loop on a float's bits (__float_as_int/__int_as_float) finds the maximum of 100 003 floats."""
    n = 100_003
    x = rng.standard_normal(n, dtype=np.float32)
    result = to_device(np.full(1, -np.inf, dtype=np.float32))
    atomics.get_function("float_max")((blocks_for(n, 256),), (256,), (to_device(x), result, np.int32(n)))
    assert to_host(result)[0] == x.max()


VECTOR_ATOMICS = r"""
// Thread i adds the four floats x[4i .. 4i + 3] into bucket i % buckets of float4 sums, and two of them into
// a bucket of float2 sums: atomicAdd on float4 and float2 (compute capability 9.0 and later).
extern "C" __global__ void vector_sums(float* sums4, float* sums2, const float* x, int buckets, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float4 value = reinterpret_cast<const float4*>(x)[i];
        atomicAdd(reinterpret_cast<float4*>(sums4) + i % buckets, value);
        atomicAdd(reinterpret_cast<float2*>(sums2) + i % buckets, make_float2(value.x, value.w));
    }
}

// One thread: the old contents come back, element by element.
extern "C" __global__ void vector_old_values(float* old4, float* old2, float* sums4, float* sums2)
{
    float4 previous4 = atomicAdd(reinterpret_cast<float4*>(sums4), make_float4(10.0f, 20.0f, 30.0f, 40.0f));
    float2 previous2 = atomicAdd(reinterpret_cast<float2*>(sums2), make_float2(50.0f, 60.0f));
    old4[0] = previous4.x; old4[1] = previous4.y; old4[2] = previous4.z; old4[3] = previous4.w;
    old2[0] = previous2.x; old2[1] = previous2.y;
}
"""


@pytest.fixture(scope="module")
def vector_atomics():
    if backend.name == "cuda" and int(backend.xp.cuda.Device().compute_capability) < 90:
        pytest.skip("atomicAdd on float2 and float4 needs compute capability 9.0 (Hopper) or later")
    return backend.RawModule(code=VECTOR_ATOMICS)


def test_atomic_add_float4_and_float2_under_contention(vector_atomics, rng, to_device, to_host):
    """50 003 threads add float4s (and float2s) into 13 buckets: every element of every term is counted."""
    n, buckets = 50_003, 13
    x = rng.random((n, 4), dtype=np.float32)
    sums4, sums2 = to_device(np.zeros((buckets, 4), np.float32)), to_device(np.zeros((buckets, 2), np.float32))
    vector_atomics.get_function("vector_sums")((blocks_for(n, 256),), (256,),
                                               (sums4, sums2, to_device(x), np.int32(buckets), np.int32(n)))
    expected = np.zeros((buckets, 4))
    np.add.at(expected, np.arange(n) % buckets, x.astype(np.float64))
    np.testing.assert_allclose(to_host(sums4), expected, rtol=1e-4)
    np.testing.assert_allclose(to_host(sums2), expected[:, [0, 3]], rtol=1e-4)


def test_atomic_add_float4_returns_the_old_values(vector_atomics, to_device, to_host):
    """The float4 and float2 atomicAdd return what the memory held before, and leave the sums."""
    sums4, sums2 = to_device(np.array([1, 2, 3, 4], np.float32)), to_device(np.array([5, 6], np.float32))
    old4, old2 = to_device(np.zeros(4, np.float32)), to_device(np.zeros(2, np.float32))
    vector_atomics.get_function("vector_old_values")((1,), (1,), (old4, old2, sums4, sums2))
    np.testing.assert_array_equal(to_host(old4), [1, 2, 3, 4])
    np.testing.assert_array_equal(to_host(old2), [5, 6])
    np.testing.assert_array_equal(to_host(sums4), [11, 22, 33, 44])
    np.testing.assert_array_equal(to_host(sums2), [55, 66])


# ---------------------------------------------------------------------------------------------------------
# Vector types
# ---------------------------------------------------------------------------------------------------------

VECTOR_TYPES = r"""
// Four floats per thread: one 16-byte load, one 16-byte store.
extern "C" __global__ void scale_shift_float4(const float* x, float* out, float scale, int n4)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n4) {
        float4 v = reinterpret_cast<const float4*>(x)[i];
        float4 r = make_float4(v.x * scale, v.y * scale + 1.0f, v.z * scale + 2.0f, v.w * scale + 3.0f);
        reinterpret_cast<float4*>(out)[i] = r;
    }
}

// Complex numbers as float2 (x = real part, y = imaginary part).
extern "C" __global__ void complex_multiply(const float2* a, const float2* b, float2* out, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float2 p = a[i];
        float2 q = b[i];
        out[i] = make_float2(p.x * q.x - p.y * q.y, p.x * q.y + p.y * q.x);
    }
}
"""


def test_float4_vector_loads_and_make_float4(rng, to_device, to_host):
    """reinterpret_cast<const float4*> loads four floats at once; make_float4 builds the result."""
    n4 = 1001
    x = rng.standard_normal(4 * n4, dtype=np.float32)
    out = to_device(np.zeros_like(x))
    kernel = backend.RawModule(code=VECTOR_TYPES).get_function("scale_shift_float4")
    kernel((blocks_for(n4, 128),), (128,), (to_device(x), out, np.float32(0.5), np.int32(n4)))
    expected = (x.reshape(n4, 4) * np.float32(0.5) + np.arange(4, dtype=np.float32)).reshape(-1)
    np.testing.assert_allclose(to_host(out), expected, rtol=1e-6, atol=1e-6)


def test_float2_arguments_as_complex_numbers(rng, to_device, to_host):
    """float2* parameters take float32 arrays of (real, imaginary) pairs; make_float2 builds the product."""
    n = 777
    a = rng.standard_normal(2 * n, dtype=np.float32)
    b = rng.standard_normal(2 * n, dtype=np.float32)
    out = to_device(np.zeros(2 * n, dtype=np.float32))
    kernel = backend.RawModule(code=VECTOR_TYPES).get_function("complex_multiply")
    kernel((blocks_for(n, 128),), (128,), (to_device(a), to_device(b), out, np.int32(n)))
    za = a.astype(np.float64).view(np.complex128)
    zb = b.astype(np.float64).view(np.complex128)
    np.testing.assert_allclose(to_host(out).astype(np.float64).view(np.complex128), za * zb, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------
# CUDA math functions against float64 numpy
# ---------------------------------------------------------------------------------------------------------

MATH = r"""
// Row f of `out` holds math function f applied to each thread's inputs.
extern "C" __global__ void math_functions(const float* x, const float* positive, const float* y, float* out, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) {
        return;
    }
    float a = x[i];         // in [-8, 8]
    float p = positive[i];  // in [0.01, 100]
    float b = y[i];         // in [-3, 3]
    int row = 0;
    out[row++ * n + i] = expf(a);
    out[row++ * n + i] = __expf(a);
    out[row++ * n + i] = tanhf(a);
    out[row++ * n + i] = erff(a);
    out[row++ * n + i] = rsqrtf(p);
    out[row++ * n + i] = __fdividef(a, p);
    out[row++ * n + i] = logf(p);
    out[row++ * n + i] = sqrtf(p);
    out[row++ * n + i] = powf(p, b);
    out[row++ * n + i] = fmaxf(a, b);
    out[row++ * n + i] = fminf(a, b);
    out[row++ * n + i] = fabsf(a);
}
"""

MATH_FUNCTIONS = ["expf", "__expf", "tanhf", "erff", "rsqrtf", "__fdividef", "logf", "sqrtf", "powf", "fmaxf", "fminf", "fabsf"]


@pytest.fixture(scope="module")
def math_results():
    """Inputs (float32) and every function's outputs, computed once for the whole module."""
    n = 4099
    rng = np.random.default_rng(7)
    x = rng.uniform(-8, 8, n).astype(np.float32)
    x[:4] = [0.0, -0.0, 1.0, -1.0]
    positive = np.exp(rng.uniform(np.log(0.01), np.log(100), n)).astype(np.float32)
    y = rng.uniform(-3, 3, n).astype(np.float32)
    xp = backend.xp
    out = xp.asarray(np.zeros(len(MATH_FUNCTIONS) * n, dtype=np.float32))
    kernel = backend.RawKernel(MATH, "math_functions")
    kernel((blocks_for(n, 128),), (128,), (xp.asarray(x), xp.asarray(positive), xp.asarray(y), out, np.int32(n)))
    results = dict(zip(MATH_FUNCTIONS, backend.asnumpy(out).reshape(len(MATH_FUNCTIONS), n)))
    return (x, positive, y), results


def erf64(values):
    return np.array([math.erf(v) for v in values])


@pytest.mark.parametrize(
    "function, reference, rtol, atol",
    [
        ("expf", lambda a, p, b: np.exp(a), 1e-6, 0),
        ("__expf", lambda a, p, b: np.exp(a), 2e-5, 0),  # the fast intrinsic: a few more ulp
        ("tanhf", lambda a, p, b: np.tanh(a), 1e-6, 1e-6),
        ("erff", lambda a, p, b: erf64(a), 1e-6, 1e-6),
        ("rsqrtf", lambda a, p, b: 1 / np.sqrt(p), 1e-6, 0),
        ("__fdividef", lambda a, p, b: a / p, 1e-6, 1e-7),
        ("logf", lambda a, p, b: np.log(p), 1e-6, 1e-6),
        ("sqrtf", lambda a, p, b: np.sqrt(p), 2e-7, 0),  # correctly rounded
        ("powf", lambda a, p, b: p**b, 2e-6, 0),
    ],
)
def test_math_function_matches_float64_numpy(math_results, function, reference, rtol, atol):
    """A CUDA single-precision math function agrees with numpy's float64 result within a few ulp."""
    inputs, results = math_results
    a, p, b = (v.astype(np.float64) for v in inputs)
    np.testing.assert_allclose(results[function], reference(a, p, b), rtol=rtol, atol=atol)


@pytest.mark.parametrize(
    "function, reference",
    [
        ("fmaxf", lambda a, p, b: np.fmax(a, b)),
        ("fminf", lambda a, p, b: np.fmin(a, b)),
        ("fabsf", lambda a, p, b: np.abs(a)),
    ],
)
def test_exact_float_functions(math_results, function, reference):
    """fmaxf, fminf and fabsf are exact."""
    inputs, results = math_results
    np.testing.assert_array_equal(results[function], reference(*inputs))


BIT_CASTS = r"""
extern "C" __global__ void bit_casts(const float* x, int* bits, float* negated, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        int b = __float_as_int(x[i]);
        bits[i] = b;
        negated[i] = __int_as_float(b ^ 0x80000000);  // flipping the sign bit negates the float
    }
}
"""


def test_float_as_int_and_int_as_float_reinterpret_the_bits(rng, to_device, to_host):
    """__float_as_int gives the IEEE bits of a float (numpy's .view(np.int32)); __int_as_float goes back."""
    x = rng.standard_normal(1000).astype(np.float32)
    x[:4] = [0.0, 1.0, -2.5, np.inf]
    bits = to_device(np.zeros(x.size, dtype=np.int32))
    negated = to_device(np.zeros(x.size, dtype=np.float32))
    backend.RawKernel(BIT_CASTS, "bit_casts")((blocks_for(x.size, 128),), (128,), (to_device(x), bits, negated, np.int32(x.size)))
    np.testing.assert_array_equal(to_host(bits), x.view(np.int32))
    np.testing.assert_array_equal(to_host(negated), -x)


# ---------------------------------------------------------------------------------------------------------
# Qualifiers, helpers, templates, modules
# ---------------------------------------------------------------------------------------------------------

GELU = r"""
#define GELU_SCALING_FACTOR 0.7978845608f  // sqrt(2 / pi)

__device__ __forceinline__ float cube(float x)
{
    return x * x * x;
}

__device__ float gelu(float x)
{
    return 0.5f * x * (1.0f + tanhf(GELU_SCALING_FACTOR * (x + 0.044715f * cube(x))));
}

// Each thread handles 4 consecutive elements; the loop is unrolled and the loads go through __ldg.
extern "C" __global__ void __launch_bounds__(128) gelu_forward(float* __restrict__ out, const float* __restrict__ inp, int n)
{
    int base = 4 * (blockIdx.x * blockDim.x + threadIdx.x);
    #pragma unroll
    for (int k = 0; k < 4; k++) {
        int i = base + k;
        if (i < n) {
            out[i] = gelu(__ldg(&inp[i]));
        }
    }
}
"""


def test_device_helpers_forceinline_restrict_launch_bounds_ldg_and_unroll(rng, to_device, to_host):
    """GPT-2's tanh GELU written with __device__/__forceinline__ helpers, __restrict__, __launch_bounds__, __ldg and #pragma unroll."""
    n = 10_001
    x = (3 * rng.standard_normal(n)).astype(np.float32)
    out = to_device(np.zeros(n, dtype=np.float32))
    kernel = backend.RawKernel(GELU, "gelu_forward")
    kernel((blocks_for(n, 4 * 128),), (128,), (out, to_device(x), np.int32(n)))
    x64 = x.astype(np.float64)
    expected = 0.5 * x64 * (1 + np.tanh(np.sqrt(2 / np.pi) * (x64 + 0.044715 * x64**3)))
    np.testing.assert_allclose(to_host(out), expected, rtol=1e-5, atol=1e-5)


TEMPLATES = r"""
template <typename T, int N>
__global__ void sum_groups(const T* x, T* out, int groups)
{
    int g = blockIdx.x * blockDim.x + threadIdx.x;
    if (g < groups) {
        T acc = 0;
        #pragma unroll
        for (int k = 0; k < N; k++) {
            acc += x[g * N + k];
        }
        out[g] = acc;
    }
}
"""


@pytest.mark.parametrize("dtype, ctype, group", [(np.float32, "float", 4), (np.float64, "double", 3)])
def test_template_kernels_through_name_expressions(dtype, ctype, group, rng, to_device, to_host):
    """A template<typename T, int N> kernel instantiated for float and double through name_expressions."""
    name = f"sum_groups<{ctype}, {group}>"
    module = backend.RawModule(code=TEMPLATES, name_expressions=[name])
    groups = 1001
    x = rng.standard_normal(groups * group).astype(dtype)
    out = to_device(np.zeros(groups, dtype=dtype))
    module.get_function(name)((blocks_for(groups, 128),), (128,), (to_device(x), out, np.int32(groups)))
    expected = x.astype(np.float64).reshape(groups, group).sum(axis=1)
    if dtype == np.float32:
        np.testing.assert_allclose(to_host(out), expected, rtol=1e-6, atol=1e-5)
    else:
        np.testing.assert_allclose(to_host(out), expected, rtol=1e-14, atol=1e-14)


def test_one_module_with_both_template_instantiations(rng, to_device, to_host):
    """One RawModule holds several instantiations of the same template at once."""
    names = ["sum_groups<float, 2>", "sum_groups<double, 5>"]
    module = backend.RawModule(code=TEMPLATES, name_expressions=names)
    x32 = rng.standard_normal(2 * 50).astype(np.float32)
    x64 = rng.standard_normal(5 * 50)
    out32 = to_device(np.zeros(50, dtype=np.float32))
    out64 = to_device(np.zeros(50, dtype=np.float64))
    module.get_function(names[0])((1,), (64,), (to_device(x32), out32, np.int32(50)))
    module.get_function(names[1])((1,), (64,), (to_device(x64), out64, np.int32(50)))
    np.testing.assert_allclose(to_host(out32), x32.astype(np.float64).reshape(50, 2).sum(axis=1), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(to_host(out64), x64.reshape(50, 5).sum(axis=1), rtol=1e-14, atol=1e-14)


EXTERN_C_MODULE = r"""
__device__ int twice(int v) { return 2 * v; }

extern "C" __global__ void doubled(const int* x, int* out, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = twice(x[i]);
}

extern "C" {

__global__ void negated(const int* x, int* out, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = -x[i];
}

}
"""


def test_extern_c_kernels_are_found_by_their_plain_names(to_device, to_host):
    """extern "C" kernels (one declared alone, one inside an extern "C" { } block) are looked up by name."""
    module = backend.RawModule(code=EXTERN_C_MODULE)
    x = np.arange(-50, 50, dtype=np.int32)
    doubled = to_device(np.zeros_like(x))
    negated = to_device(np.zeros_like(x))
    module.get_function("doubled")((2,), (64,), (to_device(x), doubled, np.int32(x.size)))
    module.get_function("negated")((2,), (64,), (to_device(x), negated, np.int32(x.size)))
    np.testing.assert_array_equal(to_host(doubled), 2 * x)
    np.testing.assert_array_equal(to_host(negated), -x)


def test_raw_kernel_with_compile_options(to_device, to_host):
    """Options such as -D reach the compiler (NVRTC on a GPU, g++ on the CPU)."""
    code = r"""
    extern "C" __global__ void fill(int* out) { out[threadIdx.x] = FILL_VALUE; }
    """
    out = to_device(np.zeros(8, dtype=np.int32))
    backend.RawKernel(code, "fill", options=("-DFILL_VALUE=42",))((1,), (8,), (out,))
    np.testing.assert_array_equal(to_host(out), np.full(8, 42))


NESTED_LAUNCH_BOUNDS = r"""
#define GROUPS 8
#define THREADS_FOR(ROWS) ((ROWS) / 4 * GROUPS)

// __launch_bounds__ whose arguments nest parentheses three deep once the macro is expanded.
template <int ROWS>
__global__ void __launch_bounds__(THREADS_FOR(ROWS), (ROWS == 64 ? 3 : 2)) scale_rows(float* out, const float* x, int n)
{
    int i = blockIdx.x * THREADS_FOR(ROWS) + threadIdx.x;
    if (i < n) out[i] = (float)ROWS * x[i];
}
"""


@pytest.mark.parametrize("rows", [64, 128])
def test_launch_bounds_with_nested_parentheses_from_a_macro(rows, rng, to_device, to_host):
    """A template kernel whose __launch_bounds__ arguments are a macro with parentheses inside parentheses."""
    name = f"scale_rows<{rows}>"
    kernel = backend.RawModule(code=NESTED_LAUNCH_BOUNDS, name_expressions=[name]).get_function(name)
    n, threads = 1000, rows // 4 * 8
    x = rng.standard_normal(n).astype(np.float32)
    out = to_device(np.zeros(n, dtype=np.float32))
    kernel((blocks_for(n, threads),), (threads,), (out, to_device(x), np.int32(n)))
    np.testing.assert_array_equal(to_host(out), np.float32(rows) * x)
