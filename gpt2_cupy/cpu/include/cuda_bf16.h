// CUDA's <cuda_bf16.h> for the CPU executor: __nv_bfloat16 (nv_bfloat16), __nv_bfloat162, conversions that
// round to nearest even, arithmetic, comparisons, and the same names as on a GPU.
#pragma once
#include <gpt2cupy/small_float.h>

GPT2CUPY_SMALL_FLOAT(__nv_bfloat16, __nv_bfloat162, __nv_bfloat16_raw, __nv_bfloat162_raw, 7, 8)
typedef __nv_bfloat16 nv_bfloat16;
typedef __nv_bfloat162 nv_bfloat162;

__forceinline__ __nv_bfloat16 __float2bfloat16(float a) { return __nv_bfloat16(a); }
__forceinline__ __nv_bfloat16 __float2bfloat16_rn(float a) { return __nv_bfloat16(a); }
__forceinline__ __nv_bfloat16 __double2bfloat16(double a) { return __nv_bfloat16(a); }
__forceinline__ __nv_bfloat16 __float2bfloat16_rz(float a) { return __nv_bfloat16_raw{gpt2cupy::round_float_exactly<7, 8>(a, 'z')}; }
__forceinline__ __nv_bfloat16 __float2bfloat16_rd(float a) { return __nv_bfloat16_raw{gpt2cupy::round_float_exactly<7, 8>(a, 'd')}; }
__forceinline__ __nv_bfloat16 __float2bfloat16_ru(float a) { return __nv_bfloat16_raw{gpt2cupy::round_float_exactly<7, 8>(a, 'u')}; }
__forceinline__ float __bfloat162float(__nv_bfloat16 a) { return (float)a; }
__forceinline__ __nv_bfloat16 __int2bfloat16_rn(int a) { return __nv_bfloat16(a); }
__forceinline__ int __bfloat162int_rn(__nv_bfloat16 a) { return __float2int_rn((float)a); }
__forceinline__ int __bfloat162int_rz(__nv_bfloat16 a) { return __float2int_rz((float)a); }
__forceinline__ int __bfloat162int_rd(__nv_bfloat16 a) { return __float2int_rd((float)a); }
__forceinline__ int __bfloat162int_ru(__nv_bfloat16 a) { return __float2int_ru((float)a); }
__forceinline__ unsigned int __bfloat162uint_rn(__nv_bfloat16 a) { return __float2uint_rn((float)a); }
__forceinline__ unsigned int __bfloat162uint_rz(__nv_bfloat16 a) { return __float2uint_rz((float)a); }
__forceinline__ __nv_bfloat16 __uint2bfloat16_rn(unsigned int a) { return __nv_bfloat16(a); }
__forceinline__ __nv_bfloat16 __short2bfloat16_rn(short a) { return __nv_bfloat16(a); }
__forceinline__ short __bfloat16_as_short(__nv_bfloat16 a) { return (short)a.__x; }
__forceinline__ unsigned short __bfloat16_as_ushort(__nv_bfloat16 a) { return a.__x; }
__forceinline__ __nv_bfloat16 __short_as_bfloat16(short bits) { return __nv_bfloat16_raw{(unsigned short)bits}; }
__forceinline__ __nv_bfloat16 __ushort_as_bfloat16(unsigned short bits) { return __nv_bfloat16_raw{bits}; }

__forceinline__ __nv_bfloat162 __halves2bfloat162(__nv_bfloat16 low, __nv_bfloat16 high) { return __nv_bfloat162(low, high); }
__forceinline__ __nv_bfloat162 make_bfloat162(__nv_bfloat16 x, __nv_bfloat16 y) { return __nv_bfloat162(x, y); }
__forceinline__ __nv_bfloat162 __bfloat162bfloat162(__nv_bfloat16 a) { return __nv_bfloat162(a, a); }
__forceinline__ __nv_bfloat162 __float2bfloat162_rn(float a) { return __nv_bfloat162(__nv_bfloat16(a), __nv_bfloat16(a)); }
__forceinline__ __nv_bfloat162 __floats2bfloat162_rn(float low, float high) {
    return __nv_bfloat162(__nv_bfloat16(low), __nv_bfloat16(high));
}
__forceinline__ __nv_bfloat162 __float22bfloat162_rn(float2 a) { return __nv_bfloat162(__nv_bfloat16(a.x), __nv_bfloat16(a.y)); }
__forceinline__ float2 __bfloat1622float2(__nv_bfloat162 a) { return gpt2cupy_to_float2(a); }
__forceinline__ __nv_bfloat16 __low2bfloat16(__nv_bfloat162 a) { return a.x; }
__forceinline__ __nv_bfloat16 __high2bfloat16(__nv_bfloat162 a) { return a.y; }
__forceinline__ __nv_bfloat162 __lowhigh2highlow(__nv_bfloat162 a) { return __nv_bfloat162(a.y, a.x); }

// No CUDART_INF_BF16, CUDART_NAN_BF16, ... constants: the <cuda_bf16.h> that NVRTC finds beside CuPy may
// predate them (CUDA 12.2 added them), and there a kernel that names one does not compile. Build the value
// from its bits instead: __ushort_as_bfloat16((unsigned short)0x7FFFU) is the canonical NaN.

// How the executor checks arrays passed for a __nv_bfloat16* or __nv_bfloat162*: numpy has no bfloat16,
// so 16-bit integer arrays holding the bits.
namespace gpt2cupy {
template <> struct Element<__nv_bfloat16> { static constexpr char kind = 'u'; static constexpr unsigned short size = 2; static constexpr bool vector = false; };
template <> struct Element<__nv_bfloat162> { static constexpr char kind = 'u'; static constexpr unsigned short size = 2; static constexpr bool vector = true; };
}  // namespace gpt2cupy
