"""The CPU executor never takes the Python process down, and says what went wrong where a GPU would not:
integer division by zero, accesses far outside an array, misaligned vector accesses, local arrays too
large for a thread, endless kernels launched from another Python thread; and its messages about
arguments count and speak as a person would.
"""

import os
import signal
import threading
import time
import traceback

import numpy as np
import pytest

from gpt2_cupy import backend

pytestmark = pytest.mark.cpu_only

if backend.name == "cpu":
    from gpt2_cupy.cpu import KernelError, OutOfBoundsError, RawKernel


DIVIDE = r"""
extern "C" __global__ void divide(int* out, const int* numerators, const int* denominators, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        out[i] = numerators[i] / denominators[i];
    }
}
"""


@pytest.mark.parametrize("numerator, denominator, words", [(7, 0, "division by zero"),
                                                            (-2**31, -1, "most negative integer by -1")])
def test_integer_division_fault_is_a_kernel_error_naming_block_and_thread(numerator, denominator, words):
    n = 300
    numerators = np.full(n, numerator, dtype=np.int32)
    denominators = np.ones(n, dtype=np.int32)
    denominators[200] = denominator  # block 1, thread 72 of 128
    with pytest.raises(KernelError, match=rf"kernel 'divide', block \(1, 0, 0\), thread \(72, 0, 0\): .*{words}"):
        RawKernel(DIVIDE, "divide")((3,), (128,), (np.zeros(n, dtype=np.int32), numerators, denominators, np.int32(n)))
    out = np.zeros(n, dtype=np.int32)  # and the executor goes on working
    RawKernel(DIVIDE, "divide")((3,), (128,), (out, np.full(n, 9, dtype=np.int32), np.full(n, 3, dtype=np.int32), np.int32(n)))
    np.testing.assert_array_equal(out, np.full(n, 3))


FAR = r"""
extern "C" __global__ void far_access(float* first, float* second, long long offset, int write)
{
    if (threadIdx.x == 3 && blockIdx.x == 1) {
        if (write) second[offset] = 1.0f;
        else first[0] = second[offset];
    }
}
"""


@pytest.mark.parametrize("offset", [100_000 + 7, 50257 * 3, -300_000, 2**31 - 1, -2**31, 2**32 - 1])
@pytest.mark.parametrize("write", [1, 0])
def test_bounds_check_catches_accesses_as_far_as_a_32_bit_index_reaches(offset, write):
    """Each array has its own guard regions, as large as a 32-bit index reaches: the report names the array
    that was indexed, the element, and the block and thread, and the process survives."""
    first, second = np.zeros(10, dtype=np.float32), np.zeros(10, dtype=np.float32)
    access = "write" if write else "read"
    with pytest.raises(OutOfBoundsError, match=rf"block \(1, 0, 0\), thread \(3, 0, 0\): out-of-bounds {access} "
                                               rf"of 'second' at element {offset};"):
        RawKernel(FAR, "far_access")((2,), (4,), (first, second, np.int64(offset), np.int32(write)), check_bounds=True)


def test_a_fault_with_the_bounds_check_on_does_not_ask_for_the_bounds_check():
    code = r"""
    extern "C" __global__ void through_a_wild_pointer(float* out)
    {
        float* wild = (float*)(unsigned long long)0x10;
        out[threadIdx.x] = *wild;
    }
    """
    with pytest.raises(KernelError) as caught:
        RawKernel(code, "through_a_wild_pointer")((1,), (1,), (np.zeros(1, dtype=np.float32),), check_bounds=True)
    assert "Run with the bounds check on" not in str(caught.value)


def test_a_misaligned_float4_access_is_reported_as_misaligned():
    code = r"""
    extern "C" __global__ void copy_float4(float* out, const float* in)
    {
        const float4* from = reinterpret_cast<const float4*>(in + 1);   // 4 bytes past a 16-byte boundary
        reinterpret_cast<float4*>(out)[threadIdx.x] = from[threadIdx.x];
    }
    """
    with pytest.raises(KernelError, match="misaligned"):
        RawKernel(code, "copy_float4")((1,), (4,), (np.zeros(16, dtype=np.float32), np.zeros(64, dtype=np.float32)))


