"""Conformance of the launch machinery: warps after divergence, kernel names, parameters passed by value,
what NVRTC accepts and refuses, and CuPy's own conventions (empty grids, grid types, get_global, printf).

Like test_conformance.py, these run on whichever backend is active: a case that passes on a GPU and fails
on the CPU executor is an executor bug.
"""

import ctypes

import numpy as np
import pytest

from gpt2_cupy import backend
from kernel_sources import SUM_LAST_BLOCK

# ---------------------------------------------------------------------------------------------------------
# Warp operations after divergent code: lanes meet only at an operation with the same mask
# ---------------------------------------------------------------------------------------------------------

DIVERGENT_WARPS = r"""
// Even lanes do two shuffles among themselves, odd lanes one; then the whole warp shuffles.
extern "C" __global__ void two_shuffles_and_one(int* out)
{
    int lane = threadIdx.x % 32;
    int v = lane;
    if (lane % 2 == 0) {
        v = __shfl_xor_sync(0x55555555u, v, 2);
        v = __shfl_xor_sync(0x55555555u, v, 4) + 100;
    } else {
        v = __shfl_xor_sync(0xaaaaaaaau, v, 2);
    }
    out[threadIdx.x] = __shfl_sync(0xffffffffu, v, (lane + 1) % 32);
}

// The two halves of the warp shuffle a different number of times (3 and 1), then vote and shuffle together.
extern "C" __global__ void halves_then_whole(int* out)
{
    int lane = threadIdx.x % 32;
    int v = lane * 10;
    if (lane < 16) {
        for (int k = 0; k < 3; ++k) v += __shfl_down_sync(0x0000ffffu, v, 1, 16);
    } else {
        v = __shfl_up_sync(0xffff0000u, v, 1, 16);
    }
    unsigned int big = __ballot_sync(0xffffffffu, v > 200);
    out[threadIdx.x] = __shfl_sync(0xffffffffu, v, 31 - lane) + (int)(big == 0u ? 0 : __popc(big)) * 100000;
}

// The quarters of the warp take 1, 2, 3 and 1 steps of exchanges within the quarter, then the warp sums.
extern "C" __global__ void quarters_then_sum(int* out)
{
    int lane = threadIdx.x % 32;
    int quarter = lane / 8;
    unsigned int mask = 0xffu << (8 * quarter);
    int v = lane;
    for (int k = 0; k <= quarter % 3; ++k) {
        v += __shfl_xor_sync(mask, v, 1 << k);
        __syncwarp(mask);
    }
    for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
    out[threadIdx.x] = v;
}
"""


def reference_two_shuffles_and_one(threads):
    lane = np.arange(threads) % 32
    v = np.where(lane % 2 == 0, ((lane ^ 2) ^ 4) + 100, lane ^ 2)
    base = np.arange(threads) - lane
    return v[base + (lane + 1) % 32]


