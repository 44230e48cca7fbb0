"""gpt2_cupy.ops.wgmma_matmul: C = A Bᵀ from bf16 A (M x K) and B (N x K) on Hopper's tensor cores.

Each result against float64 numpy on the same bf16 inputs, on sizes with ragged edges in M, N and K (tiles
are 128 x 256, slices of K 64): within a few float32 units of the sum of magnitudes per slice of 16 along K
(the tensor core rounds at least that often). bf16 output is the float32 output rounded to nearest, to the
bit. On a GPU these need compute capability 9.0 (H100, H200); on the CPU the executor emulates wgmma.
"""

import numpy as np
import pytest

from gpt2_cupy import backend

ml_dtypes = pytest.importorskip("ml_dtypes")
from gpt2_cupy.ops.wgmma_matmul import wgmma_matmul  # noqa: E402


def _is_hopper():
    return backend.xp.cuda.Device().compute_capability == "90"


hopper_or_cpu = pytest.mark.skipif(backend.name == "cuda" and not _is_hopper(),
                                   reason="wgmma needs compute capability 9.0 (H100, H200)")


def bf16_operands(rng, M, N, K):
    """(a, b as backend bf16 arrays, float64 a bᵀ of their values, the tolerance of each element)."""
    a = rng.standard_normal((M, K)).astype(np.float32).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((N, K)).astype(np.float32).astype(ml_dtypes.bfloat16)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    # float32 rounding at least once per wgmma (16 of K), a few units each: 2^-21 per step of the magnitudes
    tolerance = 2.0 ** -21 * (K // 16 + 1) * (np.abs(a64) @ np.abs(b64).T)
    return backend.xp.asarray(a), backend.xp.asarray(b), a64 @ b64.T, tolerance


def assert_within(got, expected, tolerance):
    error = np.abs(backend.asnumpy(got).astype(np.float64) - expected)
    worst = np.unravel_index(np.argmax(error - tolerance), error.shape)
    assert np.all(error <= tolerance), (f"element {tuple(int(i) for i in worst)}: error {error[worst]:.3g}, "
                                        f"tolerance {tolerance[worst]:.3g}")


@hopper_or_cpu
@pytest.mark.parametrize("M, N, K", [(130, 136, 72), (64, 256, 64), (1, 8, 8), (129, 257, 200), (200, 40, 136)])
def test_float32_output_against_float64(M, N, K, rng):
    """Ragged edges in every dimension: rows of A past M, rows of B past N and k past K are zero-filled copies,
    results past M or N are not stored (the output starts as NaN, so an element not written fails)."""
    a, b, expected, tolerance = bf16_operands(rng, M, N, K)
    out = backend.xp.full((M, N), np.nan, dtype=np.float32)
    assert wgmma_matmul(a, b, out=out) is out
    assert_within(out, expected, tolerance)
    # and the data could catch an off-by-one: the product with B's rows shifted is far outside the tolerance
    shifted = expected[:, np.r_[1:N, 0]] if N > 1 else -expected
    assert np.any(np.abs(shifted - expected) > tolerance)


@hopper_or_cpu
@pytest.mark.parametrize("N", [136, 37])
def test_bias_and_accumulate_are_added_before_the_one_rounding(N, rng):
    """out = a bᵀ + bias, then out += a bᵀ + bias: float32 additions of the bias (per column) and of the old
    out to the float32 sums; a bf16 out is the float32 value rounded once."""
    a, b, expected, tolerance = bf16_operands(rng, 70, N, 72)
    bias = rng.standard_normal(N).astype(np.float32)
    out = backend.xp.full((70, N), 0.5, dtype=np.float32)
    wgmma_matmul(a, b, out=out, bias=backend.xp.asarray(bias), accumulate=True)
    assert_within(out, expected + bias + 0.5, tolerance + 2.0 ** -22 * (np.abs(expected) + np.abs(bias) + 0.5))
    rounded = wgmma_matmul(a, b, out_dtype="bfloat16", bias=backend.xp.asarray(bias))
    float32 = backend.asnumpy(wgmma_matmul(a, b, bias=backend.xp.asarray(bias)))
    np.testing.assert_array_equal(backend.asnumpy(rounded).view(np.uint16),
                                  float32.astype(ml_dtypes.bfloat16).view(np.uint16))


@hopper_or_cpu
def test_odd_n_stores_one_element_at_a_time(rng):
    a, b, expected, tolerance = bf16_operands(rng, 70, 37, 24)
    assert_within(wgmma_matmul(a, b), expected, tolerance)


@hopper_or_cpu
def test_bfloat16_output_is_the_float32_result_rounded_to_nearest(rng):
    a, b, _, _ = bf16_operands(rng, 130, 136, 72)
    as_float32 = backend.asnumpy(wgmma_matmul(a, b))
    for out_dtype in ("bfloat16", ml_dtypes.bfloat16):
        out = wgmma_matmul(a, b, out_dtype=out_dtype)
        assert out.dtype == np.dtype(ml_dtypes.bfloat16) and out.shape == (130, 136)
        np.testing.assert_array_equal(backend.asnumpy(out).view(np.uint16),
                                      as_float32.astype(ml_dtypes.bfloat16).view(np.uint16))


@hopper_or_cpu
def test_uint16_arrays_of_bf16_bits_give_the_same_result(rng):
    a, b, _, _ = bf16_operands(rng, 40, 24, 16)
    np.testing.assert_array_equal(backend.asnumpy(wgmma_matmul(a.view(np.uint16), b.view(np.uint16))),
                                  backend.asnumpy(wgmma_matmul(a, b)))


@hopper_or_cpu
def test_empty_sums_and_empty_outputs(rng):
    a, b, _, _ = bf16_operands(rng, 5, 9, 0)
    np.testing.assert_array_equal(backend.asnumpy(wgmma_matmul(a, b)), np.zeros((5, 9), np.float32))
    a, b, _, _ = bf16_operands(rng, 0, 9, 8)
    assert wgmma_matmul(a, b).shape == (0, 9)


def test_bad_arguments_are_clear_errors():
    xp = backend.xp
    a = xp.zeros((16, 24), dtype=ml_dtypes.bfloat16)
    b = xp.zeros((8, 24), dtype=ml_dtypes.bfloat16)
    with pytest.raises(TypeError, match=r"wgmma_matmul: a has dtype float32; it must be bfloat16"):
        wgmma_matmul(xp.zeros((16, 24), np.float32), b)
    with pytest.raises(ValueError, match=r"wgmma_matmul: b has shape \(8, 16\).*K = 16.*K = 24"):
        wgmma_matmul(a, xp.zeros((8, 16), dtype=ml_dtypes.bfloat16))
    with pytest.raises(ValueError, match=r"K must be a multiple of 8.*K=20"):
        wgmma_matmul(xp.zeros((16, 20), dtype=ml_dtypes.bfloat16), xp.zeros((8, 20), dtype=ml_dtypes.bfloat16))
    with pytest.raises(ValueError, match=r"b must have shape \(N, K\)"):
        wgmma_matmul(a, xp.zeros((2, 8, 24), dtype=ml_dtypes.bfloat16))
    with pytest.raises(ValueError, match=r"out has shape \(8, 16\), but the inputs give \(16, 8\)"):
        wgmma_matmul(a, b, out=xp.zeros((8, 16), np.float32))
    with pytest.raises(TypeError, match=r"out has dtype float32; it must be bfloat16"):
        wgmma_matmul(a, b, out=xp.zeros((16, 8), np.float32), out_dtype="bfloat16")
    with pytest.raises(TypeError, match=r"out_dtype must be float32 or bfloat16, got float16"):
        wgmma_matmul(a, b, out_dtype=np.float16)
    with pytest.raises(ValueError, match="not C-contiguous"):
        wgmma_matmul(xp.zeros((24, 16), dtype=ml_dtypes.bfloat16).T, b)
