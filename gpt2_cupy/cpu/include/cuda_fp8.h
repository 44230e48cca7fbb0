// CUDA's <cuda_fp8.h> for the CPU executor: the 8-bit floating-point formats of the OCP FP8 specification,
// __nv_fp8_e4m3 (4 exponent bits, bias 7, 3 mantissa bits) and __nv_fp8_e5m2 (5, bias 15, 2), their pairs and
// quadruples, and CUDA's conversions between them and float, double, __half and __nv_bfloat16.
//
// The formats, as the OCP specification defines them:
//     E4M3  no infinities; S.1111.111 is NaN, so the largest finite value is S.1111.110 = 448; subnormals are
//           m * 2^-9. A value rounds to the nearest (ties to the even mantissa): up to 464 (the midpoint to the
//           NaN pattern's 480, a tie that goes to 448's even mantissa) it is finite.
//     E5M2  IEEE-like: S.11111.00 is infinity, S.11111.mm with mm != 0 NaN; the largest finite value is 57344,
//           and from 61440 (the midpoint to 65536, a tie that goes to the even mantissa, 2^16) a value rounds
//           to infinity; subnormals are m * 2^-16.
// To FP8, a conversion rounds to nearest, ties to even, and with __NV_SATFINITE a value past the largest finite
// one (infinity too) becomes that largest value, of its sign; with __NV_NOSAT it becomes infinity (E5M2) or NaN
// (E4M3, which has no infinity). A NaN stays a NaN (0x7F). From FP8 every value is exact in __half, float,
// __nv_bfloat16's range and double. The classes' constructors saturate, as CUDA's do.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

typedef unsigned char __nv_fp8_storage_t;
typedef unsigned short __nv_fp8x2_storage_t;
typedef unsigned int __nv_fp8x4_storage_t;

enum __nv_saturation_t { __NV_NOSAT, __NV_SATFINITE };
enum __nv_fp8_interpretation_t { __NV_E4M3, __NV_E5M2 };

namespace gpt2cupy {

struct Fp8Format {
    int mantissa_bits, bias;
    unsigned char largest;      // the largest finite value's bits
    double overflow_from;       // the smallest magnitude that rounds past it
    bool overflow_inclusive;    // whether overflow_from itself does (a tie that goes up)
    unsigned char overflow;     // what an overflow gives without saturation: infinity, or NaN
};

__forceinline__ Fp8Format fp8_format(__nv_fp8_interpretation_t interpretation) {
    if (interpretation == __NV_E4M3) return Fp8Format{3, 7, 0x7E, 464.0, false, 0x7F};
    return Fp8Format{2, 15, 0x7B, 61440.0, true, 0x7C};
}

// A double rounded to FP8 as the header comment says. The magnitude is scaled to whole units of the last place
// it keeps (2^-(bias - 1 + mantissa bits) for subnormals), which is exact, then rounded to a whole number of them.
__forceinline__ __nv_fp8_storage_t to_fp8(double value, __nv_saturation_t saturate,
                                          __nv_fp8_interpretation_t interpretation) {
    const Fp8Format format = fp8_format(interpretation);
    if (value != value) return 0x7F;
    const unsigned char sign = __builtin_signbit(value) ? 0x80 : 0;
    const double magnitude = __builtin_fabs(value);
    if (magnitude > format.overflow_from || (format.overflow_inclusive && magnitude == format.overflow_from))
        return sign | (saturate == __NV_SATFINITE ? format.largest : format.overflow);
    if (magnitude == 0) return sign;
    const int smallest_unit = 1 - format.bias - format.mantissa_bits;
    int exponent = 0;
    __builtin_frexp(magnitude, &exponent);  // magnitude = f * 2^exponent, 0.5 <= f < 1
    const int unit = exponent - 1 - format.mantissa_bits < smallest_unit ? smallest_unit
                                                                         : exponent - 1 - format.mantissa_bits;
    const double units = __builtin_rint(__builtin_ldexp(magnitude, -unit));  // ties to even
    if (unit == smallest_unit) return sign | (unsigned char)units;  // subnormal (or, at 2^M units, the smallest normal)
    const double rounded = __builtin_ldexp(units, unit);
    __builtin_frexp(rounded, &exponent);
    const unsigned mantissa = (unsigned)__builtin_ldexp(rounded, format.mantissa_bits + 1 - exponent) -
                              (1u << format.mantissa_bits);
    return sign | (unsigned char)((exponent - 1 + format.bias) << format.mantissa_bits | mantissa);
}

// The exact value of FP8 bits.
__forceinline__ double from_fp8(__nv_fp8_storage_t bits, __nv_fp8_interpretation_t interpretation) {
    const Fp8Format format = fp8_format(interpretation);
    const int mantissa_bits = format.mantissa_bits;
    const unsigned field = (bits & 0x7F) >> mantissa_bits, mantissa = bits & ((1u << mantissa_bits) - 1);
    const unsigned top = 0x7Fu >> mantissa_bits;  // the exponent field of all ones
    double magnitude;
    if (interpretation == __NV_E4M3 && (bits & 0x7F) == 0x7F) magnitude = __builtin_nan("");
    else if (interpretation == __NV_E5M2 && field == top) magnitude = mantissa ? __builtin_nan("") : __builtin_inf();
    else if (field == 0) magnitude = __builtin_ldexp((double)mantissa, 1 - format.bias - mantissa_bits);
    else magnitude = __builtin_ldexp((double)(mantissa | 1u << mantissa_bits), (int)field - format.bias - mantissa_bits);
    return bits & 0x80 ? -magnitude : magnitude;
}

}  // namespace gpt2cupy

