"""The GEMV kernel (gpt2_cupy.ops.gemv) for few-row products y = x Wᵀ + b against float64 numpy: every row count
from 1 to MAX_ROWS, weights in bf16 and float32 with x in either, ragged N and K (16-byte loads and one element
at a time), with and without bias, one to eight warps per output; linear_forward's routing of bf16 weights of
few rows to it; and the errors for input it does not take.

The reference multiplies the stored values (bf16 converted exactly) in float64. The kernel sums in float32:
its error is within the float32 summation bound of the K products, plus half a bf16 unit of the result when
y is bf16 (rounded once).
"""

import numpy as np
import pytest

from gpt2_cupy import backend
from gpt2_cupy.autograd import Tensor
from gpt2_cupy.ops import gemv as gemv_ops
from gpt2_cupy.ops.arrays import BFLOAT16, FLOAT32
from gpt2_cupy.ops.gemv import LINEAR_ROWS, MAX_ROWS, gemv_forward
from gpt2_cupy.ops.linear import linear_forward
from gpt2_cupy.testing import summation_bound

BF16_HALF_UNIT = 2.0 ** -8      # relative: bf16 keeps 8 significant bits, rounding errs by at most 2^-8


def host(array):
    return np.asarray(backend.asnumpy(array), dtype=np.float64)


def assert_product(y, x, weight, bias):
    x64, weight64 = host(x), host(weight)
    terms = x64[..., None, :] * weight64                                   # (..., N, K)
    reference = terms.sum(axis=-1) + (0.0 if bias is None else host(bias))
    bound = summation_bound(np.moveaxis(terms, -1, 0), 0.0 if bias is None else host(bias))
    if y.dtype == BFLOAT16:
        bound = bound * (1 + BF16_HALF_UNIT) + BF16_HALF_UNIT * np.abs(reference)
    error = np.abs(host(y) - reference)
    assert np.all(error <= bound + 1e-30), f"largest error {error.max():.3g}, bound there {bound.flat[error.argmax()]:.3g}"


@pytest.mark.parametrize("rows", range(1, MAX_ROWS + 1))
@pytest.mark.parametrize("weight_dtype, x_dtype", [(BFLOAT16, BFLOAT16), (BFLOAT16, FLOAT32), (FLOAT32, FLOAT32),
                                                   (FLOAT32, BFLOAT16)])
def test_gemv_matches_float64(rng, rows, weight_dtype, x_dtype):
    N, K = (37, 72) if rows % 2 else (29, 45)          # K = 72: 16-byte loads; K = 45: one element at a time
    x = backend.xp.asarray(rng.normal(size=(rows, K)).astype(x_dtype))
    weight = backend.xp.asarray(rng.normal(size=(N, K)).astype(weight_dtype))
    bias = backend.xp.asarray(rng.normal(size=N).astype(np.float32)) if rows % 3 else None
    y = gemv_forward(x, weight, bias)
    assert y.dtype == x_dtype and y.shape == (rows, N)
    assert_product(y, x, weight, bias)


@pytest.mark.parametrize("warps_per_output", [1, 2, 8])
def test_gemv_warps_sharing_an_output(rng, monkeypatch, warps_per_output):
    # Few outputs are split across warps along K; the warps' sums meet in shared memory.
    monkeypatch.setattr(gemv_ops, "_warps_per_output", lambda N, row_bytes: warps_per_output)
    x = backend.xp.asarray(rng.normal(size=(2, 3, 520)).astype(BFLOAT16))         # leading axes (2, 3): 6 rows
    weight = backend.xp.asarray(rng.normal(size=(19, 520)).astype(BFLOAT16))
    y = gemv_forward(x, weight)
    assert y.shape == (2, 3, 19)
    assert_product(y, x, weight, None)


def test_gemv_writes_into_out(rng):
    x = backend.xp.asarray(rng.normal(size=(1, 64)).astype(BFLOAT16))
    weight = backend.xp.asarray(rng.normal(size=(10, 64)).astype(BFLOAT16))
    out = backend.xp.empty((1, 10), dtype=BFLOAT16)
    assert gemv_forward(x, weight, out=out) is out
    assert_product(out, x, weight, None)


@pytest.mark.parametrize("dtype", [BFLOAT16, FLOAT32])
@pytest.mark.parametrize("K", [64, 45, 0])
def test_gemv_residual_gives_the_bits_of_the_product_then_the_add(rng, dtype, K):
    x = backend.xp.asarray(rng.normal(size=(1, 2, K)).astype(dtype))
    weight = backend.xp.asarray(rng.normal(size=(30, K)).astype(BFLOAT16))
    bias = backend.xp.asarray(rng.normal(size=30).astype(np.float32))
    residual = backend.xp.asarray(rng.normal(size=(1, 2, 30)).astype(dtype))
    fused = gemv_forward(x, weight, bias, residual=residual)
    product = gemv_forward(x, weight, bias)
    separate = (Tensor(residual) + Tensor(product)).data          # the model's x + f(x), one kernel each
    assert fused.dtype == dtype and np.array_equal(host(fused), host(separate))
    sum64 = host(residual) + host(x) @ host(weight).T + host(bias)
    assert np.abs(host(fused) - sum64).max() <= 4 * 2.0 ** -8 * max(1.0, np.abs(sum64).max())
    with pytest.raises(ValueError, match="residual"):
        gemv_forward(x, weight, residual=residual[..., :29].copy())


