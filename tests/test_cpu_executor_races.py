"""The race check finds what a GPU gets wrong silently, and only that.

With races=True the launch runs once more with every load, store and atomic of the kernel checked: two
threads that touch one place, at least one writing, with no barrier between them and not through an
atomic operation, race. A lost update (`count += 1` by many threads) is named as such, with the array
and element; results that differ only by the order of atomic operations are not races.
"""

import numpy as np
import pytest

from gpt2_cupy import backend

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


STREAM_COMPACTION = r"""
extern "C" __global__ void keep_positive(float* kept, int* count, const float* x, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n && x[i] > 0.0f) {
        kept[atomicAdd(count, 1)] = x[i];
    }
}
"""


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
