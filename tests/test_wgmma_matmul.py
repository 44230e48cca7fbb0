"""gpt2_cupy.ops.wgmma_matmul: C = op(A) op(B) from bf16 A and B on Hopper's tensor cores, in every layout.

Each result against float64 numpy on the same bf16 inputs, on sizes with ragged edges in M, N and K (tiles
are 128 x 256 or 128 x 128, slices of K 64): within a few float32 units of the sum of magnitudes per slice of
16 along K (the tensor core rounds at least that often). bf16 output is the float32 output rounded to
nearest, to the bit. The Linear layer's three layouts (x Wᵀ; dy W, B read N-major; dyᵀ x, both MN-major) and
the fourth, split K, and how the launch picks tiles and splits. On a GPU these need compute capability 9.0
(H100, H200); on the CPU the executor emulates wgmma.
"""

import numpy as np
import pytest

from gpt2_cupy import backend

ml_dtypes = pytest.importorskip("ml_dtypes")
from gpt2_cupy.ops import wgmma_matmul as wgmma_module  # noqa: E402
from gpt2_cupy.ops.wgmma_matmul import launch_shape, wgmma_matmul  # noqa: E402


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
    with pytest.raises(TypeError, match=r"wgmma_matmul: a has dtype float64; it must be bfloat16.*or float32"):
        wgmma_matmul(xp.zeros((16, 24), np.float64), b)
    with pytest.raises(TypeError, match=r"a is float32 and b is bfloat16; both must be bf16, or both float32"):
        wgmma_matmul(xp.zeros((16, 24), np.float32), b)
    with pytest.raises(ValueError, match=r"wgmma_matmul: b has shape \(8, 16\).*K = 16.*K = 24"):
        wgmma_matmul(a, xp.zeros((8, 16), dtype=ml_dtypes.bfloat16))
    with pytest.raises(ValueError, match=r"rows of a \(16, 20\) must be a multiple of 8 elements"):
        wgmma_matmul(xp.zeros((16, 20), dtype=ml_dtypes.bfloat16), xp.zeros((8, 20), dtype=ml_dtypes.bfloat16))
    with pytest.raises(ValueError, match=r"rows of b \(24, 12\) must be a multiple of 8 elements"):
        wgmma_matmul(a, xp.zeros((24, 12), dtype=ml_dtypes.bfloat16), transpose_b=False)
    with pytest.raises(ValueError, match=r"op\(a\).*a must have shape \(K, M\)|a must have shape \(K, M\)"):
        wgmma_matmul(xp.zeros((2, 16, 24), dtype=ml_dtypes.bfloat16), b, transpose_a=True)
    with pytest.raises(ValueError, match="must start on 16 bytes"):
        wgmma_matmul(xp.zeros(16 * 24 + 1, dtype=ml_dtypes.bfloat16)[1:].reshape(16, 24), b)
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


# ---------------------------------------------------------------------------------------------------------
# Every layout: a (M, K) or (K, M) if transpose_a, b (N, K) if transpose_b or (K, N)
# ---------------------------------------------------------------------------------------------------------

LAYOUTS = {"x Wᵀ (TN)": (False, True), "dy W (B N-major)": (False, False), "dyᵀ x (both MN-major)": (True, False),
           "A M-major, B K-major": (True, True)}


def stored_operands(rng, M, N, K, transpose_a, transpose_b):
    """(a, b as stored: backend bf16 arrays, float64 op(a) op(b) of their values, the tolerance of each element)."""
    a = rng.standard_normal((M, K)).astype(np.float32).astype(ml_dtypes.bfloat16)     # op(a)
    b = rng.standard_normal((K, N)).astype(np.float32).astype(ml_dtypes.bfloat16)     # op(b)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    tolerance = 2.0 ** -21 * (K // 16 + 1) * (np.abs(a64) @ np.abs(b64))
    a_stored = np.ascontiguousarray(a.T) if transpose_a else a
    b_stored = np.ascontiguousarray(b.T) if transpose_b else b
    return backend.xp.asarray(a_stored), backend.xp.asarray(b_stored), a64 @ b64, tolerance


