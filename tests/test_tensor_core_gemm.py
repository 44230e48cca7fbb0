"""Chapter 15's tensor-core kernels and gpt2_cupy.ops.tensor_core_matmul against float64 numpy.

Two checks per product:
 - against float64 on the inputs as the tensor core reads them (rounded to TF32 or bf16, or split into
   3xTF32's big and small parts): within MMA_TOLERANCE (8 float32 units) of the sum of magnitudes per
   mma.sync, since each mma rounds its sum to float32 once (a few units on a GPU, whose order of
   accumulation inside the tensor core is unspecified). This tells TF32 rounded to nearest from TF32 cut
   toward zero, and a wrong fragment layout, by far more than the tolerance;
 - against float64 on the float32 inputs, with the tolerance the precision implies: relative error
   max |C - C_ref| / max |C_ref| below 1e-3 for TF32 (10 mantissa bits), 1e-2 for bf16 (8 bits), 1e-5
   for 3xTF32; and 3xTF32 at least as accurate as a float32 dot product with fused multiply-adds.
Shapes are not multiples of the 128 x 128 x 32 tiles (nor of 4: the kernels' 4-byte copies), or are
multiples of 4 but not of the tiles (16-byte copies).
"""

import numpy as np
import pytest

import gpt2_cupy
from gpt2_cupy import backend, kernels
from gpt2_cupy.ops.tensor_core_matmul import batched_tensor_core_matmul, tensor_core_matmul, to_bf16
from gpt2_cupy.precision import bf16_bits, bf16_values, tf32_split, tf32_values
from gpt2_cupy.testing import relative_error

MMA_TOLERANCE = 2.0 ** -20                       # per mma.sync, of the sum of magnitudes
TOLERANCE = {"highest": 1e-5, "high": 1e-3, "medium": 1e-2}
MMA_DEPTH = {"highest": 8, "high": 8, "medium": 16}
SHAPES = [(67, 45, 33), (68, 44, 36), (130, 20, 70)]


def operands(rng, M, N, K, transpose_a=False, transpose_b=False, batch=None):
    """float32 a and b stored as the op takes them, and op(a), op(b) as float64."""
    lead = () if batch is None else (batch,)
    op_a = rng.standard_normal(lead + (M, K), dtype=np.float32)
    op_b = rng.standard_normal(lead + (K, N), dtype=np.float32)
    a = np.ascontiguousarray(np.swapaxes(op_a, -1, -2)) if transpose_a else op_a
    b = np.ascontiguousarray(np.swapaxes(op_b, -1, -2)) if transpose_b else op_b
    return a, b, op_a.astype(np.float64), op_b.astype(np.float64)


def as_read(precision, op_a, op_b):
    """(float64 product of the inputs as the tensor cores read them, the sum of magnitudes of its terms)."""
    if precision == "high":
        a, b = tf32_values(op_a), tf32_values(op_b)
        return a @ b, np.abs(a) @ np.abs(b)
    if precision == "medium":
        a, b = bf16_values(bf16_bits(op_a)), bf16_values(bf16_bits(op_b))
        return a @ b, np.abs(a) @ np.abs(b)
    (a_big, a_small), (b_big, b_small) = tf32_split(op_a), tf32_split(op_b)
    terms = [(a_small, b_big), (a_big, b_small), (a_big, b_big)]
    return sum(x @ y for x, y in terms), sum(np.abs(x) @ np.abs(y) for x, y in terms)


