// The CUDA built-ins a kernel may use without an #include, for the CPU executor.
//
// Every kernel is compiled as C++ with this header in front of it and nothing else: no system header
// is included, so what NVRTC would reject for lack of an #include (INFINITY, FLT_MAX, std::vector,
// fopen, rand) is rejected here too, and a kernel that compiles on the CPU also compiles for the GPU.
#pragma once
#include "executor_abi.h"
#include "include/gpt2cupy/ptx.h"  // what inline PTX (asm statements) becomes: mma.sync, ldmatrix, cp.async

#define __CUDACC__ 1
// The device the executor imitates: an H100 (compute capability 9.0), as gpt2_cupy.backend describes it.
#define __CUDA_ARCH__ 900

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
// A parameter the kernel never writes, kept where a GPU keeps parameters, so that its address (`&map`) is one
// the copy engine can read it at: here each thread holds its own copy of the parameters, the same bytes.
#define __grid_constant__
// A block's threads run as fibers of one OS thread, so a thread_local variable is one per block:
// exactly the lifetime and sharing of __shared__ memory. The compiler driver (source.py) rewrites what it
// can better: a __shared__ declaration in a function becomes a reference into the block's shared-memory
// window (gpt2cupy::shared_variable, below), and extern __shared__ arrays a pointer to its dynamic part.
#define __shared__ static thread_local

// ---- __shared__ variables in the block's shared-memory window ------------------------------------------
namespace gpt2cupy {
namespace {  // one of each per kernel library
// The library's __shared__ declarations in functions, each a struct of the variables it declares (source.py
// writes it), placed one after another when the library is loaded, as a GPU places a kernel's. They lie just
// below the block's dynamic shared memory, which runtime.cpp puts against an inaccessible guard: an access
// past the last of them (without dynamic shared memory) or past the dynamic memory faults, as on a GPU, and
// one from an array into the next stays inside the window, as on a GPU. A launch gives its kernel's own
// placement (gpt2cupy_shared_offsets, from kernel.py): only the declarations that kernel can reach lie in its
// window, as on a GPU, which gives a kernel none of its module's other kernels' variables.
struct SharedDeclaration {
    unsigned long long offset, bytes, alignment;
    unsigned serial;       // its place in the source: declarations lie in the order they are written
    const char* names;     // the variables it declares, "tile, row"
    const char* function;  // the function that declares them, as __PRETTY_FUNCTION__ spells its local struct's
};
constexpr unsigned max_shared_declarations = 4096;
struct SharedLayout {
    unsigned long long bytes = 0, alignment = 16;
    unsigned count = 0;
    SharedDeclaration declarations[max_shared_declarations];
};
SharedLayout shared_layout;  // constant-initialised: ready before any declaration registers

// Called once per declaration (per instance of a template) when the library is loaded, in an order C++ leaves
// open; place_shared_declarations then lays them out in the source's order. Returns the declaration's index.
unsigned register_shared(unsigned serial, unsigned long long bytes, unsigned long long alignment, const char* names,
                         const char* function) {
    SharedLayout& layout = shared_layout;
    if (layout.count == max_shared_declarations) __builtin_trap();  // a library of 4096 declarations: not a kernel
    layout.declarations[layout.count] = SharedDeclaration{0, bytes, alignment, serial, names, function};
    return layout.count++;
}

// Every declaration's offset, in the order of their serials (one instance of a template after another in the
// order they registered): called by the executor once the library is loaded, before any launch.
void place_shared_declarations() {
    SharedLayout& layout = shared_layout;
    layout.bytes = 0;
    unsigned placed = 0;
    for (unsigned serial = 0; placed < layout.count; ++serial) {
        for (unsigned k = 0; k < layout.count; ++k) {
            SharedDeclaration& declaration = layout.declarations[k];
            if (declaration.serial != serial) continue;
            declaration.offset = (layout.bytes + declaration.alignment - 1) / declaration.alignment * declaration.alignment;
            layout.bytes = declaration.offset + declaration.bytes;
            if (declaration.alignment > layout.alignment) layout.alignment = declaration.alignment;
            ++placed;
        }
    }
}

// Which declaration S is (a template's static member: dynamic initialization, before dlopen returns).
template <class S> struct SharedPlace { static const unsigned index; };
template <class S>
const unsigned SharedPlace<S>::index = register_shared(S::serial(), sizeof(S), alignof(S), S::names(), S::where());

// The block's instance of declaration S: the declarations end where the dynamic shared memory starts, their
// start rounded down to the largest alignment (no constructor runs, as none runs for __shared__ memory on a GPU).
template <class S>
__forceinline__ S& shared_variable() {
    const SharedLayout& layout = shared_layout;
    const unsigned long long end = (unsigned long long)gpt2cupy_dynamic_shared_memory();
    unsigned long long bytes;
    const unsigned long long* launched = gpt2cupy_shared_offsets(&bytes);  // the launched kernel's own placement
    if (launched == nullptr) bytes = layout.bytes;
    const unsigned long long start = (end - bytes) & ~(layout.alignment - 1);
    const unsigned index = SharedPlace<S>::index;
    return *reinterpret_cast<S*>(start + (launched ? launched[index] : layout.declarations[index].offset));
}
}  // namespace
}  // namespace gpt2cupy

