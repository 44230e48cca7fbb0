"""Conformance of <cuda_fp8.h>: __nv_fp8_e4m3 and __nv_fp8_e5m2, and CUDA's conversions to and from them.

The reference here is written from the OCP 8-bit floating point specification, not from any implementation: the
finite values of each format are listed from their bits, and a value converts to the nearest of them, ties to
the one whose last mantissa bit is 0. Past the largest finite value (448 for E4M3, 57344 for E5M2) a value that
rounds beyond it saturates to it with __NV_SATFINITE, and otherwise becomes infinity (E5M2) or NaN (E4M3, which has
no infinity). A NaN stays a NaN. The classes' constructors saturate. Every FP8 value is exact as a float.

The kernels run on the active backend: on a GPU this checks the reading of the specification against CUDA's
header, on the CPU that the executor's header agrees with both.
"""

import numpy as np
import pytest

from gpt2_cupy import backend

# (exponent bits, mantissa bits, bias, whether the format has infinities)
FORMATS = {"e4m3": (4, 3, 7, False), "e5m2": (5, 2, 15, True)}


def decode(code, name):
    """The value of one FP8 code (NaN for the NaN codes)."""
    exponent_bits, mantissa_bits, bias, has_infinity = FORMATS[name]
    sign = -1.0 if code & 0x80 else 1.0
    field, mantissa = (code & 0x7F) >> mantissa_bits, code & ((1 << mantissa_bits) - 1)
    top = (1 << exponent_bits) - 1
    if has_infinity and field == top:
        return sign * np.inf if mantissa == 0 else np.nan
    if not has_infinity and (code & 0x7F) == 0x7F:
        return np.nan
    if field == 0:
        return sign * mantissa * 2.0 ** (1 - bias - mantissa_bits)
    return sign * (1 + mantissa / 2 ** mantissa_bits) * 2.0 ** (field - bias)


def finite_codes(name):
    """(codes, values) of the non-negative finite values, in increasing order."""
    codes = [c for c in range(0x80) if np.isfinite(decode(c, name))]
    return np.array(codes), np.array([decode(c, name) for c in codes])


def reference(x, name, saturate):
    """The FP8 code of float x, or None for a NaN code (whose payload the specification leaves open)."""
    x = float(x)
    if np.isnan(x):
        return None
    codes, values = finite_codes(name)
    sign = 0x80 if np.signbit(x) else 0
    a = abs(x)
    largest, below_largest = values[-1], values[-2]
    boundary = largest + (largest - below_largest) / 2  # halfway to the value past the largest
    ties_up = codes[-1] & 1  # a tie at the boundary goes to the even side: up, when the largest code is odd
    if a > boundary or (a == boundary and ties_up):
        if saturate:
            return sign | codes[-1]
        return None if name == "e4m3" else sign | 0x7C
    distance = np.abs(values - a)
    nearest = np.flatnonzero(distance == distance.min())
    chosen = nearest[0] if len(nearest) == 1 else next(k for k in nearest if codes[k] % 2 == 0)
    return sign | codes[chosen]


def interesting_floats(rng):
    """Every FP8 value, the midpoints between neighbours (ties) and the floats just beside them, values around the
    largest finite ones and past them, subnormal floats, zeros of both signs, infinities and NaN."""
    values = set()
    for name in FORMATS:
        _, finite = finite_codes(name)
        values.update(finite)
        middles = (finite[1:] + finite[:-1]) / 2
        values.update(middles)
        values.update(np.nextafter(middles.astype(np.float32), np.float32(np.inf)).astype(np.float64))
        values.update(np.nextafter(middles.astype(np.float32), np.float32(0)).astype(np.float64))
    values.update([449.0, 463.0, 464.0, 465.0, 479.0, 480.0, 500.0, 57343.0, 57344.0, 61439.0, 61440.0, 61441.0,
                   65536.0, 1e30, 3.4e38, 1e-40, 1e-45, 2.0 ** -10, 2.0 ** -17, 2.0 ** -18])
    values.update(np.abs(rng.standard_normal(200) * 100))
    values = np.array(sorted(values), dtype=np.float32)
    return np.concatenate([values, -values, np.array([np.inf, -np.inf, np.nan, -0.0], dtype=np.float32)])