// ---- conversions of storage ------------------------------------------------------------------------------
__forceinline__ __nv_fp8_storage_t __nv_cvt_double_to_fp8(double x, __nv_saturation_t saturate,
                                                          __nv_fp8_interpretation_t interpretation) {
    return gpt2cupy::to_fp8(x, saturate, interpretation);
}
__forceinline__ __nv_fp8_storage_t __nv_cvt_float_to_fp8(float x, __nv_saturation_t saturate,
                                                         __nv_fp8_interpretation_t interpretation) {
    return gpt2cupy::to_fp8(gpt2cupy::exact_double(x), saturate, interpretation);
}
__forceinline__ __nv_fp8_storage_t __nv_cvt_halfraw_to_fp8(__half_raw x, __nv_saturation_t saturate,
                                                           __nv_fp8_interpretation_t interpretation) {
    return gpt2cupy::to_fp8(gpt2cupy::widen_small<10, 5>(x.x), saturate, interpretation);
}
__forceinline__ __nv_fp8_storage_t __nv_cvt_bfloat16raw_to_fp8(__nv_bfloat16_raw x, __nv_saturation_t saturate,
                                                               __nv_fp8_interpretation_t interpretation) {
    return gpt2cupy::to_fp8(gpt2cupy::widen_small<7, 8>(x.x), saturate, interpretation);
}
__forceinline__ __nv_fp8x2_storage_t gpt2cupy_fp8_pair(__nv_fp8_storage_t low, __nv_fp8_storage_t high) {
    return (__nv_fp8x2_storage_t)(low | high << 8);
}
__forceinline__ __nv_fp8x2_storage_t __nv_cvt_double2_to_fp8x2(double2 x, __nv_saturation_t saturate,
                                                               __nv_fp8_interpretation_t interpretation) {
    return gpt2cupy_fp8_pair(__nv_cvt_double_to_fp8(x.x, saturate, interpretation),
                             __nv_cvt_double_to_fp8(x.y, saturate, interpretation));
}
__forceinline__ __nv_fp8x2_storage_t __nv_cvt_float2_to_fp8x2(float2 x, __nv_saturation_t saturate,
                                                              __nv_fp8_interpretation_t interpretation) {
    return gpt2cupy_fp8_pair(__nv_cvt_float_to_fp8(x.x, saturate, interpretation),
                             __nv_cvt_float_to_fp8(x.y, saturate, interpretation));
}
__forceinline__ __nv_fp8x2_storage_t __nv_cvt_halfraw2_to_fp8x2(__half2_raw x, __nv_saturation_t saturate,
                                                                __nv_fp8_interpretation_t interpretation) {
    return gpt2cupy_fp8_pair(__nv_cvt_halfraw_to_fp8(__half_raw{x.x}, saturate, interpretation),
                             __nv_cvt_halfraw_to_fp8(__half_raw{x.y}, saturate, interpretation));
}
__forceinline__ __nv_fp8x2_storage_t __nv_cvt_bfloat16raw2_to_fp8x2(__nv_bfloat162_raw x, __nv_saturation_t saturate,
                                                                    __nv_fp8_interpretation_t interpretation) {
    return gpt2cupy_fp8_pair(__nv_cvt_bfloat16raw_to_fp8(__nv_bfloat16_raw{x.x}, saturate, interpretation),
                             __nv_cvt_bfloat16raw_to_fp8(__nv_bfloat16_raw{x.y}, saturate, interpretation));
}
__forceinline__ __half_raw __nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t x, __nv_fp8_interpretation_t interpretation) {
    return __half_raw{gpt2cupy::round_to_small<10, 5>(gpt2cupy::from_fp8(x, interpretation))};  // exact
}
__forceinline__ __half2_raw __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t x,
                                                       __nv_fp8_interpretation_t interpretation) {
    return __half2_raw{__nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)x, interpretation).x,
                       __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)(x >> 8), interpretation).x};
}