// ---- where a thread is -----------------------------------------------------------------------------
// The types by their qualified names: a kernel may name a parameter `dim3` or `uint3`, as nvcc allows.
#define threadIdx (static_cast<const ::uint3&>(gpt2cupy_current_thread->thread_idx))
#define blockIdx (static_cast<const ::uint3&>(gpt2cupy_current_thread->block_idx))
#define blockDim (static_cast<const ::dim3&>(gpt2cupy_current_thread->block_dim))
#define gridDim (static_cast<const ::dim3&>(gpt2cupy_current_thread->grid_dim))
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
float nanf(const char*) noexcept;
double nan(const char*) noexcept;
float modff(float, float*) noexcept;
double modf(double, double*) noexcept;
double fma(double, double, double) noexcept;
float ldexpf(float, int) noexcept;
double ldexp(double, int) noexcept;
float frexpf(float, int*) noexcept;
double frexp(double, int*) noexcept;
void sincosf(float, float*, float*) noexcept;
void sincos(double, double*, double*) noexcept;
long lrintf(float) noexcept;
long lrint(double) noexcept;
long long llrintf(float) noexcept;
long long llrint(double) noexcept;
long lroundf(float) noexcept;
long lround(double) noexcept;
long long llroundf(float) noexcept;
long long llround(double) noexcept;
float scalbnf(float, int) noexcept;
double scalbn(double, int) noexcept;
int ilogbf(float) noexcept;
int ilogb(double) noexcept;
float logbf(float) noexcept;
double logb(double) noexcept;
float modff(float, float*) noexcept;
double modf(double, double*) noexcept;
float remquof(float, float, int*) noexcept;
double remquo(double, double, int*) noexcept;
float nanf(const char*) noexcept;
double nan(const char*) noexcept;
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
// Clamped to [0, 1]; a NaN becomes 0, as the GPU's .sat modifier does.
__forceinline__ float __saturatef(float x) { return x >= 0.0f ? (x <= 1.0f ? x : 1.0f) : 0.0f; }
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

// Conversions with a rounding mode in the name: _rn to nearest (ties to even), _rz toward zero, _rd down,
// _ru up. Float to integer saturates as the GPU does: out-of-range values give the type's smallest or
// largest value. A NaN gives 0 only from float to a 32-bit integer; from a double, or to a 64-bit integer,
// it gives the value with only the top bit set (the smallest signed value; 2^31 or 2^63 unsigned), as the
// PTX ISA specifies for cvt. (A plain C cast such as (int)x does not saturate: out of range it is undefined.)
template <class I>
__forceinline__ I gpt2cupy_saturate(double integral, I lowest, I highest, I not_a_number) {
    if (integral != integral) return not_a_number;
    if (integral <= (double)lowest) return lowest;
    if (integral >= (double)highest) return highest;
    return (I)integral;
}
#define GPT2CUPY_TO_INTEGER(from, F, to, I, lowest, highest, on_nan)                                                    \
    __forceinline__ I __##from##2##to##_rn(F x) { return gpt2cupy_saturate<I>(rint((double)x), lowest, highest, on_nan); }  \
    __forceinline__ I __##from##2##to##_rz(F x) { return gpt2cupy_saturate<I>(trunc((double)x), lowest, highest, on_nan); } \
    __forceinline__ I __##from##2##to##_rd(F x) { return gpt2cupy_saturate<I>(floor((double)x), lowest, highest, on_nan); } \
    __forceinline__ I __##from##2##to##_ru(F x) { return gpt2cupy_saturate<I>(ceil((double)x), lowest, highest, on_nan); }
GPT2CUPY_TO_INTEGER(float, float, int, int, -2147483647 - 1, 2147483647, 0)
GPT2CUPY_TO_INTEGER(float, float, uint, unsigned int, 0u, 4294967295u, 0u)
GPT2CUPY_TO_INTEGER(float, float, ll, long long, -9223372036854775807LL - 1, 9223372036854775807LL, -9223372036854775807LL - 1)
GPT2CUPY_TO_INTEGER(float, float, ull, unsigned long long, 0ull, 18446744073709551615ull, 1ull << 63)
GPT2CUPY_TO_INTEGER(double, double, int, int, -2147483647 - 1, 2147483647, -2147483647 - 1)
GPT2CUPY_TO_INTEGER(double, double, uint, unsigned int, 0u, 4294967295u, 1u << 31)
GPT2CUPY_TO_INTEGER(double, double, ll, long long, -9223372036854775807LL - 1, 9223372036854775807LL, -9223372036854775807LL - 1)
GPT2CUPY_TO_INTEGER(double, double, ull, unsigned long long, 0ull, 18446744073709551615ull, 1ull << 63)
#undef GPT2CUPY_TO_INTEGER

