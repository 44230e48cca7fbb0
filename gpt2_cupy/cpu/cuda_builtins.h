// The CUDA built-ins a kernel may use without an #include, for the CPU executor.
//
// Every kernel is compiled as C++ with this header in front of it and nothing else: no system header
// is included, so what NVRTC would reject for lack of an #include (INFINITY, FLT_MAX, std::vector,
// fopen, rand) is rejected here too, and a kernel that compiles on the CPU also compiles for the GPU.
#pragma once
#include "executor_abi.h"

#define __CUDACC__ 1

// ---- qualifiers ------------------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __constant__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __restrict__ __restrict
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)
// A block's threads run as fibers of one OS thread, so a thread_local variable is one per block:
// exactly the lifetime and sharing of __shared__ memory. (extern __shared__ arrays are rewritten by
// the compiler driver into a pointer to the block's dynamic shared memory.)
#define __shared__ static thread_local

// ---- where a thread is -----------------------------------------------------------------------------
#define threadIdx (static_cast<const uint3&>(gpt2cupy_current_thread->thread_idx))
#define blockIdx (static_cast<const uint3&>(gpt2cupy_current_thread->block_idx))
#define blockDim (static_cast<const dim3&>(gpt2cupy_current_thread->block_dim))
#define gridDim (static_cast<const dim3&>(gpt2cupy_current_thread->grid_dim))
// A variable on a GPU, not a compile-time constant: `float s[warpSize]` fails there and here.
extern "C" const int gpt2cupy_warp_size;
#define warpSize gpt2cupy_warp_size

// ---- vector types ----------------------------------------------------------------------------------
#define GPT2CUPY_VECTOR2(name, T, align)                                          \
    struct __attribute__((aligned(align))) name { T x, y; };                      \
    __forceinline__ name make_##name(T x, T y) { return name{x, y}; }
#define GPT2CUPY_VECTOR3(name, T)                                                 \
    struct name { T x, y, z; };                                                   \
    __forceinline__ name make_##name(T x, T y, T z) { return name{x, y, z}; }
#define GPT2CUPY_VECTOR4(name, T, align)                                          \
    struct __attribute__((aligned(align))) name { T x, y, z, w; };                \
    __forceinline__ name make_##name(T x, T y, T z, T w) { return name{x, y, z, w}; }

GPT2CUPY_VECTOR2(float2, float, 8)
GPT2CUPY_VECTOR3(float3, float)
GPT2CUPY_VECTOR4(float4, float, 16)
GPT2CUPY_VECTOR2(double2, double, 16)
GPT2CUPY_VECTOR2(int2, int, 8)
GPT2CUPY_VECTOR3(int3, int)
GPT2CUPY_VECTOR4(int4, int, 16)
GPT2CUPY_VECTOR2(uint2, unsigned int, 8)
GPT2CUPY_VECTOR4(uint4, unsigned int, 16)
GPT2CUPY_VECTOR2(short2, short, 4)
GPT2CUPY_VECTOR2(ushort2, unsigned short, 4)
GPT2CUPY_VECTOR4(char4, signed char, 4)
GPT2CUPY_VECTOR4(uchar4, unsigned char, 4)
GPT2CUPY_VECTOR2(longlong2, long long, 16)
GPT2CUPY_VECTOR2(ulonglong2, unsigned long long, 16)
__forceinline__ uint3 make_uint3(unsigned int x, unsigned int y, unsigned int z) { return uint3{x, y, z}; }