def reference_halves_then_whole(threads):
    out = []
    for warp in range(threads // 32):
        v = np.arange(32) * 10
        low = v[:16].copy()
        for _ in range(3):
            shifted = np.concatenate([low[1:], low[-1:]])  # lane 15 keeps its own value
            low = low + shifted
        high = v[16:].copy()
        high = np.concatenate([high[:1], high[:-1]])  # lane 16 keeps its own value
        v = np.concatenate([low, high])
        votes = int(np.count_nonzero(v > 200))
        out.extend(v[31 - np.arange(32)] + votes * 100000)
    return np.array(out)


def reference_quarters_then_sum(threads):
    out = []
    for warp in range(threads // 32):
        v = np.arange(32)
        for quarter in range(4):
            lanes = np.arange(8 * quarter, 8 * quarter + 8)
            for k in range(quarter % 3 + 1):
                v[lanes] = v[lanes] + v[lanes ^ (1 << k)]
        out.extend(np.full(32, v.sum()))
    return np.array(out)


@pytest.mark.parametrize("name, reference", [
    ("two_shuffles_and_one", reference_two_shuffles_and_one),
    ("halves_then_whole", reference_halves_then_whole),
    ("quarters_then_sum", reference_quarters_then_sum),
])
@pytest.mark.parametrize("threads", [32, 128])
def test_lanes_meet_only_at_a_warp_operation_with_their_mask(name, reference, threads, to_device, to_host):
    """After divergent code, a warp operation waits for every lane its mask names to reach one with the same mask."""
    out = to_device(np.full(threads, -1, dtype=np.int32))
    backend.RawModule(code=DIVERGENT_WARPS).get_function(name)((1,), (threads,), (out,))
    np.testing.assert_array_equal(to_host(out), reference(threads))


# ---------------------------------------------------------------------------------------------------------
# Kernels named like C library functions are the kernels
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["div", "random", "index", "time", "select", "exit", "rand", "puts", "sleep",
                                  "strlen", "open", "close", "signal", "qsort"])
def test_a_kernel_named_like_a_c_library_function_runs_the_kernel(name, to_device, to_host):
    code = f'extern "C" __global__ void {name}(int* out) {{ out[threadIdx.x] = 7 * threadIdx.x + 1; }}'
    out = to_device(np.zeros(8, dtype=np.int32))
    backend.RawKernel(code, name)((1,), (8,), (out,))
    np.testing.assert_array_equal(to_host(out), 7 * np.arange(8) + 1)


# ---------------------------------------------------------------------------------------------------------
# Parameters passed by value: vector types, structs, enums, and their alignment among other parameters
# ---------------------------------------------------------------------------------------------------------

BY_VALUE = r"""
struct Affine { float scale; int offset; double extra; };
enum Mode { ADD = 3, MULTIPLY = 7 };

extern "C" __global__ void by_value(double* out, char c, float2 f2, double2 d2, float4 f4, Affine affine,
                                    Mode mode, unsigned int u, short s, double d)
{
    out[0] = c;       out[1] = f2.x;    out[2] = f2.y;    out[3] = d2.x;    out[4] = d2.y;
    out[5] = f4.x;    out[6] = f4.y;    out[7] = f4.z;    out[8] = f4.w;
    out[9] = affine.scale;  out[10] = affine.offset;  out[11] = affine.extra;
    out[12] = (int)mode;    out[13] = u;  out[14] = s;  out[15] = d;
}

extern "C" __global__ void float4_by_value_to_every_thread(float* out, float4 v, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = v.x + 10.0f * v.y + 100.0f * v.z + 1000.0f * v.w + i;
}
"""

FLOAT4 = np.dtype([("x", np.float32), ("y", np.float32), ("z", np.float32), ("w", np.float32)], align=True)
AFFINE = np.dtype([("scale", np.float32), ("offset", np.int32), ("extra", np.float64)], align=True)


def scalar_of(dtype, values):
    """A numpy scalar of a structured dtype: what CuPy passes by its bytes for a struct parameter."""
    return np.array(tuple(values), dtype=dtype)[()]


def test_structs_vectors_and_enums_by_value_arrive_whole(to_device, to_host):
    out = to_device(np.zeros(16))
    arguments = (out, np.int8(-5), np.complex64(1.5 - 2.5j), np.complex128(3.25 + 4.5j),
                 scalar_of(FLOAT4, (5, 6, 7, 8)), scalar_of(AFFINE, (0.5, -9, 1e100)), np.int32(7),
                 np.uint32(4_000_000_000), np.int16(-300), np.float64(np.pi))
    backend.RawModule(code=BY_VALUE).get_function("by_value")((1,), (1,), arguments)
    expected = [-5, 1.5, -2.5, 3.25, 4.5, 5, 6, 7, 8, 0.5, -9, 1e100, 7, 4_000_000_000, -300, np.pi]
    np.testing.assert_array_equal(to_host(out), np.array(expected))


def test_float4_by_value_reaches_every_block(to_device, to_host):
    n = 1000
    out = to_device(np.zeros(n, dtype=np.float32))
    kernel = backend.RawModule(code=BY_VALUE).get_function("float4_by_value_to_every_thread")
    kernel((4,), (256,), (out, scalar_of(FLOAT4, (1, 2, 3, 4)), np.int32(n)))
    np.testing.assert_array_equal(to_host(out), 4321 + np.arange(n, dtype=np.float32))


def test_a_string_for_a_struct_parameter_is_a_type_error(to_device):
    kernel = backend.RawModule(code=BY_VALUE).get_function("float4_by_value_to_every_thread")
    with pytest.raises(TypeError):
        kernel((1,), (32,), (to_device(np.zeros(4, dtype=np.float32)), "1 2 3 4", np.int32(4)))


UNSIGNED = r"""
extern "C" __global__ void store_unsigned(unsigned int* out, unsigned int value, unsigned short small)
{
    out[0] = value;
    out[1] = small;
}
"""


def test_numpy_int32_for_an_unsigned_int_passes_its_bits(to_device, to_host):
    """numpy.int32(-1) for an unsigned int parameter arrives as 4294967295, as CuPy passes the same 4 bytes."""
    out = to_device(np.zeros(2, dtype=np.uint32))
    backend.RawKernel(UNSIGNED, "store_unsigned")((1,), (1,), (out, np.int32(-1), np.int16(-2)))
    np.testing.assert_array_equal(to_host(out), [2**32 - 1, 2**16 - 2])


# ---------------------------------------------------------------------------------------------------------
# What NVRTC accepts: the preprocessor decides what is a kernel
# ---------------------------------------------------------------------------------------------------------

PREPROCESSED = r"""
#if 0
extern "C" __global__ void not_compiled(float* out) { this is not C++ at all }
#endif

#define SCALE_KERNEL(NAME, FACTOR)                                                     \
    extern "C" __global__ void NAME(float* out, const float* in, size_t n)             \
    {                                                                                  \
        size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;                      \
        if (i < n) out[i] = FACTOR * in[i];                                            \
    }
SCALE_KERNEL(twice, 2.0f)
SCALE_KERNEL(three_times, 3.0f)

#define BLOCK 64
extern "C" __global__ void __launch_bounds__(BLOCK) reverse_through_aligned_shared(float* out, const float* in)
{
    extern __shared__ __align__(sizeof(float4)) unsigned char shared_bytes[];
    float* buffer = reinterpret_cast<float*>(shared_bytes);
    buffer[threadIdx.x] = in[blockIdx.x * blockDim.x + threadIdx.x];
    __syncthreads();
    out[blockIdx.x * blockDim.x + threadIdx.x] = buffer[blockDim.x - 1 - threadIdx.x];
}
"""


def test_kernels_defined_by_a_macro_with_size_t_and_no_include(rng, to_device, to_host):
    module = backend.RawModule(code=PREPROCESSED)
    x = rng.standard_normal(1000).astype(np.float32)
    for name, factor in (("twice", 2), ("three_times", 3)):
        out = to_device(np.zeros_like(x))
        module.get_function(name)((4,), (256,), (out, to_device(x), np.uint64(x.size)))
        np.testing.assert_array_equal(to_host(out), np.float32(factor) * x)


def test_extern_shared_with_an_align_expression(rng, to_device, to_host):
    x = rng.standard_normal(4 * 64).astype(np.float32)
    out = to_device(np.zeros_like(x))
    kernel = backend.RawModule(code=PREPROCESSED).get_function("reverse_through_aligned_shared")
    kernel((4,), (64,), (out, to_device(x)), shared_mem=64 * 4)
    np.testing.assert_array_equal(to_host(out), x.reshape(4, 64)[:, ::-1].reshape(-1))


def test_a_kernel_inside_if_0_is_not_there():
    module = backend.RawModule(code=PREPROCESSED)
    with pytest.raises(Exception):
        module.get_function("not_compiled")


# ---------------------------------------------------------------------------------------------------------
# What the GPU refuses is refused here too
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("declaration", ["__shared__ float total = 0.0f;", "__shared__ int counts[2] = {0, 0};",
                                         "__shared__ __align__(16) float aligned = 1.0f;"])
def test_a_shared_variable_with_an_initializer_is_refused(declaration):
    code = ('extern "C" __global__ void initialised(float* out)\n{\n    ' + declaration +
            "\n    out[threadIdx.x] = 1.0f;\n}\n")
    with pytest.raises(Exception):
        backend.RawKernel(code, "initialised")((1,), (1,), (backend.xp.zeros(1, dtype=backend.xp.float32),))
        backend.synchronize()


BIG_SHARED = r"""
extern "C" __global__ void big_static_shared(float* out)
{
    __shared__ float tile[STATIC_FLOATS];
    tile[STATIC_FLOATS - 1 - threadIdx.x] = (float)threadIdx.x;
    __syncthreads();
    out[threadIdx.x] = tile[STATIC_FLOATS - 32 + threadIdx.x];
}
"""


def big_static_shared(floats):
    return backend.RawKernel(BIG_SHARED, "big_static_shared", options=(f"-DSTATIC_FLOATS={floats}",))


def test_static_shared_memory_over_48_kib_is_refused():
    with pytest.raises(Exception):
        big_static_shared(48 * 1024 // 4 + 1)((1,), (32,), (backend.xp.zeros(32, dtype=backend.xp.float32),))
        backend.synchronize()


def test_static_shared_memory_of_exactly_48_kib_runs(to_host):
    out = backend.xp.zeros(32, dtype=backend.xp.float32)
    big_static_shared(48 * 1024 // 4)((1,), (32,), (out,))
    np.testing.assert_array_equal(to_host(out), 31 - np.arange(32, dtype=np.float32))


def test_static_plus_dynamic_shared_memory_over_48_kib_needs_the_attribute(to_host):
    """40 KiB of __shared__ arrays and 16 KiB of dynamic shared memory: refused until the kernel's
    max_dynamic_shared_size_bytes is raised."""
    kernel = big_static_shared(40 * 1024 // 4)
    out = backend.xp.zeros(32, dtype=backend.xp.float32)
    with pytest.raises(Exception):
        kernel((1,), (32,), (out,), shared_mem=16 * 1024)
        backend.synchronize()
    kernel.max_dynamic_shared_size_bytes = 16 * 1024
    kernel((1,), (32,), (out,), shared_mem=16 * 1024)
    np.testing.assert_array_equal(to_host(out), 31 - np.arange(32, dtype=np.float32))


# ---------------------------------------------------------------------------------------------------------
# CuPy's conventions: empty grids, integer sizes, module globals, long printf lines
# ---------------------------------------------------------------------------------------------------------

COUNT_BLOCKS = r"""
extern "C" __global__ void count_blocks(int* blocks_run, int n)
{
    if (threadIdx.x == 0) atomicAdd(blocks_run, 1);
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) blocks_run[1 + i] = 1;
}
"""


@pytest.mark.parametrize("grid", [(0,), (0, 0), (0, 1, 0)])
def test_a_grid_of_zero_blocks_launches_one_block(grid, to_device, to_host):
    """CuPy launches max(1, n) blocks along each axis, so `(n + 255) // 256` blocks with n = 0 runs one block."""
    blocks_run = to_device(np.zeros(2, dtype=np.int32))
    backend.RawKernel(COUNT_BLOCKS, "count_blocks")(grid, (64,), (blocks_run, np.int32(0)))
    np.testing.assert_array_equal(to_host(blocks_run), [1, 0])


# Only the x sizes: CuPy 14 on an H100 launched a grid of (1, 1.5) without complaint (what it made of the
# 1.5 is not a behaviour to teach), so the executor's refusal there is not tested against it.
@pytest.mark.parametrize("grid, block", [((2.0,), (64,)), ((2,), (64.0,))])
def test_float_grid_or_block_sizes_are_a_type_error(grid, block, to_device):
    blocks_run = to_device(np.zeros(2, dtype=np.int32))
    with pytest.raises(TypeError):
        backend.RawKernel(COUNT_BLOCKS, "count_blocks")(grid, block, (blocks_run, np.int32(0)))


def test_numpy_integer_grid_sizes_are_accepted(to_device, to_host):
    blocks_run = to_device(np.zeros(2, dtype=np.int32))
    backend.RawKernel(COUNT_BLOCKS, "count_blocks")((np.int64(3),), (np.int32(64),), (blocks_run, np.int32(1)))
    np.testing.assert_array_equal(to_host(blocks_run), [3, 1])


GLOBALS = r"""
__constant__ float weights[8];
__device__ int bias;

extern "C" __global__ void weigh(float* out, const float* x)
{
    out[threadIdx.x] = weights[threadIdx.x] * x[threadIdx.x] + bias;
}
"""


def test_get_global_fills_constant_and_device_variables_from_python(rng, to_device, to_host):
    module = backend.RawModule(code=GLOBALS)
    weights = rng.standard_normal(8).astype(np.float32)
    bias = np.array([5], dtype=np.int32)
    module.get_global("weights").copy_from_host(weights.ctypes.data_as(ctypes.c_void_p), weights.nbytes)
    module.get_global("bias").copy_from_host(bias.ctypes.data_as(ctypes.c_void_p), bias.nbytes)
    x = rng.standard_normal(8).astype(np.float32)
    out = to_device(np.zeros(8, dtype=np.float32))
    module.get_function("weigh")((1,), (8,), (out, to_device(x)))
    np.testing.assert_allclose(to_host(out), weights * x + 5, rtol=1e-6)
    read_back = np.zeros(8, dtype=np.float32)
    module.get_global("weights").copy_to_host(read_back.ctypes.data_as(ctypes.c_void_p), read_back.nbytes)
    np.testing.assert_array_equal(read_back, weights)


LONG_LINE = r"""
extern "C" __global__ void print_long_line(int length)
{
    char line[2001];
    for (int i = 0; i < length; ++i) line[i] = (char)('a' + i % 26);
    line[length] = 0;
    printf("<%s>\n", line);
}
"""


def test_printf_lines_longer_than_1023_characters_are_whole(capfd):
    backend.RawKernel(LONG_LINE, "print_long_line")((1,), (1,), (np.int32(2000),))
    backend.synchronize()
    printed = capfd.readouterr().out
    expected = "".join(chr(ord("a") + i % 26) for i in range(2000))
    assert f"<{expected}>" in printed


# ---------------------------------------------------------------------------------------------------------
# Warps are scheduled independently: a thread waiting for another warp's flag gets there
# ---------------------------------------------------------------------------------------------------------

SPIN = r"""
// Warp 0's first lane waits for a flag in global memory that the last warp raises.
extern "C" __global__ void wait_for_global_flag(int* out, volatile int* flag)
{
    if (threadIdx.x == 0) {
        while (*flag == 0) { }
        out[0] = *flag;
    }
    if (threadIdx.x == blockDim.x - 1) *flag = 42;
}

// A whole warp waits for a shared flag that another warp raises.
extern "C" __global__ void wait_for_shared_flag(int* out)
{
    __shared__ volatile int flag;
    if (threadIdx.x == 0) flag = 0;
    __syncthreads();
    if (threadIdx.x < 32) {
        while (flag == 0) { }
        out[blockIdx.x * 32 + threadIdx.x] = flag + threadIdx.x;
    } else if (threadIdx.x == 64) {
        flag = 1000 + blockIdx.x;
    }
}

// The last warp waits politely (__nanosleep) for the first warp's lanes to check in, one by one.
extern "C" __global__ void wait_with_nanosleep(int* out, volatile int* arrived)
{
    if (threadIdx.x < 32) {
        atomicAdd((int*)arrived, 1);
    } else if (threadIdx.x == blockDim.x - 1) {
        while (*arrived < 32) __nanosleep(100);
        out[0] = *arrived;
    }
}

// Warp 1 waits, through an atomic read, for warp 0 to count to 32.
extern "C" __global__ void wait_for_atomic_count(int* out, int* count)
{
    if (threadIdx.x >= 32) {
        while (atomicAdd(count, 0) < 32) { }
        out[threadIdx.x - 32] = atomicAdd(count, 0);
    } else {
        atomicAdd(count, 1);
    }
}
"""


def test_a_thread_spinning_on_a_flag_another_warp_raises_finishes(to_device, to_host):
    out, flag = to_device(np.zeros(1, dtype=np.int32)), to_device(np.zeros(1, dtype=np.int32))
    backend.RawModule(code=SPIN).get_function("wait_for_global_flag")((1,), (96,), (out, flag))
    np.testing.assert_array_equal(to_host(out), [42])


def test_a_warp_spinning_on_a_shared_flag_finishes(to_device, to_host):
    out = to_device(np.zeros(2 * 32, dtype=np.int32))
    backend.RawModule(code=SPIN).get_function("wait_for_shared_flag")((2,), (96,), (out,))
    expected = np.concatenate([1000 + np.arange(32), 1001 + np.arange(32)])
    np.testing.assert_array_equal(to_host(out), expected)


def test_a_warp_spinning_on_an_atomic_counter_finishes(to_device, to_host):
    out, count = to_device(np.zeros(32, dtype=np.int32)), to_device(np.zeros(1, dtype=np.int32))
    backend.RawModule(code=SPIN).get_function("wait_for_atomic_count")((1,), (64,), (out, count))
    np.testing.assert_array_equal(to_host(out), np.full(32, 32))


def test_a_thread_waiting_with_nanosleep_finishes(to_device, to_host):
    out, arrived = to_device(np.zeros(1, dtype=np.int32)), to_device(np.zeros(1, dtype=np.int32))
    backend.RawModule(code=SPIN).get_function("wait_with_nanosleep")((1,), (128,), (out, arrived))
    np.testing.assert_array_equal(to_host(out), [32])


# ---------------------------------------------------------------------------------------------------------
# The "last block" pattern: blocks publish partials with __threadfence() and an atomic ticket
# ---------------------------------------------------------------------------------------------------------


def test_the_last_block_to_take_a_ticket_sums_every_blocks_partial(to_device, to_host):
    """Small integers as floats: the sum is exact in any order. Launched twice: the counter is left at zero.
    On the CPU executor the launches also pass the race check (the fence orders the partials)."""
    blocks = 37
    x = np.arange(1, blocks + 1, dtype=np.float32)
    total, partials = to_device(np.zeros(1, dtype=np.float32)), to_device(np.zeros(blocks, dtype=np.float32))
    counter = to_device(np.zeros(1, dtype=np.uint32))
    kernel = backend.RawModule(code=SUM_LAST_BLOCK.replace("FENCE", "__threadfence();")).get_function("sum_last_block")
    with backend.checks(races=True):
        for launch in range(2):
            total[...] = 0
            kernel((blocks,), (32,), (total, partials, counter, to_device(x)))
            assert to_host(total)[0] == blocks * (blocks + 1) // 2, launch
    assert to_host(counter)[0] == 0