__forceinline__ float gpt2cupy_next_toward(float x, float direction) { return nextafterf(x, direction); }
__forceinline__ double gpt2cupy_next_toward(double x, double direction) { return nextafter(x, direction); }
// `nearest` is the exact value rounded to nearest; `exact_above` says whether the exact value is greater
// than it (+1), less (-1) or equal (0). The result is rounded toward zero (mode 'z'), down ('d') or up ('u').
template <class F>
__forceinline__ F gpt2cupy_round_directed(F nearest, int exact_above, char mode) {
    const F infinity = (F)1e300 * (F)1e300;
    bool toward_minus = (mode == 'd' && exact_above < 0) || (mode == 'z' && exact_above < 0 && nearest > 0);
    bool toward_plus = (mode == 'u' && exact_above > 0) || (mode == 'z' && exact_above > 0 && nearest < 0);
    if (toward_minus) return gpt2cupy_next_toward(nearest, -infinity);
    if (toward_plus) return gpt2cupy_next_toward(nearest, infinity);
    return nearest;
}
template <class F, class I>
__forceinline__ F gpt2cupy_integer_to_floating(I x, char mode) {
    F nearest = (F)x;  // the C++ conversion rounds to nearest, ties to even
    if (mode == 'n') return nearest;
    __int128 exact = x;
    // nearest is a whole number (or 2^64, for the largest unsigned long long): exact in __int128.
    __int128 rounded = (__int128)nearest;
    return gpt2cupy_round_directed(nearest, exact > rounded ? 1 : (exact < rounded ? -1 : 0), mode);
}
#define GPT2CUPY_FROM_INTEGER(from, I, to, F)                                                                          \
    __forceinline__ F __##from##2##to##_rn(I x) { return gpt2cupy_integer_to_floating<F>(x, 'n'); }                   \
    __forceinline__ F __##from##2##to##_rz(I x) { return gpt2cupy_integer_to_floating<F>(x, 'z'); }                   \
    __forceinline__ F __##from##2##to##_rd(I x) { return gpt2cupy_integer_to_floating<F>(x, 'd'); }                   \
    __forceinline__ F __##from##2##to##_ru(I x) { return gpt2cupy_integer_to_floating<F>(x, 'u'); }
GPT2CUPY_FROM_INTEGER(int, int, float, float)
GPT2CUPY_FROM_INTEGER(uint, unsigned int, float, float)
GPT2CUPY_FROM_INTEGER(ll, long long, float, float)
GPT2CUPY_FROM_INTEGER(ull, unsigned long long, float, float)
GPT2CUPY_FROM_INTEGER(ll, long long, double, double)
GPT2CUPY_FROM_INTEGER(ull, unsigned long long, double, double)
#undef GPT2CUPY_FROM_INTEGER
__forceinline__ double __int2double_rn(int x) { return x; }
__forceinline__ double __uint2double_rn(unsigned int x) { return x; }
__forceinline__ float gpt2cupy_double_to_float(double x, char mode) {
    float nearest = (float)x;
    if (mode == 'n' || x != x) return nearest;
    return gpt2cupy_round_directed(nearest, x > (double)nearest ? 1 : (x < (double)nearest ? -1 : 0), mode);
}
__forceinline__ float __double2float_rn(double x) { return gpt2cupy_double_to_float(x, 'n'); }
__forceinline__ float __double2float_rz(double x) { return gpt2cupy_double_to_float(x, 'z'); }
__forceinline__ float __double2float_rd(double x) { return gpt2cupy_double_to_float(x, 'd'); }
__forceinline__ float __double2float_ru(double x) { return gpt2cupy_double_to_float(x, 'u'); }
__forceinline__ int __double2hiint(double x) { return (int)(gpt2cupy_bit_cast<unsigned long long>(x) >> 32); }
__forceinline__ int __double2loint(double x) { return (int)gpt2cupy_bit_cast<unsigned long long>(x); }
__forceinline__ double __hiloint2double(int high, int low) {
    return gpt2cupy_bit_cast<double>(((unsigned long long)(unsigned int)high << 32) | (unsigned int)low);
}
__forceinline__ double __fma_rn(double x, double y, double z) { return fma(x, y, z); }
__forceinline__ double __dadd_rn(double x, double y) { return x + y; }
__forceinline__ double __dsub_rn(double x, double y) { return x - y; }
__forceinline__ double __dmul_rn(double x, double y) { return x * y; }
__forceinline__ double __ddiv_rn(double x, double y) { return x / y; }
__forceinline__ double __drcp_rn(double x) { return 1.0 / x; }
__forceinline__ double __dsqrt_rn(double x) { return sqrt(x); }

