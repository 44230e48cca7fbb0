"""The CPU executor's teaching checks: out-of-bounds accesses and races are caught and explained.

bounds: every read and write of an array argument is checked against the array's size; the first bad one
        raises OutOfBoundsError naming the kernel, the parameter, the block and thread, and the element.
races:  the launch runs again with the threads in another order; if an output differs, the result depended
        on an order CUDA does not promise (a missing __syncthreads(), say), and RaceError says which output.

They can be switched on per call (check_bounds=/check_races=), for a block of code (backend.checks or
launch_checks), or for the whole process (GPT2_CUPY_CHECKS=bounds,races).
"""

import re

import numpy as np
import pytest

from gpt2_cupy import backend
from kernel_sources import BLOCK_SUM, LOOP_BARRIER, TILED_MATMUL

pytestmark = pytest.mark.cpu_only

if backend.name == "cpu":
    from gpt2_cupy.cpu import OutOfBoundsError, RaceError, RawKernel, launch_checks


def assert_names_thread(message, block, thread):
    """The message names the block and the thread, as 'block (x, y, z)' and 'thread (x, y, z)'."""
    assert f"block ({block[0]}, {block[1]}, {block[2]})" in message, message
    assert f"thread ({thread[0]}, {thread[1]}, {thread[2]})" in message, message


def assert_names_index(message, index):
    """The message mentions the element index (as a whole number, not part of a larger one)."""
    assert re.search(rf"(?<![\d-]){re.escape(str(index))}(?!\d)", message), message


# ---------------------------------------------------------------------------------------------------------
# Bounds
# ---------------------------------------------------------------------------------------------------------

OFF_BY_ONE_COPY = r"""
extern "C" __global__ void copy_off_by_one(const float* source, float* destination, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i <= n) {  // the bug: should be i < n
        destination[i] = source[i];
    }
}
"""


def test_read_past_the_end_is_reported_with_argument_thread_and_index():
    """Reading source[100] of a 100-element array: kernel, 'source', block (3,0,0), thread (4,0,0) and 100."""
    source = np.ones(100, dtype=np.float32)
    destination = np.zeros(101, dtype=np.float32)  # big enough: only the read is out of bounds
    kernel = RawKernel(OFF_BY_ONE_COPY, "copy_off_by_one")
    with pytest.raises(OutOfBoundsError) as info:
        kernel((4,), (32,), (source, destination, np.int32(100)), check_bounds=True)
    message = str(info.value)
    assert "copy_off_by_one" in message
    assert "source" in message
    assert_names_thread(message, block=(3, 0, 0), thread=(4, 0, 0))
    assert_names_index(message, 100)


def test_write_past_the_end_is_reported_with_argument_thread_and_index():
    """Writing destination[100] of a 100-element array names 'destination' and the thread that wrote."""
    source = np.ones(101, dtype=np.float32)  # big enough: only the write is out of bounds
    destination = np.zeros(100, dtype=np.float32)
    kernel = RawKernel(OFF_BY_ONE_COPY, "copy_off_by_one")
    with pytest.raises(OutOfBoundsError) as info:
        kernel((4,), (32,), (source, destination, np.int32(100)), check_bounds=True)
    message = str(info.value)
    assert "copy_off_by_one" in message
    assert "destination" in message
    assert_names_thread(message, block=(3, 0, 0), thread=(4, 0, 0))
    assert_names_index(message, 100)


BACKWARD_DIFFERENCE = r"""
extern "C" __global__ void backward_difference(const float* values, float* differences, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        differences[i] = values[i] - values[i - 1];  // the bug: i = 0 reads values[-1]
    }
}
"""


def test_negative_index_read_is_reported():
    """values[-1], read by thread 0 of block 0, is out of bounds too (index -1)."""
    values = np.arange(50, dtype=np.float32)
    differences = np.zeros(50, dtype=np.float32)
    with pytest.raises(OutOfBoundsError) as info:
        RawKernel(BACKWARD_DIFFERENCE, "backward_difference")((2,), (32,), (values, differences, np.int32(50)), check_bounds=True)
    message = str(info.value)
    assert "backward_difference" in message
    assert "values" in message
    assert_names_thread(message, block=(0, 0, 0), thread=(0, 0, 0))
    assert_names_index(message, -1)


FLOAT4_SUMS = r"""
extern "C" __global__ void sum_of_fours(const float* packed, float* sums, int groups)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < groups) {
        float4 v = reinterpret_cast<const float4*>(packed)[i];
        sums[i] = v.x + v.y + v.z + v.w;
    }
}
"""


