// The 16-bit floating-point types of <cuda_fp16.h> (__half: 5 exponent bits, 10 mantissa bits) and
// <cuda_bf16.h> (__nv_bfloat16: 8 and 7), for the CPU executor. Stored as their bits; every conversion
// rounds to nearest, ties to even, in integer arithmetic on the bits, so results are bit-exact with a GPU
// (overflow to infinity, subnormals, -0). Arithmetic is done in double and rounded once to 16 bits:
// double has more than twice the bits plus two, so the two roundings give the correctly rounded result.
// Division is within a unit in the last place, as on a GPU (see divide_as_gpu).
#pragma once

namespace gpt2cupy {

// Shift m right by `shift` bits, rounding as `mode` says: 'n' to nearest, ties to even; 'z' toward zero;
// 'u' up and 'd' down (toward +inf and -inf: for a negative number, whose magnitude m is, the other way).
__forceinline__ unsigned long long shift_right_rounding(unsigned long long m, int shift, char mode = 'n', bool negative = false) {
    if (shift <= 0) return m;
    unsigned long long result = shift >= 64 ? 0 : m >> shift;
    unsigned long long rest = shift >= 64 ? m : m & ((1ull << shift) - 1);
    if (rest == 0) return result;
    if (mode == 'n') {
        unsigned long long half = 1ull << (shift < 64 ? shift - 1 : 63);  // m < 2^53: never past half when shift >= 64
        if (rest > half || (rest == half && (result & 1))) ++result;
    } else if ((mode == 'u' && !negative) || (mode == 'd' && negative)) {
        ++result;
    }
    return result;
}

// The bits of `value` rounded (as shift_right_rounding's mode says) to a float with E exponent bits and M
// mantissa bits. A NaN becomes the canonical NaN 0x7fff, as on a GPU.
template <int M, int E>
__forceinline__ unsigned short round_to_small(double value, char mode = 'n') {
    const int bias = (1 << (E - 1)) - 1;
    unsigned long long bits = gpt2cupy_bit_cast<unsigned long long>(value);
    bool negative = bits >> 63;
    unsigned int sign = (unsigned int)negative << (M + E);
    unsigned long long magnitude = bits & 0x7fffffffffffffffull;
    unsigned long long infinity = ((1ull << E) - 1) << M;
    if (magnitude > 0x7ff0000000000000ull) return 0x7fff;
    if (magnitude == 0x7ff0000000000000ull) return (unsigned short)(sign | infinity);
    // Past the largest finite value: infinity when rounding to nearest or away from zero, else the largest.
    bool to_infinity = mode == 'n' || (mode == 'u' && !negative) || (mode == 'd' && negative);
    unsigned long long overflow = to_infinity ? infinity : infinity - 1;
    int exponent = (int)(magnitude >> 52);
    if (exponent == 0)  // 0, or a double subnormal: far below the smallest 16-bit value
        return (unsigned short)(sign | (magnitude != 0 && mode != 'n' && to_infinity ? 1 : 0));
    unsigned long long mantissa = (magnitude & 0xfffffffffffffull) | (1ull << 52);
    int target = exponent - 1023 + bias;  // the biased exponent in the 16-bit format
    unsigned long long result;
    if (target >= 1) {
        if (target >= (1 << E)) return (unsigned short)(sign | overflow);
        // The leading 1 lands on bit M, adding 1 to the exponent field: hence target - 1.
        result = ((unsigned long long)(target - 1) << M) + shift_right_rounding(mantissa, 52 - M, mode, negative);
    } else {  // a subnormal (or 0, or the smallest normal)
        result = shift_right_rounding(mantissa, 52 - M + 1 - target, mode, negative);
    }
    if (result >= infinity) result = overflow;  // rounded past the largest finite value
    return (unsigned short)(sign | result);
}

// 2^power as a double, for -1022 <= power <= 1023: its bits written directly.
__forceinline__ constexpr unsigned long long power_of_two_bits(int power) {
    return (unsigned long long)(power + 1023) << 52;
}

// A float's exact value as a double, subnormals included. Kernels run with subnormal float arithmetic flushed
// to zero, as a GPU's under CuPy's -ftz=true, and the CPU's flag for that (DAZ) would read a subnormal float
// as 0 in a plain conversion too; a GPU's conversion to a 16-bit format reads it whole. So a subnormal's
// value is built from its bits: its mantissa times 2^-149, both normal doubles.
__forceinline__ double exact_double(float value) {
    unsigned int bits = gpt2cupy_bit_cast<unsigned int>(value);
    if ((bits & 0x7f800000u) != 0 || (bits & 0x7fffffu) == 0) return (double)value;  // no subnormal to read
    double magnitude = (double)(bits & 0x7fffffu) * gpt2cupy_bit_cast<double>(power_of_two_bits(-149));
    return bits >> 31 ? -magnitude : magnitude;
}

// round_to_small of a float: its exact value, subnormal or not.
template <int M, int E>
__forceinline__ unsigned short round_float_exactly(float value, char mode = 'n') {
    return round_to_small<M, E>(exact_double(value), mode);
}

// A float rounded to nearest even as round_to_small does it, bit by bit where the format is bf16, whose
// exponent is a float's: the upper 16 bits after adding just under half of the lower 16 bits' range, plus
// the last kept bit (ties to even); overflow to infinity and subnormals come out of the same addition.
template <int M, int E>
__forceinline__ unsigned short round_float_to_small(float value) {
    if (M != 7 || E != 8) return round_float_exactly<M, E>(value);
    unsigned int bits = gpt2cupy_bit_cast<unsigned int>(value);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fff;  // NaN: the canonical NaN, as round_to_small gives
    return (unsigned short)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// The exact value of 16 bits of that format. A normal number's double is written bit by bit (the exponent
// rebiased, the mantissa moved up), a subnormal's is its mantissa times a power of two: both exact, and
// without a call of ldexp for each conversion.
template <int M, int E>
__forceinline__ double widen_small(unsigned short bits) {
    const int bias = (1 << (E - 1)) - 1;
    unsigned int exponent = (bits >> M) & ((1u << E) - 1u);
    unsigned int mantissa = bits & ((1u << M) - 1u);
    double magnitude;
    if (exponent == (1u << E) - 1u) {
        magnitude = mantissa ? __builtin_nan("") : __builtin_inf();
    } else if (exponent == 0) {
        magnitude = (double)mantissa * gpt2cupy_bit_cast<double>(power_of_two_bits(1 - bias - M));
    } else {
        unsigned long long exponent_bits = (unsigned long long)((int)exponent - bias + 1023) << 52;
        magnitude = gpt2cupy_bit_cast<double>(exponent_bits | ((unsigned long long)mantissa << (52 - M)));
    }
    return (bits >> (M + E)) & 1u ? -magnitude : magnitude;
}

// 16 bits of that format as a float, exactly. A bf16 is a float's upper half, subnormals included, which a
// conversion from double would flush (the kernels' flag for float subnormals, FTZ, applies to it): its bits are
// moved instead, as a GPU moves them. Every half is a normal float or zero, converted exactly.
template <int M, int E>
__forceinline__ float small_to_float(unsigned short bits) {
    if (M == 7 && E == 8) return gpt2cupy_bit_cast<float>((unsigned int)bits << 16);
    return (float)widen_small<M, E>(bits);
}

// a * b + c rounded once: a * b is exact in double; the sum is rounded to odd (the last bit records any
// inexactness), which a second rounding to far fewer bits leaves correct.
__forceinline__ double fma_rounded_to_odd(double a, double b, double c) {
    double product = a * b;
    double sum = product + c;
    double back = sum - c;
    double error = (product - back) + (c - (sum - back));  // the exact sum is sum + error (TwoSum)
    if (error == 0.0 || sum != sum || __builtin_isinf(sum)) return sum;
    unsigned long long bits = gpt2cupy_bit_cast<unsigned long long>(sum);
    if ((bits & 1) == 0) bits += ((error > 0) == (sum > 0)) ? 1 : -1;  // toward the exact value
    return gpt2cupy_bit_cast<double>(bits);
}

// a / b as a GPU's __hdiv gives it: within a unit in the last place of the exact quotient (an H100 divides a
// bfloat16 by a divisor of 2^126 or more accurately too, though its reciprocal is a float subnormal).
__forceinline__ double divide_as_gpu(double a, double b) {
    return a / b;
}

}  // namespace gpt2cupy

// One 16-bit type T (with its pair T2 = {x, y}), its operators and the functions shared by both formats.
#define GPT2CUPY_SMALL_FLOAT(T, T2, RAW, RAW2, M, E)                                                              \
    struct RAW { unsigned short x; };                                                                            \
    struct RAW2 { unsigned short x, y; };                                                                        \
    struct __align__(2) T {                                                                                      \
        unsigned short __x;                                                                                      \
        T() = default;                                                                                           \
        constexpr T(const RAW& raw) : __x(raw.x) {}                                                              \
        T(float value) : __x(gpt2cupy::round_float_to_small<M, E>(value)) {}                                     \
        T(double value) : __x(gpt2cupy::round_to_small<M, E>(value)) {}                                          \
        T(int value) : __x(gpt2cupy::round_to_small<M, E>(value)) {}                                             \
        T(unsigned int value) : __x(gpt2cupy::round_to_small<M, E>(value)) {}                                    \
        T(short value) : __x(gpt2cupy::round_to_small<M, E>(value)) {}                                           \
        T(unsigned short value) : __x(gpt2cupy::round_to_small<M, E>(value)) {}                                  \
        T(long long value) : __x(gpt2cupy::round_to_small<M, E>((double)value)) {}                               \
        T(unsigned long long value) : __x(gpt2cupy::round_to_small<M, E>((double)value)) {}                      \
        operator RAW() const { return RAW{__x}; }                                                                \
        operator float() const { return gpt2cupy::small_to_float<M, E>(__x); }                                   \
        T& operator=(float value) { __x = gpt2cupy::round_float_to_small<M, E>(value); return *this; }           \
        T& operator=(double value) { __x = gpt2cupy::round_to_small<M, E>(value); return *this; }                \
        T& operator=(const RAW& raw) { __x = raw.x; return *this; }                                              \
    };                                                                                                           \
    struct __align__(4) T2 {                                                                                     \
        T x, y;                                                                                                  \
        T2() = default;                                                                                          \
        constexpr T2(const T& a, const T& b) : x(a), y(b) {}                                                     \
        T2(const RAW2& raw) : x(RAW{raw.x}), y(RAW{raw.y}) {}                                                    \
        operator RAW2() const { return RAW2{x.__x, y.__x}; }                                                     \
    };                                                                                                           \
    __forceinline__ double gpt2cupy_wide(T a) { return gpt2cupy::widen_small<M, E>(a.__x); }                     \
    __forceinline__ T gpt2cupy_narrow_##T(double value) { return RAW{gpt2cupy::round_to_small<M, E>(value)}; }   \
    __forceinline__ bool __hisnan(T a) { return (a.__x & 0x7fff) > (((1u << E) - 1u) << M); }                     \
    __forceinline__ int __hisinf(T a) {                                                                          \
        return (a.__x & 0x7fff) == (((1u << E) - 1u) << M) ? ((a.__x >> 15) ? -1 : 1) : 0;                        \
    }                                                                                                            \
    __forceinline__ T __hadd(T a, T b) { return gpt2cupy_narrow_##T(gpt2cupy_wide(a) + gpt2cupy_wide(b)); }       \
    __forceinline__ T __hsub(T a, T b) { return gpt2cupy_narrow_##T(gpt2cupy_wide(a) - gpt2cupy_wide(b)); }       \
    __forceinline__ T __hmul(T a, T b) { return gpt2cupy_narrow_##T(gpt2cupy_wide(a) * gpt2cupy_wide(b)); }       \
    __forceinline__ T __hdiv(T a, T b) { return gpt2cupy_narrow_##T(gpt2cupy::divide_as_gpu(gpt2cupy_wide(a), gpt2cupy_wide(b))); } \
    __forceinline__ T __hfma(T a, T b, T c) {                                                                    \
        return gpt2cupy_narrow_##T(gpt2cupy::fma_rounded_to_odd(gpt2cupy_wide(a), gpt2cupy_wide(b), gpt2cupy_wide(c))); \
    }                                                                                                            \
    /* The _rn versions are never fused into an fma by the compiler: here nothing is. */                       \
    __forceinline__ T __hadd_rn(T a, T b) { return __hadd(a, b); }                                               \
    __forceinline__ T __hsub_rn(T a, T b) { return __hsub(a, b); }                                               \
    __forceinline__ T __hmul_rn(T a, T b) { return __hmul(a, b); }                                               \
    /* _sat: the result clamped to [0, 1] (NaN to 0); _relu: negative results (and NaN) to 0. */              \
    __forceinline__ T gpt2cupy_saturate_##T(T a) { return gpt2cupy_narrow_##T(__saturatef((float)gpt2cupy_wide(a))); } \
    __forceinline__ T __hadd_sat(T a, T b) { return gpt2cupy_saturate_##T(__hadd(a, b)); }                      \
    __forceinline__ T __hsub_sat(T a, T b) { return gpt2cupy_saturate_##T(__hsub(a, b)); }                      \
    __forceinline__ T __hmul_sat(T a, T b) { return gpt2cupy_saturate_##T(__hmul(a, b)); }                      \
    __forceinline__ T __hfma_sat(T a, T b, T c) { return gpt2cupy_saturate_##T(__hfma(a, b, c)); }              \
    __forceinline__ T __hfma_relu(T a, T b, T c) {                                                               \
        T r = __hfma(a, b, c);                                                                                   \
        return (r.__x & 0x7fff) > (((1u << E) - 1u) << M) || (r.__x >> 15) ? T(RAW{0}) : r;                     \
    }                                                                                                            \
    __forceinline__ T __hneg(T a) { return RAW{(unsigned short)(a.__x ^ 0x8000u)}; }                             \
    __forceinline__ T __habs(T a) { return RAW{(unsigned short)(a.__x & 0x7fffu)}; }                             \
    /* Ordered comparisons are false when either side is NaN; the ...u ones (unordered) are then true. */       \
    __forceinline__ bool __heq(T a, T b) { return gpt2cupy_wide(a) == gpt2cupy_wide(b); }                        \
    __forceinline__ bool __hne(T a, T b) { return gpt2cupy_wide(a) < gpt2cupy_wide(b) || gpt2cupy_wide(a) > gpt2cupy_wide(b); } \
    __forceinline__ bool __hlt(T a, T b) { return gpt2cupy_wide(a) < gpt2cupy_wide(b); }                         \
    __forceinline__ bool __hle(T a, T b) { return gpt2cupy_wide(a) <= gpt2cupy_wide(b); }                        \
    __forceinline__ bool __hgt(T a, T b) { return gpt2cupy_wide(a) > gpt2cupy_wide(b); }                         \
    __forceinline__ bool __hge(T a, T b) { return gpt2cupy_wide(a) >= gpt2cupy_wide(b); }                        \
    __forceinline__ bool __hequ(T a, T b) { return !__hne(a, b); }                                               \
    __forceinline__ bool __hneu(T a, T b) { return !__heq(a, b); }                                               \
    __forceinline__ bool __hltu(T a, T b) { return !__hge(a, b); }                                               \
    __forceinline__ bool __hleu(T a, T b) { return !__hgt(a, b); }                                               \
    __forceinline__ bool __hgtu(T a, T b) { return !__hle(a, b); }                                               \
    __forceinline__ bool __hgeu(T a, T b) { return !__hlt(a, b); }                                               \
    /* __hmax/__hmin ignore a NaN (fmaxf-like); the _nan versions return NaN if either is NaN. */               \
    __forceinline__ T __hmax(T a, T b) {                                                                         \
        if (__hisnan(a)) return __hisnan(b) ? T(RAW{0x7fff}) : b;                                                \
        if (__hisnan(b)) return a;                                                                               \
        return gpt2cupy_wide(a) > gpt2cupy_wide(b) || (gpt2cupy_wide(a) == gpt2cupy_wide(b) && !(a.__x >> 15)) ? a : b; \
    }                                                                                                            \
    __forceinline__ T __hmin(T a, T b) {                                                                         \
        if (__hisnan(a)) return __hisnan(b) ? T(RAW{0x7fff}) : b;                                                \
        if (__hisnan(b)) return a;                                                                               \
        return gpt2cupy_wide(a) < gpt2cupy_wide(b) || (gpt2cupy_wide(a) == gpt2cupy_wide(b) && (a.__x >> 15)) ? a : b; \
    }                                                                                                            \
    __forceinline__ T __hmax_nan(T a, T b) { return __hisnan(a) || __hisnan(b) ? T(RAW{0x7fff}) : __hmax(a, b); } \
    __forceinline__ T __hmin_nan(T a, T b) { return __hisnan(a) || __hisnan(b) ? T(RAW{0x7fff}) : __hmin(a, b); } \
    __forceinline__ T operator+(const T& a, const T& b) { return __hadd(a, b); }                                 \
    __forceinline__ T operator-(const T& a, const T& b) { return __hsub(a, b); }                                 \
    __forceinline__ T operator*(const T& a, const T& b) { return __hmul(a, b); }                                 \
    __forceinline__ T operator/(const T& a, const T& b) { return __hdiv(a, b); }                                 \
    __forceinline__ T& operator+=(T& a, const T& b) { return a = __hadd(a, b); }                                 \
    __forceinline__ T& operator-=(T& a, const T& b) { return a = __hsub(a, b); }                                 \
    __forceinline__ T& operator*=(T& a, const T& b) { return a = __hmul(a, b); }                                 \
    __forceinline__ T& operator/=(T& a, const T& b) { return a = __hdiv(a, b); }                                 \
    __forceinline__ T operator-(const T& a) { return __hneg(a); }                                                \
    __forceinline__ T operator+(const T& a) { return a; }                                                        \
    __forceinline__ T& operator++(T& a) { return a = __hadd(a, T(1.0f)); }                                       \
    __forceinline__ T& operator--(T& a) { return a = __hsub(a, T(1.0f)); }                                       \
    __forceinline__ T operator++(T& a, int) { T old = a; a = __hadd(a, T(1.0f)); return old; }                  \
    __forceinline__ T operator--(T& a, int) { T old = a; a = __hsub(a, T(1.0f)); return old; }                  \
    __forceinline__ bool operator==(const T& a, const T& b) { return __heq(a, b); }                              \
    __forceinline__ bool operator!=(const T& a, const T& b) { return __hneu(a, b); }                             \
    __forceinline__ bool operator<(const T& a, const T& b) { return __hlt(a, b); }                               \
    __forceinline__ bool operator<=(const T& a, const T& b) { return __hle(a, b); }                              \
    __forceinline__ bool operator>(const T& a, const T& b) { return __hgt(a, b); }                               \
    __forceinline__ bool operator>=(const T& a, const T& b) { return __hge(a, b); }                              \
    /* Pairs: each operation on x and on y. */                                                                  \
    __forceinline__ T2 __hadd2(T2 a, T2 b) { return T2(__hadd(a.x, b.x), __hadd(a.y, b.y)); }                    \
    __forceinline__ T2 __hsub2(T2 a, T2 b) { return T2(__hsub(a.x, b.x), __hsub(a.y, b.y)); }                    \
    __forceinline__ T2 __hmul2(T2 a, T2 b) { return T2(__hmul(a.x, b.x), __hmul(a.y, b.y)); }                    \
    __forceinline__ T2 __h2div(T2 a, T2 b) { return T2(__hdiv(a.x, b.x), __hdiv(a.y, b.y)); }                    \
    __forceinline__ T2 __hfma2(T2 a, T2 b, T2 c) { return T2(__hfma(a.x, b.x, c.x), __hfma(a.y, b.y, c.y)); }    \
    __forceinline__ T2 __hneg2(T2 a) { return T2(__hneg(a.x), __hneg(a.y)); }                                    \
    __forceinline__ T2 __habs2(T2 a) { return T2(__habs(a.x), __habs(a.y)); }                                    \
    __forceinline__ T2 __hmax2(T2 a, T2 b) { return T2(__hmax(a.x, b.x), __hmax(a.y, b.y)); }                    \
    __forceinline__ T2 __hmin2(T2 a, T2 b) { return T2(__hmin(a.x, b.x), __hmin(a.y, b.y)); }                    \
    __forceinline__ T2 operator+(const T2& a, const T2& b) { return __hadd2(a, b); }                             \
    __forceinline__ T2 operator-(const T2& a, const T2& b) { return __hsub2(a, b); }                             \
    __forceinline__ T2 operator*(const T2& a, const T2& b) { return __hmul2(a, b); }                             \
    __forceinline__ T2 operator/(const T2& a, const T2& b) { return __h2div(a, b); }                             \
    __forceinline__ T2& operator+=(T2& a, const T2& b) { return a = __hadd2(a, b); }                             \
    __forceinline__ T2& operator*=(T2& a, const T2& b) { return a = __hmul2(a, b); }                             \
    __forceinline__ T2 operator-(const T2& a) { return __hneg2(a); }                                             \
    __forceinline__ float __low2float(T2 a) { return (float)a.x; }                                               \
    __forceinline__ float __high2float(T2 a) { return (float)a.y; }                                              \
    __forceinline__ float2 gpt2cupy_to_float2(T2 a) { return float2{(float)a.x, (float)a.y}; }                   \
    /* Math through float (the GPU's versions are approximations of these; compare with a tolerance). */        \
    __forceinline__ T hsqrt(T a) { return gpt2cupy_narrow_##T(sqrt(gpt2cupy_wide(a))); }                         \
    __forceinline__ T hrsqrt(T a) { return gpt2cupy_narrow_##T(1.0 / sqrt(gpt2cupy_wide(a))); }                  \
    __forceinline__ T hrcp(T a) { return gpt2cupy_narrow_##T(1.0 / gpt2cupy_wide(a)); }                          \
    __forceinline__ T hexp(T a) { return gpt2cupy_narrow_##T(exp(gpt2cupy_wide(a))); }                           \
    __forceinline__ T hexp2(T a) { return gpt2cupy_narrow_##T(exp2(gpt2cupy_wide(a))); }                         \
    __forceinline__ T hexp10(T a) { return gpt2cupy_narrow_##T(exp10(gpt2cupy_wide(a))); }                       \
    __forceinline__ T hlog(T a) { return gpt2cupy_narrow_##T(log(gpt2cupy_wide(a))); }                           \
    __forceinline__ T hlog2(T a) { return gpt2cupy_narrow_##T(log2(gpt2cupy_wide(a))); }                         \
    __forceinline__ T hlog10(T a) { return gpt2cupy_narrow_##T(log10(gpt2cupy_wide(a))); }                       \
    __forceinline__ T hsin(T a) { return gpt2cupy_narrow_##T(sin(gpt2cupy_wide(a))); }                           \
    __forceinline__ T hcos(T a) { return gpt2cupy_narrow_##T(cos(gpt2cupy_wide(a))); }                           \
    __forceinline__ T htanh(T a) { return gpt2cupy_narrow_##T(tanh(gpt2cupy_wide(a))); }                         \
    __forceinline__ T hceil(T a) { return gpt2cupy_narrow_##T(ceil(gpt2cupy_wide(a))); }                         \
    __forceinline__ T hfloor(T a) { return gpt2cupy_narrow_##T(floor(gpt2cupy_wide(a))); }                       \
    __forceinline__ T htrunc(T a) { return gpt2cupy_narrow_##T(trunc(gpt2cupy_wide(a))); }                       \
    __forceinline__ T hrint(T a) { return gpt2cupy_narrow_##T(rint(gpt2cupy_wide(a))); }                         \
    /* Atomics as a compare-and-swap loop on the bits. */                                                       \
    __forceinline__ T atomicAdd(T* address, T value) {                                                           \
        unsigned short* bits = reinterpret_cast<unsigned short*>(address);                                       \
        unsigned short old = __atomic_load_n(bits, __ATOMIC_RELAXED);                                            \
        while (!__atomic_compare_exchange_n(bits, &old, __hadd(T(RAW{old}), value).__x, true,                     \
                                            __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {}                              \
        return T(RAW{old});                                                                                      \
    }                                                                                                            \
    __forceinline__ T2 atomicAdd(T2* address, T2 value) {                                                        \
        unsigned int* bits = reinterpret_cast<unsigned int*>(address);                                           \
        unsigned int old = __atomic_load_n(bits, __ATOMIC_RELAXED);                                              \
        for (;;) {                                                                                               \
            T2 sum = __hadd2(gpt2cupy_bit_cast<T2>(old), value);                                                 \
            if (__atomic_compare_exchange_n(bits, &old, gpt2cupy_bit_cast<unsigned int>(sum), true,               \
                                            __ATOMIC_RELAXED, __ATOMIC_RELAXED)) break;                           \
        }                                                                                                        \
        return gpt2cupy_bit_cast<T2>(old);                                                                       \
    }
