"""Conformance of accesses past the end of a block's shared memory.

A GPU gives each block one window of shared memory: the kernel's __shared__ variables, then the launch's dynamic
shared memory (extern __shared__, `shared_mem` bytes). An access past the end of the window stops the kernel with
an illegal address; the CPU executor stops it too, with an OutOfBoundsError (a KernelError) that names the kernel,
the block and thread, and the array it ran off, with the checks on or off. Such a launch ends a GPU's CUDA context
for good, so on the GPU each faulting launch runs in a process of its own.

An access past one array that stays inside the window (into the dynamic shared memory that follows the __shared__
variables) is valid CUDA: the GPU goes on, and so must the executor, with its checks on.

Every kernel takes (out, x, shift) as gpt2_cupy.testing.launch_in_a_process_of_its_own gives them: out eight
zeros, x = 1 .. 8 (float32), one block.
"""

import re

import numpy as np
import pytest

from gpt2_cupy import backend
from gpt2_cupy.testing import launch_in_a_process_of_its_own

# A GPU gives each kernel a window of the __shared__ variables it can reach, whatever else its module declares;
# so does the executor (shifted_beside_a_larger_kernel: a module whose other kernel declares 4 KiB).
KERNELS = {
    "warp_partials": r"""
// The block reduction's last step as it is often written wrong: the 8 warps' partial sums in an array of 8, and
// every lane of warp 0 reading partial[lane % span], though only lanes 0..7 use what they read. With span 32,
// lanes 8..31 read past the array's end.
extern "C" __global__ void warp_partials(float* out, const float* x, int span)
{
    __shared__ float partial[8];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (lane == 0) partial[warp] = x[warp];
    __syncthreads();
    if (warp == 0) {
        const float mine = partial[lane % span];
        float v = mine * (lane < 8 ? 1.0f : 0.0f);  // every lane's read happens: the product needs it
        for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
        if (lane == 0) out[0] = v;
    }
}
""",
    "static_shifted": r"""
// Eight threads copy x into a __shared__ array and read it back `shift` elements further on.
extern "C" __global__ void static_shifted(float* out, const float* x, int shift)
{
    __shared__ float staged[8];
    staged[threadIdx.x] = x[threadIdx.x];
    __syncthreads();
    out[threadIdx.x] = staged[threadIdx.x + shift];
}
""",
    "dynamic_shifted": r"""
// The same through dynamic shared memory (launched with 32 floats of it): read back `shift` further on.
extern "C" __global__ void dynamic_shifted(float* out, const float* x, int shift)
{
    extern __shared__ float staged[];
    staged[24 + threadIdx.x] = x[threadIdx.x];
    __syncthreads();
    out[threadIdx.x] = staged[24 + threadIdx.x + shift];
}
""",
    "static_before": r"""
// Eight threads copy x into a __shared__ array and read it back `back` elements before.
extern "C" __global__ void static_before(float* out, const float* x, int back)
{
    __shared__ float staged[8];
    staged[threadIdx.x] = x[threadIdx.x];
    __syncthreads();
    out[threadIdx.x] = staged[(int)threadIdx.x - back];
}
""",
    "static_into_dynamic": r"""
// A __shared__ array followed by the launch's dynamic shared memory: reading past the array's end reads the
// dynamic memory, which follows it in the block's window (on a GPU, and in the executor).
extern "C" __global__ void static_into_dynamic(float* out, const float* x, int shift)
{
    __shared__ float staged[8];
    extern __shared__ float after[];
    staged[threadIdx.x] = x[threadIdx.x];
    after[threadIdx.x] = 10.0f * x[threadIdx.x];
    __syncthreads();
    out[threadIdx.x] = threadIdx.x + shift < 8 ? staged[threadIdx.x + shift] : 0.0f;
    if (threadIdx.x == 0) {
        const volatile float* past = staged;
        const float read = past[8 + shift - 1];  // read, whatever it holds
        out[0] = read == read || read != read ? 1.0f : 0.0f;
    }
}
""",
    "device_function_shifted": r"""
// `static __shared__` in a __device__ function, read one element past its end by the last thread.
__device__ float read_block_value(int index, float value)
{
    static __shared__ float values[8];
    values[threadIdx.x] = value;
    __syncthreads();
    return values[index];
}

extern "C" __global__ void device_function_shifted(float* out, const float* x, int shift)
{
    out[threadIdx.x] = read_block_value(threadIdx.x + shift, x[threadIdx.x]);
}
""",
}