def test_float4_load_past_the_end_is_reported():
    """A float4 load of floats 28..31 from a 30-float array is caught, although floats 28 and 29 exist."""
    packed = np.ones(30, dtype=np.float32)
    sums = np.zeros(8, dtype=np.float32)
    with pytest.raises(OutOfBoundsError) as info:
        # 8 groups of 4 need 32 floats; only 30 are there. Group 7 is block 1, thread 3.
        RawKernel(FLOAT4_SUMS, "sum_of_fours")((2,), (4,), (packed, sums, np.int32(8)), check_bounds=True)
    message = str(info.value)
    assert "sum_of_fours" in message
    assert "packed" in message
    assert_names_thread(message, block=(1, 0, 0), thread=(3, 0, 0))


def test_float4_loads_inside_the_array_pass():
    """The same kernel with 7 groups stays inside the array and gives the right sums under the check."""
    packed = np.arange(30, dtype=np.float32)
    sums = np.zeros(7, dtype=np.float32)
    RawKernel(FLOAT4_SUMS, "sum_of_fours")((2,), (4,), (packed, sums, np.int32(7)), check_bounds=True)
    np.testing.assert_array_equal(sums, packed[:28].reshape(7, 4).sum(axis=1))


NEIGHBOUR_SUMS = r"""
extern "C" __global__ void add_right_neighbour(const float* matrix, float* out, int rows, int cols)
{
    int row = blockIdx.y * blockDim.y + threadIdx.y;
    int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (row < rows && col < cols) {
        // the bug: the last column's "right neighbour" is the next row's first element,
        // and for the very last element it is past the end of the matrix
        out[row * cols + col] = matrix[row * cols + col] + matrix[row * cols + col + 1];
    }
}
"""


def test_out_of_bounds_in_a_two_dimensional_launch_reports_y_coordinates():
    """Only the last element (row 9, col 5) reads past the end: block (1, 2, 0), thread (1, 1, 0) of 4x4 blocks."""
    rows, cols = 10, 6
    matrix = np.ones((rows, cols), dtype=np.float32)
    out = np.zeros((rows, cols), dtype=np.float32)
    with pytest.raises(OutOfBoundsError) as info:
        RawKernel(NEIGHBOUR_SUMS, "add_right_neighbour")((2, 3), (4, 4), (matrix, out, np.int32(rows), np.int32(cols)), check_bounds=True)
    message = str(info.value)
    assert "matrix" in message
    assert_names_thread(message, block=(1, 2, 0), thread=(1, 1, 0))
    assert_names_index(message, rows * cols)




