"""The GEMV kernel (gpt2_cupy.ops.gemv) for few-row products y = x Wᵀ + b against float64 numpy: every row count
from 1 to MAX_ROWS, weights in bf16 and float32 with x in either, ragged N and K (16-byte loads and one element
at a time), with and without bias, one to eight warps per output; gpt2_cupy.dispatch.linear_forward's routing of bf16 weights of
few rows to it; the errors for input it does not take; and gemv_rmsnorm_forward, the product's last block
norming its output, against the separate kernels bit for bit, launch after launch and replayed from a graph.

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
from gpt2_cupy.dispatch import GEMV_ROWS, linear_forward
from gpt2_cupy.ops.gemv import MAX_ROWS, gemv_forward, gemv_rmsnorm_forward
from gpt2_cupy.ops.rmsnorm import rmsnorm_forward
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
    x = backend.xp.asarray(rng.normal(size=(1, GEMV_ROWS, 40)).astype(np.float32))
    y = linear_forward(x, weight, bias)                     # float32 x, bf16 weight: only the GEMV takes both
    assert y.dtype == FLOAT32 and y.shape == (1, GEMV_ROWS, 21)
    assert np.array_equal(host(y), host(gemv_forward(x, weight, bias)))
    many = backend.xp.asarray(rng.normal(size=(GEMV_ROWS + 1, 40)).astype(BFLOAT16))
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


# ---- gemv_rmsnorm_forward: the norm after the product in the launch's last block --------------------------------

def product_then_norm(x, weight, norm_weight, bias=None, residual=None, eps=1e-6):
    """The separate kernels: the GEMV (with its residual add), then rmsnorm_forward of its output."""
    y = gemv_forward(x, weight, bias, residual=residual)
    return y, rmsnorm_forward(y, norm_weight, eps=eps)[0]


def assert_same_bits(got, expected):
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert np.array_equal(backend.asnumpy(got).view(np.uint8), backend.asnumpy(expected).view(np.uint8))


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("N, K", [(37, 45), (130, 72), (2048, 24), (4096, 16)])
def test_gemv_rmsnorm_gives_the_bits_of_the_product_then_rmsnorm(rng, rows, N, K):
    # N = 37: one column a load, a warp a row (8 rows at once); 130: a warp a row; 2048: 4 warps a row (two rows at
    # once), Llama 3.2 1B's width; 4096: all 8 warps, Llama 2 7B's. K = 45: the product one element at a time.
    dtype = BFLOAT16 if rows != 3 else FLOAT32                        # x, y, residual; float32 x with a bf16 weight
    x = backend.xp.asarray(rng.normal(size=(rows, K)).astype(dtype))
    weight = backend.xp.asarray((rng.normal(size=(N, K)) / np.sqrt(K)).astype(BFLOAT16))
    residual = backend.xp.asarray(rng.normal(size=(rows, N)).astype(dtype)) if rows != 2 else None
    bias = backend.xp.asarray(rng.normal(size=N).astype(np.float32)) if rows == 5 else None
    norm_weight = backend.xp.asarray((1 + 0.1 * rng.normal(size=N)).astype(FLOAT32 if rows == 8 else BFLOAT16))
    y, normed = gemv_rmsnorm_forward(x, weight, norm_weight, bias, residual=residual, eps=1e-5)
    expected_y, expected_normed = product_then_norm(x, weight, norm_weight, bias, residual, eps=1e-5)
    assert_same_bits(y, expected_y)
    assert_same_bits(normed, expected_normed)
    # Independent of the separate kernels: the norm of the y it returned, in float64. float32 errs, relative, by at
    # most (N - 1) 2^-24 on the sum of N squares (half of that on rstd), 2 units on rsqrtf, one on the mean, the
    # eps and each of the two products: within (N + 4) 2^-24, plus the rounding to y's dtype.
    y64 = host(y)
    exact = y64 / np.sqrt((y64 ** 2).mean(-1, keepdims=True) + 1e-5) * host(norm_weight)
    rounding = BF16_HALF_UNIT if dtype == BFLOAT16 else 2.0 ** -24
    bound = (rounding + (N + 4) * 2.0 ** -24) * np.abs(exact) + 1e-30
    assert np.all(np.abs(host(normed) - exact) <= bound)


def test_gemv_rmsnorm_leaves_its_counter_at_zero_for_the_next_launch(rng):
    # Launch after launch, each with its own data: every one has a last block, and the counter is 0 after each.
    from gpt2_cupy.ops.arrays import counters

    weight = backend.xp.asarray((rng.normal(size=(300, 64)) / 8).astype(BFLOAT16))
    norm_weight = backend.xp.asarray(rng.normal(size=300).astype(BFLOAT16))
    for rows in (1, 4, 1, 7):
        x = backend.xp.asarray(rng.normal(size=(rows, 64)).astype(BFLOAT16))
        residual = backend.xp.asarray(rng.normal(size=(rows, 300)).astype(BFLOAT16))
        y, normed = gemv_rmsnorm_forward(x, weight, norm_weight, residual=residual)
        assert_same_bits(normed, product_then_norm(x, weight, norm_weight, residual=residual)[1])
        assert int(backend.asnumpy(counters(1))[0]) == 0


def test_gemv_rmsnorm_replayed_from_a_graph(rng):
    # Two launches in a row, the second reading the first's normed rows (a layer's o_proj and then its gate and up
    # product read so): captured once, launched dependent, replayed with new inputs; each replay gives the bits of
    # the separate kernels, so the counter was back at 0 for each launch and each replay.
    import gpt2_cupy

    rows, C = 1, 2048
    first = backend.xp.asarray((rng.normal(size=(C, 96)) / 10).astype(BFLOAT16))
    second = backend.xp.asarray((rng.normal(size=(C, C)) / 45).astype(BFLOAT16))
    norms = [backend.xp.asarray((1 + 0.1 * rng.normal(size=C)).astype(BFLOAT16)) for _ in range(2)]
    x = backend.xp.zeros((rows, 96), dtype=BFLOAT16)
    residual = backend.xp.zeros((rows, C), dtype=BFLOAT16)
    y1, h1, y2, h2 = (backend.xp.empty((rows, C), dtype=BFLOAT16) for _ in range(4))

    def step():
        gemv_rmsnorm_forward(x, first, norms[0], residual=residual, out=y1, norm_out=h1)
        gemv_rmsnorm_forward(h1, second, norms[1], residual=y1, out=y2, norm_out=h2)

    step()                                                            # compiled, the counters allocated
    g = gpt2_cupy.cuda.CUDAGraph()
    with gpt2_cupy.cuda.graph(g):
        step()
    for _ in range(3):
        backend.copy_into(x, backend.xp.asarray(rng.normal(size=(rows, 96)).astype(BFLOAT16)))
        backend.copy_into(residual, backend.xp.asarray(rng.normal(size=(rows, C)).astype(BFLOAT16)))
        g.replay()
        expected_y1, expected_h1 = product_then_norm(x, first, norms[0], residual=residual)
        expected_y2, expected_h2 = product_then_norm(expected_h1, second, norms[1], residual=expected_y1)
        for got, expected in ((y1, expected_y1), (h1, expected_h1), (y2, expected_y2), (h2, expected_h2)):
            assert_same_bits(got, expected)


def test_gemv_rmsnorm_of_rows_too_long_for_one_block_takes_the_norm_kernel(rng):
    # More than NORM_MOST_COLUMNS columns: the product, then rmsnorm_forward: the same bits, from two launches.
    N = gemv_ops.NORM_MOST_COLUMNS + 4
    x = backend.xp.asarray(rng.normal(size=(2, 8)).astype(BFLOAT16))
    weight = backend.xp.asarray(rng.normal(size=(N, 8)).astype(BFLOAT16))
    norm_weight = backend.xp.asarray(rng.normal(size=N).astype(BFLOAT16))
    y, normed = gemv_rmsnorm_forward(x, weight, norm_weight)
    assert_same_bits(normed, product_then_norm(x, weight, norm_weight)[1])


def test_gemv_rmsnorm_refuses_a_norm_weight_of_another_width(rng):
    x = backend.xp.asarray(rng.normal(size=(1, 16)).astype(BFLOAT16))
    weight = backend.xp.zeros((8, 16), dtype=BFLOAT16)
    with pytest.raises(ValueError, match="gemv_rmsnorm_forward: norm_weight must have shape \\(8,\\), got \\(9,\\)"):
        gemv_rmsnorm_forward(x, weight, backend.xp.ones(9, dtype=BFLOAT16))
    with pytest.raises(TypeError, match="gemv_rmsnorm_forward: norm_weight has dtype int32"):
        gemv_rmsnorm_forward(x, weight, backend.xp.ones(8, dtype=np.int32))


# ---- gemv_rope_store: the q, k, v product and RoPE with the cache's store ----------------------------------------

@pytest.mark.parametrize("warps_per_output", [1, 2, 4])
@pytest.mark.parametrize("B, n, H, H_kv, D, K, interleaved", [(1, 1, 4, 2, 16, 64, False), (2, 3, 4, 2, 16, 45, True),
                                                              (1, 1, 32, 8, 64, 128, False), (1, 2, 3, 1, 8, 72, True)])
def test_gemv_rope_store_gives_the_bits_of_the_product_then_rope_store(rng, monkeypatch, warps_per_output, B, n, H,
                                                                       H_kv, D, K, interleaved):
    from gpt2_cupy.ops.gemv import gemv_rope_store
    from gpt2_cupy.ops.rope import rope_store_new_positions

    monkeypatch.setattr(gemv_ops, "_warps_per_output", lambda N, row_bytes: warps_per_output)
    N, start = (H + 2 * H_kv) * D, 7
    x = backend.xp.asarray(rng.normal(size=(B, n, K)).astype(BFLOAT16))
    weight = backend.xp.asarray((rng.normal(size=(N, K)) / np.sqrt(K)).astype(BFLOAT16))
    keys, values = (backend.xp.asarray(rng.normal(size=(B, H_kv, start + n + 2, D)).astype(BFLOAT16)) for _ in range(2))
    expected_keys, expected_values = keys.copy(), values.copy()
    expected_q = rope_store_new_positions(gemv_forward(x, weight), expected_keys, expected_values, H, start=start,
                                          interleaved=interleaved)
    for given in (start, backend.xp.asarray(np.array([start], dtype=np.int32))):
        got_keys, got_values = keys.copy(), values.copy()
        q = gemv_rope_store(x, weight, got_keys, got_values, H, start=given, interleaved=interleaved)
        assert_same_bits(q, expected_q)
        assert_same_bits(got_keys, expected_keys)
        assert_same_bits(got_values, expected_values)


def test_gemv_rope_store_replayed_from_a_graph_at_each_new_position(rng, monkeypatch):
    # Captured once with the position in device memory; each replay writes the next position of the cache.
    import gpt2_cupy
    from gpt2_cupy.graphs import graph_pool_handle, use_pool
    from gpt2_cupy.ops.gemv import gemv_rope_store
    from gpt2_cupy.ops.rope import rope_store_new_positions

    monkeypatch.setattr(gemv_ops, "_warps_per_output", lambda N, row_bytes: 1)
    H, H_kv, D, K, capacity = 4, 2, 16, 64, 6
    weight = backend.xp.asarray((rng.normal(size=((H + 2 * H_kv) * D, K)) / 8).astype(BFLOAT16))
    x = backend.xp.zeros((1, 1, K), dtype=BFLOAT16)
    position = backend.xp.asarray(np.array([0], dtype=np.int32))
    keys, values = (backend.xp.zeros((1, H_kv, capacity, D), dtype=BFLOAT16) for _ in range(2))
    pool = graph_pool_handle()
    with use_pool(pool):                                                      # the warm-up: q's memory
        warm_up_q = gemv_rope_store(x, weight, keys, values, H, start=position)
    del warm_up_q
    g = gpt2_cupy.cuda.CUDAGraph()
    with gpt2_cupy.cuda.graph(g, pool=pool):
        q = gemv_rope_store(x, weight, keys, values, H, start=position)
    expected_keys, expected_values = keys.copy(), values.copy()
    for p in range(1, capacity + 1):                                          # the last one is past the cache
        backend.copy_into(position, backend.xp.asarray(np.array([p], dtype=np.int32)))
        backend.copy_into(x, backend.xp.asarray(rng.normal(size=(1, 1, K)).astype(BFLOAT16)))
        g.replay()
        expected_q = rope_store_new_positions(gemv_forward(x, weight), expected_keys, expected_values, H,
                                              start=backend.xp.asarray(np.array([p], dtype=np.int32)))
        assert_same_bits(q, expected_q)
        assert_same_bits(keys, expected_keys)
        assert_same_bits(values, expected_values)


def test_gemv_rope_store_keeps_two_kernels_where_the_product_takes_eight_warps(rng, monkeypatch):
    from gpt2_cupy.ops.gemv import gemv_rope_store
    from gpt2_cupy.ops.rope import rope_store_new_positions

    monkeypatch.setattr(gemv_ops, "_warps_per_output", lambda N, row_bytes: 8)
    x = backend.xp.asarray(rng.normal(size=(1, 1, 32)).astype(BFLOAT16))
    weight = backend.xp.asarray(rng.normal(size=(64, 32)).astype(BFLOAT16))         # 2 + 2 x 1 heads of 16
    keys, values = (backend.xp.zeros((1, 1, 4, 16), dtype=BFLOAT16) for _ in range(2))
    expected_keys, expected_values = keys.copy(), values.copy()
    q = gemv_rope_store(x, weight, keys, values, 2, start=1)
    assert_same_bits(q, rope_store_new_positions(gemv_forward(x, weight), expected_keys, expected_values, 2, start=1))
    assert_same_bits(keys, expected_keys)
    with pytest.raises(ValueError, match="gemv_rope_store: qkv's last axis is 64; 3 query heads"):
        gemv_rope_store(x, weight, keys, values, 3, start=1)
