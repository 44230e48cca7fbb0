"""float32 products on Hopper's wgmma: TF32 ("high"), 3xTF32 ("highest"), and "medium" on the bf16 wgmma.

wgmma_matmul with float32 a and b runs wgmma's .tf32 instruction, which reads each value's upper 19 bits (the
value rounded toward zero to TF32): checked against float64 of those bits within float32 summation error, on
ragged sizes, with bias, accumulate and split K. gpt2_cupy.dispatch routes a large 2-D float32 product there
(SMALL_PRODUCT and MIN_COPIED_EXTENT are lowered here, so that small products take the route on the CPU
executor too): "high" in every layout (an operand that is not K-major copied first), "highest" as 3xTF32,
whose error against float64 is checked against chapter 01's float32 kernel's on the same inputs, and
"medium" against float64 of the bf16 values. On a GPU these need compute capability 9.0 (H100, H200).
"""

import itertools

import numpy as np
import pytest

from gpt2_cupy import backend
from gpt2_cupy import dispatch
from gpt2_cupy.ops import wgmma_matmul as wgmma_module
from gpt2_cupy.ops.matmul import matmul
from gpt2_cupy.dispatch import tensor_core_matmul
from gpt2_cupy.ops.wgmma_matmul import wgmma_matmul
from gpt2_cupy.precision import bf16_bits, bf16_values, tf32_split, tf32_values
from gpt2_cupy.testing import relative_error


def _is_hopper():
    return backend.xp.cuda.Device().compute_capability == "90"


pytestmark = pytest.mark.skipif(backend.name == "cuda" and not _is_hopper(),
                                reason="wgmma needs compute capability 9.0 (H100, H200)")

SUMMATION = 2.0 ** -21   # float32 rounding, a few units, at least once per slice of 32 along K


def upper_19_bits(x):
    """float32 x as wgmma's .tf32 reads it: the low 13 bits cleared (rounded toward zero), as float64."""
    return (np.asarray(x, np.float32).view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32).astype(np.float64)


def operand(rng, shape):
    return rng.standard_normal(shape).astype(np.float32)


def assert_within(got, expected, tolerance):
    error = np.abs(backend.asnumpy(got).astype(np.float64) - expected)
    worst = np.unravel_index(np.argmax(error - tolerance), error.shape)
    assert np.all(error <= tolerance), (f"element {tuple(int(i) for i in worst)}: error {error[worst]:.3g}, "
                                        f"tolerance {tolerance[worst]:.3g}")


