"""The race check finds what a GPU gets wrong silently, and only that.

With races=True the launch runs once more with every load, store and atomic of the kernel checked: two
threads that touch one place, at least one writing, with no barrier between them and not through an
atomic operation, race. A lost update (`count += 1` by many threads) is named as such, with the array
and element; results that differ only by the order of atomic operations are not races.
"""

import re

import numpy as np
import pytest

from gpt2_cupy import backend
from kernel_sources import SUM_LAST_BLOCK

pytestmark = pytest.mark.cpu_only

if backend.name == "cpu":
    from gpt2_cupy.cpu import RaceError, RawKernel


def launch_checked(code, name, grid, block, args):
    RawKernel(code, name)(grid, block, args, check_races=True)


COUNT_WITHOUT_ATOMIC = r"""
extern "C" __global__ void count_all(int* hist)
{
    hist[0] += 1;
}
"""


def test_a_count_without_atomic_is_a_read_modify_write_race_naming_the_array():
    with pytest.raises(RaceError) as caught:
        launch_checked(COUNT_WITHOUT_ATOMIC, "count_all", (1,), (256,), (np.zeros(1, dtype=np.int32),))
    message = str(caught.value)
    assert "read-modify-write race on 'hist' element 0" in message
    assert "atomicAdd" in message
    assert "__syncthreads" not in message  # the missing piece is an atomic, not a barrier


def test_a_histogram_of_plain_increments_across_blocks_is_a_race():
    """One thread per block adds to a shared bin: blocks are never ordered, so updates are lost on a GPU."""
    code = r"""
extern "C" __global__ void per_block_bins(int* bins)
{
    if (threadIdx.x == 0) bins[blockIdx.x % 4] += 1;
}
"""
    with pytest.raises(RaceError, match=r"read-modify-write race on 'bins' element [0-3]"):
        launch_checked(code, "per_block_bins", (16,), (32,), (np.zeros(4, dtype=np.int32),))


def test_a_shared_counter_without_atomic_is_a_race():
    code = r"""
extern "C" __global__ void shared_count(int* out)
{
    __shared__ int count;
    if (threadIdx.x == 0) count = 0;
    __syncthreads();
    count += 1;
    __syncthreads();
    if (threadIdx.x == 0) out[blockIdx.x] = count;
}
"""
    with pytest.raises(RaceError, match="read-modify-write race on shared memory"):
        launch_checked(code, "shared_count", (2,), (64,), (np.zeros(2, dtype=np.int32),))


def test_reading_another_warps_shared_value_without_a_barrier_blames_the_missing_barrier():
    code = r"""
extern "C" __global__ void rotate_through_shared(int* out)
{
    __shared__ int values[64];
    values[threadIdx.x] = threadIdx.x;
    out[threadIdx.x] = values[(threadIdx.x + 32) % 64];   // another warp's value: __syncthreads() missing
}
"""
    with pytest.raises(RaceError, match=r"race on shared memory.* (reads|writes) it and thread .* (reads|writes) it with no __syncthreads\(\)"):
        launch_checked(code, "rotate_through_shared", (1,), (64,), (np.zeros(64, dtype=np.int32),))


def test_a_warp_exchanging_through_shared_memory_after_syncwarp_is_not_a_race():
    code = r"""
extern "C" __global__ void swap_neighbours(int* out)
{
    __shared__ int values[64];
    values[threadIdx.x] = threadIdx.x;
    __syncwarp();
    out[threadIdx.x] = values[threadIdx.x ^ 1];
}
"""
    out = np.zeros(64, dtype=np.int32)
    launch_checked(code, "swap_neighbours", (1,), (64,), (out,))
    np.testing.assert_array_equal(out, np.arange(64) ^ 1)