// ---- math: the C library's functions, declared here and only here ---------------------------------
extern "C" {
#define GPT2CUPY_UNARY(name) float name##f(float) noexcept; double name(double) noexcept;
#define GPT2CUPY_BINARY(name) float name##f(float, float) noexcept; double name(double, double) noexcept;
GPT2CUPY_UNARY(exp) GPT2CUPY_UNARY(exp2) GPT2CUPY_UNARY(exp10) GPT2CUPY_UNARY(expm1)
GPT2CUPY_UNARY(log) GPT2CUPY_UNARY(log2) GPT2CUPY_UNARY(log10) GPT2CUPY_UNARY(log1p)
GPT2CUPY_UNARY(sqrt) GPT2CUPY_UNARY(cbrt)
GPT2CUPY_UNARY(sin) GPT2CUPY_UNARY(cos) GPT2CUPY_UNARY(tan)
GPT2CUPY_UNARY(asin) GPT2CUPY_UNARY(acos) GPT2CUPY_UNARY(atan)
GPT2CUPY_UNARY(sinh) GPT2CUPY_UNARY(cosh) GPT2CUPY_UNARY(tanh)
GPT2CUPY_UNARY(asinh) GPT2CUPY_UNARY(acosh) GPT2CUPY_UNARY(atanh)
GPT2CUPY_UNARY(erf) GPT2CUPY_UNARY(erfc) GPT2CUPY_UNARY(lgamma) GPT2CUPY_UNARY(tgamma)
GPT2CUPY_UNARY(fabs) GPT2CUPY_UNARY(floor) GPT2CUPY_UNARY(ceil) GPT2CUPY_UNARY(trunc)
GPT2CUPY_UNARY(round) GPT2CUPY_UNARY(rint) GPT2CUPY_UNARY(nearbyint)
GPT2CUPY_BINARY(pow) GPT2CUPY_BINARY(atan2) GPT2CUPY_BINARY(hypot) GPT2CUPY_BINARY(fmod)
GPT2CUPY_BINARY(remainder) GPT2CUPY_BINARY(fmax) GPT2CUPY_BINARY(fmin) GPT2CUPY_BINARY(fdim)
GPT2CUPY_BINARY(copysign) GPT2CUPY_BINARY(nextafter)
#undef GPT2CUPY_UNARY
#undef GPT2CUPY_BINARY
float fmaf(float, float, float) noexcept;
double fma(double, double, double) noexcept;
float ldexpf(float, int) noexcept;
double ldexp(double, int) noexcept;
float frexpf(float, int*) noexcept;
double frexp(double, int*) noexcept;
void sincosf(float, float*, float*) noexcept;
void sincos(double, double*, double*) noexcept;
void* memcpy(void*, const void*, unsigned long) noexcept;
void* memset(void*, int, unsigned long) noexcept;
}

__forceinline__ float rsqrtf(float x) { return 1.0f / sqrtf(x); }
__forceinline__ double rsqrt(double x) { return 1.0 / sqrt(x); }
// The fast, less exact hardware intrinsics: on the CPU they are the exact functions.
__forceinline__ float __expf(float x) { return expf(x); }
__forceinline__ float __exp10f(float x) { return exp10f(x); }
__forceinline__ float __logf(float x) { return logf(x); }
__forceinline__ float __log2f(float x) { return log2f(x); }
__forceinline__ float __log10f(float x) { return log10f(x); }
__forceinline__ float __sinf(float x) { return sinf(x); }
__forceinline__ float __cosf(float x) { return cosf(x); }
__forceinline__ float __tanf(float x) { return tanf(x); }
__forceinline__ float __powf(float x, float y) { return powf(x, y); }
__forceinline__ float __fdividef(float x, float y) { return x / y; }
__forceinline__ float __frcp_rn(float x) { return 1.0f / x; }
__forceinline__ float __fsqrt_rn(float x) { return sqrtf(x); }
__forceinline__ float __frsqrt_rn(float x) { return 1.0f / sqrtf(x); }
__forceinline__ float __fadd_rn(float x, float y) { return x + y; }
__forceinline__ float __fsub_rn(float x, float y) { return x - y; }
__forceinline__ float __fmul_rn(float x, float y) { return x * y; }
__forceinline__ float __fdiv_rn(float x, float y) { return x / y; }
__forceinline__ float __fmaf_rn(float x, float y, float z) { return fmaf(x, y, z); }
__forceinline__ float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x); }
__forceinline__ float exp2f_fast(float x) { return exp2f(x); }

template <class To, class From>
__forceinline__ To gpt2cupy_bit_cast(From value) {
    static_assert(sizeof(To) == sizeof(From), "bit cast between types of different sizes");
    To result;
    __builtin_memcpy(&result, &value, sizeof(To));
    return result;
}
__forceinline__ int __float_as_int(float x) { return gpt2cupy_bit_cast<int>(x); }
__forceinline__ unsigned int __float_as_uint(float x) { return gpt2cupy_bit_cast<unsigned int>(x); }
__forceinline__ float __int_as_float(int x) { return gpt2cupy_bit_cast<float>(x); }
__forceinline__ float __uint_as_float(unsigned int x) { return gpt2cupy_bit_cast<float>(x); }
__forceinline__ long long __double_as_longlong(double x) { return gpt2cupy_bit_cast<long long>(x); }
__forceinline__ double __longlong_as_double(long long x) { return gpt2cupy_bit_cast<double>(x); }