def assert_tensor_core_product(got, precision, op_a, op_b, start=None):
    """got = start + op(a) op(b) as the tensor cores compute it, and close enough to float64."""
    exact, magnitudes = as_read(precision, op_a, op_b)
    start = np.zeros_like(exact) if start is None else start.astype(np.float64)
    mmas = -(-op_a.shape[-1] // MMA_DEPTH[precision]) * (3 if precision == "highest" else 1)
    error = np.abs(got - (exact + start))
    tolerance = MMA_TOLERANCE * (mmas + 1) * (magnitudes + np.abs(start))
    assert np.all(error <= tolerance), f"largest error {error.max():.3g}, tolerance there {tolerance.flat[error.argmax()]:.3g}"
    assert relative_error(got, op_a @ op_b + start) < TOLERANCE[precision]


# ---- the package's op --------------------------------------------------------------------------------------

@pytest.mark.parametrize("precision", ["highest", "high", "medium"])
@pytest.mark.parametrize("transpose_a, transpose_b", [(False, False), (False, True), (True, False), (True, True)])
@pytest.mark.parametrize("M, N, K", SHAPES)
def test_tensor_core_matmul_matches_float64(precision, transpose_a, transpose_b, M, N, K, rng, to_device, to_host):
    a, b, op_a, op_b = operands(rng, M, N, K, transpose_a, transpose_b)
    out = to_device(np.full((M, N), np.nan, dtype=np.float32))   # every element must be written
    tensor_core_matmul(to_device(a), to_device(b), transpose_a, transpose_b, out=out, precision=precision)
    assert_tensor_core_product(to_host(out), precision, op_a, op_b)


@pytest.mark.parametrize("precision", ["highest", "high", "medium"])
def test_accumulate_adds_to_out(precision, rng, to_device, to_host):
    a, b, op_a, op_b = operands(rng, 45, 67, 33, transpose_a=True)
    start = rng.standard_normal((45, 67), dtype=np.float32)
    out = to_device(start)
    tensor_core_matmul(to_device(a), to_device(b), transpose_a=True, out=out, accumulate=True, precision=precision)
    assert_tensor_core_product(to_host(out), precision, op_a, op_b, start=start)


@pytest.mark.parametrize("precision", ["highest", "high", "medium"])
def test_batched_products(precision, rng, to_device, to_host):
    a, b, op_a, op_b = operands(rng, 19, 21, 35, transpose_b=True, batch=3)
    got = to_host(batched_tensor_core_matmul(to_device(a), to_device(b), transpose_b=True, precision=precision))
    for i in range(3):
        assert_tensor_core_product(got[i], precision, op_a[i], op_b[i])


# GPT-2's Linear products at a twelfth of the width (C = 64) and a few tokens: (C_in, C_out) of attention's
# qkv projection and of the MLP's down projection.
GPT2_SCALED = {"attention qkv": (64, 192), "MLP down": (256, 64)}
ROWS = 80   # B * T


@pytest.mark.parametrize("precision", ["highest", "high", "medium"])
@pytest.mark.parametrize("layer", sorted(GPT2_SCALED))
def test_linear_layer_products(layer, precision, rng, to_device, to_host):
    """y = x Wᵀ, dx = dout W and dW += doutᵀ x, each as the Linear layer asks for it (no copies)."""
    c_in, c_out = GPT2_SCALED[layer]
    x = rng.standard_normal((ROWS, c_in), dtype=np.float32)
    w = rng.standard_normal((c_out, c_in), dtype=np.float32)
    dout = rng.standard_normal((ROWS, c_out), dtype=np.float32)
    dw_start = rng.standard_normal((c_out, c_in), dtype=np.float32)
    x_d, w_d, dout_d, dw = to_device(x), to_device(w), to_device(dout), to_device(dw_start)
    y = tensor_core_matmul(x_d, w_d, transpose_b=True, precision=precision)
    dx = tensor_core_matmul(dout_d, w_d, precision=precision)
    tensor_core_matmul(dout_d, x_d, transpose_a=True, out=dw, accumulate=True, precision=precision)
    x64, w64, dout64 = (v.astype(np.float64) for v in (x, w, dout))
    assert_tensor_core_product(to_host(y), precision, x64, w64.T)
    assert_tensor_core_product(to_host(dx), precision, dout64, w64)
    assert_tensor_core_product(to_host(dw), precision, dout64.T, x64, start=dw_start)


def fma_dot_products(a, b):
    """a @ b in float32 as one thread per output computes it: acc = fma(a_ik, b_kj, acc) for k = 0, 1, ..."""
    acc = np.zeros((a.shape[0], b.shape[1]), dtype=np.float32)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    for k in range(a.shape[1]):
        # the float64 product of two floats is exact, so one rounding per step, as a fused multiply-add
        acc = (acc + np.outer(a64[:, k], b64[k])).astype(np.float32)
    return acc


def test_3xtf32_is_as_accurate_as_float32(rng, to_device, to_host):
    """At K = 1024, 3xTF32's error against float64 (as a norm over the whole matrix) is no larger than that of
    float32 fused multiply-adds, while TF32's is over a hundred times larger."""
    a, b, op_a, op_b = operands(rng, 64, 64, 1024)
    reference = op_a @ op_b

    def norm_error(c):
        return np.linalg.norm(c - reference) / np.linalg.norm(reference)

    three = to_host(tensor_core_matmul(to_device(a), to_device(b), precision="highest"))
    one = to_host(tensor_core_matmul(to_device(a), to_device(b), precision="high"))
    float32 = norm_error(fma_dot_products(a, b))
    assert norm_error(three) <= float32
    assert norm_error(one) > 100 * float32


def test_precision_setting_chooses_the_kernel(rng, to_device, to_host):
    a, b, _, _ = operands(rng, 40, 24, 40)
    assert gpt2_cupy.get_float32_matmul_precision() == "highest"
    try:
        results = {}
        for precision in ("medium", "high", "highest"):
            gpt2_cupy.set_float32_matmul_precision(precision)
            assert gpt2_cupy.get_float32_matmul_precision() == precision
            results[precision] = to_host(tensor_core_matmul(to_device(a), to_device(b)))
            np.testing.assert_array_equal(
                results[precision], to_host(tensor_core_matmul(to_device(a), to_device(b), precision=precision)))
        assert not np.array_equal(results["high"], results["highest"])
        assert not np.array_equal(results["high"], results["medium"])
    finally:
        gpt2_cupy.set_float32_matmul_precision("highest")


def test_unknown_precision_is_a_value_error(to_device):
    with pytest.raises(ValueError, match="'low' is not one of 'highest', 'high', 'medium'"):
        gpt2_cupy.set_float32_matmul_precision("low")
    assert gpt2_cupy.get_float32_matmul_precision() == "highest"
    a = to_device(np.ones((4, 4), dtype=np.float32))
    with pytest.raises(ValueError, match="tensor_core_matmul: precision must be one of"):
        tensor_core_matmul(a, a, precision="tf32")


def test_shapes_and_dtypes_are_checked_as_matmul_does(to_device):
    a = to_device(np.ones((6, 5), dtype=np.float32))
    with pytest.raises(ValueError, match="inner dimensions 5 and 6 differ"):
        tensor_core_matmul(a, a)
    with pytest.raises(TypeError, match="dtype float64"):
        tensor_core_matmul(to_device(np.ones((6, 5))), a, transpose_b=True)


@pytest.mark.parametrize("precision", ["highest", "medium"])
def test_empty_sums(precision, to_device, to_host):
    a, b = to_device(np.ones((3, 0), dtype=np.float32)), to_device(np.ones((0, 2), dtype=np.float32))
    np.testing.assert_array_equal(to_host(tensor_core_matmul(a, b, precision=precision)), np.zeros((3, 2)))
    out = to_device(np.full((3, 2), 7, dtype=np.float32))
    tensor_core_matmul(a, b, out=out, accumulate=True, precision=precision)
    np.testing.assert_array_equal(to_host(out), np.full((3, 2), 7))


def test_float_to_bf16_rounds_to_nearest_even_and_pads_with_zeros(rng, to_device, to_host):
    special = np.array([1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, -(1 + 2.0 ** -8), 3.4e38, np.inf, -np.inf, np.nan, 0.0, -0.0,
                        1e-40, 2.0 ** -126], dtype=np.float32)
    x = np.concatenate([special, rng.standard_normal(5 * 13 - special.size, dtype=np.float32)]).reshape(5, 13)
    got, ld = to_bf16(to_device(x))
    got = to_host(got)
    assert ld == 16 and got.shape == (5, 16)
    np.testing.assert_array_equal(got[:, :13], bf16_bits(x))
    np.testing.assert_array_equal(got[:, 13:], 0)
    assert list(got.flat[:3]) == [0x3F80, 0x3F82, 0xBF80]   # ties: to the even neighbour
    assert np.isnan(bf16_values(got.flat[6]))


# ---- the chapter's steps --------------------------------------------------------------------------------------

@pytest.mark.parametrize("products, precision", [(1, "high"), (3, "highest")])
def test_one_warp_one_tile_tf32(products, precision, rng, to_device, to_host):
    a, b, op_a, op_b = operands(rng, 16, 8, 40)
    c = to_device(np.full((16, 8), np.nan, dtype=np.float32))
    kernels.function("steps/mma_tile", "mma_tile_tf32")((1,), (32,), (c, to_device(a), to_device(b), np.int32(40),
                                                                     np.int32(products)))
    assert_tensor_core_product(to_host(c), precision, op_a, op_b)


def test_one_warp_one_tile_bf16(rng, to_device, to_host):
    a, b, op_a, op_b = operands(rng, 16, 8, 48)
    c = to_device(np.full((16, 8), np.nan, dtype=np.float32))
    kernels.function("steps/mma_tile", "mma_tile_bf16")((1,), (32,), (c, to_device(bf16_bits(a)), to_device(bf16_bits(b)),
                                                                     np.int32(48)))
    assert_tensor_core_product(to_host(c), "medium", op_a, op_b)


@pytest.mark.parametrize("name, M, N, K", [("tf32_matmul_tiled", 67, 45, 33), ("tf32_matmul_tiled", 130, 70, 40),
                                           ("tf32_matmul_pipelined", 67, 45, 36),
                                           ("tf32_matmul_pipelined", 130, 70, 100)])
def test_tiled_and_pipelined_steps(name, M, N, K, rng, to_device, to_host):
    """C = A Bᵀ with B stored N x K (the forward of a Linear layer)."""
    a, b, op_a, op_b = operands(rng, M, N, K, transpose_b=True)
    c = to_device(np.full((M, N), np.nan, dtype=np.float32))
    grid = ((N + 63) // 64, (M + 63) // 64)
    kernels.function("steps/tf32_matmul_tiled", name)(grid, (128,), (c, to_device(a), to_device(b), np.int32(M),
                                                                     np.int32(N), np.int32(K)))
    assert_tensor_core_product(to_host(c), "high", op_a, op_b)


@pytest.mark.cpu_only
def test_pipelined_step_passes_the_race_check(rng, to_device, to_host):
    """Every stage is waited for (cp.async.wait_group, then __syncthreads) before it is read, and read
    before it is refilled."""
    a, b, op_a, op_b = operands(rng, 64, 64, 80, transpose_b=True)
    c = to_device(np.zeros((64, 64), dtype=np.float32))
    kernels.function("steps/tf32_matmul_tiled", "tf32_matmul_pipelined")(
        (1, 1), (128,), (c, to_device(a), to_device(b), np.int32(64), np.int32(64), np.int32(80)),
        check_races=True, check_bounds=True)
    assert_tensor_core_product(to_host(c), "high", op_a, op_b)