def test_the_same_exchange_with_syncthreads_is_not_a_race():
    code = r"""
extern "C" __global__ void rotate_after_barrier(int* out)
{
    __shared__ int values[64];
    values[threadIdx.x] = threadIdx.x;
    __syncthreads();
    out[threadIdx.x] = values[(threadIdx.x + 32) % 64];
}
"""
    out = np.zeros(64, dtype=np.int32)
    launch_checked(code, "rotate_after_barrier", (1,), (64,), (out,))
    np.testing.assert_array_equal(out, (np.arange(64) + 32) % 64)


def test_a_warp_synchronised_by_a_narrower_mask_is_not_ordered_with_the_lanes_left_out():
    """Each half of the warp waits for its own half only: a lane reading the other half's value races."""
    code = r"""
extern "C" __global__ void swap_halves(int* out)
{
    __shared__ int values[32];
    values[threadIdx.x] = threadIdx.x;
    __syncwarp(threadIdx.x < 16 ? 0x0000ffffu : 0xffff0000u);
    out[threadIdx.x] = values[threadIdx.x ^ 16];   // a lane of the other half: not in this __syncwarp
}
"""
    with pytest.raises(RaceError, match=r"race on shared memory.* writes it and thread .* reads it"):
        launch_checked(code, "swap_halves", (1,), (32,), (np.zeros(32, dtype=np.int32),))


# ---- dynamic shared memory (extern __shared__) is checked like __shared__ arrays ----------------------

def test_a_shuffle_in_a_kernel_that_declares_dynamic_shared_memory_it_does_not_use_is_not_a_race():
    """No dynamic shared memory at all (shared_mem=0): declaring the array is still no race."""
    code = r"""
extern "C" __global__ void shuffle_beside_unused_shared(float* out, const float* x)
{
    extern __shared__ float unused[];
    float v = x[threadIdx.x];
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    out[threadIdx.x] = v;
}
"""
    x = np.arange(32, dtype=np.float32)
    out = np.zeros(32, dtype=np.float32)
    RawKernel(code, "shuffle_beside_unused_shared")((1,), (32,), (out, x), shared_mem=0, check_races=True)
    np.testing.assert_array_equal(out, x + x[np.arange(32) ^ 1])


def test_dynamic_shared_memory_written_then_read_across_syncthreads_is_not_a_race():
    code = r"""
extern "C" __global__ void swap_through_dynamic_shared(float* out)
{
    extern __shared__ float shared[];
    shared[threadIdx.x] = threadIdx.x;
    __syncthreads();
    out[threadIdx.x] = shared[threadIdx.x ^ 1];
}
"""
    out = np.zeros(64, dtype=np.float32)
    RawKernel(code, "swap_through_dynamic_shared")((1,), (64,), (out,), shared_mem=256, check_races=True)
    np.testing.assert_array_equal(out, np.arange(64) ^ 1)


def test_dynamic_shared_memory_read_from_another_warp_without_a_barrier_is_a_race():
    code = r"""
extern "C" __global__ void rotate_through_dynamic_shared(float* out)
{
    extern __shared__ float shared[];
    shared[threadIdx.x] = threadIdx.x;
    out[threadIdx.x] = shared[(threadIdx.x + 32) % 64];   // another warp's value: __syncthreads() missing
}
"""
    with pytest.raises(RaceError, match=r"race on shared memory.* (reads|writes) it and thread .* (reads|writes) it with no __syncthreads\(\)"):
        RawKernel(code, "rotate_through_dynamic_shared")((2,), (64,), (np.zeros(64, dtype=np.float32),),
                                                         shared_mem=256, check_races=True)


def test_a_lost_update_in_dynamic_shared_memory_is_a_race():
    code = r"""
extern "C" __global__ void count_in_dynamic_shared(int* out)
{
    extern __shared__ int count[];
    if (threadIdx.x == 0) count[0] = 0;
    __syncthreads();
    count[0] += 1;
    __syncthreads();
    if (threadIdx.x == 0) out[blockIdx.x] = count[0];
}
"""
    with pytest.raises(RaceError, match="read-modify-write race on shared memory"):
        RawKernel(code, "count_in_dynamic_shared")((2,), (64,), (np.zeros(2, dtype=np.int32),),
                                                   shared_mem=4, check_races=True)