__forceinline__ int __float2int_rn(float x) { return (int)rintf(x); }
__forceinline__ int __float2int_rz(float x) { return (int)x; }
__forceinline__ int __float2int_rd(float x) { return (int)floorf(x); }
__forceinline__ int __float2int_ru(float x) { return (int)ceilf(x); }
__forceinline__ float __int2float_rn(int x) { return (float)x; }

__forceinline__ bool isnan(float x) { return __builtin_isnan(x); }
__forceinline__ bool isnan(double x) { return __builtin_isnan(x); }
__forceinline__ bool isinf(float x) { return __builtin_isinf(x); }
__forceinline__ bool isinf(double x) { return __builtin_isinf(x); }
__forceinline__ bool isfinite(float x) { return __builtin_isfinite(x); }
__forceinline__ bool isfinite(double x) { return __builtin_isfinite(x); }
__forceinline__ bool signbit(float x) { return __builtin_signbit(x); }
__forceinline__ bool signbit(double x) { return __builtin_signbit(x); }

__forceinline__ int abs(int x) { return x < 0 ? -x : x; }
__forceinline__ long long llabs(long long x) { return x < 0 ? -x : x; }
__forceinline__ float abs(float x) { return fabsf(x); }
__forceinline__ double abs(double x) { return fabs(x); }

// min and max: the overloads CUDA's math headers give device code (a call that mixes float and int is
// ambiguous there, and so it is here).
#define GPT2CUPY_MIN_MAX(A, B, R)                                     \
    __forceinline__ R min(A a, B b) { return (R)a < (R)b ? (R)a : (R)b; } \
    __forceinline__ R max(A a, B b) { return (R)a > (R)b ? (R)a : (R)b; }
GPT2CUPY_MIN_MAX(int, int, int)
GPT2CUPY_MIN_MAX(unsigned int, unsigned int, unsigned int)
GPT2CUPY_MIN_MAX(int, unsigned int, unsigned int)
GPT2CUPY_MIN_MAX(unsigned int, int, unsigned int)
GPT2CUPY_MIN_MAX(long long, long long, long long)
GPT2CUPY_MIN_MAX(unsigned long long, unsigned long long, unsigned long long)
GPT2CUPY_MIN_MAX(long, long, long)
GPT2CUPY_MIN_MAX(unsigned long, unsigned long, unsigned long)
GPT2CUPY_MIN_MAX(float, float, float)
GPT2CUPY_MIN_MAX(double, double, double)
GPT2CUPY_MIN_MAX(float, double, double)
GPT2CUPY_MIN_MAX(double, float, double)
#undef GPT2CUPY_MIN_MAX
__forceinline__ unsigned int umin(unsigned int a, unsigned int b) { return a < b ? a : b; }
__forceinline__ unsigned int umax(unsigned int a, unsigned int b) { return a > b ? a : b; }

// ---- bits ------------------------------------------------------------------------------------------
__forceinline__ int __popc(unsigned int x) { return __builtin_popcount(x); }
__forceinline__ int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
__forceinline__ int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned int)x); }
__forceinline__ int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll((unsigned long long)x); }
__forceinline__ int __ffs(int x) { return __builtin_ffs(x); }
__forceinline__ int __ffsll(long long x) { return __builtin_ffsll(x); }
__forceinline__ unsigned int __brev(unsigned int x) {
    unsigned int r = 0;
    for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
    return r;
}
__forceinline__ unsigned int __umulhi(unsigned int a, unsigned int b) {
    return (unsigned int)(((unsigned long long)a * b) >> 32);
}
__forceinline__ int __mulhi(int a, int b) { return (int)(((long long)a * b) >> 32); }

// ---- memory ----------------------------------------------------------------------------------------
template <class T>
__forceinline__ T __ldg(const T* address) { return *address; }
__forceinline__ void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
__forceinline__ void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