// ---- the classes: one value, a pair, four ------------------------------------------------------------------
#define GPT2CUPY_FP8(T, T2, T4, INTERPRETATION)                                                                  \
    struct __align__(1) T {                                                                                      \
        __nv_fp8_storage_t __x;                                                                                  \
        T() = default;                                                                                           \
        explicit T(float f) : __x(__nv_cvt_float_to_fp8(f, __NV_SATFINITE, INTERPRETATION)) {}                   \
        explicit T(double f) : __x(__nv_cvt_double_to_fp8(f, __NV_SATFINITE, INTERPRETATION)) {}                 \
        explicit T(__half f) : __x(__nv_cvt_halfraw_to_fp8(__half_raw(f), __NV_SATFINITE, INTERPRETATION)) {}    \
        explicit T(__nv_bfloat16 f)                                                                              \
            : __x(__nv_cvt_bfloat16raw_to_fp8(__nv_bfloat16_raw(f), __NV_SATFINITE, INTERPRETATION)) {}          \
        explicit T(int v) : T((double)v) {}                                                                      \
        explicit T(unsigned int v) : T((double)v) {}                                                             \
        explicit T(short v) : T((double)v) {}                                                                    \
        explicit T(unsigned short v) : T((double)v) {}                                                           \
        explicit T(long long v) : T((double)v) {}                                                                \
        explicit T(unsigned long long v) : T((double)v) {}                                                       \
        explicit operator float() const { return (float)gpt2cupy::from_fp8(__x, INTERPRETATION); }              \
        explicit operator double() const { return gpt2cupy::from_fp8(__x, INTERPRETATION); }                    \
        explicit operator __half() const { return __half(__nv_cvt_fp8_to_halfraw(__x, INTERPRETATION)); }       \
        explicit operator __nv_bfloat16() const { return __nv_bfloat16((float)*this); }                          \
        explicit operator bool() const { return (__x & 0x7F) != 0; }                                             \
        explicit operator int() const { return __float2int_rz((float)*this); }                                   \
        explicit operator unsigned int() const { return __float2uint_rz((float)*this); }                         \
        explicit operator long long() const { return __float2ll_rz((float)*this); }                              \
        explicit operator unsigned long long() const { return __float2ull_rz((float)*this); }                    \
    };                                                                                                           \
    struct __align__(2) T2 {                                                                                     \
        __nv_fp8x2_storage_t __x;                                                                                \
        T2() = default;                                                                                          \
        explicit T2(float2 f) : __x(__nv_cvt_float2_to_fp8x2(f, __NV_SATFINITE, INTERPRETATION)) {}              \
        explicit T2(double2 f) : __x(__nv_cvt_double2_to_fp8x2(f, __NV_SATFINITE, INTERPRETATION)) {}            \
        explicit T2(__half2 f) : __x(__nv_cvt_halfraw2_to_fp8x2(__half2_raw(f), __NV_SATFINITE, INTERPRETATION)) {} \
        explicit T2(__nv_bfloat162 f)                                                                            \
            : __x(__nv_cvt_bfloat16raw2_to_fp8x2(__nv_bfloat162_raw(f), __NV_SATFINITE, INTERPRETATION)) {}      \
        explicit operator __half2() const { return __half2(__nv_cvt_fp8x2_to_halfraw2(__x, INTERPRETATION)); }   \
        explicit operator float2() const {                                                                       \
            return float2{(float)gpt2cupy::from_fp8((__nv_fp8_storage_t)__x, INTERPRETATION),                    \
                          (float)gpt2cupy::from_fp8((__nv_fp8_storage_t)(__x >> 8), INTERPRETATION)};             \
        }                                                                                                        \
    };                                                                                                           \
    struct __align__(4) T4 {                                                                                     \
        __nv_fp8x4_storage_t __x;                                                                                \
        T4() = default;                                                                                          \
        explicit T4(float4 f)                                                                                    \
            : __x(__nv_cvt_float2_to_fp8x2(float2{f.x, f.y}, __NV_SATFINITE, INTERPRETATION) |                   \
                  (__nv_fp8x4_storage_t)__nv_cvt_float2_to_fp8x2(float2{f.z, f.w}, __NV_SATFINITE, INTERPRETATION) << 16) {} \
        explicit T4(__half2 low, __half2 high)                                                                   \
            : __x(__nv_cvt_halfraw2_to_fp8x2(__half2_raw(low), __NV_SATFINITE, INTERPRETATION) |                 \
                  (__nv_fp8x4_storage_t)__nv_cvt_halfraw2_to_fp8x2(__half2_raw(high), __NV_SATFINITE, INTERPRETATION) << 16) {} \
        explicit operator float4() const {                                                                       \
            return float4{(float)gpt2cupy::from_fp8((__nv_fp8_storage_t)__x, INTERPRETATION),                    \
                          (float)gpt2cupy::from_fp8((__nv_fp8_storage_t)(__x >> 8), INTERPRETATION),              \
                          (float)gpt2cupy::from_fp8((__nv_fp8_storage_t)(__x >> 16), INTERPRETATION),             \
                          (float)gpt2cupy::from_fp8((__nv_fp8_storage_t)(__x >> 24), INTERPRETATION)};            \
        }                                                                                                        \
    };