def test_warp_sums_by_shuffles_in_many_warps_then_one_sum_through_dynamic_shared_memory_are_not_races():
    """Each warp sums its rows with shuffles; warp 0 adds the warps' sums after a barrier (a block reduction)."""
    code = r"""
extern "C" __global__ void sum_rows_by_warps(float* out, const float* x, int rows)
{
    extern __shared__ float warp_sums[];
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    float total = 0.0f;
    for (int row = warp; row < rows; row += warps) {
        float v = x[row * 32 + lane];
        for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
        total += v;
    }
    if (lane == 0) warp_sums[warp] = total;
    __syncthreads();
    if (warp == 0) {
        float v = lane < warps ? warp_sums[lane] : 0.0f;
        for (int offset = 16; offset > 0; offset /= 2) v += __shfl_down_sync(0xffffffffu, v, offset);
        if (lane == 0) out[blockIdx.x] = v;
    }
}
"""
    rows, threads, blocks = 40, 1024, 3
    x = np.ones(rows * 32, dtype=np.float32)
    out = np.zeros(blocks, dtype=np.float32)
    RawKernel(code, "sum_rows_by_warps")((blocks,), (threads,), (out, x, np.int32(rows)),
                                         shared_mem=threads // 32 * 4, check_races=True)
    np.testing.assert_array_equal(out, np.full(blocks, rows * 32, dtype=np.float32))


def test_float4_loads_of_an_array_whose_size_is_no_multiple_of_four_pass_both_checks():
    """The bounds check also runs the kernel on the array's bytes moved right against the guard, no longer
    16-byte aligned: a float4 load that faults only there is no finding (a GPU's arrays are aligned)."""
    code = r"""
extern "C" __global__ void double_by_float4(float* out, const float* x, int n)
{
    int i = 4 * (blockIdx.x * blockDim.x + threadIdx.x);
    if (i + 3 < n) {
        float4 v = reinterpret_cast<const float4*>(x)[i / 4];
        reinterpret_cast<float4*>(out)[i / 4] = make_float4(2 * v.x, 2 * v.y, 2 * v.z, 2 * v.w);
    } else {
        for (; i < n; ++i) out[i] = 2 * x[i];
    }
}
"""
    n = 10
    x = np.arange(n, dtype=np.float32)
    out = np.zeros(n, dtype=np.float32)
    RawKernel(code, "double_by_float4")((1,), (32,), (out, x, np.int32(n)), check_bounds=True, check_races=True)
    np.testing.assert_array_equal(out, 2 * x)


STREAM_COMPACTION = r"""
extern "C" __global__ void keep_positive(float* kept, int* count, const float* x, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n && x[i] > 0.0f) {
        kept[atomicAdd(count, 1)] = x[i];
    }
}
"""


def test_block_votes_are_not_races():
    """__syncthreads_count, _and and _or share a count among the block's threads inside the executor: that
    bookkeeping is the runtime's own, not the kernel's memory, and must not be reported."""
    code = r"""
extern "C" __global__ void votes(int* out, const int* x)
{
    int positive = x[threadIdx.x] > 0;
    int count = __syncthreads_count(positive);
    int all = __syncthreads_and(positive);
    int any = __syncthreads_or(positive);
    if (threadIdx.x == 0) { out[0] = count; out[1] = all; out[2] = any; }
}
"""
    x = np.where(np.arange(64) % 3 == 0, 1, -1).astype(np.int32)
    out = np.zeros(3, dtype=np.int32)
    launch_checked(code, "votes", (1,), (64,), (out, x))
    np.testing.assert_array_equal(out, [np.count_nonzero(x > 0), 0, 1])


def test_stream_compaction_through_atomic_slots_is_not_a_race(rng):
    """The order of the kept values depends on the order of the atomics: allowed, so no RaceError."""
    n = 3000
    x = rng.standard_normal(n).astype(np.float32)
    kept, count = np.zeros(n, dtype=np.float32), np.zeros(1, dtype=np.int32)
    launch_checked(STREAM_COMPACTION, "keep_positive", ((n + 255) // 256,), (256,), (kept, count, x, np.int32(n)))
    positive = np.sort(x[x > 0])
    assert count[0] == positive.size
    np.testing.assert_array_equal(np.sort(kept[: count[0]]), positive)


def test_a_float_atomic_sum_whose_terms_cancel_is_not_a_race():
    """Large terms that cancel make the sum depend on the order of the atomicAdds: still not a race."""
    code = r"""
extern "C" __global__ void atomic_total(float* total, const float* x, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) atomicAdd(total, x[i]);
}
"""
    x = np.concatenate([np.full(500, 1e7), np.full(500, -1e7), [0.5, 0.25]]).astype(np.float32)
    launch_checked(code, "atomic_total", (4,), (256,), (np.zeros(1, dtype=np.float32), x, np.int32(x.size)))


def test_a_spin_lock_built_from_atomics_is_not_a_race():
    code = r"""
extern "C" __global__ void locked_add(int* lock, int* total)
{
    if (threadIdx.x % 32 == 0) {
        while (atomicCAS(lock, 0, 1) != 0) { }
        atomicAdd(total, 1);
        atomicExch(lock, 0);
    }
}
"""
    total = np.zeros(1, dtype=np.int32)
    launch_checked(code, "locked_add", (4,), (128,), (np.zeros(1, dtype=np.int32), total))
    assert total[0] == 16


def test_where_the_checked_build_fails_the_check_compares_two_orders(monkeypatch):
    """A compiler without -fsanitize=thread: the race check falls back to comparing the outputs of two orders."""
    from gpt2_cupy.cpu import toolchain

    monkeypatch.setattr(toolchain, "race_check_flags", lambda: ("-fno-such-option-anywhere",))
    code = r"""
extern "C" __global__ void last_one_wins(int* winner)
{
    winner[0] = threadIdx.x + 1000 * 0;   // every thread writes: which one stays depends on the order
}
"""
    with pytest.raises(RaceError, match="'winner' differs"):
        launch_checked(code, "last_one_wins", (1,), (64,), (np.zeros(1, dtype=np.int32),))
    out = np.zeros(64, dtype=np.int32)
    launch_checked(r"""
extern "C" __global__ void own_slot(int* out) { out[threadIdx.x] = threadIdx.x + 1000 * 0; }
""", "own_slot", (1,), (64,), (out,))
    np.testing.assert_array_equal(out, np.arange(64))


# The "last block" pattern: each block writes a partial, calls __threadfence(), then takes a ticket with an
# atomic; the block that draws the last ticket reads every block's partial. Correct on a GPU: the fence
# makes the partial visible before the ticket counts it (kernel_sources.SUM_LAST_BLOCK, FENCE to be replaced).


def sum_last_block_arguments(blocks):
    x = np.arange(1, blocks + 1, dtype=np.float32)
    return (np.zeros(1, dtype=np.float32), np.zeros(blocks, dtype=np.float32), np.zeros(1, dtype=np.uint32), x)


def test_the_last_block_pattern_with_a_fence_is_not_a_race():
    total, partials, counter, x = arguments = sum_last_block_arguments(8)
    launch_checked(SUM_LAST_BLOCK.replace("FENCE", "__threadfence();"), "sum_last_block", (8,), (32,), arguments)
    assert total[0] == x.sum()
    assert counter[0] == 0


def test_the_last_block_pattern_without_a_fence_is_a_race_that_asks_for_one():
    with pytest.raises(RaceError) as caught:
        launch_checked(SUM_LAST_BLOCK.replace("FENCE", ""), "sum_last_block", (8,), (32,),
                       sum_last_block_arguments(8))
    message = str(caught.value)
    assert "race on 'partials' element" in message
    assert "__threadfence()" in message


def test_a_block_fence_does_not_publish_a_partial_to_other_blocks():
    """__threadfence_block() orders memory for the block's own threads only: the ticket may still overtake
    the partial."""
    with pytest.raises(RaceError, match="race on 'partials' element .*__threadfence\\(\\)"):
        launch_checked(SUM_LAST_BLOCK.replace("FENCE", "__threadfence_block();"), "sum_last_block", (8,), (32,),
                       sum_last_block_arguments(8))


def test_every_thread_of_the_last_block_reads_the_partials_after_the_barrier():
    """The ticket is taken by thread 0 and shared through shared memory and __syncthreads(); each thread of
    the last block then reads partials written (each by its own thread) in other blocks, which fenced, then
    met at a barrier before thread 0 took the ticket."""
    code = r"""
extern "C" __global__ void column_sums_last_block(float* sums, float* partials, unsigned int* counter,
                                                  const float* x, int columns)
{
    __shared__ bool last;
    int column = threadIdx.x;
    if (column < columns) partials[blockIdx.x * columns + column] = x[blockIdx.x * columns + column];
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicInc(counter, gridDim.x - 1) == gridDim.x - 1;
    __syncthreads();
    if (last && column < columns) {
        float sum = 0.0f;
        for (unsigned int b = 0; b < gridDim.x; ++b) sum += __ldcg(partials + b * columns + column);
        sums[column] = sum;
    }
}
"""
    blocks, columns = 6, 40
    x = np.arange(blocks * columns, dtype=np.float32).reshape(blocks, columns)
    sums, counter = np.zeros(columns, dtype=np.float32), np.zeros(1, dtype=np.uint32)
    launch_checked(code, "column_sums_last_block", (blocks,), (64,),
                   (sums, np.zeros(blocks * columns, dtype=np.float32), counter, x, np.int32(columns)))
    np.testing.assert_array_equal(sums, x.sum(axis=0))
    assert counter[0] == 0  # atomicInc wraps to zero at the last ticket


def test_a_fence_after_a_barrier_publishes_the_whole_block():
    """Every thread writes, __syncthreads(), then thread 0 alone fences and takes the ticket: a GPU's fence
    also publishes what the barrier showed thread 0."""
    code = r"""
extern "C" __global__ void copy_last_block(float* out, float* partials, unsigned int* counter, const float* x)
{
    __shared__ bool last;
    partials[blockIdx.x * blockDim.x + threadIdx.x] = x[blockIdx.x * blockDim.x + threadIdx.x];
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        last = atomicAdd(counter, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (last) {
        for (unsigned int b = 0; b < gridDim.x; ++b)
            out[b * blockDim.x + threadIdx.x] = __ldcg(partials + ((b + 1) % gridDim.x) * blockDim.x + threadIdx.x);
    }
}
"""
    x = np.arange(4 * 32, dtype=np.float32)
    out = np.zeros_like(x)
    launch_checked(code, "copy_last_block", (4,), (32,), (out, np.zeros_like(x), np.zeros(1, dtype=np.uint32), x))
    np.testing.assert_array_equal(out, np.roll(x, -32))


def test_a_block_that_reads_another_blocks_partial_without_any_atomic_is_a_race():
    """Every block fences and counts itself, but the reading thread (thread 1 of block 0) takes no ticket and
    meets no barrier after its block's: nothing tells it the partial is there yet."""
    code = r"""
extern "C" __global__ void read_neighbour(float* out, float* partials, unsigned int* counter, const float* x)
{
    if (threadIdx.x == 0) {
        partials[blockIdx.x] = x[blockIdx.x];
        __threadfence();
        atomicAdd(counter, 1u);
    }
    if (blockIdx.x == 0 && threadIdx.x == 1) out[0] = __ldcg(partials + 1);
}
"""
    with pytest.raises(RaceError, match="race on 'partials' element 1") as caught:
        launch_checked(code, "read_neighbour", (4,), (32,),
                       (np.zeros(1, dtype=np.float32), np.zeros(4, dtype=np.float32), np.zeros(1, dtype=np.uint32),
                        np.arange(4, dtype=np.float32)))
    assert "__threadfence" not in str(caught.value)  # a fence would not help: the reader has no ticket


def test_the_dyt_backward_last_block_sums_pass_the_race_check(rng):
    from gpt2_cupy.ops.dyt import dyt_backward

    rows, columns = 150, 72  # 3 blocks of rows per stripe of columns, 3 stripes (one partly empty)
    dout, x = (rng.standard_normal((rows, columns)).astype(np.float32) for _ in range(2))
    alpha = np.array([0.7], dtype=np.float32)
    weight = rng.standard_normal(columns).astype(np.float32)
    dalpha, dweight, dbias = np.zeros(1, np.float32), np.zeros(columns, np.float32), np.zeros(columns, np.float32)
    with backend.checks(races=True):
        dx = dyt_backward(dout, x, alpha, weight, dalpha=dalpha, dweight=dweight, dbias=dbias)
    squashed = np.tanh(0.7 * x.astype(np.float64))
    local = dout * (1 - squashed ** 2)
    np.testing.assert_allclose(dx, local * weight * 0.7, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dweight, (dout * squashed).sum(axis=0), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dbias, dout.sum(axis=0), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dalpha[0], (local * weight * x).sum(), rtol=1e-4, atol=1e-3)


# ---------------------------------------------------------------------------------------------------------
# A shuffle that reads a lane outside its mask, or one that has exited: undefined on a GPU
# ---------------------------------------------------------------------------------------------------------

WARP_SUM_WITH_MASK = r"""
extern "C" __global__ void warp_sum(float* out, const float* x, unsigned int mask, int first_offset, int width)
{
    float sum = x[blockIdx.x * blockDim.x + threadIdx.x];
    if ((mask >> (threadIdx.x % 32)) & 1u) {
        for (int offset = first_offset; offset > 0; offset /= 2) sum += __shfl_down_sync(mask, sum, offset, width);
    }
    out[blockIdx.x * blockDim.x + threadIdx.x] = sum;
}
"""


def warp_sum(threads, mask, first_offset, check_races, width=32):
    x = np.arange(threads, dtype=np.float32)
    out = np.zeros(threads, dtype=np.float32)
    arguments = (out, x, np.uint32(mask), np.int32(first_offset), np.int32(width))
    RawKernel(WARP_SUM_WITH_MASK, "warp_sum")((1,), (threads,), arguments, check_races=check_races)
    return out


def test_a_shuffle_reading_a_lane_outside_its_mask_is_reported_with_the_lane():
    """Lanes 0-15 shuffle down by 16 with a mask of lanes 0-15 and a width of 32: lane l reads lane l + 16."""
    with pytest.raises(RaceError) as caught:
        warp_sum(32, 0x0000FFFF, 16, check_races=True)
    message = str(caught.value)
    assert "kernel 'warp_sum'" in message and "block (0, 0, 0)" in message
    assert re.search(r"thread \((\d+), 0, 0\): a warp shuffle \(mask 0x0000ffff\) reads lane (\d+), which is not in the mask",
                     message)
    reader, source = map(int, re.search(r"thread \((\d+), 0, 0\).* reads lane (\d+)", message).groups())
    assert source == reader + 16


def test_a_shuffle_reading_past_a_short_last_warp_is_reported():
    """48 threads: the second warp has 16 lanes, and a full-mask shuffle down by 16 reads lanes that do not exist."""
    with pytest.raises(RaceError, match=r"thread \((3[2-9]|4[0-7]), 0, 0\).*reads lane (1[6-9]|2\d|3[01]), which has exited or does not exist"):
        warp_sum(48, 0xFFFFFFFF, 16, check_races=True)


def test_a_shuffle_inside_its_mask_is_not_reported():
    """Lanes 0-15 with a width of 16: a lane whose source lies past lane 15 gets its own value, as CUDA defines."""
    out = warp_sum(32, 0x0000FFFF, 8, check_races=True, width=16)
    assert out[0] == sum(range(16))


def test_without_the_check_an_absent_lane_gives_the_readers_own_value():
    """Undefined on a GPU; the executor stays deterministic: at the shuffle by 16 each of lanes 0-15 reads an
    absent lane and gets its own value back, doubling it; the rest of the sum is exact."""
    out = warp_sum(32, 0x0000FFFF, 16, check_races=False)
    assert out[0] == 2 * sum(range(16))


# ---------------------------------------------------------------------------------------------------------
# Bytes, not words: neighbouring threads that store a half, a bfloat16, a byte or a bool do not race
# ---------------------------------------------------------------------------------------------------------

SUB_WORD_STORES = r"""
#include <cuda_bf16.h>
extern "C" __global__ void bfloat16_residual(__nv_bfloat16* out, const __nv_bfloat16* a, const __nv_bfloat16* b, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = __float2bfloat16((float)a[i] + (float)b[i]);
}
extern "C" __global__ void byte_flags(unsigned char* flags, bool* odd, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        flags[i] = (unsigned char)(i * 3);
        odd[i] = i % 2;
    }
}
// Two threads to each byte: thread 2k and thread 2k + 1 both store to byte k.
extern "C" __global__ void two_threads_per_byte(unsigned char* bytes)
{
    bytes[threadIdx.x / 2] = (unsigned char)threadIdx.x;
}
// Each thread writes its byte, then reads its neighbour's with no barrier between.
extern "C" __global__ void read_neighbours_byte(unsigned char* out, const unsigned char* in)
{
    __shared__ unsigned char staged[64];
    staged[threadIdx.x] = in[threadIdx.x];
    out[threadIdx.x] = staged[(threadIdx.x + 1) % blockDim.x];
}
"""


def test_a_bfloat16_elementwise_kernel_has_no_race():
    n = 1000
    out = np.zeros(n, dtype=np.uint16)
    a = np.full(n, 0x3F80, dtype=np.uint16)  # 1.0
    RawKernel(SUB_WORD_STORES, "bfloat16_residual")((8,), (128,), (out, a, a.copy(), np.int32(n)), check_races=True)
    np.testing.assert_array_equal(out, np.full(n, 0x4000, dtype=np.uint16))  # 2.0


def test_bytes_and_bools_of_neighbouring_threads_have_no_race():
    n = 1000
    flags, odd = np.zeros(n, dtype=np.uint8), np.zeros(n, dtype=np.bool_)
    RawKernel(SUB_WORD_STORES, "byte_flags")((8,), (128,), (flags, odd, np.int32(n)), check_races=True)
    np.testing.assert_array_equal(flags, (np.arange(n) * 3).astype(np.uint8))
    np.testing.assert_array_equal(odd, np.arange(n) % 2 == 1)


def test_two_threads_storing_to_one_byte_race():
    with pytest.raises(RaceError, match=r"race on 'bytes' element \d+: .*both write it"):
        RawKernel(SUB_WORD_STORES, "two_threads_per_byte")((1,), (64,), (np.zeros(32, dtype=np.uint8),), check_races=True)


def test_every_distinct_race_of_a_launch_is_listed_up_to_ten_and_the_rest_counted():
    """64 threads each read a byte another thread writes, with no barrier: 64 places, 10 reported in full."""
    with pytest.raises(RaceError) as caught:
        RawKernel(SUB_WORD_STORES, "read_neighbours_byte")(
            (1,), (64,), (np.zeros(64, dtype=np.uint8), np.arange(64, dtype=np.uint8)), check_races=True)
    message = str(caught.value)
    assert "race on shared memory" in message
    assert "63 more race(s) in this launch:" in message
    assert len(re.findall(r"^  shared memory .*: a (write and a read|read and a write), thread", message, re.M)) == 9
    assert message.endswith("... and 54 more")


# Threads writing one place with nothing between them race only if their values can differ. CUDA's programming
# guide: where several threads of a warp write one location in one instruction, one write is performed, which
# one undefined; with one value, the result does not depend on it (llm.c's `shared_sum[warp_id] = warp_sum`,
# every lane holding the sum its shuffles gave it, "lane_id == 0 guard not needed").
SAME_VALUE_WRITES = r"""
extern "C" __global__ void warp_sums_stored_by_every_lane(float* out, const float* x)
{
    __shared__ float per_warp[32];
    float sum = x[threadIdx.x];
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffff, sum, offset);
    per_warp[threadIdx.x / 32] = sum;                       // every lane of the warp: the same value
    __syncthreads();
    if (threadIdx.x == 0) out[0] = per_warp[0] + per_warp[1];
}

extern "C" __global__ void one_flag_set_by_all(float* out)
{
    __shared__ float flag;
    flag = 1.0f;                                            // every thread of both warps: the same value
    __syncthreads();
    out[threadIdx.x] = flag;
}

extern "C" __global__ void same_value_then_ordered_change(float* out)
{
    __shared__ float flag;
    if (threadIdx.x < 2) flag = 1.0f;                       // lanes 0 and 1: the same value, unordered
    __syncwarp();
    if (threadIdx.x == 0) flag = 2.0f;                      // after the warp's sync: ordered after both
    __syncthreads();
    out[threadIdx.x] = flag;
}

extern "C" __global__ void lane_numbers_into_one_place(float* out)
{
    __shared__ float last;
    last = (float)threadIdx.x;                              // different values: which stays is not promised
    __syncthreads();
    out[threadIdx.x] = last;
}

extern "C" __global__ void copy_columns_stepping_by_one(float* out, const float* x, int columns)
{
    for (int c = threadIdx.x; c < columns; c += 1) out[c] = 2.0f * x[c];   // each column stored by many threads
}
"""


def test_every_lane_storing_the_warps_sum_is_not_a_race():
    x = np.arange(64, dtype=np.float32)
    out = np.zeros(1, dtype=np.float32)
    RawKernel(SAME_VALUE_WRITES, "warp_sums_stored_by_every_lane")((1,), (64,), (out, x), check_races=True)
    assert out[0] == x.sum()


def test_threads_of_several_warps_setting_one_flag_to_one_value_is_not_a_race():
    out = np.zeros(64, dtype=np.float32)
    RawKernel(SAME_VALUE_WRITES, "one_flag_set_by_all")((1,), (64,), (out,), check_races=True)
    np.testing.assert_array_equal(out, np.ones(64, dtype=np.float32))


def test_a_same_value_write_followed_by_an_ordered_change_is_not_a_race():
    out = np.zeros(32, dtype=np.float32)
    RawKernel(SAME_VALUE_WRITES, "same_value_then_ordered_change")((1,), (32,), (out,), check_races=True)
    np.testing.assert_array_equal(out, np.full(32, 2.0, dtype=np.float32))


def test_threads_writing_different_values_to_one_place_race():
    with pytest.raises(RaceError, match=r"race on shared memory.*both write it"):
        RawKernel(SAME_VALUE_WRITES, "lane_numbers_into_one_place")((1,), (64,), (np.zeros(64, dtype=np.float32),),
                                                                    check_races=True)


def test_a_store_loop_stepping_by_one_stores_the_same_values_and_is_not_a_race():
    x = np.arange(100, dtype=np.float32)
    out = np.zeros(100, dtype=np.float32)
    RawKernel(SAME_VALUE_WRITES, "copy_columns_stepping_by_one")((1,), (64,), (out, x, np.int32(100)),
                                                                 check_races=True)
    np.testing.assert_array_equal(out, 2 * x)
