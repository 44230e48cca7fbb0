"""Conformance of cooperative groups beyond warp tiles: `cg::thread_group` as every group's base class,
`coalesced_threads()` inside divergent code, `binary_partition` and `labeled_partition`, tiles of more
than a warp (with and without `block_tile_memory`), `cg::reduce` over them, and kernels in the style of
NVIDIA's samples (a two-level `shfl_scan`, reductions through `thread_group`).

Like tests/test_conformance.py, every test runs on the active backend: on a GPU it checks the kernels and
the numpy references against CUDA itself, on the CPU that the executor behaves as CUDA does.
"""

import numpy as np
import pytest

from gpt2_cupy import backend

HEADERS = r"""
#include <cooperative_groups.h>
#include <cooperative_groups/reduce.h>
namespace cg = cooperative_groups;
"""


def launch(code, name, grid, block, *arguments):
    backend.RawKernel(HEADERS + code, name)(grid, block, arguments)


def ranks_among(selected):
    """For each True in `selected` (along its last axis), how many Trues come before it: its rank; -1 elsewhere."""
    return np.where(selected, np.cumsum(selected, axis=-1) - 1, -1)


# ---------------------------------------------------------------------------------------------------------
# thread_group: one function serves a block, a tile and a coalesced group
# ---------------------------------------------------------------------------------------------------------

# The sum of the group's values through shared memory, halving each step, as the CUDA Programming Guide
# writes it for any thread_group (taken by value) - and its size and the caller's rank, by reference.
THREAD_GROUP_SUM = r"""
__device__ int sum_through_shared(cg::thread_group group, int* scratch, int value)
{
    int rank = group.thread_rank();
    for (int half = group.size() / 2; half > 0; half /= 2) {
        scratch[rank] = value;
        group.sync();
        if (rank < half) value += scratch[rank + half];
        group.sync();
    }
    return value;  // rank 0 holds the sum
}

__device__ int describe(const cg::thread_group& group) { return 1000 * (int)group.size() + (int)group.thread_rank(); }

extern "C" __global__ void group_sums(int* sums, int* descriptions, const int* values)
{
    __shared__ int scratch[256];
    cg::thread_block block = cg::this_thread_block();
    cg::thread_block_tile<32> warp = cg::tiled_partition<32>(block);
    cg::thread_group quad = cg::tiled_partition(warp, 4);          // tiles of a size known at run time
    int t = block.thread_rank();
    int value = values[blockIdx.x * block.size() + t];

    int block_sum = sum_through_shared(block, scratch, value);
    block.sync();
    int warp_sum = sum_through_shared(warp, scratch + 32 * warp.meta_group_rank(), value);
    int quad_sum = sum_through_shared(quad, scratch + 4 * (t / 4), value);
    int* mine = sums + 3 * (blockIdx.x * block.size() + t);
    mine[0] = block_sum;
    mine[1] = warp_sum;
    mine[2] = quad_sum;
    int* described = descriptions + 4 * (blockIdx.x * block.size() + t);
    described[0] = describe(block);
    described[1] = describe(warp);
    described[2] = describe(quad);
    described[3] = -1;
    if (t % 4 != 1) described[3] = describe(cg::coalesced_threads());  // three lanes of every four
}
"""


