// CUDA's <cuda_fp16.h> for the CPU executor: __half (half), __half2 (half2), conversions that round to
// nearest even, arithmetic, comparisons, and the same names as on a GPU.
#pragma once
#include <gpt2cupy/small_float.h>

GPT2CUPY_SMALL_FLOAT(__half, __half2, __half_raw, __half2_raw, 10, 5)
typedef __half half;
typedef __half2 half2;

__forceinline__ __half __float2half(float a) { return __half(a); }
__forceinline__ __half __float2half_rn(float a) { return __half(a); }
__forceinline__ __half __double2half(double a) { return __half(a); }
__forceinline__ __half __float2half_rz(float a) { return __half_raw{gpt2cupy::round_float_exactly<10, 5>(a, 'z')}; }
__forceinline__ __half __float2half_rd(float a) { return __half_raw{gpt2cupy::round_float_exactly<10, 5>(a, 'd')}; }
__forceinline__ __half __float2half_ru(float a) { return __half_raw{gpt2cupy::round_float_exactly<10, 5>(a, 'u')}; }
__forceinline__ float __half2float(__half a) { return (float)a; }
__forceinline__ __half __int2half_rn(int a) { return __half(a); }
__forceinline__ __half __uint2half_rn(unsigned int a) { return __half(a); }
__forceinline__ int __half2int_rn(__half a) { return __float2int_rn((float)a); }
__forceinline__ int __half2int_rz(__half a) { return __float2int_rz((float)a); }
__forceinline__ int __half2int_rd(__half a) { return __float2int_rd((float)a); }
__forceinline__ int __half2int_ru(__half a) { return __float2int_ru((float)a); }
__forceinline__ unsigned int __half2uint_rn(__half a) { return __float2uint_rn((float)a); }
__forceinline__ unsigned int __half2uint_rz(__half a) { return __float2uint_rz((float)a); }
__forceinline__ long long __half2ll_rn(__half a) { return __float2ll_rn((float)a); }
__forceinline__ long long __half2ll_rz(__half a) { return __float2ll_rz((float)a); }
__forceinline__ short __half2short_rn(__half a) { int v = __float2int_rn((float)a); return (short)(v < -32768 ? -32768 : (v > 32767 ? 32767 : v)); }
__forceinline__ short __half2short_rz(__half a) { int v = __float2int_rz((float)a); return (short)(v < -32768 ? -32768 : (v > 32767 ? 32767 : v)); }
__forceinline__ __half __short2half_rn(short a) { return __half(a); }
__forceinline__ __half __ushort2half_rn(unsigned short a) { return __half(a); }
__forceinline__ __half __ll2half_rn(long long a) { return __half(a); }
__forceinline__ __half __ull2half_rn(unsigned long long a) { return __half(a); }
__forceinline__ short __half_as_short(__half a) { return (short)a.__x; }
__forceinline__ unsigned short __half_as_ushort(__half a) { return a.__x; }
__forceinline__ __half __short_as_half(short bits) { return __half_raw{(unsigned short)bits}; }
__forceinline__ __half __ushort_as_half(unsigned short bits) { return __half_raw{bits}; }

__forceinline__ __half2 __halves2half2(__half low, __half high) { return __half2(low, high); }
__forceinline__ __half2 make_half2(__half x, __half y) { return __half2(x, y); }
__forceinline__ __half2 __half2half2(__half a) { return __half2(a, a); }
__forceinline__ __half2 __float2half2_rn(float a) { return __half2(__half(a), __half(a)); }
__forceinline__ __half2 __floats2half2_rn(float low, float high) { return __half2(__half(low), __half(high)); }
__forceinline__ __half2 __float22half2_rn(float2 a) { return __half2(__half(a.x), __half(a.y)); }
__forceinline__ float2 __half22float2(__half2 a) { return gpt2cupy_to_float2(a); }
__forceinline__ __half __low2half(__half2 a) { return a.x; }
__forceinline__ __half __high2half(__half2 a) { return a.y; }
__forceinline__ __half2 __low2half2(__half2 a) { return __half2(a.x, a.x); }
__forceinline__ __half2 __high2half2(__half2 a) { return __half2(a.y, a.y); }
__forceinline__ __half2 __lowhigh2highlow(__half2 a) { return __half2(a.y, a.x); }
__forceinline__ __half2 __lows2half2(__half2 a, __half2 b) { return __half2(a.x, b.x); }
__forceinline__ __half2 __highs2half2(__half2 a, __half2 b) { return __half2(a.y, b.y); }

// No CUDART_INF_FP16, CUDART_NAN_FP16, ... constants: the <cuda_fp16.h> that NVRTC finds beside CuPy may
// predate them (CUDA 12.2 added them), and there a kernel that names one does not compile. Build the value
// from its bits instead: __ushort_as_half((unsigned short)0x7FFFU) is the canonical NaN.

// How the executor checks arrays passed for a __half* or __half2*: float16 ones.
namespace gpt2cupy {
template <> struct Element<__half> { static constexpr char kind = 'f'; static constexpr unsigned short size = 2; static constexpr bool vector = false; };
template <> struct Element<__half2> { static constexpr char kind = 'f'; static constexpr unsigned short size = 2; static constexpr bool vector = true; };
}  // namespace gpt2cupy