@hopper_or_cpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("M, N, K", [(136, 264, 72), (72, 40, 200)])
def test_every_layout_against_float64(layout, M, N, K, rng):
    """Ragged edges in M, N and K in each layout: an MN-major operand's columns past M or N and its rows past K
    are zero-filled copies; results past M or N are not stored (out starts as NaN)."""
    transpose_a, transpose_b = LAYOUTS[layout]
    a, b, expected, tolerance = stored_operands(rng, M, N, K, transpose_a, transpose_b)
    out = backend.xp.full((M, N), np.nan, dtype=np.float32)
    wgmma_matmul(a, b, out=out, transpose_a=transpose_a, transpose_b=transpose_b)
    assert_within(out, expected, tolerance)
    # the data tells op(a) from its transpose: the product with a's rows shifted is far outside the tolerance
    assert np.any(np.abs(expected[np.r_[1:M, 0]] - expected) > tolerance)


@hopper_or_cpu
@pytest.mark.parametrize("layout", ["dy W (B N-major)", "dyᵀ x (both MN-major)"])
def test_transposed_layouts_add_bias_and_accumulate(layout, rng):
    """The weight gradient's use: dW += dyᵀ x into a float32 buffer; with a bias, and a bf16 out rounded once."""
    transpose_a, transpose_b = LAYOUTS[layout]
    a, b, expected, tolerance = stored_operands(rng, 72, 48, 136, transpose_a, transpose_b)
    bias = rng.standard_normal(48).astype(np.float32)
    out = backend.xp.full((72, 48), 0.25, dtype=np.float32)
    wgmma_matmul(a, b, out=out, bias=backend.xp.asarray(bias), accumulate=True, transpose_a=transpose_a,
                 transpose_b=transpose_b)
    assert_within(out, expected + bias + 0.25, tolerance + 2.0 ** -22 * (np.abs(expected) + np.abs(bias) + 0.25))
    rounded = wgmma_matmul(a, b, out_dtype="bfloat16", transpose_a=transpose_a, transpose_b=transpose_b)
    float32 = backend.asnumpy(wgmma_matmul(a, b, transpose_a=transpose_a, transpose_b=transpose_b))
    np.testing.assert_array_equal(backend.asnumpy(rounded).view(np.uint16),
                                  float32.astype(ml_dtypes.bfloat16).view(np.uint16))


@hopper_or_cpu
@pytest.mark.parametrize("block_n", [128, 256])
@pytest.mark.parametrize("accumulate", [False, True])
def test_split_k_adds_every_stretch_once(block_n, accumulate, rng):
    """K split into 3 stretches of 64 (the last one ragged): each adds its part into out, the bias once; with
    accumulate the old out is kept, without it out is zeroed first (it starts as NaN)."""
    a, b, expected, tolerance = stored_operands(rng, 40, 24, 168, True, False)
    bias = rng.standard_normal(24).astype(np.float32)
    xp = backend.xp
    old = 0.5 if accumulate else np.nan
    out = xp.full((40, 24), old, dtype=np.float32)
    wgmma_module.launch_wgmma_matmul(a, b, out, xp.asarray(bias), accumulate, True, False, shape=(block_n, 3, 64))
    start = 0.5 if accumulate else 0.0
    assert_within(out, expected + bias + start, tolerance + 2.0 ** -21 * (np.abs(expected) + np.abs(bias) + 1))


@hopper_or_cpu
def test_split_k_adds_the_stretches_in_order_the_same_every_run(rng):
    """The stretches' partial sums are added in stretch order after the old out and before the bias: bit for bit
    the float32 sum of the stretches computed one by one, and the same on a second run (no atomics)."""
    a, b, _, _ = stored_operands(rng, 40, 24, 168, True, False)
    xp = backend.xp
    bias = xp.asarray(rng.standard_normal(24).astype(np.float32))
    old = xp.asarray(rng.standard_normal((40, 24)).astype(np.float32))
    runs = []
    for _ in range(2):
        out = old.copy()
        wgmma_module.launch_wgmma_matmul(a, b, out, bias, True, True, False, shape=(128, 3, 64))
        runs.append(backend.asnumpy(out))
    expected = backend.asnumpy(old).copy()
    for k0 in (0, 64, 128):
        part = xp.zeros((40, 24), dtype=np.float32)
        wgmma_module.launch_wgmma_matmul(a[k0:k0 + 64], b[k0:k0 + 64], part, None, False, True, False,
                                         shape=(128, 1, 64))
        expected += backend.asnumpy(part)
    expected += backend.asnumpy(bias)
    assert np.array_equal(runs[0], expected) and np.array_equal(runs[1], runs[0])


