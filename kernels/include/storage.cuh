// What an activation is stored as: float (float32) or __nv_bfloat16 (bf16: float32's 8 exponent bits and
// sign, 7 of its 23 mantissa bits; <cuda_bf16.h>). A kernel templated on its storage type `floatX` reads
// each element into a float, computes in float32, and rounds once when it stores the result, to nearest
// with ties to even. Sums, maxima, means and variances stay float32 inside the kernel: bf16 is only how
// the values travel through memory, half the bytes of float32.
#ifndef GPT2_CUPY_STORAGE_CUH
#define GPT2_CUPY_STORAGE_CUH

#include <cuda_bf16.h>
#include "float_groups.cuh"

// A stored element as a float: exact for both types (every bf16 value is a float32 value).
__device__ __forceinline__ float to_float(float x)
{
    return x;
}

__device__ __forceinline__ float to_float(__nv_bfloat16 x)
{
    return __bfloat162float(x);
}

// A float as the storage type: itself, or rounded to the nearest bf16 (ties to even; NaN stays NaN).
template <typename floatX>
__device__ __forceinline__ floatX from_float(float x);

template <>
__device__ __forceinline__ float from_float<float>(float x)
{
    return x;
}

template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x)
{
    return __float2bfloat16_rn(x);
}

// WIDTH neighbouring bf16 moved by one load or store (8 bytes for 4 of them): the array's address must be a
// multiple of the group's size, as float_groups.cuh's float4s need 16 bytes.
template <int WIDTH>
struct alignas(2 * WIDTH) Bf16Group {
    __nv_bfloat16 item[WIDTH];
};

// WIDTH elements from source into destination as floats when `inside`, zeros otherwise (nothing read):
// float4 groups for float (float_groups.cuh's load_group), WIDTH-element groups for bf16.
template <int WIDTH>
__device__ __forceinline__ void load_as_float(float* destination, const float* source, bool inside)
{
    load_group<WIDTH>(destination, source, inside);
}

template <int WIDTH>
__device__ __forceinline__ void load_as_float(float* destination, const __nv_bfloat16* source, bool inside)
{
    if (!inside) {
        for (int w = 0; w < WIDTH; ++w) {
            destination[w] = 0.0f;
        }
        return;
    }
    Bf16Group<WIDTH> group = *reinterpret_cast<const Bf16Group<WIDTH>*>(source);
    for (int w = 0; w < WIDTH; ++w) {
        destination[w] = __bfloat162float(group.item[w]);
    }
}

// WIDTH floats stored as WIDTH elements of the storage type, each rounded once.
template <int WIDTH>
__device__ __forceinline__ void store_from_float(float* destination, const float* source)
{
    store_group<WIDTH>(destination, source);
}

template <int WIDTH>
__device__ __forceinline__ void store_from_float(__nv_bfloat16* destination, const float* source)
{
    Bf16Group<WIDTH> group;
    for (int w = 0; w < WIDTH; ++w) {
        group.item[w] = __float2bfloat16_rn(source[w]);
    }
    *reinterpret_cast<Bf16Group<WIDTH>*>(destination) = group;
}

// Two neighbours of a row stored at once, each rounded once: one 8-byte store of float, 4-byte of bf16 (the
// destination a multiple of that size).
__device__ __forceinline__ void store_pair(float* destination, float first, float second)
{
    *reinterpret_cast<float2*>(destination) = make_float2(first, second);
}

__device__ __forceinline__ void store_pair(__nv_bfloat16* destination, float first, float second)
{
    *reinterpret_cast<__nv_bfloat162*>(destination) = __floats2bfloat162_rn(first, second);
}

#endif