def tf32_reference(a, b):
    """(float64 a bᵀ of the TF32 values the tensor core reads, the tolerance of each element)."""
    a64, b64 = upper_19_bits(a), upper_19_bits(b)
    K = a.shape[1]
    return a64 @ b64.T, SUMMATION * (K // 32 + 2) * (np.abs(a64) @ np.abs(b64).T)


# ---------------------------------------------------------------------------------------------------------
# wgmma_matmul on float32: the TF32 instruction, K-major operands as they lie
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("M, N, K", [(130, 136, 36), (70, 37, 40), (1, 8, 4), (129, 257, 100)])
def test_tf32_product_reads_the_upper_19_bits(M, N, K, rng):
    """Ragged edges in M, N and K (a slice is 32 floats; rows of a and b past M, N and k past K are zero-filled,
    results past M or N not stored: out starts as NaN); the values as stored give a result far outside the
    tolerance, so the check tells the TF32 reading from float32."""
    a, b = operand(rng, (M, K)), operand(rng, (N, K))
    out = backend.xp.full((M, N), np.nan, dtype=np.float32)
    assert wgmma_matmul(backend.xp.asarray(a), backend.xp.asarray(b), out=out) is out
    expected, tolerance = tf32_reference(a, b)
    assert_within(out, expected, tolerance)
    exact = a.astype(np.float64) @ b.T.astype(np.float64)
    assert np.any(np.abs(exact - expected) > tolerance)


def test_tf32_bias_accumulate_and_bf16_output(rng):
    a, b = operand(rng, (70, 40)), operand(rng, (136, 40))
    bias = operand(rng, (136,))
    xp = backend.xp
    expected, tolerance = tf32_reference(a, b)
    out = xp.full((70, 136), 0.5, dtype=np.float32)
    wgmma_matmul(xp.asarray(a), xp.asarray(b), out=out, bias=xp.asarray(bias), accumulate=True)
    assert_within(out, expected + bias + 0.5, tolerance + 2.0 ** -22 * (np.abs(expected) + np.abs(bias) + 0.5))
    rounded = wgmma_matmul(xp.asarray(a), xp.asarray(b), out_dtype="bfloat16")
    float32 = backend.asnumpy(wgmma_matmul(xp.asarray(a), xp.asarray(b)))
    np.testing.assert_array_equal(backend.asnumpy(rounded).view(np.uint16), bf16_bits(float32))


@pytest.mark.parametrize("accumulate", [False, True])
def test_tf32_split_k_adds_every_stretch_once(accumulate, rng):
    """K = 168 in three stretches of 64 floats (two slices each, the last ragged), added in order into out."""
    a, b = operand(rng, (40, 168)), operand(rng, (24, 168))
    xp = backend.xp
    out = xp.full((40, 24), 0.5 if accumulate else np.nan, dtype=np.float32)
    wgmma_module.launch_wgmma_matmul(xp.asarray(a), xp.asarray(b), out, None, accumulate, False, True,
                                     shape=(128, 3, 64))
    expected, tolerance = tf32_reference(a, b)
    assert_within(out, expected + (0.5 if accumulate else 0.0), tolerance + 2.0 ** -22 * (np.abs(expected) + 1))


def test_float32_operands_bad_arguments_are_clear_errors(rng):
    xp = backend.xp
    a, b = xp.asarray(operand(rng, (8, 16))), xp.asarray(operand(rng, (8, 16)))
    with pytest.raises(ValueError, match="K-major only"):
        wgmma_matmul(a, b, transpose_b=False)
    with pytest.raises(ValueError, match="K-major only"):
        wgmma_matmul(a, b, transpose_a=True)
    with pytest.raises(TypeError, match="both must be bf16, or both float32"):
        wgmma_matmul(a, xp.asarray(operand(rng, (8, 16)).astype(bf16_dtype())))
    with pytest.raises(ValueError, match="multiple of 4"):
        wgmma_matmul(xp.asarray(operand(rng, (8, 6))), xp.asarray(operand(rng, (8, 6))))
    with pytest.raises(TypeError, match="float64"):
        wgmma_matmul(a.astype(np.float64), b)


def bf16_dtype():
    import ml_dtypes
    return ml_dtypes.bfloat16


# ---------------------------------------------------------------------------------------------------------
# tensor_core_matmul's route to the wgmma for large 2-D float32 products
# ---------------------------------------------------------------------------------------------------------

@pytest.fixture
def every_product_on_wgmma(monkeypatch):
    """The route's thresholds lowered to 0: the small products of these tests take it (on the CPU executor a
    product at the real SMALL_PRODUCT would take minutes)."""
    monkeypatch.setattr(dispatch, "SMALL_PRODUCT", 0)
    monkeypatch.setattr(dispatch, "MIN_COPIED_EXTENT", 0)


LAYOUTS = [(False, True), (False, False), (True, False), (True, True)]   # x Wᵀ, dy W, dyᵀ x, and the fourth


def layout_operands(rng, M, N, K, transpose_a, transpose_b):
    a = operand(rng, (K, M) if transpose_a else (M, K))
    b = operand(rng, (N, K) if transpose_b else (K, N))
    return a, b, (a.T if transpose_a else a), (b.T if transpose_b else b)


@pytest.mark.parametrize("transpose_a, transpose_b", LAYOUTS)
@pytest.mark.parametrize("K", [40, 37])
def test_high_runs_tf32_wgmma_in_every_layout(transpose_a, transpose_b, K, rng, every_product_on_wgmma):
    """"high": the TF32 wgmma's reading (upper 19 bits), not mma.sync's rounding to nearest, in every layout
    (x Wᵀ as it lies; the others, and a K of 37 that is not whole 16-byte rows, through a K-major copy), with
    accumulate."""
    a, b, op_a, op_b = layout_operands(rng, 70, 136, K, transpose_a, transpose_b)
    old = operand(rng, (70, 136))
    out = backend.xp.asarray(old.copy())   # on the CPU, asarray may share old itself
    tensor_core_matmul(backend.xp.asarray(a), backend.xp.asarray(b), transpose_a, transpose_b, out=out,
                       accumulate=True, precision="high")
    expected, tolerance = tf32_reference(op_a, op_b.T)
    assert_within(out, expected + old, tolerance + 2.0 ** -22 * (np.abs(expected) + np.abs(old)))
    rounded_to_nearest = tf32_values(op_a) @ tf32_values(op_b)
    assert np.any(np.abs(rounded_to_nearest + old - expected - old) > tolerance)


def float32_kernel_error(op_a, op_b, exact, transpose_a, transpose_b, a, b):
    """Chapter 01's float32 kernel's relative error against float64 on the same inputs."""
    xp = backend.xp
    return relative_error(backend.asnumpy(matmul(xp.asarray(a), xp.asarray(b), transpose_a, transpose_b)), exact)


@pytest.mark.parametrize("transpose_a, transpose_b", LAYOUTS)
def test_highest_stays_as_accurate_as_float32(transpose_a, transpose_b, rng, every_product_on_wgmma):
    """"highest" (3xTF32 on the wgmma, its big times big part summed on the CUDA cores) against float64: an error
    of float32's class, at most twice chapter 01's float32 kernel's on the same inputs (both are float32 sums in
    different orders, and the tensor cores' accumulator truncates as it aligns its addends, where the CUDA cores
    round to nearest: chapter 15b), and far below one TF32 product's."""
    M, N, K = 70, 136, 300
    a, b, op_a, op_b = layout_operands(rng, M, N, K, transpose_a, transpose_b)
    exact = op_a.astype(np.float64) @ op_b.astype(np.float64)
    got = backend.asnumpy(tensor_core_matmul(backend.xp.asarray(a), backend.xp.asarray(b), transpose_a, transpose_b,
                                             precision="highest"))
    error = relative_error(got, exact)
    float32_error = float32_kernel_error(op_a, op_b, exact, transpose_a, transpose_b, a, b)
    assert error <= 2 * float32_error, (error, float32_error)
    assert error < relative_error(upper_19_bits(op_a) @ upper_19_bits(op_b), exact) / 100


@pytest.mark.parametrize("transpose_a, transpose_b", [(False, True), (True, False)])
def test_3xtf32_on_the_wgmma_is_far_more_accurate_than_tf32(transpose_a, transpose_b, rng):
    """The wgmma's 3xTF32 product (small·big + big·small + big·big over [small | big] and [big | small] rows,
    the big parts read twice): at least ten times closer to float64 than one TF32 product."""
    from gpt2_cupy.ops.wgmma_matmul import launch_tf32_wgmma_product

    a, b, op_a, op_b = layout_operands(rng, 70, 136, 300, transpose_a, transpose_b)
    exact = op_a.astype(np.float64) @ op_b.astype(np.float64)
    xp = backend.xp
    errors = []
    for products in (1, 3):
        out = xp.zeros((70, 136), dtype=np.float32)
        launch_tf32_wgmma_product(xp.asarray(a), xp.asarray(b), out, transpose_a, transpose_b, False, products)
        errors.append(relative_error(backend.asnumpy(out), exact))
    assert errors[1] < errors[0] / 10, errors


def test_highest_accumulates_and_takes_a_ragged_k(rng, every_product_on_wgmma):
    a, b, op_a, op_b = layout_operands(rng, 40, 136, 37, True, False)
    old = operand(rng, (40, 136))
    out = backend.xp.asarray(old.copy())   # on the CPU, asarray may share old itself
    tensor_core_matmul(backend.xp.asarray(a), backend.xp.asarray(b), True, False, out=out, accumulate=True,
                       precision="highest")
    exact = op_a.astype(np.float64) @ op_b.astype(np.float64) + old
    assert relative_error(backend.asnumpy(out), exact) < 1e-6


@pytest.mark.parametrize("transpose_a, transpose_b", [(False, True), (True, False)])
def test_medium_runs_bf16_wgmma(transpose_a, transpose_b, rng, every_product_on_wgmma):
    """"medium": inputs rounded to bf16 (to nearest), float32 sums."""
    a, b, op_a, op_b = layout_operands(rng, 70, 136, 40, transpose_a, transpose_b)
    got = backend.asnumpy(tensor_core_matmul(backend.xp.asarray(a), backend.xp.asarray(b), transpose_a, transpose_b,
                                             precision="medium"))
    as_read = bf16_values(bf16_bits(op_a)) @ bf16_values(bf16_bits(op_b))
    assert relative_error(got, as_read) < 1e-5
    assert relative_error(got, op_a.astype(np.float64) @ op_b.astype(np.float64)) > 1e-4   # it did round


@pytest.mark.parametrize("precision", ["highest", "high", "medium"])
def test_linear_bias_goes_into_the_products_store(precision, rng, every_product_on_wgmma):
    """The Linear forward adds its bias in the wgmma's store (one pass over y, not two): the bits of the product
    without a bias plus the bias, added once in float32, at every precision ("highest" on the CPU executor runs
    chapter 01's kernel and chapter 02's bias_add, which must agree the same way)."""
    import gpt2_cupy
    from gpt2_cupy.dispatch import linear_forward
    x, w, bias = operand(rng, (70, 40)), operand(rng, (136, 40)), operand(rng, (136,))
    before = gpt2_cupy.get_float32_matmul_precision()
    gpt2_cupy.set_float32_matmul_precision(precision)
    try:
        xp = backend.xp
        y = backend.asnumpy(linear_forward(xp.asarray(x), xp.asarray(w), xp.asarray(bias)))
        product = backend.asnumpy(linear_forward(xp.asarray(x), xp.asarray(w)))
    finally:
        gpt2_cupy.set_float32_matmul_precision(before)
    assert np.array_equal(y, product + bias)


def test_small_products_keep_the_mma_sync_kernel(rng):
    """Below SMALL_PRODUCT, "high" stays on mma.sync's kernel, which rounds its inputs to nearest TF32."""
    a, b = operand(rng, (40, 36)), operand(rng, (24, 36))
    got = backend.asnumpy(tensor_core_matmul(backend.xp.asarray(a), backend.xp.asarray(b), transpose_b=True,
                                             precision="high"))
    assert relative_error(got, tf32_values(a) @ tf32_values(b).T) < 1e-6


def test_a_copied_operand_needs_wide_products(rng, monkeypatch):
    """With SMALL_PRODUCT lowered but MIN_COPIED_EXTENT as it is: "high" x Wᵀ (read as it lies) takes the TF32
    wgmma at M = 40, while dy W (W copied K-major first) stays on mma.sync, which rounds to nearest."""
    monkeypatch.setattr(dispatch, "SMALL_PRODUCT", 0)
    assert dispatch.MIN_COPIED_EXTENT > 40
    a, w = operand(rng, (40, 36)), operand(rng, (24, 36))
    xp = backend.xp
    forward = backend.asnumpy(tensor_core_matmul(xp.asarray(a), xp.asarray(w), transpose_b=True, precision="high"))
    expected, tolerance = tf32_reference(a, w)
    assert_within(forward, expected, tolerance)
    dy = operand(rng, (40, 24))
    backward = backend.asnumpy(tensor_core_matmul(xp.asarray(dy), xp.asarray(w), precision="high"))
    assert relative_error(backward, tf32_values(dy) @ tf32_values(w)) < 1e-6


def test_tf32_operand_rows_split_and_pad(rng):
    """The one pass before a TF32 or 3xTF32 product: rows of op(x) made of parts one after another (here
    [small | big | value]), each padded to K rounded up to 4, where big is x rounded to nearest TF32 and small
    the TF32 of x - big; transposed input read as it lies."""
    x = operand(rng, (37, 50))    # stored K x rows: op(x) = xᵀ is 50 x 37
    parts = (wgmma_module.PART_SMALL, wgmma_module.PART_BIG, wgmma_module.PART_VALUE)
    got = backend.asnumpy(wgmma_module.tf32_operand_rows(backend.xp.asarray(x), False, parts))
    assert got.shape == (50, 3 * 40)
    rows = x.T.astype(np.float64)
    big = tf32_values(x.T)
    small = tf32_values((rows - big).astype(np.float32))
    np.testing.assert_array_equal(got[:, 0:37], small)
    np.testing.assert_array_equal(got[:, 40:77], big)
    np.testing.assert_array_equal(got[:, 80:117], x.T)
    for start in (37, 77, 117):
        assert not np.any(got[:, start:start + 3])
    assert np.all(np.abs(big + small - rows) <= 2.0 ** -21 * np.abs(rows))   # big + small keeps 22 bits


def operand_rows_reference(rows_of_x, parts, segment_k):
    """What tf32_operand_rows writes, from numpy: the float32 rows of op(x) once per part, each padded with zeros
    to segment_k (big and small from tf32_split, which rounds as cvt.rna.tf32 does)."""
    rows, K = rows_of_x.shape
    big, small = tf32_split(rows_of_x)
    by_part = {wgmma_module.PART_VALUE: rows_of_x, wgmma_module.PART_BIG: big.astype(np.float32),
               wgmma_module.PART_SMALL: small.astype(np.float32)}
    expected = np.zeros((rows, len(parts) * segment_k), dtype=np.float32)
    for segment, part in enumerate(parts):
        expected[:, segment * segment_k:segment * segment_k + K] = by_part[part]
    return expected


def awkward_floats(rng, size):
    """float32 values spread over 40 binades, with ties of the TF32 rounding (the 13 dropped bits 1000...0,
    rounded away from zero), signed zeros, subnormals of either sign, and normal values just above the smallest
    normal, whose x - big is subnormal (the kernel's subtraction flushes it: tf32_split models that)."""
    x = (rng.standard_normal(size) * 2.0 ** rng.integers(-20, 20, size)).astype(np.float32)
    bits = x.view(np.uint32)
    kind = rng.integers(0, 10, size)
    bits[kind == 0] = (bits[kind == 0] & 0xFFFFE000) | 0x1000
    sign = bits & 0x80000000
    bits[kind == 1] = (sign | rng.integers(1, 0x800000, size).astype(np.uint32))[kind == 1]
    bits[kind == 2] &= 0x80000000
    bits[kind == 3] = (sign | rng.integers(0x800000, 0x1800000, size).astype(np.uint32))[kind == 3]
    return x


OPERAND_ROW_PARTS = [parts for count in (1, 2, 3) for parts in itertools.permutations(
    (wgmma_module.PART_VALUE, wgmma_module.PART_BIG, wgmma_module.PART_SMALL), count)]


@pytest.mark.parametrize("rows, K", [(1, 1), (5, 3), (63, 65), (64, 64), (130, 97), (70, 200)])
@pytest.mark.parametrize("k_contiguous", [True, False])
@pytest.mark.parametrize("offset", [0, 1])
def test_tf32_operand_rows_bits_at_awkward_sizes(rows, K, k_contiguous, offset, rng):
    """Every bit of the pass, in every order of 1, 2 or 3 parts, segments padded to 4 and to a slice of 32, for
    sizes across and inside one block's tile, x as it lies (k contiguous) or transposed, and x a view `offset`
    floats into an array (rows that start off 16 bytes are read a float at a time, not as float4s)."""
    shape = (rows, K) if k_contiguous else (K, rows)
    whole = backend.xp.asarray(awkward_floats(rng, rows * K + offset))
    x = whole[offset:].reshape(shape)
    rows_of_x = backend.asnumpy(x) if k_contiguous else backend.asnumpy(x).T
    for segment_multiple in (wgmma_module.TF32_ROW_MULTIPLE, wgmma_module.TF32_SLICE_K):
        segment_k = -(-K // segment_multiple) * segment_multiple
        for parts in OPERAND_ROW_PARTS:
            got = backend.asnumpy(wgmma_module.tf32_operand_rows(x, k_contiguous, parts, segment_multiple))
            expected = operand_rows_reference(rows_of_x, parts, segment_k)
            assert got.shape == expected.shape
            np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32),
                                          err_msg=f"parts {parts}, segments of {segment_k}")