def run_matmul(A, B, **checks):
    M, K = A.shape
    N = B.shape[1]
    C = np.zeros((M, N), dtype=np.float32)
    grid = ((N + 15) // 16, (M + 15) // 16)
    RawKernel(TILED_MATMUL, "tiled_matmul")(grid, (16, 16), (A, B, C, np.int32(M), np.int32(N), np.int32(K)), **checks)
    return C


def test_correct_kernel_gives_the_same_result_with_bounds_checks(rng):
    """A correct tiled matmul (37x45 @ 45x29) passes the bounds check and gives bit-identical results."""
    A = rng.standard_normal((37, 45), dtype=np.float32)
    B = rng.standard_normal((45, 29), dtype=np.float32)
    unchecked = run_matmul(A, B, check_bounds=False)
    checked = run_matmul(A, B, check_bounds=True)
    np.testing.assert_array_equal(checked, unchecked)
    np.testing.assert_allclose(checked, A.astype(np.float64) @ B, rtol=1e-4, atol=1e-4)


def test_bounds_check_sees_the_array_size_not_the_n_argument():
    """A launch with n smaller than the arrays is fine: only the arrays' real sizes matter."""
    source = np.arange(200, dtype=np.float32)
    destination = np.zeros(200, dtype=np.float32)
    RawKernel(OFF_BY_ONE_COPY, "copy_off_by_one")((4,), (32,), (source, destination, np.int32(120)), check_bounds=True)
    np.testing.assert_array_equal(destination[:121], source[:121])
    assert not destination[121:].any()


# ---------------------------------------------------------------------------------------------------------
# Races
# ---------------------------------------------------------------------------------------------------------

RACY_BLOCK_SUM = BLOCK_SUM.replace(LOOP_BARRIER, "        // (missing __syncthreads(): the next step may read a sum not yet written)\n")
assert RACY_BLOCK_SUM != BLOCK_SUM


def block_sum_arguments(rng, n=1000, block=128):
    x = rng.random(n, dtype=np.float32)
    blocks = (n + block - 1) // block
    return x, np.zeros(blocks, dtype=np.float32), np.int32(n), blocks


def test_missing_syncthreads_in_a_reduction_is_a_race(rng):
    """Without __syncthreads() between the steps the sums depend on thread order: RaceError names kernel and 'sums'."""
    x, sums, n, blocks = block_sum_arguments(rng)
    with pytest.raises(RaceError) as info:
        RawKernel(RACY_BLOCK_SUM, "block_sum")((blocks,), (128,), (x, sums, n), check_races=True)
    message = str(info.value)
    assert "block_sum" in message
    assert "sums" in message


def test_correct_reduction_passes_the_race_check(rng):
    """With the barrier the result does not depend on thread order: no error, and the right sums."""
    x, sums, n, blocks = block_sum_arguments(rng)
    RawKernel(BLOCK_SUM, "block_sum")((blocks,), (128,), (x, sums, n), check_races=True)
    padded = np.zeros(blocks * 128)
    padded[: x.size] = x
    np.testing.assert_allclose(sums, padded.reshape(blocks, 128).sum(axis=1), rtol=1e-5)


def test_many_threads_writing_one_element_is_a_race():
    """Every thread writes its own index to winner[0]: which one lands depends on the order."""
    code = r"""
extern "C" __global__ void last_writer_wins(int* winner)
{
    winner[0] = threadIdx.x;
}
"""
    with pytest.raises(RaceError) as info:
        RawKernel(code, "last_writer_wins")((1,), (64,), (np.zeros(1, dtype=np.int32),), check_races=True)
    assert "last_writer_wins" in str(info.value)
    assert "winner" in str(info.value)


def test_in_place_kernel_is_not_mistaken_for_a_race(rng):
    """A kernel that updates its input in place (x[i] *= 2) runs once as far as the caller can see: no error, 2*x."""
    code = r"""
extern "C" __global__ void double_in_place(float* x, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        x[i] *= 2.0f;
    }
}
"""
    original = rng.standard_normal(1000, dtype=np.float32)
    x = original.copy()
    RawKernel(code, "double_in_place")((8,), (128,), (x, np.int32(1000)), check_races=True)
    np.testing.assert_array_equal(x, 2 * original)


def test_integer_atomics_are_not_a_race(rng):
    """atomicAdd on ints gives the same histogram in any order: no RaceError, and the right counts."""
    code = r"""
extern "C" __global__ void histogram(const int* values, int* counts, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        atomicAdd(&counts[values[i]], 1);
    }
}
"""
    values = rng.integers(0, 10, size=5000, dtype=np.int32)
    counts = np.zeros(10, dtype=np.int32)
    RawKernel(code, "histogram")((40,), (128,), (values, counts, np.int32(5000)), check_races=True)
    np.testing.assert_array_equal(counts, np.bincount(values, minlength=10))


def test_float_atomic_sums_are_not_a_race(rng):
    """A float atomicAdd sum depends on the order only in its last bits: no RaceError, and the right sum."""
    code = r"""
extern "C" __global__ void atomic_sum(const float* x, float* total, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        atomicAdd(total, x[i]);
    }
}
"""
    x = rng.standard_normal(5000).astype(np.float32)
    total = np.zeros(1, dtype=np.float32)
    RawKernel(code, "atomic_sum")((40,), (128,), (x, total, np.int32(5000)), check_races=True)
    np.testing.assert_allclose(total[0], x.astype(np.float64).sum(), rtol=0, atol=1e-3)


def test_correct_tiled_matmul_passes_both_checks(rng):
    """The shared-memory tiled matmul, with both its barriers, passes bounds and race checks together."""
    A = rng.standard_normal((33, 20), dtype=np.float32)
    B = rng.standard_normal((20, 17), dtype=np.float32)
    C = run_matmul(A, B, check_bounds=True, check_races=True)
    np.testing.assert_allclose(C, A.astype(np.float64) @ B, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------------------
# Three ways to switch the checks on
# ---------------------------------------------------------------------------------------------------------


def launch_racy_sum(rng, **checks):
    x, sums, n, blocks = block_sum_arguments(rng)
    RawKernel(RACY_BLOCK_SUM, "block_sum")((blocks,), (128,), (x, sums, n), **checks)


def launch_read_past_end(**checks):
    source, destination = np.ones(100, dtype=np.float32), np.zeros(101, dtype=np.float32)
    RawKernel(OFF_BY_ONE_COPY, "copy_off_by_one")((4,), (32,), (source, destination, np.int32(100)), **checks)


def test_checks_are_off_by_default(rng, monkeypatch):
    """With no keyword, no context and no environment variable, the racy kernel runs unchecked."""
    monkeypatch.delenv("GPT2_CUPY_CHECKS", raising=False)
    launch_racy_sum(rng)


def test_backend_checks_context_manager_switches_checks_on(rng, monkeypatch):
    """Inside `with backend.checks(bounds=True, races=True)` launches are checked; after the block they are not."""
    monkeypatch.delenv("GPT2_CUPY_CHECKS", raising=False)
    with backend.checks(bounds=True):
        with pytest.raises(OutOfBoundsError):
            launch_read_past_end()
    with backend.checks(races=True):
        with pytest.raises(RaceError):
            launch_racy_sum(rng)
    launch_racy_sum(rng)  # checks are off again


def test_launch_checks_context_manager_of_the_executor(rng, monkeypatch):
    """gpt2_cupy.cpu.launch_checks is the same switch, for code that uses the executor directly."""
    monkeypatch.delenv("GPT2_CUPY_CHECKS", raising=False)
    with launch_checks(bounds=True, races=True):
        with pytest.raises(OutOfBoundsError):
            launch_read_past_end()
        with pytest.raises(RaceError):
            launch_racy_sum(rng)


def test_keyword_false_overrides_the_context(rng, monkeypatch):
    """check_races=False on one call switches the race check off for that call, even inside backend.checks."""
    monkeypatch.delenv("GPT2_CUPY_CHECKS", raising=False)
    with backend.checks(races=True):
        launch_racy_sum(rng, check_races=False)


@pytest.mark.parametrize("setting", ["bounds", "bounds,races"])
def test_environment_variable_switches_bounds_checks_on(setting, monkeypatch):
    """GPT2_CUPY_CHECKS=bounds (or bounds,races) checks every launch of the process."""
    monkeypatch.setenv("GPT2_CUPY_CHECKS", setting)
    with pytest.raises(OutOfBoundsError):
        launch_read_past_end()


@pytest.mark.parametrize("setting", ["races", "bounds,races"])
def test_environment_variable_switches_race_checks_on(setting, rng, monkeypatch):
    """GPT2_CUPY_CHECKS=races (or bounds,races) runs every launch of the process twice in different orders."""
    monkeypatch.setenv("GPT2_CUPY_CHECKS", setting)
    with pytest.raises(RaceError):
        launch_racy_sum(rng)


def test_environment_variable_with_only_bounds_leaves_races_unchecked(rng, monkeypatch):
    """GPT2_CUPY_CHECKS=bounds does not switch on the race check."""
    monkeypatch.setenv("GPT2_CUPY_CHECKS", "bounds")
    launch_racy_sum(rng)


IN_PLACE_ADD = r"""
extern "C" __global__ void add_into(float* out, const float* a, const float* b, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        out[i] = a[i] + b[i];
    }
}
"""


@pytest.mark.parametrize("checks", [{"check_bounds": True}, {"check_races": True},
                                    {"check_bounds": True, "check_races": True}])
def test_checks_keep_arguments_that_share_memory_shared(checks, rng):
    """Launches whose arguments share memory give under the checks exactly what they give without them:
    in place (out and a the same array), and reading two overlapping views of one array. The checks copy
    shared memory once, and start every pass from the original bytes."""
    kernel = RawKernel(IN_PLACE_ADD, "add_into")
    n = np.int32(300)
    x, y = rng.standard_normal(300).astype(np.float32), rng.standard_normal(300).astype(np.float32)
    unchecked, checked = x.copy(), x.copy()
    kernel((2,), (256,), (unchecked, unchecked, y, n))
    kernel((2,), (256,), (checked, checked, y, n), **checks)
    np.testing.assert_array_equal(checked, unchecked)
    np.testing.assert_array_equal(checked, x + y)

    w = rng.standard_normal(301).astype(np.float32)
    unchecked, checked = np.zeros(300, np.float32), np.zeros(300, np.float32)
    kernel((2,), (256,), (unchecked, w[1:], w[:-1], n))
    kernel((2,), (256,), (checked, w[1:], w[:-1], n), **checks)
    np.testing.assert_array_equal(checked, unchecked)


def test_write_just_past_an_array_whose_size_is_not_a_multiple_of_16_bytes_is_reported():
    """30 floats (120 bytes) keep their 16-byte alignment under the check, so 8 bytes lie between the
    array and its guard: a write into them (element 30) is still reported, with the argument and element."""
    code = r"""
extern "C" __global__ void write_one_past(float* values, int n)
{
    if (threadIdx.x == 0) {
        values[n] = 1.0f;
    }
}
"""
    values = np.zeros(30, dtype=np.float32)
    with pytest.raises(OutOfBoundsError) as info:
        RawKernel(code, "write_one_past")((1,), (32,), (values, np.int32(30)), check_bounds=True)
    message = str(info.value)
    assert "values" in message and "write" in message
    assert_names_index(message, 30)
    np.testing.assert_array_equal(values, 0)  # the failed launch wrote nothing back