// ---- more math --------------------------------------------------------------------------------------
__forceinline__ float fdividef(float x, float y) { return x / y; }
__forceinline__ float rcbrtf(float x) { return (float)(1.0 / cbrt((double)x)); }
__forceinline__ double rcbrt(double x) { return 1.0 / cbrt(x); }
__forceinline__ float rhypotf(float x, float y) { return (float)(1.0 / hypot((double)x, (double)y)); }
__forceinline__ float norm3df(float x, float y, float z) { return (float)sqrt((double)x * x + (double)y * y + (double)z * z); }
__forceinline__ float rnorm3df(float x, float y, float z) { return (float)(1.0 / sqrt((double)x * x + (double)y * y + (double)z * z)); }
// sin(pi x) and cos(pi x), exact at whole and half numbers (sinpif(1) is 0, not sin of a rounded pi).
__forceinline__ double gpt2cupy_sinpi(double x) {
    if (__builtin_isinf(x)) return x - x;
    double r = remainder(x, 2.0);  // in [-1, 1], exact
    if (r == trunc(r)) return copysign(0.0, x);
    if (r == 0.5 || r == -1.5) return 1.0;
    if (r == -0.5 || r == 1.5) return -1.0;
    return sin(3.14159265358979323846 * r);
}
__forceinline__ double gpt2cupy_cospi(double x) {
    if (__builtin_isinf(x)) return x - x;
    double r = fabs(remainder(x, 2.0));
    if (r == 0.5) return 0.0;
    if (r == 0.0) return 1.0;
    if (r == 1.0) return -1.0;
    return cos(3.14159265358979323846 * r);
}
__forceinline__ float sinpif(float x) { return (float)gpt2cupy_sinpi(x); }
__forceinline__ float cospif(float x) { return (float)gpt2cupy_cospi(x); }
__forceinline__ double sinpi(double x) { return gpt2cupy_sinpi(x); }
__forceinline__ double cospi(double x) { return gpt2cupy_cospi(x); }
__forceinline__ void sincospif(float x, float* s, float* c) { *s = sinpif(x); *c = cospif(x); }
__forceinline__ void sincospi(double x, double* s, double* c) { *s = sinpi(x); *c = cospi(x); }
__forceinline__ void __sincosf(float x, float* s, float* c) { sincosf(x, s, c); }
// The inverses of erf and erfc by Newton's method in double precision, each from a start on the side
// where the function's curvature makes every step after the first approach the root from one side.
__forceinline__ double gpt2cupy_newton_inverse(double x, double y, bool complement) {
    for (int step = 0; step < 100; ++step) {
        double value = complement ? y - erfc(x) : erf(x) - y;
        double next = x - value / (1.1283791670955126 * exp(-x * x));
        if (fabs(next - x) <= 1e-16 * fabs(next)) return next;
        x = next;
    }
    return x;
}
// erfc(x) = y for y in (0, 0.5]: from sqrt(-log y), which lies right of the root.
__forceinline__ double gpt2cupy_erfcinv_tail(double y) { return gpt2cupy_newton_inverse(sqrt(-log(y)), y, true); }
__forceinline__ double gpt2cupy_erfinv(double y) {
    if (!(y > -1.0 && y < 1.0)) return y == 1.0 ? __builtin_inf() : (y == -1.0 ? -__builtin_inf() : __builtin_nan(""));
    if (y == 0.0) return y;
    if (fabs(y) < 0.5) return gpt2cupy_newton_inverse(y * 0.88622692545275801365, y, false);
    return copysign(gpt2cupy_erfcinv_tail(1.0 - fabs(y)), y);
}
__forceinline__ double gpt2cupy_erfcinv(double y) {
    if (!(y > 0.0 && y < 2.0)) return y == 0.0 ? __builtin_inf() : (y == 2.0 ? -__builtin_inf() : __builtin_nan(""));
    if (y < 0.5) return gpt2cupy_erfcinv_tail(y);
    if (y > 1.5) return -gpt2cupy_erfcinv_tail(2.0 - y);
    return gpt2cupy_erfinv(1.0 - y);  // exact for y in [0.5, 1.5]
}
// A GPU's erfcinvf takes a subnormal input (below 2^-126) for 0 and returns +inf; normcdfinvf(p) is
// -sqrt(2) erfcinvf(2p), so it returns -inf where 2p, rounded to float, is subnormal.
__forceinline__ bool gpt2cupy_subnormal(float y) { return y > 0.0f && y < 1.17549435e-38f; }
__forceinline__ float erfcinvf(float y) { return gpt2cupy_subnormal(y) ? __builtin_inff() : (float)gpt2cupy_erfcinv(y); }
__forceinline__ float erfinvf(float y) { return (float)gpt2cupy_erfinv(y); }
__forceinline__ double erfcinv(double y) { return gpt2cupy_erfcinv(y); }
__forceinline__ double erfinv(double y) { return gpt2cupy_erfinv(y); }
__forceinline__ float normcdff(float x) { return (float)(0.5 * erfc(-(double)x * 0.70710678118654752440)); }
__forceinline__ double normcdf(double x) { return 0.5 * erfc(-x * 0.70710678118654752440); }
__forceinline__ float normcdfinvf(float p) {
    return gpt2cupy_subnormal(p + p) ? -__builtin_inff() : (float)(-1.41421356237309504880 * gpt2cupy_erfcinv(2.0 * (double)p));
}
__forceinline__ double normcdfinv(double p) { return -1.41421356237309504880 * gpt2cupy_erfcinv(2.0 * p); }

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
#undef GPT2CUPY_MIN_MAX
// On floating point they are fminf/fmaxf (fmin/fmax): a NaN argument is ignored, the other one returned.
__forceinline__ float min(float a, float b) { return fminf(a, b); }
__forceinline__ float max(float a, float b) { return fmaxf(a, b); }
__forceinline__ double min(double a, double b) { return fmin(a, b); }
__forceinline__ double max(double a, double b) { return fmax(a, b); }
__forceinline__ double min(float a, double b) { return fmin(a, b); }
__forceinline__ double max(float a, double b) { return fmax(a, b); }
__forceinline__ double min(double a, float b) { return fmin(a, b); }
__forceinline__ double max(double a, float b) { return fmax(a, b); }
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
__forceinline__ unsigned long long __brevll(unsigned long long x) {
    return ((unsigned long long)__brev((unsigned int)x) << 32) | __brev((unsigned int)(x >> 32));
}
__forceinline__ long long __mul64hi(long long a, long long b) { return (long long)(((__int128)a * b) >> 64); }
__forceinline__ unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
    return (unsigned long long)(((unsigned __int128)a * b) >> 64);
}
// 24-bit multiplies: the low 24 bits of each operand (sign-extended for __mul24), the low 32 bits of the product.
__forceinline__ int __mul24(int a, int b) {
    return (int)((unsigned int)((a << 8) >> 8) * (unsigned int)((b << 8) >> 8));
}
__forceinline__ unsigned int __umul24(unsigned int a, unsigned int b) { return (a & 0xffffffu) * (b & 0xffffffu); }
// Averages without overflow: (a + b) >> 1, and rounded up for the r versions.
__forceinline__ int __hadd(int a, int b) { return (int)(((long long)a + b) >> 1); }
__forceinline__ int __rhadd(int a, int b) { return (int)(((long long)a + b + 1) >> 1); }
__forceinline__ unsigned int __uhadd(unsigned int a, unsigned int b) { return (unsigned int)(((unsigned long long)a + b) >> 1); }
__forceinline__ unsigned int __urhadd(unsigned int a, unsigned int b) { return (unsigned int)(((unsigned long long)a + b + 1) >> 1); }
__forceinline__ unsigned int __sad(int a, int b, unsigned int c) { return c + (unsigned int)(a > b ? (long long)a - b : (long long)b - a); }
__forceinline__ unsigned int __usad(unsigned int a, unsigned int b, unsigned int c) { return c + (a > b ? a - b : b - a); }
// The shift amount is taken modulo 32 (the plain versions) or clamped to 32 (the c versions).
__forceinline__ unsigned int __funnelshift_l(unsigned int low, unsigned int high, unsigned int shift) {
    return (unsigned int)((((unsigned long long)high << 32 | low) << (shift & 31)) >> 32);
}
__forceinline__ unsigned int __funnelshift_lc(unsigned int low, unsigned int high, unsigned int shift) {
    return (unsigned int)((((unsigned long long)high << 32 | low) << (shift < 32 ? shift : 32)) >> 32);
}
__forceinline__ unsigned int __funnelshift_r(unsigned int low, unsigned int high, unsigned int shift) {
    return (unsigned int)(((unsigned long long)high << 32 | low) >> (shift & 31));
}
__forceinline__ unsigned int __funnelshift_rc(unsigned int low, unsigned int high, unsigned int shift) {
    return (unsigned int)(((unsigned long long)high << 32 | low) >> (shift < 32 ? shift : 32));
}
// Byte i of the result is byte (selector >> 4i) & 7 of the eight bytes of (y, x).
__forceinline__ unsigned int __byte_perm(unsigned int x, unsigned int y, unsigned int selector) {
    unsigned long long bytes = (unsigned long long)y << 32 | x;
    unsigned int result = 0;
    for (int i = 0; i < 4; ++i) result |= (unsigned int)((bytes >> (8 * ((selector >> (4 * i)) & 7u))) & 0xffu) << (8 * i);
    return result;
}