@hopper_or_cpu
def test_a_long_sum_with_few_tiles_is_split_by_the_launch(rng, monkeypatch):
    """launch_shape splits a float32 product of one tile and K = 2048 in two (on the narrow tile, which does
    half the work of a wide one); the result is the same sum."""
    assert launch_shape(24, 16, 2048, True) == (128, 2, 1024)
    assert launch_shape(24, 16, 2048, False) == (128, 1, 2048)   # a bf16 out is never split
    a, b, expected, tolerance = stored_operands(rng, 24, 16, 2048, True, False)
    assert_within(wgmma_matmul(a, b, transpose_a=True, transpose_b=False), expected, tolerance)


def test_launch_shape_on_gpt2_linear_shapes(monkeypatch):
    """On 132 multiprocessors (an H100 or H200; the CPU reports the same), the shapes an H100 or H200 ran fastest:
    wide tiles where they fill the rounds (the output layer, and the MLP's forward and input gradient at K = 768),
    128-wide (ping-pong, storing while multiplying) where 256-wide ones would leave much of the last round idle
    (the attention's qkv forward: 8.7 rounds against 4.4, 452 TFLOP/s against 435 on an H200), and split K where
    the tiles are few and K long (the weight gradients' K = B*T = 8192, and the output layer's input gradient,
    whose 192 wide tiles fill 1.5 rounds); never for a bf16 out."""
    monkeypatch.setattr(backend, "multiprocessor_count", lambda: 132)
    assert launch_shape(8192, 50304, 768, True) == (256, 1, 768)      # 12608 wide tiles: 95.5 rounds
    assert launch_shape(8192, 2304, 768, True) == (128, 1, 768)       # 576 wide tiles: 4.4 rounds; 1152: 8.7
    assert launch_shape(8192, 3072, 768, True) == (256, 1, 768)       # 768 wide tiles: 5.8 rounds; 1536: 11.6
    assert launch_shape(8192, 768, 768, True) == (128, 1, 768)        # 192 wide tiles: 1.5 rounds; 384: 2.9
    assert launch_shape(8192, 768, 2304, True) == (128, 1, 2304)      # two stretches' slabs cost more than they save
    assert launch_shape(8192, 768, 3072, False) == (128, 1, 3072)
    assert launch_shape(8192, 768, 50304, True) == (256, 2, 25152)    # 192 wide tiles twice: 2.9 rounds of half K
    assert launch_shape(8192, 768, 50304, False) == (128, 1, 50304)   # 384 narrow tiles: 2.9 rounds; 192: 1.5
    assert launch_shape(2304, 768, 8192, True) == (256, 2, 4096)      # dW: 18 x 3 tiles, 2 stretches
    assert launch_shape(3072, 768, 8192, True) == (256, 3, 2752)      # dW: 72 tiles, 3 stretches
    assert launch_shape(768, 768, 8192, True) == (128, 3, 2752)       # dW: 36 narrow tiles, 3 stretches
    assert launch_shape(768, 768, 8192, False) == (128, 1, 8192)
    assert launch_shape(50304, 768, 8192, True) == (256, 1, 8192)     # 1179 tiles
    assert launch_shape(4096, 4096, 4096, True) == (256, 1, 4096)
    # 3xTF32 (three times K) on the 128-wide tiles its slice sums need
    assert launch_shape(768, 768, 3 * 8192, True, widths=(128,)) == (128, 3, 8192)


@hopper_or_cpu
@pytest.mark.parametrize("block_n, ping_pong", [(256, False), (128, False), (128, True)])
def test_one_block_takes_many_tiles_each_longer_than_the_ring(block_n, ping_pong, rng, monkeypatch):
    """One block for all the tiles (the persistent loop; on a GPU a block takes every 132nd or so), each tile's K
    three times as many slices as the ring has stages: the ring runs on from tile to tile, and with ping-pong
    the warpgroups take the tiles in turn without reading another tile's slices."""
    monkeypatch.setattr(wgmma_module, "grid_blocks", lambda items: 1)
    M, N, K = 256, 2 * block_n + 8, 64 * 3 * wgmma_module.STAGE_ROOM // ((128 + block_n) * 128)
    a, b, expected, tolerance = bf16_operands(rng, M, N, K)
    out = backend.xp.full((M, N), np.nan, dtype=np.float32)
    wgmma_module.launch_wgmma_matmul(a, b, out, shape=(block_n, 1, K), ping_pong=ping_pong)
    assert_within(out, expected, tolerance)