CONVERSIONS = r"""
#include <cuda_fp8.h>
// out[4 i + k]: x[i] converted with (E4M3, E5M2) x (saturating, not) by __nv_cvt_float_to_fp8; by_class[2 i + k]:
// x[i] through the constructors of __nv_fp8_e4m3 and __nv_fp8_e5m2 (which saturate) and their bits.
extern "C" __global__ void to_fp8(unsigned char* out, unsigned char* by_class, const float* x, int n)
{
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    out[4 * i + 0] = __nv_cvt_float_to_fp8(x[i], __NV_SATFINITE, __NV_E4M3);
    out[4 * i + 1] = __nv_cvt_float_to_fp8(x[i], __NV_NOSAT, __NV_E4M3);
    out[4 * i + 2] = __nv_cvt_float_to_fp8(x[i], __NV_SATFINITE, __NV_E5M2);
    out[4 * i + 3] = __nv_cvt_float_to_fp8(x[i], __NV_NOSAT, __NV_E5M2);
    by_class[2 * i + 0] = __nv_fp8_e4m3(x[i]).__x;
    by_class[2 * i + 1] = __nv_fp8_e5m2(x[i]).__x;
}

// Every code of each format back to float (operator float) and through __half (operator __half).
extern "C" __global__ void from_fp8(float* as_float, float* through_half)
{
    const int code = threadIdx.x;
    __nv_fp8_e4m3 e4m3;
    __nv_fp8_e5m2 e5m2;
    e4m3.__x = (__nv_fp8_storage_t)code;
    e5m2.__x = (__nv_fp8_storage_t)code;
    as_float[code] = float(e4m3);
    as_float[256 + code] = float(e5m2);
    through_half[code] = __half2float(__half(e4m3));
    through_half[256 + code] = __half2float(__half(e5m2));
}
"""

COLUMNS = [("e4m3", True), ("e4m3", False), ("e5m2", True), ("e5m2", False)]


def assert_codes(got, x, name, saturate, what):
    for value, code in zip(x, got):
        expected = reference(value, name, saturate)
        if expected is None:  # NaN: the exponent and mantissa of a NaN code, either sign
            is_nan = (code & 0x7F) == 0x7F if name == "e4m3" else (code & 0x7C) == 0x7C and (code & 0x03) != 0
            assert is_nan, f"{what}({value!r}) = {code:#04x}, expected a NaN code"
        else:
            assert code == expected, f"{what}({value!r}) = {code:#04x}, expected {expected:#04x}"


def test_float_to_fp8_rounds_to_nearest_even_and_saturates_as_asked(rng, to_device, to_host):
    x = interesting_floats(rng)
    kernel = backend.RawModule(code=CONVERSIONS).get_function("to_fp8")
    out = to_device(np.zeros((x.size, 4), np.uint8))
    by_class = to_device(np.zeros((x.size, 2), np.uint8))
    kernel(((x.size + 127) // 128,), (128,), (out, by_class, to_device(x), np.int32(x.size)))
    got, got_class = to_host(out), to_host(by_class)
    for column, (name, saturate) in enumerate(COLUMNS):
        what = f"__nv_cvt_float_to_fp8(.., {'__NV_SATFINITE' if saturate else '__NV_NOSAT'}, {name})"
        assert_codes(got[:, column], x, name, saturate, what)
    assert_codes(got_class[:, 0], x, "e4m3", True, "__nv_fp8_e4m3")
    assert_codes(got_class[:, 1], x, "e5m2", True, "__nv_fp8_e5m2")


def test_every_fp8_code_converts_back_exactly(to_device, to_host):
    kernel = backend.RawModule(code=CONVERSIONS).get_function("from_fp8")
    as_float, through_half = to_device(np.zeros(512, np.float32)), to_device(np.zeros(512, np.float32))
    kernel((1,), (256,), (as_float, through_half))
    expected = np.array([decode(c, n) for n in ("e4m3", "e5m2") for c in range(256)])
    for got in (to_host(as_float), to_host(through_half)):
        np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
        finite = ~np.isnan(expected)
        assert got[finite].tolist() == expected[finite].tolist()
        assert np.signbit(got[finite]).tolist() == np.signbit(expected[finite]).tolist()


def test_the_reference_knows_the_formats_edges():
    # the specification's numbers, so that the reference above cannot drift from it
    assert finite_codes("e4m3")[1][-1] == 448 and finite_codes("e5m2")[1][-1] == 57344
    assert decode(0x01, "e4m3") == 2.0 ** -9 and decode(0x01, "e5m2") == 2.0 ** -16
    assert reference(464.0, "e4m3", False) == 0x7E and reference(464.5, "e4m3", False) is None
    assert reference(61439.0, "e5m2", False) == 0x7B and reference(61440.0, "e5m2", False) == 0x7C
    assert reference(np.inf, "e5m2", True) == 0x7B and reference(-np.inf, "e4m3", True) == 0xFE