# static_shifted in a module with more __shared__ memory that it never reaches: another kernel's 4 KiB, and a
# __device__ function's 4 KiB that only another kernel calls.
KERNELS["shifted_beside_a_larger_kernel"] = KERNELS["static_shifted"].replace(
    "static_shifted", "shifted_beside_a_larger_kernel") + r"""
extern "C" __global__ void larger(float* out, const float* x, int shift)
{
    __shared__ float table[1024];
    table[threadIdx.x] = x[threadIdx.x];
    __syncthreads();
    out[threadIdx.x] = table[threadIdx.x + shift];
}
"""
KERNELS["shifted_beside_an_uncalled_function"] = KERNELS["static_shifted"].replace(
    "static_shifted", "shifted_beside_an_uncalled_function") + r"""
__device__ float from_table(const float* x, int i)
{
    __shared__ float table[1024];
    table[threadIdx.x] = x[threadIdx.x];
    __syncthreads();
    return table[i];
}

extern "C" __global__ void through_the_table(float* out, const float* x, int shift)
{
    out[threadIdx.x] = from_table(x, threadIdx.x + shift);
}
"""

# (kernel, shift, threads, dynamic shared bytes, the array named in the CPU's message)
# A block's shared memory is given in units of 128 bytes (the executor's SHARED_ALLOCATION_BYTES): 8 floats of
# __shared__ take one unit, so the first read that faults is the 33rd float, a shift of 25 for the last thread.
OVERRUNS = [
    ("static_shifted", 25, 8, 0, "staged"),         # one element past the block's unit, by the last thread
    ("static_shifted", 5000, 8, 0, "staged"),       # far past it
    ("shifted_beside_a_larger_kernel", 25, 8, 0, "staged"),   # the other kernel's 4 KiB are not in its window
    ("shifted_beside_an_uncalled_function", 25, 8, 0, "staged"),   # nor a function's it never calls
    ("dynamic_shifted", 1, 8, 128, "the dynamic shared memory"),   # 128 bytes: one past the unit's end
    ("device_function_shifted", 25, 8, 0, "values"),
]


def launch_elsewhere(name, shift, threads, shared_mem):
    return launch_in_a_process_of_its_own(KERNELS[name], name, np.float32, shift, threads, shared_mem)


@pytest.mark.parametrize("name, shift, threads, shared_mem, array", OVERRUNS,
                         ids=[f"{name}-{shift}" for name, shift, *_ in OVERRUNS])
def test_an_access_past_the_shared_window_stops_the_kernel(name, shift, threads, shared_mem, array):
    if backend.name == "cuda":
        outcome = launch_elsewhere(name, shift, threads, shared_mem)
        assert re.search(r"ILLEGAL_ADDRESS|illegal (memory access|address)", outcome), outcome
        return
    from gpt2_cupy.cpu import OutOfBoundsError
    kernel = backend.RawModule(code=KERNELS[name]).get_function(name)
    out, x = np.zeros(8, np.float32), np.arange(1, 9, dtype=np.float32)
    for checks in ({}, {"check_bounds": True, "check_races": True}):
        with pytest.raises(OutOfBoundsError, match=rf"kernel '{name}', block \(0, 0, 0\), thread \(\d+, 0, 0\): "
                                                   rf"out-of-bounds read of shared memory, .*end of '?{array}'?"):
            kernel((1,), (threads,), (out, x, np.int32(shift)), shared_mem=shared_mem, **checks)


def test_an_access_far_before_the_shared_window_stops_the_kernel():
    # 8 KiB before the block's first array: below the window on a GPU (which keeps 1 KiB for the system below a
    # block's own shared memory, so a read just before the first array may not fault there). The executor finds
    # it under the bounds check, whose second pass puts the window against a guard below it.
    if backend.name == "cuda":
        outcome = launch_elsewhere("static_before", 2048, 8, 0)
        # (an H100 has answered this read with an illegal instruction as well as an illegal address: stopped, either way)
        assert re.search(r"ILLEGAL_(ADDRESS|INSTRUCTION)|illegal (memory access|address|instruction)", outcome), outcome
        return
    from gpt2_cupy.cpu import OutOfBoundsError
    kernel = backend.RawModule(code=KERNELS["static_before"]).get_function("static_before")
    out, x = np.zeros(8, np.float32), np.arange(1, 9, dtype=np.float32)
    with pytest.raises(OutOfBoundsError, match=r"kernel 'static_before', block \(0, 0, 0\), thread \(\d+, 0, 0\): "
                                               r"out-of-bounds read of shared memory, before the start of 'staged'"):
        kernel((1,), (8,), (out, x, np.int32(2048)), check_bounds=True)
    kernel((1,), (8,), (out, x, np.int32(1)), check_bounds=True)  # staged[-1]: the system's bytes, on a GPU