def test_a_misaligned_float4_atomic_add_is_reported_as_misaligned():
    code = r"""
    extern "C" __global__ void add_float4(float* sums)
    {
        atomicAdd(reinterpret_cast<float4*>(sums + 2), make_float4(1.0f, 1.0f, 1.0f, 1.0f));  // 8 bytes past 16
    }
    """
    with pytest.raises(KernelError, match="misaligned"):
        RawKernel(code, "add_float4")((1,), (1,), (np.zeros(16, dtype=np.float32),))


LOCAL_ARRAY = r"""
extern "C" __global__ void reverse_in_local_memory(float* out, int n)
{
    float local[LOCAL_FLOATS];
    for (int i = 0; i < n; ++i) local[i] = (float)i;
    out[blockIdx.x * blockDim.x + threadIdx.x] = local[n - 1 - threadIdx.x];
}
"""


def test_a_local_array_of_480_kib_fits_as_on_a_gpu():
    floats = 480 * 1024 // 4
    out = np.zeros(2 * 32, dtype=np.float32)
    RawKernel(LOCAL_ARRAY, "reverse_in_local_memory", options=(f"-DLOCAL_FLOATS={floats}",))(
        (2,), (32,), (out, np.int32(floats)))
    np.testing.assert_array_equal(out, np.tile(floats - 1 - np.arange(32, dtype=np.float32), 2))


def test_a_local_array_larger_than_a_thread_may_have_is_reported_as_such():
    floats = 2 * 1024 * 1024 // 4
    with pytest.raises(KernelError, match="stack overflow.*local memory"):
        RawKernel(LOCAL_ARRAY, "reverse_in_local_memory", options=(f"-DLOCAL_FLOATS={floats}",))(
            (1,), (32,), (np.zeros(32, dtype=np.float32), np.int32(floats)))


ENDLESS = r"""
extern "C" __global__ void endless(int* counters, int n)
{
    int i = threadIdx.x;
    while (i < n) {
        counters[i % 4] += 1;
    }
}
"""


def test_ctrl_c_stops_an_endless_kernel_launched_from_another_python_thread():
    caught = []
    kernel = RawKernel(ENDLESS, "endless")
    kernel.compile()  # before the thread starts, so that the interrupt finds the kernel running

    def launch():
        try:
            kernel((4,), (64,), (np.zeros(4, dtype=np.int32), np.int32(10)))
        except KeyboardInterrupt as error:
            caught.append(error)

    worker = threading.Thread(target=launch)
    worker.start()
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGINT)
    worker.join(timeout=5)
    assert not worker.is_alive() and caught


# ---------------------------------------------------------------------------------------------------------
# Messages about arguments
# ---------------------------------------------------------------------------------------------------------

SCALE = r"""
extern "C" __global__ void scale(const float* x, float* out, int n, unsigned int flags)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = 2.0f * x[i];
}
"""


def scale_call(n, flags=np.uint32(0)):
    x = np.ones(8, dtype=np.float32)
    RawKernel(SCALE, "scale")((1,), (8,), (x, np.zeros(8, dtype=np.float32), n, flags))


@pytest.mark.parametrize("wrong", [8, np.int64(8)])
def test_a_64_bit_integer_for_an_int_parameter_is_explained_the_same_way(wrong):
    """Counted as a person counts, with the right article, and the same explanation for int and numpy.int64."""
    with pytest.raises(TypeError, match=r"the third argument \('int n'\): got .*64-bit integer, of which an int "
                                        r"parameter reads the first 4 bytes.*numpy\.int32"):
        scale_call(wrong)


def test_a_failed_launch_shows_the_learners_line_first():
    """The traceback of a refused call holds the caller's frame and the launch, not the executor's insides."""
    try:
        scale_call(np.float32(8))
    except TypeError as error:
        frames = traceback.extract_tb(error.__traceback__)
    assert frames[-2].name == "scale_call"
    assert len(frames) == 3  # this test, scale_call, RawKernel.__call__