// ---- memory ----------------------------------------------------------------------------------------
template <class T>
__forceinline__ T __ldg(const T* address) { return *address; }
__forceinline__ void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
// A block's threads take turns on one OS thread: keeping the compiler from moving accesses across is enough.
// (It also keeps the race check from taking it for __threadfence(), which orders memory for other blocks.)
__forceinline__ void __threadfence_block() { __atomic_signal_fence(__ATOMIC_SEQ_CST); }
__forceinline__ void __threadfence_system() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
// Loads and stores with a cache hint (streaming, cache-global, ...): on the CPU a plain load or store.
template <class T> __forceinline__ T __ldcg(const T* address) { return *address; }
template <class T> __forceinline__ T __ldca(const T* address) { return *address; }
template <class T> __forceinline__ T __ldcs(const T* address) { return *address; }
template <class T> __forceinline__ T __ldlu(const T* address) { return *address; }
template <class T> __forceinline__ T __ldcv(const T* address) { return *address; }
template <class T> __forceinline__ void __stwb(T* address, T value) { *address = value; }
template <class T> __forceinline__ void __stcg(T* address, T value) { *address = value; }
template <class T> __forceinline__ void __stcs(T* address, T value) { *address = value; }
template <class T> __forceinline__ void __stwt(T* address, T value) { *address = value; }