def test_linear_sends_few_rows_of_a_bf16_weight_to_gemv(rng):
    weight = backend.xp.asarray(rng.normal(size=(21, 40)).astype(BFLOAT16))
    bias = backend.xp.asarray(rng.normal(size=21).astype(np.float32))
    x = backend.xp.asarray(rng.normal(size=(1, LINEAR_ROWS, 40)).astype(np.float32))
    y = linear_forward(x, weight, bias)                     # float32 x, bf16 weight: only the GEMV takes both
    assert y.dtype == FLOAT32 and y.shape == (1, LINEAR_ROWS, 21)
    assert np.array_equal(host(y), host(gemv_forward(x, weight, bias)))
    many = backend.xp.asarray(rng.normal(size=(LINEAR_ROWS + 1, 40)).astype(BFLOAT16))
    assert_product(linear_forward(many, weight, bias), many, weight, bias)   # the tiled product, float32 sums
    with pytest.raises(TypeError, match="linear_forward: weight has dtype bfloat16; it must be float32"):
        linear_forward(many.astype(np.float32), weight)     # the tiled product takes one dtype for both


def test_gemv_refuses_what_it_does_not_take(rng):
    weight = backend.xp.asarray(rng.normal(size=(8, 16)).astype(BFLOAT16))
    with pytest.raises(ValueError, match=f"x has {MAX_ROWS + 1} rows; the kernel takes at most {MAX_ROWS}"):
        gemv_forward(backend.xp.zeros((MAX_ROWS + 1, 16), dtype=BFLOAT16), weight)
    with pytest.raises(TypeError, match="gemv_forward: x has dtype float64; it must be float32 or bfloat16"):
        gemv_forward(backend.xp.zeros((1, 16)), weight)
    with pytest.raises(TypeError, match="gemv_forward: weight has dtype int32"):
        gemv_forward(backend.xp.zeros((1, 16), dtype=np.float32), backend.xp.zeros((8, 16), dtype=np.int32))
    with pytest.raises(ValueError, match="gemv_forward: weight has shape \\(8, 16\\), which gives K = 16"):
        gemv_forward(backend.xp.zeros((1, 15), dtype=np.float32), weight)
    with pytest.raises(TypeError, match="gemv_forward: bias has dtype bfloat16; it must be float32"):
        gemv_forward(backend.xp.zeros((1, 16), dtype=np.float32), weight, backend.xp.zeros(8, dtype=BFLOAT16))



@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("warps_per_output", [1, 4, 8])
def test_gemv_gated_gives_the_bits_of_the_products_then_swiglu(rng, monkeypatch, rows, warps_per_output):
    # silu(x W_gateᵀ) * (x W_upᵀ) in one launch: the products rounded to bf16 as stored, then swiglu_forward's bits.
    from gpt2_cupy.ops.swiglu import swiglu_forward

    monkeypatch.setattr(gemv_ops, "_warps_per_output", lambda N, row_bytes: warps_per_output)
    x = backend.xp.asarray(rng.normal(size=(rows, 64)).astype(BFLOAT16))
    weight = backend.xp.asarray((0.3 * rng.normal(size=(2 * 21, 64))).astype(BFLOAT16))   # gate rows, then up
    gated = gemv_forward(x, weight, gated=True)
    assert gated.shape == (rows, 21) and gated.dtype == BFLOAT16
    products = gemv_forward(x, weight)                                                  # (rows, 42)
    separate = swiglu_forward(backend.xp.ascontiguousarray(products[:, :21]),
                              backend.xp.ascontiguousarray(products[:, 21:]))
    assert np.array_equal(host(gated), host(separate))
    gate, up = host(products[:, :21]), host(products[:, 21:])
    assert np.abs(host(gated) - gate / (1 + np.exp(-gate)) * up).max() <= 4 * BF16_HALF_UNIT * max(1.0, np.abs(gate * up).max())


def test_gemv_refuses_a_gate_without_its_pair(rng):
    x = backend.xp.asarray(rng.normal(size=(1, 16)).astype(BFLOAT16))
    with pytest.raises(ValueError, match="gated=True takes a weight of an even number of rows"):
        gemv_forward(x, backend.xp.zeros((7, 16), dtype=BFLOAT16), gated=True)
    with pytest.raises(ValueError, match="and no residual"):
        gemv_forward(x, backend.xp.zeros((8, 16), dtype=BFLOAT16), gated=True, residual=backend.xp.zeros((1, 4), BFLOAT16))