def test_thread_group_takes_a_block_a_tile_and_a_run_time_tile(rng, to_device, to_host):
    """sync(), size() and thread_rank() through `cg::thread_group` for four kinds of group (CUDA 13 declares
    num_threads() there without defining it: NVRTC refuses the call, and so does the executor)."""
    blocks, threads = 3, 256
    values = rng.integers(-100, 100, blocks * threads).astype(np.int32)
    sums = to_device(np.zeros(blocks * threads * 3, np.int32))
    descriptions = to_device(np.zeros(blocks * threads * 4, np.int32))
    launch(THREAD_GROUP_SUM, "group_sums", (blocks,), (threads,), sums, descriptions, to_device(values))
    got = to_host(sums).reshape(blocks, threads, 3)
    described = to_host(descriptions).reshape(blocks, threads, 4)
    v = values.reshape(blocks, threads)
    np.testing.assert_array_equal(got[:, 0, 0], v.sum(axis=1))
    np.testing.assert_array_equal(got[:, ::32, 1], v.reshape(blocks, -1, 32).sum(axis=2))
    np.testing.assert_array_equal(got[:, ::4, 2], v.reshape(blocks, -1, 4).sum(axis=2))
    t = np.arange(threads)
    np.testing.assert_array_equal(described[:, :, 0], np.broadcast_to(256_000 + t, (blocks, threads)))
    np.testing.assert_array_equal(described[:, :, 1], np.broadcast_to(32_000 + t % 32, (blocks, threads)))
    np.testing.assert_array_equal(described[:, :, 2], np.broadcast_to(4_000 + t % 4, (blocks, threads)))
    # The coalesced group of the lanes that took the branch: 24 of each warp, ranked among themselves.
    taken = t % 4 != 1
    rank = ranks_among(taken.reshape(-1, 32)).reshape(-1)
    np.testing.assert_array_equal(described[:, :, 3], np.broadcast_to(np.where(taken, 24_000 + rank, -1), (blocks, threads)))


# ---------------------------------------------------------------------------------------------------------
# coalesced_threads() inside divergent code
# ---------------------------------------------------------------------------------------------------------

# Stream compaction with one atomicAdd per warp, as NVIDIA's "warp-aggregated atomics" write it: the lanes
# whose value passes take a coalesced group; its rank 0 reserves room for all of them, and each writes
# at the reserved start plus its rank.
COMPACTION = r"""
__device__ int reserve_slot(int* counter)
{
    cg::coalesced_group active = cg::coalesced_threads();
    int start;
    if (active.thread_rank() == 0) start = atomicAdd(counter, (int)active.size());
    return active.shfl(start, 0) + active.thread_rank();
}

extern "C" __global__ void keep_positive(int* kept, int* counter, int* group_facts, const int* values, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    int value = values[i];
    if (value > 0) {
        kept[reserve_slot(counter)] = value;
        cg::coalesced_group active = cg::coalesced_threads();
        int* facts = group_facts + 8 * i;
        facts[0] = active.size();
        facts[1] = active.thread_rank();
        facts[2] = active.shfl_down(value, 1);         // the last rank keeps its own
        facts[3] = active.shfl_up(value, 2);           // the first two ranks keep their own
        facts[4] = (int)active.ballot(value % 2 == 0); // bit k: the group's thread of rank k
        facts[5] = active.any(value > 90) + 10 * active.all(value > 3);
        facts[6] = cg::reduce(active, value, cg::plus<int>());
        facts[7] = active.meta_group_rank() + 10 * active.meta_group_size();
        active.sync();
    }
}
"""