// ---- time ------------------------------------------------------------------------------------------
typedef long clock_t;
// A cycle counter that only goes up; its rate is the CPU's, not the GPU's.
__forceinline__ long long clock64() {
#if defined(__x86_64__) || defined(__i386__)
    unsigned int low, high;
    __asm__ __volatile__("rdtsc" : "=a"(low), "=d"(high));
    return (long long)((unsigned long long)high << 32 | low);
#elif defined(__aarch64__)
    unsigned long long ticks;
    __asm__ __volatile__("mrs %0, cntvct_el0" : "=r"(ticks));
    return (long long)ticks;
#else
    static thread_local long long ticks = 0;
    return ++ticks;
#endif
}
__forceinline__ clock_t clock() { return (clock_t)clock64(); }
__forceinline__ void __nanosleep(unsigned int) { gpt2cupy_yield(); }  // lets the block's other threads run
__forceinline__ void __trap() { gpt2cupy_assert_failed("__trap()", "kernel", 0); }

// Atomics: blocks run on several OS threads at once, so these are real atomic instructions. Each type has
// the atomics CUDA gives it and no others, so that what compiles here compiles for a GPU.
#define GPT2CUPY_ATOMIC_ADD_EXCH_CAS(T)                                                                 \
    __forceinline__ T atomicAdd(T* a, T v) { return __atomic_fetch_add(a, v, __ATOMIC_RELAXED); }         \
    __forceinline__ T atomicExch(T* a, T v) { return __atomic_exchange_n(a, v, __ATOMIC_RELAXED); }       \
    __forceinline__ T atomicCAS(T* a, T expected, T desired) {                                            \
        __atomic_compare_exchange_n(a, &expected, desired, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);     \
        return expected;                                                                                   \
    }
#define GPT2CUPY_ATOMIC_BITS(T)                                                                          \
    __forceinline__ T atomicAnd(T* a, T v) { return __atomic_fetch_and(a, v, __ATOMIC_RELAXED); }         \
    __forceinline__ T atomicOr(T* a, T v) { return __atomic_fetch_or(a, v, __ATOMIC_RELAXED); }           \
    __forceinline__ T atomicXor(T* a, T v) { return __atomic_fetch_xor(a, v, __ATOMIC_RELAXED); }
