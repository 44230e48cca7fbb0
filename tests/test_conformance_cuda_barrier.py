"""Conformance of libcu++'s asynchronous copies as CuPy's headers offer them: <cuda/barrier> (cuda::barrier in shared
memory, cuda::memcpy_async by a whole block or by one thread) and <cuda/pipeline> (a thread's own pipeline).

Each kernel stages tiles of its input through shared memory with these, and the results are compared with numpy,
under the bounds and race checks where they exist: a thread that reads the tile after the barrier's wait (or the
pipeline's consumer_wait) reads what every thread copied. What the CPU executor leaves out is refused when the
kernel is compiled, naming the header and what to use instead.
"""

import numpy as np
import pytest

from gpt2_cupy import backend

BLOCK_COPY = r"""
#include <cuda/barrier>
#include <cooperative_groups.h>
namespace cg = cooperative_groups;
// (NVRTC warns that a __shared__ cuda::barrier is not constructed; init() is what sets it up, as CUDA's guide says)
#pragma nv_diag_suppress static_var_with_dynamic_init

// Each block sums its tiles of TILE floats: the whole block copies a tile into shared memory with memcpy_async,
// all arrive and wait on a block-scoped barrier, then each thread reads the tile. The barrier is used again for
// every tile (one phase each), and once more before the tile is overwritten.
#define TILE 256
extern "C" __global__ void tile_sums(float* out, const float* x, int tiles_per_block)
{
    __shared__ float tile[TILE];
    __shared__ cuda::barrier<cuda::thread_scope_block> ready;
    cg::thread_block block = cg::this_thread_block();
    if (block.thread_rank() == 0) init(&ready, block.size());
    block.sync();
    float sum = 0.0f;
    for (int t = 0; t < tiles_per_block; ++t) {
        const float* source = x + ((size_t)blockIdx.x * tiles_per_block + t) * TILE;
        cuda::memcpy_async(block, tile, source, cuda::aligned_size_t<16>(sizeof(float) * TILE), ready);
        ready.arrive_and_wait();
        for (int i = threadIdx.x; i < TILE; i += blockDim.x) sum += tile[i] * (i % 3 + 1);
        auto token = ready.arrive();  // every thread is done with the tile before the next copy
        ready.wait(static_cast<decltype(token)&&>(token));
    }
    out[blockIdx.x * blockDim.x + threadIdx.x] = sum;
}

// One thread's own copy against the block's barrier: each thread copies its float4 of the tile.
extern "C" __global__ void own_copies(float* out, const float* x)
{
    __shared__ __align__(16) float tile[4 * 64];
    __shared__ cuda::barrier<cuda::thread_scope_block> ready;
    if (threadIdx.x == 0) init(&ready, blockDim.x);
    __syncthreads();
    cuda::memcpy_async(tile + 4 * threadIdx.x, x + 4 * threadIdx.x, sizeof(float4), ready);
    ready.arrive_and_wait();
    const int other = (threadIdx.x + 1) % blockDim.x;  // another thread's copy
    out[threadIdx.x] = tile[4 * other] + tile[4 * other + 3];
}
"""

THREAD_PIPELINE = r"""
#include <cuda/pipeline>

// Each thread double-buffers its float4s through its own pipeline: copy the next while adding up the current.
extern "C" __global__ void pipelined_sums(float* out, const float* x, int steps)
{
    __shared__ __align__(16) float buffers[2][64 * 4];
    cuda::pipeline<cuda::thread_scope_thread> pipe = cuda::make_pipeline();
    const int me = threadIdx.x;
    const float* mine = x + (size_t)me * 4;
    pipe.producer_acquire();
    cuda::memcpy_async(&buffers[0][4 * me], mine, sizeof(float4), pipe);
    pipe.producer_commit();
    float sum = 0.0f;
    for (int s = 0; s < steps; ++s) {
        if (s + 1 < steps) {
            pipe.producer_acquire();
            cuda::memcpy_async(&buffers[(s + 1) % 2][4 * me], mine + (size_t)(s + 1) * 64 * 4, sizeof(float4), pipe);
            pipe.producer_commit();
        }
        cuda::pipeline_consumer_wait_prior<1>(pipe);
        if (s + 1 == steps) pipe.consumer_wait();
        const float* current = &buffers[s % 2][4 * me];
        sum += current[0] + 2 * current[1] + 3 * current[2] + 4 * current[3];
        pipe.consumer_release();
    }
    out[me] = sum;
}
"""


@pytest.mark.parametrize("threads", [64, 128])
def test_a_block_copies_tiles_with_memcpy_async_and_a_barrier(threads, rng, to_device, to_host):
    blocks, tiles = 3, 4
    x = rng.integers(-8, 9, blocks * tiles * 256).astype(np.float32)  # small integers: every sum is exact
    kernel = backend.RawModule(code=BLOCK_COPY).get_function("tile_sums")
    out = to_device(np.zeros(blocks * threads, np.float32))
    with backend.checks(bounds=True, races=True):
        kernel((blocks,), (threads,), (out, to_device(x), np.int32(tiles)))
    weighted = x.reshape(blocks, tiles, 256) * (np.arange(256) % 3 + 1)
    per_thread = weighted.reshape(blocks, tiles, 256 // threads, threads).sum(axis=(1, 2))
    assert to_host(out).reshape(blocks, threads).tolist() == per_thread.tolist()


def test_each_thread_copies_its_own_part_against_the_blocks_barrier(to_device, to_host):
    x = np.arange(4 * 64, dtype=np.float32)
    kernel = backend.RawModule(code=BLOCK_COPY).get_function("own_copies")
    out = to_device(np.zeros(64, np.float32))
    with backend.checks(bounds=True, races=True):
        kernel((1,), (64,), (out, to_device(x)))
    other = (np.arange(64) + 1) % 64
    assert to_host(out).tolist() == (x[4 * other] + x[4 * other + 3]).tolist()


def test_a_threads_own_pipeline_double_buffers_its_copies(rng, to_device, to_host):
    steps = 5
    x = rng.integers(-8, 9, steps * 64 * 4).astype(np.float32)
    kernel = backend.RawModule(code=THREAD_PIPELINE).get_function("pipelined_sums")
    out = to_device(np.zeros(64, np.float32))
    with backend.checks(bounds=True, races=True):
        kernel((1,), (64,), (out, to_device(x), np.int32(steps)))
    expected = (x.reshape(steps, 64, 4) * np.array([1, 2, 3, 4])).sum(axis=(0, 2))
    assert to_host(out).tolist() == expected.tolist()


@pytest.mark.cpu_only
@pytest.mark.parametrize("declaration, message", [
    ("__shared__ cuda::pipeline_shared_state<cuda::thread_scope_block, 2> state;",
     r"not on the CPU executor: <cuda/pipeline>'s cuda::pipeline_shared_state.*Use cuda::barrier"),
    ("__shared__ cuda::barrier<cuda::thread_scope_device> across;",
     r"not on the CPU executor: <cuda/barrier> with another scope than cuda::thread_scope_block"),
])
def test_what_the_executor_leaves_out_is_refused_at_compile_time(declaration, message):
    from gpt2_cupy.cpu import CompileError
    code = "#include <cuda/pipeline>\nextern \"C\" __global__ void uses(float* out)\n{\n    " + declaration + \
           "\n    out[0] = sizeof(" + declaration.split()[-1].rstrip(";") + ");\n}\n"
    with pytest.raises(CompileError, match=message):
        backend.RawModule(code=code).get_function("uses")
