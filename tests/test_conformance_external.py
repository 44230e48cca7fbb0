"""Conformance: the CUDA that kernels written elsewhere use, in kernels of the style of llm.c's `dev/cuda`
files and NVIDIA's samples, checked against numpy.

Like tests/test_conformance.py, these run on whichever backend is active: on a GPU they check that the
kernels and the references agree with CUDA itself, on the CPU that the executor behaves as CUDA does.
`warpSize` as a variable, parameters named like CUDA's types, every order of `extern __shared__`,
`__CUDA_ARCH__`, sub-word stores, null pointers and cooperative groups beyond warp tiles.
"""

import numpy as np
import pytest

from gpt2_cupy import backend
from test_conformance_builtins import bfloat16_bits_reference, bfloat16_to_float


def blocks_for(n, block):
    return (n + block - 1) // block


# ---------------------------------------------------------------------------------------------------------
# warpSize: a variable of value 32, usable wherever a variable is, and nowhere a constant is needed
# ---------------------------------------------------------------------------------------------------------

# A row's sum, as llm.c's softmax kernels take it: each warp sums its lanes' values with __shfl_xor_sync, its
# first lane puts the warp's sum in shared memory sized at launch (one float per warp), and warp 0 adds those.
ROW_SUM_BY_WARPS = r"""
extern "C" __global__ void row_sums(float* out, const float* x, int columns)
{
    extern __shared__ float warp_sums[];
    const int warp = threadIdx.x / warpSize;
    const int lane = threadIdx.x % warpSize;
    const int warps = blockDim.x / warpSize;
    const float* row = x + (size_t)blockIdx.x * columns;
    float sum = 0.0f;
    for (int c = threadIdx.x; c < columns; c += blockDim.x) sum += row[c];
    for (int offset = warpSize / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffff, sum, offset);
    if (lane == 0) warp_sums[warp] = sum;
    __syncthreads();
    if (warp == 0) {
        sum = lane < warps ? warp_sums[lane] : 0.0f;
        for (int offset = warpSize / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffff, sum, offset);
        if (lane == 0) out[blockIdx.x] = sum;
    }
}
"""