#define GPT2CUPY_ATOMIC_MIN_MAX(T)                                                                       \
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
GPT2CUPY_ATOMIC_ADD_EXCH_CAS(int) GPT2CUPY_ATOMIC_BITS(int) GPT2CUPY_ATOMIC_MIN_MAX(int)
GPT2CUPY_ATOMIC_ADD_EXCH_CAS(unsigned int) GPT2CUPY_ATOMIC_BITS(unsigned int) GPT2CUPY_ATOMIC_MIN_MAX(unsigned int)
GPT2CUPY_ATOMIC_ADD_EXCH_CAS(unsigned long long) GPT2CUPY_ATOMIC_BITS(unsigned long long)
GPT2CUPY_ATOMIC_MIN_MAX(unsigned long long)
GPT2CUPY_ATOMIC_BITS(long long) GPT2CUPY_ATOMIC_MIN_MAX(long long)
#undef GPT2CUPY_ATOMIC_ADD_EXCH_CAS
#undef GPT2CUPY_ATOMIC_BITS
#undef GPT2CUPY_ATOMIC_MIN_MAX
__forceinline__ int atomicSub(int* a, int v) { return __atomic_fetch_sub(a, v, __ATOMIC_RELAXED); }
__forceinline__ unsigned int atomicSub(unsigned int* a, unsigned int v) { return __atomic_fetch_sub(a, v, __ATOMIC_RELAXED); }
__forceinline__ unsigned short atomicCAS(unsigned short* a, unsigned short expected, unsigned short desired) {
    __atomic_compare_exchange_n(a, &expected, desired, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
    return expected;
}
long long atomicAdd(long long*, long long) = delete;  // CUDA has no atomicAdd for long long: use unsigned long long
long long atomicSub(long long*, long long) = delete;  // CUDA has no atomicSub for long long
long long atomicExch(long long*, long long) = delete;  // CUDA has no atomicExch for long long: use unsigned long long
long long atomicCAS(long long*, long long, long long) = delete;  // CUDA has no atomicCAS for long long: use unsigned long long
unsigned long long atomicSub(unsigned long long*, unsigned long long) = delete;  // CUDA has no atomicSub for unsigned long long: add the negation

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
// float2 and float4 atomicAdd (compute capability 9.0 and later, global memory): each element is added
// atomically, not the vector as one access, as CUDA documents; the address must be aligned to the vector.
__forceinline__ float2 atomicAdd(float2* a, float2 v) {
    if (reinterpret_cast<unsigned long long>(a) % sizeof(float2) != 0)
        gpt2cupy_assert_failed("atomicAdd(float2*) at a misaligned address: it must be a multiple of 8 bytes", "atomicAdd", 0);
    float x = atomicAdd(&a->x, v.x);
    return make_float2(x, atomicAdd(&a->y, v.y));
}
__forceinline__ float4 atomicAdd(float4* a, float4 v) {
    if (reinterpret_cast<unsigned long long>(a) % sizeof(float4) != 0)
        gpt2cupy_assert_failed("atomicAdd(float4*) at a misaligned address: it must be a multiple of 16 bytes", "atomicAdd", 0);
    float x = atomicAdd(&a->x, v.x), y = atomicAdd(&a->y, v.y), z = atomicAdd(&a->z, v.z);
    return make_float4(x, y, z, atomicAdd(&a->w, v.w));
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
// The value lane `source` put on the table, or the caller's own value where CUDA says so (a source
// outside the segment). A source lane that did not take part (not in the mask, or exited) gives a value
// CUDA leaves undefined: the race check reports it; without the check it is the caller's own value.
template <class T>
__forceinline__ T gpt2cupy_take(const gpt2cupy::WarpExchange* table, unsigned int mask, unsigned int source,
                                bool inside, T own) {
    if (!inside || source >= 32) return own;
    if (!((table->arrived >> source) & 1u)) {
        gpt2cupy_shuffle_from_absent_lane(mask, source);
        return own;
    }
    T value;
    __builtin_memcpy(&value, &table->value[source], sizeof(T));
    return value;
}
template <class T>
__forceinline__ T __shfl_sync(unsigned int mask, T var, int source_lane, int width = 32) {
    const gpt2cupy::WarpExchange* table = gpt2cupy_warp_exchange(mask, gpt2cupy_to_slot(var));
    unsigned int lane = gpt2cupy_current_thread->lane;
    unsigned int segment_start = lane & ~(unsigned int)(width - 1);
    return gpt2cupy_take(table, mask, segment_start + ((unsigned int)source_lane & (unsigned int)(width - 1)), true, var);
}
template <class T>
__forceinline__ T __shfl_up_sync(unsigned int mask, T var, unsigned int delta, int width = 32) {
    const gpt2cupy::WarpExchange* table = gpt2cupy_warp_exchange(mask, gpt2cupy_to_slot(var));
    unsigned int lane = gpt2cupy_current_thread->lane;
    unsigned int position = lane & (unsigned int)(width - 1);
    return gpt2cupy_take(table, mask, lane - delta, position >= delta, var);
}
template <class T>
__forceinline__ T __shfl_down_sync(unsigned int mask, T var, unsigned int delta, int width = 32) {
    const gpt2cupy::WarpExchange* table = gpt2cupy_warp_exchange(mask, gpt2cupy_to_slot(var));
    unsigned int lane = gpt2cupy_current_thread->lane;
    unsigned int position = lane & (unsigned int)(width - 1);
    return gpt2cupy_take(table, mask, lane + delta, position + delta < (unsigned int)width, var);
}
template <class T>
__forceinline__ T __shfl_xor_sync(unsigned int mask, T var, int lane_mask, int width = 32) {
    const gpt2cupy::WarpExchange* table = gpt2cupy_warp_exchange(mask, gpt2cupy_to_slot(var));
    unsigned int lane = gpt2cupy_current_thread->lane;
    unsigned int source = lane ^ (unsigned int)lane_mask;
    unsigned int segment_end = (lane & ~(unsigned int)(width - 1)) + (unsigned int)width;
    return gpt2cupy_take(table, mask, source, source < segment_end, var);
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

// __syncthreads() that also counts the threads whose predicate is non-zero. The counts live in the block's
// shared memory (thread_local, one per block), three of them in turn: a thread clears the next call's
// count before the barrier, when every thread has read the previous call's result (they all passed the
// barrier after it) and none has added to the next one yet (they have not passed this barrier). The first
// vote of each block starts from clean counts, even after a block that failed halfway through a vote.
__forceinline__ int gpt2cupy_block_count(int predicate) {
    // The block's threads share these (fibers of one OS thread, so never at the same instant); relaxed atomics,
    // which the race check does not record, keep this bookkeeping out of its report about the kernel's memory.
    static thread_local int counts[3];
    static thread_local unsigned int call;
    static thread_local unsigned long long block = ~0ull;
    if (__atomic_load_n(&block, __ATOMIC_RELAXED) != gpt2cupy_block_serial()) {
        __atomic_store_n(&block, gpt2cupy_block_serial(), __ATOMIC_RELAXED);
        for (int& count : counts) __atomic_store_n(&count, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&call, 0u, __ATOMIC_RELAXED);
    }
    unsigned int mine = __atomic_load_n(&call, __ATOMIC_RELAXED);
    __atomic_store_n(&counts[(mine + 1) % 3], 0, __ATOMIC_RELAXED);
    __atomic_fetch_add(&counts[mine % 3], predicate != 0, __ATOMIC_RELAXED);
    __syncthreads();
    __atomic_store_n(&call, mine + 1, __ATOMIC_RELAXED);
    return __atomic_load_n(&counts[mine % 3], __ATOMIC_RELAXED);
}
__forceinline__ int __syncthreads_count(int predicate) { return gpt2cupy_block_count(predicate); }
__forceinline__ int __syncthreads_and(int predicate) { return gpt2cupy_block_count(predicate == 0) == 0; }
__forceinline__ int __syncthreads_or(int predicate) { return gpt2cupy_block_count(predicate) != 0; }

// The lanes of the calling thread's warp that run this instruction together with it: inside an `if`, those
// that took the branch; lanes that have returned, or that do not exist (a block of 48 threads has a last
// warp of 16), are not there. Not a barrier: it orders no memory between them.
__forceinline__ unsigned int __activemask() { return gpt2cupy_converged_lanes(); }

// Warp reductions over the lanes in mask: every lane gets the result.
#define GPT2CUPY_WARP_REDUCE(name, T, START, COMBINE)                                                     \
    __forceinline__ T name(unsigned int mask, T value) {                                                 \
        const gpt2cupy::WarpExchange* table = gpt2cupy_warp_exchange(mask, gpt2cupy_to_slot(value));      \
        T result = START;                                                                                 \
        for (unsigned int lanes = table->arrived & mask; lanes != 0; lanes &= lanes - 1) {                \
            T other;                                                                                      \
            __builtin_memcpy(&other, &table->value[__builtin_ctz(lanes)], sizeof(T));                     \
            result = COMBINE;                                                                             \
        }                                                                                                 \
        return result;                                                                                    \
    }
GPT2CUPY_WARP_REDUCE(__reduce_add_sync, unsigned int, 0u, result + other)
GPT2CUPY_WARP_REDUCE(__reduce_add_sync, int, 0, (int)((unsigned int)result + (unsigned int)other))
GPT2CUPY_WARP_REDUCE(__reduce_min_sync, unsigned int, 0xffffffffu, other < result ? other : result)
GPT2CUPY_WARP_REDUCE(__reduce_min_sync, int, 2147483647, other < result ? other : result)
GPT2CUPY_WARP_REDUCE(__reduce_max_sync, unsigned int, 0u, other > result ? other : result)
GPT2CUPY_WARP_REDUCE(__reduce_max_sync, int, -2147483647 - 1, other > result ? other : result)
GPT2CUPY_WARP_REDUCE(__reduce_and_sync, unsigned int, 0xffffffffu, result & other)
GPT2CUPY_WARP_REDUCE(__reduce_or_sync, unsigned int, 0u, result | other)
GPT2CUPY_WARP_REDUCE(__reduce_xor_sync, unsigned int, 0u, result ^ other)
#undef GPT2CUPY_WARP_REDUCE

// The lanes in mask whose value has the same bits as the caller's.
template <class T>
__forceinline__ unsigned int gpt2cupy_match_any(unsigned int mask, T value) {
    const gpt2cupy::WarpExchange* table = gpt2cupy_warp_exchange(mask, gpt2cupy_to_slot(value));
    unsigned long long mine = gpt2cupy_to_slot(value);
    unsigned int same = 0;
    for (unsigned int lanes = table->arrived & mask; lanes != 0; lanes &= lanes - 1)
        if (table->value[__builtin_ctz(lanes)] == mine) same |= 1u << __builtin_ctz(lanes);
    return same;
}
// mask if every lane in mask has the same value (and *predicate = 1), else 0 (and *predicate = 0).
template <class T>
__forceinline__ unsigned int gpt2cupy_match_all(unsigned int mask, T value, int* predicate) {
    const gpt2cupy::WarpExchange* table = gpt2cupy_warp_exchange(mask, gpt2cupy_to_slot(value));
    unsigned long long mine = gpt2cupy_to_slot(value);
    bool all = true;
    for (unsigned int lanes = table->arrived & mask; lanes != 0; lanes &= lanes - 1)
        all = all && table->value[__builtin_ctz(lanes)] == mine;
    *predicate = all;
    return all ? mask : 0u;
}

// The types CUDA matches (a bool or a char is ambiguous there, and here).
#define GPT2CUPY_MATCH(T)                                                                                       \
    __forceinline__ unsigned int __match_any_sync(unsigned int mask, T value) { return gpt2cupy_match_any(mask, value); } \
    __forceinline__ unsigned int __match_all_sync(unsigned int mask, T value, int* predicate) {                   \
        return gpt2cupy_match_all(mask, value, predicate);                                                        \
    }
GPT2CUPY_MATCH(unsigned int) GPT2CUPY_MATCH(int) GPT2CUPY_MATCH(unsigned long) GPT2CUPY_MATCH(long)
GPT2CUPY_MATCH(unsigned long long) GPT2CUPY_MATCH(long long) GPT2CUPY_MATCH(float) GPT2CUPY_MATCH(double)
#undef GPT2CUPY_MATCH

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