def test_coalesced_threads_in_divergent_code(rng, to_device, to_host):
    """The lanes that took the branch form the group: its size, ranks, shuffles, votes and reduce; and
    warp-aggregated atomics compact the positive values (in an order the atomics decide; compared sorted)."""
    n, threads = 1000, 128  # the last warp is partial: 1000 = 7 * 128 + 104
    values = rng.integers(-100, 100, n).astype(np.int32)
    kept = to_device(np.zeros(n, np.int32))
    counter = to_device(np.zeros(1, np.int32))
    facts = to_device(np.full(8 * n, -7, np.int32))
    launch(COMPACTION, "keep_positive", ((n + threads - 1) // threads,), (threads,), kept, counter, facts,
           to_device(values), np.int32(n))
    positive = values > 0
    count = int(to_host(counter)[0])
    assert count == positive.sum()
    np.testing.assert_array_equal(np.sort(to_host(kept)[:count]), np.sort(values[positive]))

    got = to_host(facts).reshape(n, 8)
    for warp_start in range(0, n, 32):
        lanes = np.arange(warp_start, min(warp_start + 32, n))
        members = lanes[positive[lanes]]
        v = values[members]
        size = len(members)
        rank = np.arange(size)
        np.testing.assert_array_equal(got[members, 0], size)
        np.testing.assert_array_equal(got[members, 1], rank)
        np.testing.assert_array_equal(got[members, 2], np.where(rank + 1 < size, np.roll(v, -1), v))
        np.testing.assert_array_equal(got[members, 3], np.where(rank >= 2, np.roll(v, 2), v))
        even_bits = int(sum(1 << k for k in range(size) if v[k] % 2 == 0))
        np.testing.assert_array_equal(got[members, 4].view(np.uint32), np.uint32(even_bits))
        np.testing.assert_array_equal(got[members, 5], int((v > 90).any()) + 10 * int((v > 3).all()))
        np.testing.assert_array_equal(got[members, 6], v.sum())
        np.testing.assert_array_equal(got[members, 7], 0 + 10 * 1)
        assert (got[lanes[~positive[lanes]]] == -7).all()


# ---------------------------------------------------------------------------------------------------------
# binary_partition and labeled_partition
# ---------------------------------------------------------------------------------------------------------

PARTITIONS = r"""
extern "C" __global__ void partitions(int* out, const int* values)
{
    cg::thread_block block = cg::this_thread_block();
    cg::thread_block_tile<32> warp = cg::tiled_partition<32>(block);
    int t = block.thread_rank();
    int value = values[blockIdx.x * block.size() + t];
    int* mine = out + 9 * (blockIdx.x * block.size() + t);

    cg::coalesced_group parity = cg::binary_partition(warp, value % 2 != 0);
    mine[0] = parity.size();
    mine[1] = parity.thread_rank();
    mine[2] = parity.meta_group_rank() + 10 * parity.meta_group_size();
    mine[3] = cg::reduce(parity, value, cg::plus<int>());

    cg::coalesced_group bucket = cg::labeled_partition(warp, value % 5);
    mine[4] = bucket.size();
    mine[5] = bucket.thread_rank();
    mine[6] = bucket.meta_group_size();
    mine[7] = cg::reduce(bucket, value, cg::greater<int>());

    // A partition of a coalesced group: the lanes below 20 of the even-indexed threads, split by sign.
    if (t % 2 == 0 && warp.thread_rank() < 20) {
        cg::coalesced_group sign = cg::binary_partition(cg::coalesced_threads(), value < 0);
        mine[8] = 1000 * (int)sign.size() + (int)sign.thread_rank();
    } else {
        mine[8] = -1;
    }
}
"""


def test_binary_and_labeled_partitions(rng, to_device, to_host):
    """Parity and remainder-by-5 partitions of each warp (and a sign partition of a coalesced group): sizes,
    ranks, meta groups and a reduce within each partition."""
    blocks, threads = 2, 96
    values = rng.integers(-50, 50, blocks * threads).astype(np.int32)
    values[:32] = 2 * values[:32]  # the first warp all even: one partition, of rank 0 among 1
    out = to_device(np.zeros(blocks * threads * 9, np.int32))
    launch(PARTITIONS, "partitions", (blocks,), (threads,), out, to_device(values))
    got = to_host(out).reshape(-1, 9)
    for warp_start in range(0, blocks * threads, 32):
        v = values[warp_start:warp_start + 32]
        g = got[warp_start:warp_start + 32]
        odd = v % 2 != 0
        remainder = np.fmod(v, 5)  # C's %: negative for a negative value
        split = odd.any() and not odd.all()
        for lane in range(32):
            same = odd == odd[lane]
            assert g[lane, 0] == same.sum()
            assert g[lane, 1] == same[:lane].sum()
            assert g[lane, 2] == (int(odd[lane]) + 20 if split else 10)
            assert g[lane, 3] == v[same].sum()
            bucket = remainder == remainder[lane]
            assert g[lane, 4] == bucket.sum()
            assert g[lane, 5] == bucket[:lane].sum()
            assert g[lane, 6] == len(np.unique(remainder))
            assert g[lane, 7] == v[bucket].max()
        in_branch = (np.arange(32) % 2 == 0) & (np.arange(32) < 20)
        for lane in range(32):
            if not in_branch[lane]:
                assert g[lane, 8] == -1
                continue
            same_sign = in_branch & ((v < 0) == (v[lane] < 0))
            assert g[lane, 8] == 1000 * same_sign.sum() + same_sign[:lane].sum()


# ---------------------------------------------------------------------------------------------------------
# Tiles larger than a warp
# ---------------------------------------------------------------------------------------------------------

# Each thread writes its value to shared memory, the tile synchronises, and each reads the value of the
# thread at the mirrored rank of its tile: without a barrier over the tile's warps it would read stale
# data. Then the tile's first thread's value by shfl, a vote and cg::reduce over the whole tile.
LARGE_TILES = r"""
template <unsigned int Size>
__device__ void mirror(const cg::thread_block& block, int* shared, int value, int* out)
{
    cg::thread_block_tile<Size> tile = cg::tiled_partition<Size>(block);
    int t = block.thread_rank();
    shared[t] = value;
    tile.sync();
    int first_of_tile = t - tile.thread_rank();
    out[0] = shared[first_of_tile + Size - 1 - tile.thread_rank()];
    out[1] = tile.thread_rank() + 10000 * tile.meta_group_rank() + 1000000 * tile.meta_group_size();
    out[2] = (int)tile.num_threads();
    out[3] = tile.shfl(value, 3);
    out[4] = tile.any(value == 7) + 10 * tile.all(value >= 0);
    out[5] = cg::reduce(tile, value, cg::plus<int>());
    tile.sync();  // every thread of the tile has read `shared` before the next size writes it
}

__device__ void every_size(const cg::thread_block& block, int* out, const int* values)
{
    __shared__ int shared[512];
    int t = block.thread_rank();
    int value = values[blockIdx.x * block.size() + t];
    int* mine = out + 3 * 6 * (blockIdx.x * block.size() + t);
    mirror<64>(block, shared, value, mine);
    mirror<128>(block, shared, value, mine + 6);
    mirror<256>(block, shared, value, mine + 12);
}

extern "C" __global__ void large_tiles(int* out, const int* values)
{
    every_size(cg::this_thread_block(), out, values);
}

// The same with the scratch memory older GPUs need: on compute capability 8.0 and later it goes unused.
extern "C" __global__ void large_tiles_with_tile_memory(int* out, const int* values)
{
    __shared__ cg::block_tile_memory<512> tile_memory;
    every_size(cg::this_thread_block(tile_memory), out, values);
}
"""


@pytest.mark.parametrize("kernel", ["large_tiles", "large_tiles_with_tile_memory"])
def test_tiles_of_64_128_and_256_threads(kernel, rng, to_device, to_host):
    """tiled_partition<64/128/256>(block): sync() over the tile's warps, ranks, meta groups, shfl, any/all and
    cg::reduce, in blocks of 512 threads."""
    blocks, threads = 2, 512
    values = rng.integers(0, 1000, blocks * threads).astype(np.int32)
    values[70] = 7    # any(value == 7) holds in the tiles holding thread 70 of block 0
    values[600] = -1  # all(value >= 0) fails in the tiles holding thread 88 of block 1
    out = to_device(np.zeros(blocks * threads * 18, np.int32))
    launch(LARGE_TILES, kernel, (blocks,), (threads,), out, to_device(values))
    got = to_host(out).reshape(blocks, threads, 3, 6)
    t = np.arange(threads)
    for b in range(blocks):
        v = values[b * threads:(b + 1) * threads]
        for which, size in enumerate((64, 128, 256)):
            tiles = v.reshape(-1, size)
            g = got[b, :, which]
            np.testing.assert_array_equal(g[:, 0], tiles[:, ::-1].reshape(-1))
            np.testing.assert_array_equal(g[:, 1], t % size + 10000 * (t // size) + 1000000 * (threads // size))
            np.testing.assert_array_equal(g[:, 2], size)
            np.testing.assert_array_equal(g[:, 3], np.repeat(tiles[:, 3], size))
            votes = (tiles == 7).any(axis=1).astype(int) + 10 * (tiles >= 0).all(axis=1)
            np.testing.assert_array_equal(g[:, 4], np.repeat(votes, size))
            np.testing.assert_array_equal(g[:, 5], np.repeat(tiles.sum(axis=1), size))


# ---------------------------------------------------------------------------------------------------------
# Kernels in the style of NVIDIA's samples
# ---------------------------------------------------------------------------------------------------------

# shfl_scan: an inclusive scan within each warp with __shfl_up_sync, the warps' totals scanned by the first
# warp through shared memory, then added back: a block-wide inclusive prefix sum.
SHFL_SCAN = r"""
extern "C" __global__ void block_inclusive_scan(int* out, const int* values, int* block_totals, int n)
{
    extern __shared__ int warp_totals[];
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    int lane = threadIdx.x % warpSize, warp = threadIdx.x / warpSize;
    int value = i < n ? values[i] : 0;
    for (int offset = 1; offset < warpSize; offset *= 2) {
        int below = __shfl_up_sync(0xffffffff, value, offset);
        if (lane >= offset) value += below;
    }
    if (lane == warpSize - 1) warp_totals[warp] = value;
    __syncthreads();
    if (warp == 0) {
        int warps = blockDim.x / warpSize;
        int total = lane < warps ? warp_totals[lane] : 0;
        for (int offset = 1; offset < warps; offset *= 2) {
            int below = __shfl_up_sync(0xffffffff, total, offset);
            if (lane >= offset) total += below;
        }
        if (lane < warps) warp_totals[lane] = total;
    }
    __syncthreads();
    if (warp > 0) value += warp_totals[warp - 1];
    if (i < n) out[i] = value;
    if (block_totals != nullptr && threadIdx.x == blockDim.x - 1) block_totals[blockIdx.x] = value;
}
"""


@pytest.mark.parametrize("with_totals", [True, False])
def test_shfl_scan_block_prefix_sums(with_totals, rng, to_device, to_host):
    """A block-wide inclusive scan from warp scans (__shfl_up_sync), as NVIDIA's shfl_scan sample computes
    it; the blocks' totals are an optional output (a null pointer when not wanted)."""
    n, threads = 3000, 256
    blocks = (n + threads - 1) // threads
    values = rng.integers(-1000, 1000, n).astype(np.int32)
    out = to_device(np.zeros(n, np.int32))
    totals = to_device(np.zeros(blocks, np.int32)) if with_totals else 0
    kernel = backend.RawKernel(SHFL_SCAN, "block_inclusive_scan")
    kernel((blocks,), (threads,), (out, to_device(values), totals, np.int32(n)), shared_mem=threads // 32 * 4)
    padded = np.zeros(blocks * threads, np.int64)
    padded[:n] = values
    expected = np.cumsum(padded.reshape(blocks, threads), axis=1)
    np.testing.assert_array_equal(to_host(out), expected.reshape(-1)[:n])
    if with_totals:
        np.testing.assert_array_equal(to_host(totals), expected[:, -1])


# A reduction in the style of the samples' reduce kernels with cooperative groups: each thread sums a
# grid-strided slice, the block reduces through a function taking any thread_group (shared memory and
# sync()), and the first warp's coalesced lanes finish the per-block partial sums of the warps.
SAMPLES_REDUCE = r"""
__device__ float reduce_in_shared(const cg::thread_group& group, float* scratch, float value)
{
    const unsigned int rank = group.thread_rank();
    scratch[rank] = value;
    group.sync();
    for (unsigned int half = group.size() / 2; half >= 32; half /= 2) {
        if (rank < half) scratch[rank] = value = value + scratch[rank + half];
        group.sync();
    }
    return value;  // ranks below 32 hold partial sums of 1/32 of the group each
}

extern "C" __global__ void sum_blocks(float* block_sums, const float* x, int n)
{
    extern __shared__ float scratch[];
    cg::thread_block block = cg::this_thread_block();
    float value = 0.0f;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) value += x[i];
    value = reduce_in_shared(block, scratch, value);
    if (block.thread_rank() < 32) {
        cg::coalesced_group first_warp = cg::coalesced_threads();
        value = cg::reduce(first_warp, value, cg::plus<float>());
        if (first_warp.thread_rank() == 0) block_sums[blockIdx.x] = value;
    }
}
"""


def test_samples_style_reduction_through_thread_group_and_coalesced_threads(rng, to_device, to_host):
    """A reduction of 100 000 floats over 8 blocks of 256: a thread_group function, then a coalesced group."""
    n, blocks, threads = 100_000, 8, 256
    x = rng.standard_normal(n).astype(np.float32)
    sums = to_device(np.zeros(blocks, np.float32))
    kernel = backend.RawKernel(HEADERS + SAMPLES_REDUCE, "sum_blocks")
    kernel((blocks,), (threads,), (sums, to_device(x), np.int32(n)), shared_mem=threads * 4)
    stride = blocks * threads
    padded = np.zeros(-(-n // stride) * stride, np.float64)
    padded[:n] = x
    expected = padded.reshape(-1, blocks, threads).sum(axis=(0, 2))
    np.testing.assert_allclose(to_host(sums), expected, rtol=1e-4, atol=1e-3)


# ---------------------------------------------------------------------------------------------------------
# What the executor refuses, as a GPU does
# ---------------------------------------------------------------------------------------------------------

RUN_TIME_TILE_OF_64 = r"""
extern "C" __global__ void too_large(int* out)
{
    cg::thread_group tile = cg::tiled_partition(cg::this_thread_block(), 64);
    out[threadIdx.x] = tile.thread_rank();
}
"""


@pytest.mark.cpu_only
def test_a_run_time_tile_larger_than_a_warp_is_refused_with_what_to_do(to_device):
    """tiled_partition(block, 64) aborts the kernel on a GPU; the executor says which sizes it takes."""
    with pytest.raises(Exception, match=r"tile_size of 1, 2, 4, 8, 16 or 32.*tiled_partition<N>\(block\)"):
        launch(RUN_TIME_TILE_OF_64, "too_large", (1,), (128,), to_device(np.zeros(128, np.int32)))
        backend.synchronize()


TILE_DEADLOCK = r"""
extern "C" __global__ void tile_waits_for_block(int* out)
{
    cg::thread_block block = cg::this_thread_block();
    cg::thread_block_tile<64> tile = cg::tiled_partition<64>(block);
    if (block.thread_rank() < 100) tile.sync();  // threads 100..127 of the second tile never come
    else block.sync();
    out[threadIdx.x] = 1;
}
"""


@pytest.mark.cpu_only
def test_a_tile_sync_that_waits_for_threads_at_syncthreads_is_a_deadlock(to_device):
    """A GPU hangs; the executor names a thread in the tile's sync() and one at __syncthreads()."""
    with pytest.raises(Exception, match=r"deadlock: thread \(\d+, 0, 0\) waits in a tile's sync\(\) .* at __syncthreads\(\)"):
        launch(TILE_DEADLOCK, "tile_waits_for_block", (1,), (128,), to_device(np.zeros(128, np.int32)))
        backend.synchronize()


@pytest.mark.cpu_only
def test_num_threads_through_a_thread_group_is_refused_as_nvrtc_refuses_it():
    from gpt2_cupy.cpu import CompileError

    code = ('#include <cooperative_groups.h>\nnamespace cg = cooperative_groups;\n'
            '__device__ int count(const cg::thread_group& g) { return (int)g.num_threads(); }\n'
            'extern "C" __global__ void k(int* out) { out[threadIdx.x] = count(cg::this_thread_block()); }\n')
    with pytest.raises(CompileError, match="num_threads"):
        backend.RawKernel(code, "k")((1,), (32,), (np.zeros(32, dtype=np.int32),))