// Atomics: blocks run on several OS threads at once, so these are real atomic instructions.
#define GPT2CUPY_ATOMIC_INTEGER(T)                                                                       \
    __forceinline__ T atomicAdd(T* a, T v) { return __atomic_fetch_add(a, v, __ATOMIC_RELAXED); }         \
    __forceinline__ T atomicSub(T* a, T v) { return __atomic_fetch_sub(a, v, __ATOMIC_RELAXED); }         \
    __forceinline__ T atomicExch(T* a, T v) { return __atomic_exchange_n(a, v, __ATOMIC_RELAXED); }       \
    __forceinline__ T atomicAnd(T* a, T v) { return __atomic_fetch_and(a, v, __ATOMIC_RELAXED); }         \
    __forceinline__ T atomicOr(T* a, T v) { return __atomic_fetch_or(a, v, __ATOMIC_RELAXED); }           \
    __forceinline__ T atomicXor(T* a, T v) { return __atomic_fetch_xor(a, v, __ATOMIC_RELAXED); }         \
    __forceinline__ T atomicCAS(T* a, T expected, T desired) {                                            \
        __atomic_compare_exchange_n(a, &expected, desired, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);     \
        return expected;                                                                                   \
    }                                                                                                      \
    __forceinline__ T atomicMax(T* a, T v) {                                                              \
        T old = __atomic_load_n(a, __ATOMIC_RELAXED);                                                      \
        while (old < v && !__atomic_compare_exchange_n(a, &old, v, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {} \
        return old;                                                                                        \
    }                                                                                                      \
    __forceinline__ T atomicMin(T* a, T v) {                                                              \
        T old = __atomic_load_n(a, __ATOMIC_RELAXED);                                                      \
        while (old > v && !__atomic_compare_exchange_n(a, &old, v, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {} \
        return old;                                                                                        \
    }
GPT2CUPY_ATOMIC_INTEGER(int)
GPT2CUPY_ATOMIC_INTEGER(unsigned int)
GPT2CUPY_ATOMIC_INTEGER(unsigned long long)
GPT2CUPY_ATOMIC_INTEGER(long long)
#undef GPT2CUPY_ATOMIC_INTEGER

// Floating-point atomics as a compare-and-swap loop on the bits.
template <class F, class Bits>
__forceinline__ F gpt2cupy_atomic_update(F* address, F value, F (*update)(F, F)) {
    Bits* bits = reinterpret_cast<Bits*>(address);
    Bits old = __atomic_load_n(bits, __ATOMIC_RELAXED);
    Bits desired;
    do {
        desired = gpt2cupy_bit_cast<Bits>(update(gpt2cupy_bit_cast<F>(old), value));
    } while (!__atomic_compare_exchange_n(bits, &old, desired, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
    return gpt2cupy_bit_cast<F>(old);
}
__forceinline__ float atomicAdd(float* a, float v) {
    return gpt2cupy_atomic_update<float, unsigned int>(a, v, [](float x, float y) { return x + y; });
}
__forceinline__ double atomicAdd(double* a, double v) {
    return gpt2cupy_atomic_update<double, unsigned long long>(a, v, [](double x, double y) { return x + y; });
}
__forceinline__ float atomicExch(float* a, float v) {
    return gpt2cupy_bit_cast<float>(atomicExch(reinterpret_cast<unsigned int*>(a), gpt2cupy_bit_cast<unsigned int>(v)));
}
__forceinline__ unsigned int atomicInc(unsigned int* a, unsigned int limit) {
    unsigned int old = __atomic_load_n(a, __ATOMIC_RELAXED);
    while (!__atomic_compare_exchange_n(a, &old, old >= limit ? 0u : old + 1u, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {}
    return old;
}
__forceinline__ unsigned int atomicDec(unsigned int* a, unsigned int limit) {
    unsigned int old = __atomic_load_n(a, __ATOMIC_RELAXED);
    while (!__atomic_compare_exchange_n(a, &old, (old == 0u || old > limit) ? limit : old - 1u, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {}
    return old;
}

// ---- synchronisation, warps ------------------------------------------------------------------------
__forceinline__ void __syncthreads() { gpt2cupy_syncthreads(); }
__forceinline__ void __syncwarp(unsigned int mask = 0xffffffffu) { gpt2cupy_warp_exchange(mask, 0); }

template <class T>
__forceinline__ unsigned long long gpt2cupy_to_slot(T value) {
    static_assert(sizeof(T) <= 8, "a warp shuffle moves at most 8 bytes");
    unsigned long long slot = 0;
    __builtin_memcpy(&slot, &value, sizeof(T));
    return slot;
}
// The value lane `source` put on the table, or the caller's own value where CUDA says so
// (a source outside the segment, or a lane that did not take part).
template <class T>
__forceinline__ T gpt2cupy_take(const gpt2cupy::WarpExchange* table, unsigned int source, bool inside, T own) {
    if (!inside || source >= 32 || !((table->arrived >> source) & 1u)) return own;
    T value;
    __builtin_memcpy(&value, &table->value[source], sizeof(T));
    return value;
}
template <class T>
__forceinline__ T __shfl_sync(unsigned int mask, T var, int source_lane, int width = 32) {
    const gpt2cupy::WarpExchange* table = gpt2cupy_warp_exchange(mask, gpt2cupy_to_slot(var));
    unsigned int lane = gpt2cupy_current_thread->lane;
    unsigned int segment_start = lane & ~(unsigned int)(width - 1);
    return gpt2cupy_take(table, segment_start + ((unsigned int)source_lane & (unsigned int)(width - 1)), true, var);
}
template <class T>
__forceinline__ T __shfl_up_sync(unsigned int mask, T var, unsigned int delta, int width = 32) {
    const gpt2cupy::WarpExchange* table = gpt2cupy_warp_exchange(mask, gpt2cupy_to_slot(var));
    unsigned int lane = gpt2cupy_current_thread->lane;
    unsigned int position = lane & (unsigned int)(width - 1);
    return gpt2cupy_take(table, lane - delta, position >= delta, var);
}
template <class T>
__forceinline__ T __shfl_down_sync(unsigned int mask, T var, unsigned int delta, int width = 32) {
    const gpt2cupy::WarpExchange* table = gpt2cupy_warp_exchange(mask, gpt2cupy_to_slot(var));
    unsigned int lane = gpt2cupy_current_thread->lane;
    unsigned int position = lane & (unsigned int)(width - 1);
    return gpt2cupy_take(table, lane + delta, position + delta < (unsigned int)width, var);
}
template <class T>
__forceinline__ T __shfl_xor_sync(unsigned int mask, T var, int lane_mask, int width = 32) {
    const gpt2cupy::WarpExchange* table = gpt2cupy_warp_exchange(mask, gpt2cupy_to_slot(var));
    unsigned int lane = gpt2cupy_current_thread->lane;
    unsigned int source = lane ^ (unsigned int)lane_mask;
    unsigned int segment_end = (lane & ~(unsigned int)(width - 1)) + (unsigned int)width;
    return gpt2cupy_take(table, source, source < segment_end, var);
}
__forceinline__ unsigned int __ballot_sync(unsigned int mask, int predicate) {
    const gpt2cupy::WarpExchange* table = gpt2cupy_warp_exchange(mask, predicate != 0);
    unsigned int ballot = 0;
    for (unsigned int lane = 0; lane < 32; ++lane)
        if (((table->arrived & mask) >> lane & 1u) && table->value[lane]) ballot |= 1u << lane;
    return ballot;
}
__forceinline__ int __any_sync(unsigned int mask, int predicate) { return __ballot_sync(mask, predicate) != 0; }
__forceinline__ int __all_sync(unsigned int mask, int predicate) {
    const gpt2cupy::WarpExchange* table = gpt2cupy_warp_exchange(mask, predicate != 0);
    for (unsigned int lane = 0; lane < 32; ++lane)
        if (((table->arrived & mask) >> lane & 1u) && !table->value[lane]) return 0;
    return 1;
}

// ---- printf and assert -----------------------------------------------------------------------------
// Output is kept per block and printed in block order when the launch returns.
#define printf gpt2cupy_printf
#define assert(condition) ((condition) ? (void)0 : gpt2cupy_assert_failed(#condition, __FILE__, __LINE__))

// ---- how the executor calls a kernel ---------------------------------------------------------------
namespace gpt2cupy {

template <class T> struct Element { static constexpr char kind = 's'; static constexpr unsigned short size = sizeof(T); static constexpr bool vector = false; };
template <> struct Element<void> { static constexpr char kind = 'v'; static constexpr unsigned short size = 0; static constexpr bool vector = false; };
#define GPT2CUPY_ELEMENT(T, KIND)   \
    template <> struct Element<T> { static constexpr char kind = KIND; static constexpr unsigned short size = sizeof(T); static constexpr bool vector = false; };
GPT2CUPY_ELEMENT(bool, 'b')
GPT2CUPY_ELEMENT(char, 'i')
GPT2CUPY_ELEMENT(signed char, 'i')
GPT2CUPY_ELEMENT(unsigned char, 'u')
GPT2CUPY_ELEMENT(short, 'i')
GPT2CUPY_ELEMENT(unsigned short, 'u')
GPT2CUPY_ELEMENT(int, 'i')
GPT2CUPY_ELEMENT(unsigned int, 'u')
GPT2CUPY_ELEMENT(long, 'i')
GPT2CUPY_ELEMENT(unsigned long, 'u')
GPT2CUPY_ELEMENT(long long, 'i')
GPT2CUPY_ELEMENT(unsigned long long, 'u')
GPT2CUPY_ELEMENT(float, 'f')
GPT2CUPY_ELEMENT(double, 'f')
#undef GPT2CUPY_ELEMENT
#define GPT2CUPY_VECTOR_ELEMENT(V, T) \
    template <> struct Element<V> { static constexpr char kind = Element<T>::kind; static constexpr unsigned short size = sizeof(T); static constexpr bool vector = true; };
GPT2CUPY_VECTOR_ELEMENT(float2, float) GPT2CUPY_VECTOR_ELEMENT(float3, float) GPT2CUPY_VECTOR_ELEMENT(float4, float)
GPT2CUPY_VECTOR_ELEMENT(double2, double)
GPT2CUPY_VECTOR_ELEMENT(int2, int) GPT2CUPY_VECTOR_ELEMENT(int3, int) GPT2CUPY_VECTOR_ELEMENT(int4, int)
GPT2CUPY_VECTOR_ELEMENT(uint2, unsigned int) GPT2CUPY_VECTOR_ELEMENT(uint3, unsigned int) GPT2CUPY_VECTOR_ELEMENT(uint4, unsigned int)
GPT2CUPY_VECTOR_ELEMENT(short2, short) GPT2CUPY_VECTOR_ELEMENT(ushort2, unsigned short)
GPT2CUPY_VECTOR_ELEMENT(char4, signed char) GPT2CUPY_VECTOR_ELEMENT(uchar4, unsigned char)
GPT2CUPY_VECTOR_ELEMENT(longlong2, long long) GPT2CUPY_VECTOR_ELEMENT(ulonglong2, unsigned long long)
#undef GPT2CUPY_VECTOR_ELEMENT

template <class T> struct Unqualified { using type = T; };
template <class T> struct Unqualified<const T> { using type = T; };
template <class T> struct Unqualified<volatile T> { using type = T; };
template <class T> struct Unqualified<const volatile T> { using type = T; };

template <class T> struct Describe {
    static constexpr ParameterType type() {
        using E = Element<T>;
        return ParameterType{E::vector ? 's' : E::kind, E::kind, (unsigned short)sizeof(T), E::size};
    }
};
template <class T> struct Describe<T*> {
    static constexpr ParameterType type() {
        using E = Element<typename Unqualified<T>::type>;
        return ParameterType{'p', E::kind, (unsigned short)sizeof(T*), E::size};
    }
};

template <unsigned... I> struct Indices {};
template <unsigned N, unsigned... I> struct MakeIndices : MakeIndices<N - 1, N - 1, I...> {};
template <unsigned... I> struct MakeIndices<0, I...> { using type = Indices<I...>; };

template <class T>
__forceinline__ T read_argument(const unsigned char* slot) {
    static_assert(sizeof(T) <= argument_slot_bytes, "a kernel argument larger than 8 bytes");
    T value;
    __builtin_memcpy(&value, slot, sizeof(T));
    return value;
}

// In an unnamed namespace: every kernel library has its own entries. (Static data of a template with
// external linkage would be merged across libraries by the dynamic linker, so two sources with a kernel
// of the same name would share one entry.)
namespace {
template <auto Kernel, class Signature> struct Entry;
template <auto Kernel, class... A> struct Entry<Kernel, void (*)(A...)> {
    static_assert(sizeof...(A) <= max_parameters, "too many kernel parameters");
    template <unsigned... I>
    static void call(const unsigned char* packed, Indices<I...>) {
        Kernel(read_argument<A>(packed + I * argument_slot_bytes)...);
    }
    static void invoke(const unsigned char* packed) { call(packed, typename MakeIndices<sizeof...(A)>::type{}); }
    static const KernelEntry* entry() {
        static const KernelEntry description = {(int)sizeof...(A), {Describe<A>::type()...}, &invoke};
        return &description;
    }
};
}  // namespace

}  // namespace gpt2cupy