# The same kernels reading inside the window: the GPU goes on, and the executor's checks report nothing.
INSIDE = [
    ("warp_partials", 8, 256, 0),
    ("warp_partials", 32, 256, 0),       # the pattern public kernels write: past the 8 floats, inside the unit
    ("static_shifted", 0, 8, 0),
    ("static_shifted", 24, 8, 0),        # the unit's last float
    ("device_function_shifted", 24, 8, 0),
    ("static_before", 0, 8, 0),
    ("dynamic_shifted", 0, 8, 128),
    ("dynamic_shifted", -24, 8, 128),   # the first elements of the dynamic memory
    ("static_into_dynamic", 4, 8, 128),  # past the __shared__ array, into the dynamic memory after it
    ("device_function_shifted", 0, 8, 0),
]


@pytest.mark.parametrize("name, shift, threads, shared_mem", INSIDE, ids=[f"{n}-{s}" for n, s, *_ in INSIDE])
def test_an_access_inside_the_shared_window_is_not_reported(name, shift, threads, shared_mem, to_device, to_host):
    kernel = backend.RawModule(code=KERNELS[name]).get_function(name)
    x = np.arange(1, 9, dtype=np.float32)
    out = to_device(np.zeros(8, np.float32))
    with backend.checks(bounds=True, races=True):
        kernel((1,), (threads,), (out, to_device(x), np.int32(shift)), shared_mem=shared_mem)
    got = to_host(out)
    if name == "warp_partials":
        assert got[0] == x.sum()
    elif name == "static_into_dynamic":
        assert got.tolist() == [1.0, 6.0, 7.0, 8.0, 0.0, 0.0, 0.0, 0.0]
    elif shift == -24 or shift >= 8:  # the dynamic memory's first 8 floats, or the rest of the array's 128-byte
        assert got.shape == (8,)        # unit: what lies there is not known (the launch ran, unreported)
    else:
        assert got.tolist() == x.tolist()


@pytest.mark.cpu_only
def test_reading_from_one_shared_array_into_the_next_is_not_reported():
    # Two __shared__ declarations: first[8 .. 15] lie inside the block's window in the order they are written
    # (second's elements), and past its end in the other order, both of which a GPU's compiler may choose. Only a
    # read past the window in any order, 64 bytes or more past the start of either array, can be reported.
    code = r"""
extern "C" __global__ void two_arrays(float* out, const float* x, int shift)
{
    __shared__ float first[8];
    __shared__ float second[8];
    first[threadIdx.x] = x[threadIdx.x];
    second[threadIdx.x] = 10.0f * x[threadIdx.x];
    __syncthreads();
    out[threadIdx.x] = first[threadIdx.x + shift];
}
"""
    from gpt2_cupy.cpu import OutOfBoundsError
    kernel = backend.RawModule(code=code).get_function("two_arrays")
    out, x = np.zeros(8, np.float32), np.arange(1, 9, dtype=np.float32)
    kernel((1,), (8,), (out, x, np.int32(8)), check_bounds=True, check_races=True)
    assert out.tolist() == (10 * x).tolist()
    kernel((1,), (8,), (out, x, np.int32(15)), check_bounds=True)  # first[15 .. 22]: inside in some order
    # (the guard lies 32 bytes or more past the window's end: the dynamic memory's alignment may add to them)
    with pytest.raises(OutOfBoundsError, match=r"thread \(0, 0, 0\): out-of-bounds read of shared memory, \d+ bytes "
                                               r"past the end of 'second'.*'first' \(32 bytes\), 'second' \(32 bytes\)"):
        kernel((1,), (8,), (out, x, np.int32(1000)))


@pytest.mark.cpu_only
def test_static_shared_bytes_count_the_kernels_own_declarations():
    # what a GPU reports as the kernel's static shared memory: its own __shared__ arrays, in one struct each
    kernel = backend.RawModule(code=KERNELS["warp_partials"]).get_function("warp_partials")
    assert kernel.static_shared_bytes == 8 * 4
    assert kernel.max_dynamic_shared_size_bytes == 48 * 1024 - 8 * 4