@pytest.mark.parametrize("threads", [32, 128, 1024])
def test_warp_size_in_expressions_and_dynamic_shared_sizes(threads, rng, to_device, to_host):
    rows, columns = 5, 1000
    x = rng.standard_normal((rows, columns)).astype(np.float32)
    out = to_device(np.zeros(rows, dtype=np.float32))
    kernel = backend.RawKernel(ROW_SUM_BY_WARPS, "row_sums")
    kernel((rows,), (threads,), (out, to_device(x), np.int32(columns)), shared_mem=threads // 32 * 4)
    np.testing.assert_allclose(to_host(out), x.astype(np.float64).sum(axis=1), rtol=1e-5, atol=1e-4)


WARP_SIZE_IN_A_TEMPLATE = r"""
template <int WARPS_PER_BLOCK>
__global__ void lanes_and_warps(int* out)
{
    __shared__ int per_warp[WARPS_PER_BLOCK];
    if (threadIdx.x % warpSize == 0) per_warp[threadIdx.x / warpSize] = warpSize * (int)(threadIdx.x / warpSize);
    __syncthreads();
    out[threadIdx.x] = per_warp[threadIdx.x / warpSize] + threadIdx.x % warpSize;
}
"""


def test_warp_size_in_a_template_kernel(to_device, to_host):
    module = backend.RawModule(code=WARP_SIZE_IN_A_TEMPLATE, name_expressions=["lanes_and_warps<4>"])
    out = to_device(np.full(128, -1, dtype=np.int32))
    module.get_function("lanes_and_warps<4>")((1,), (128,), (out,))
    np.testing.assert_array_equal(to_host(out), np.arange(128, dtype=np.int32))


def test_a_single_use_of_warp_size_does_not_stop_the_sources_other_kernels(to_device, to_host):
    code = r"""
    extern "C" __global__ void warp_size(int* out) { out[threadIdx.x] = warpSize; }
    extern "C" __global__ void identity(int* out) { out[threadIdx.x] = threadIdx.x; }
    """
    module = backend.RawModule(code=code)
    out = to_device(np.zeros(40, dtype=np.int32))
    module.get_function("identity")((1,), (40,), (out,))
    np.testing.assert_array_equal(to_host(out), np.arange(40, dtype=np.int32))
    module.get_function("warp_size")((1,), (40,), (out,))
    np.testing.assert_array_equal(to_host(out), np.full(40, 32, dtype=np.int32))


@pytest.mark.parametrize("declaration", ["__shared__ float per_lane[warpSize];",
                                         "float in_registers[warpSize] = {};"])
def test_an_array_sized_by_warp_size_is_refused(declaration):
    """warpSize is a variable in CUDA, not a constant expression: nvcc and NVRTC refuse it as an array size."""
    code = ('extern "C" __global__ void sized_by_warp(float* out)\n{\n    ' + declaration +
            "\n    out[threadIdx.x] = 0.0f;\n}\n")
    with pytest.raises(Exception, match="warpSize"):
        backend.RawKernel(code, "sized_by_warp")((1,), (32,), (backend.xp.zeros(32, dtype=backend.xp.float32),))
        backend.synchronize()


# ---------------------------------------------------------------------------------------------------------
# Parameters named like CUDA's types, as llm.c's permute kernel names its sizes dim1 .. dim4
# ---------------------------------------------------------------------------------------------------------

# (dim1, dim2, dim3, dim4) -> (dim1, dim3, dim2, dim4): attention's (B, N, NH, d) to (B, NH, N, d).
PERMUTE = r"""
extern "C" __global__ void permute(float* out, const float* in, int dim1, int dim2, int dim3, int dim4)
{
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx < dim1 * dim2 * dim3 * dim4) {
        int d4 = idx % dim4;
        int d2 = (idx / dim4) % dim2;
        int d3 = (idx / (dim4 * dim2)) % dim3;
        int d1 = idx / (dim4 * dim2 * dim3);
        out[idx] = in[((d1 * dim2 + d2) * dim3 + d3) * dim4 + d4];
    }
}
"""


def test_a_parameter_named_dim3_leaves_block_dim_and_grid_dim_alone(rng, to_device, to_host):
    shape = (2, 7, 3, 5)
    x = rng.standard_normal(shape).astype(np.float32)
    out = to_device(np.zeros(x.size, dtype=np.float32))
    backend.RawKernel(PERMUTE, "permute")((blocks_for(x.size, 64),), (64,),
                                           (out, to_device(x), *map(np.int32, shape)))
    np.testing.assert_array_equal(to_host(out), x.transpose(0, 2, 1, 3).reshape(-1))


TYPE_NAMED_PARAMETERS = r"""
extern "C" __global__ void type_named(int* out, int uint3, int dim3, int int2)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    out[i] = uint3 * 10000 + dim3 * 100 + int2 + (int)(gridDim.x * 1000000);
}
"""


def test_parameters_named_uint3_dim3_int2_leave_the_coordinates_alone(to_device, to_host):
    out = to_device(np.zeros(3 * 32, dtype=np.int32))
    backend.RawKernel(TYPE_NAMED_PARAMETERS, "type_named")((3,), (32,), (out, np.int32(4), np.int32(5), np.int32(6)))
    np.testing.assert_array_equal(to_host(out), np.full(96, 3 * 1000000 + 4 * 10000 + 5 * 100 + 6, dtype=np.int32))


# ---------------------------------------------------------------------------------------------------------
# extern __shared__: every order of the specifiers nvcc accepts
# ---------------------------------------------------------------------------------------------------------

EXTERN_SHARED_REVERSE = r"""
extern "C" __global__ void reverse_in_shared(float* out, const float* in)
{
    DECLARATION
    buffer[threadIdx.x] = in[blockIdx.x * blockDim.x + threadIdx.x];
    __syncthreads();
    out[blockIdx.x * blockDim.x + threadIdx.x] = buffer[blockDim.x - 1 - threadIdx.x];
}
"""


@pytest.mark.parametrize("declaration", [
    "extern __shared__ float buffer[];",
    "extern float __shared__ buffer[];",
    "__shared__ extern float buffer[];",
    "extern __shared__ __align__(16) float buffer[];",
    "extern __align__(16) float __shared__ buffer[];",
    "__shared__ __align__(8) extern float buffer[];",
    "extern volatile __shared__ float buffer[];",
])
def test_extern_shared_in_every_order(declaration, rng, to_device, to_host):
    x = rng.standard_normal(3 * 96).astype(np.float32)
    out = to_device(np.zeros_like(x))
    kernel = backend.RawKernel(EXTERN_SHARED_REVERSE.replace("DECLARATION", declaration), "reverse_in_shared")
    kernel((3,), (96,), (out, to_device(x)), shared_mem=96 * 4)
    np.testing.assert_array_equal(to_host(out), x.reshape(3, 96)[:, ::-1].reshape(-1))


def test_extern_shared_at_file_scope_after_the_type(rng, to_device, to_host):
    code = "extern float __shared__ buffer[];\n" + EXTERN_SHARED_REVERSE.replace("DECLARATION", "")
    x = rng.standard_normal(64).astype(np.float32)
    out = to_device(np.zeros_like(x))
    backend.RawKernel(code, "reverse_in_shared")((1,), (64,), (out, to_device(x)), shared_mem=64 * 4)
    np.testing.assert_array_equal(to_host(out), x[::-1])


# ---------------------------------------------------------------------------------------------------------
# __CUDA_ARCH__: 900 on an H100 and H200, and on the executor that imitates one
# ---------------------------------------------------------------------------------------------------------

CUDA_ARCH = r"""
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
extern "C" __global__ void architecture(int* out)
{
    // The sm_80 warp reduction, where older GPUs need a shuffle loop.
    out[threadIdx.x] = __reduce_add_sync(0xffffffff, (int)threadIdx.x) + 1000 * __CUDA_ARCH__;
}
#endif
"""


def test_cuda_arch_is_defined_as_hopper_also_where_kernels_are_found(to_device, to_host):
    """The kernel exists only under `__CUDA_ARCH__ >= 800`: the preprocessor that finds it sees the value too."""
    out = to_device(np.zeros(32, dtype=np.int32))
    backend.RawKernel(CUDA_ARCH, "architecture")((1,), (32,), (out,))
    assert set(to_host(out).tolist()) == {sum(range(32)) + 1000 * 900}


# ---------------------------------------------------------------------------------------------------------
# Elements smaller than a word: bfloat16 as llm.c stores it (one per thread, and eight at a time through a
# 16-byte Packed128 with __ldcs/__stcs), bytes and bools. Neighbouring threads store to one 4-byte word.
# ---------------------------------------------------------------------------------------------------------

BFLOAT16_ELEMENTWISE = r"""
#include <cuda_bf16.h>
typedef __nv_bfloat16 floatX;

// 16 bytes of elements of type T, loaded and stored as one int4 (llm.c's Packed128).
template <class T>
struct alignas(16) Packed128 {
    static constexpr int size = sizeof(int4) / sizeof(T);
    T payload[size];
    __device__ Packed128() {}
    __device__ explicit Packed128(int4 bits) { memcpy(&payload, &bits, sizeof(bits)); }
    __device__ int4 get_bits() const {
        int4 bits;
        memcpy(&bits, &payload, sizeof(bits));
        return bits;
    }
    __device__ T& operator[](int index) { return payload[index]; }
};
template <class T> __device__ Packed128<T> load128cs(const T* address) {
    return Packed128<T>(__ldcs(reinterpret_cast<const int4*>(address)));
}
template <class T> __device__ void store128cs(T* target, Packed128<T> value) {
    __stcs(reinterpret_cast<int4*>(target), value.get_bits());
}

// One element per thread: neighbouring threads write the two halves of one word.
extern "C" __global__ void residual_forward(floatX* out, const floatX* a, const floatX* b, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = __float2bfloat16((float)a[i] + (float)b[i]);
}

// Eight elements per thread, 16 bytes at a time (n a multiple of 8).
extern "C" __global__ void multiply_packed(floatX* out, const floatX* a, const floatX* b, int n)
{
    int i = (blockIdx.x * blockDim.x + threadIdx.x) * Packed128<floatX>::size;
    if (i >= n) return;
    Packed128<floatX> packed_a = load128cs(a + i), packed_b = load128cs(b + i), packed_out;
    for (int k = 0; k < Packed128<floatX>::size; ++k)
        packed_out[k] = __float2bfloat16((float)packed_a[k] * (float)packed_b[k]);
    store128cs(out + i, packed_out);
}

// A byte and a bool per thread.
extern "C" __global__ void signs(unsigned char* positive, bool* negative, const float* x, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        positive[i] = x[i] > 0.0f;
        negative[i] = x[i] < 0.0f;
    }
}

// A 16-bit store per thread.
extern "C" __global__ void thread_numbers(unsigned short* out) { out[blockIdx.x * blockDim.x + threadIdx.x] = threadIdx.x; }
"""


def bfloat16_inputs(rng, n):
    """bfloat16 bits (as uint16, numpy has no bfloat16) of normal random values."""
    return bfloat16_bits_reference(rng.standard_normal(n).astype(np.float32))


def test_bfloat16_one_element_per_thread(rng, to_device, to_host):
    n = 1001
    a, b = bfloat16_inputs(rng, n), bfloat16_inputs(rng, n)
    out = to_device(np.zeros(n, dtype=np.uint16))
    backend.RawModule(code=BFLOAT16_ELEMENTWISE).get_function("residual_forward")(
        (blocks_for(n, 128),), (128,), (out, to_device(a), to_device(b), np.int32(n)))
    expected = bfloat16_bits_reference(bfloat16_to_float(a) + bfloat16_to_float(b))  # one float32 sum, then RNE
    np.testing.assert_array_equal(to_host(out), expected)


def test_bfloat16_eight_elements_per_thread_through_packed128(rng, to_device, to_host):
    n = 8 * 300
    a, b = bfloat16_inputs(rng, n), bfloat16_inputs(rng, n)
    out = to_device(np.zeros(n, dtype=np.uint16))
    backend.RawModule(code=BFLOAT16_ELEMENTWISE).get_function("multiply_packed")(
        (blocks_for(n // 8, 64),), (64,), (out, to_device(a), to_device(b), np.int32(n)))
    # Two 8-bit significands multiply exactly in float32: the only rounding is the one to bfloat16.
    product = bfloat16_to_float(a).astype(np.float64) * bfloat16_to_float(b)
    np.testing.assert_array_equal(to_host(out), bfloat16_bits_reference(product.astype(np.float32)))


def test_bytes_and_bools_one_per_thread(rng, to_device, to_host):
    n = 777
    x = rng.standard_normal(n).astype(np.float32)
    x[::50] = 0.0
    positive, negative = to_device(np.full(n, 7, dtype=np.uint8)), to_device(np.ones(n, dtype=np.bool_))
    backend.RawModule(code=BFLOAT16_ELEMENTWISE).get_function("signs")(
        (blocks_for(n, 96),), (96,), (positive, negative, to_device(x), np.int32(n)))
    np.testing.assert_array_equal(to_host(positive), (x > 0).astype(np.uint8))
    np.testing.assert_array_equal(to_host(negative), x < 0)


def test_sixteen_bit_stores_one_per_thread(to_device, to_host):
    out = to_device(np.zeros(3 * 33, dtype=np.uint16))
    backend.RawModule(code=BFLOAT16_ELEMENTWISE).get_function("thread_numbers")((3,), (33,), (out,))
    np.testing.assert_array_equal(to_host(out), np.tile(np.arange(33, dtype=np.uint16), 3))


# ---------------------------------------------------------------------------------------------------------
# Null pointers: CuPy passes a Python int as 8 bytes, so 0 for a pointer parameter is NULL
# ---------------------------------------------------------------------------------------------------------

# A row's softmax and, where the caller wants them, the probabilities (llm.c's fused classifier writes
# them only when its `probs` is not null).
SOFTMAX_WITH_OPTIONAL_PROBABILITIES = r"""
extern "C" __global__ void row_max_and_probabilities(float* row_max, float* probs, const float* logits, int columns)
{
    if (threadIdx.x != 0) return;
    const float* row = logits + (size_t)blockIdx.x * columns;
    float largest = row[0];
    for (int c = 1; c < columns; ++c) largest = fmaxf(largest, row[c]);
    row_max[blockIdx.x] = largest;
    if (probs == nullptr) return;
    float sum = 0.0f;
    for (int c = 0; c < columns; ++c) sum += expf(row[c] - largest);
    for (int c = 0; c < columns; ++c) probs[(size_t)blockIdx.x * columns + c] = expf(row[c] - largest) / sum;
}
"""


@pytest.mark.parametrize("null", [0, np.uint64(0), np.int64(0)], ids=["int", "uint64", "int64"])
def test_zero_for_a_pointer_parameter_is_a_null_pointer(null, rng, to_device, to_host):
    rows, columns = 3, 50
    logits = rng.standard_normal((rows, columns)).astype(np.float32)
    kernel = backend.RawKernel(SOFTMAX_WITH_OPTIONAL_PROBABILITIES, "row_max_and_probabilities")
    row_max = to_device(np.zeros(rows, dtype=np.float32))
    kernel((rows,), (32,), (row_max, null, to_device(logits), np.int32(columns)))
    np.testing.assert_array_equal(to_host(row_max), logits.max(axis=1))

    probs = to_device(np.zeros((rows, columns), dtype=np.float32))
    kernel((rows,), (32,), (row_max, probs, to_device(logits), np.int32(columns)))
    shifted = np.exp(logits.astype(np.float64) - logits.max(axis=1, keepdims=True))
    np.testing.assert_allclose(to_host(probs), shifted / shifted.sum(axis=1, keepdims=True), rtol=1e-5)