GPT2CUPY_FP8(__nv_fp8_e4m3, __nv_fp8x2_e4m3, __nv_fp8x4_e4m3, __NV_E4M3)
GPT2CUPY_FP8(__nv_fp8_e5m2, __nv_fp8x2_e5m2, __nv_fp8x4_e5m2, __NV_E5M2)
#undef GPT2CUPY_FP8

// How the executor checks arrays passed for these: uint8 (one value), uint16 (a pair), uint32 (four), as for
// __nv_bfloat16, whose bits numpy holds in unsigned integers too.
namespace gpt2cupy {
template <> struct Element<__nv_fp8_e4m3> { static constexpr char kind = 'u'; static constexpr unsigned short size = 1; static constexpr bool vector = false; };
template <> struct Element<__nv_fp8_e5m2> { static constexpr char kind = 'u'; static constexpr unsigned short size = 1; static constexpr bool vector = false; };
template <> struct Element<__nv_fp8x2_e4m3> { static constexpr char kind = 'u'; static constexpr unsigned short size = 2; static constexpr bool vector = false; };
template <> struct Element<__nv_fp8x2_e5m2> { static constexpr char kind = 'u'; static constexpr unsigned short size = 2; static constexpr bool vector = false; };
template <> struct Element<__nv_fp8x4_e4m3> { static constexpr char kind = 'u'; static constexpr unsigned short size = 4; static constexpr bool vector = false; };
template <> struct Element<__nv_fp8x4_e5m2> { static constexpr char kind = 'u'; static constexpr unsigned short size = 4; static constexpr bool vector = false; };
}  // namespace gpt2cupy
