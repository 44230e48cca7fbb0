"""RMSNorm, RoPE and SwiGLU (chapter 17a): gpt2_cupy.ops.rmsnorm, .rope and .swiglu against float64 numpy.

Each reference's gradient is first checked against central finite differences; then the ops run on the
active backend on sizes that are not multiples of the block size (256), of a warp (32) or of 4, and on
views that start 4 bytes past a 16-byte boundary (the one-element kernels of SwiGLU).
"""

import numpy as np
import pytest

from gpt2_cupy import backend
from gpt2_cupy.ops.rmsnorm import rmsnorm_backward, rmsnorm_forward, row_layout
from gpt2_cupy.ops.rope import inverse_frequencies_host, permute_for_interleaved, rope_backward, rope_forward
from gpt2_cupy.ops.swiglu import swiglu_backward, swiglu_forward
from gpt2_cupy.testing import assert_within_summation_bound, finite_difference_gradient, relative_error

EPS = 1e-6  # Llama's rms_norm_eps (Llama 2 uses 1e-5; the op takes either)


# ---- float64 references ----------------------------------------------------------------------------------

def rmsnorm_reference(x, weight, eps=EPS):
    rstd = 1 / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)
    return x * rstd * weight, rstd[..., 0]


def rmsnorm_backward_reference(dout, x, weight, eps=EPS):
    """(dx, dweight): xhat = x r, g = w dout, dx = r (g - xhat mean(g xhat)), dweight = sum of dout xhat."""
    rstd = 1 / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)
    x_hat, g = x * rstd, weight * dout
    dx = rstd * (g - x_hat * (g * x_hat).mean(axis=-1, keepdims=True))
    return dx, (dout * x_hat).reshape(-1, x.shape[-1]).sum(axis=0)


def rope_reference(x, theta, start, interleaved, sign=1.0):
    """x (B, T, H, D) rotated as transformers (rotate_half) or llama2.c (interleaved) write it, in float64."""
    B, T, H, D = x.shape
    inv_freq = 1.0 / theta ** (np.arange(0, D, 2) / D)                       # (D/2,)
    angles = np.arange(start, start + T)[:, None] * inv_freq[None, :]        # (T, D/2)
    cos, sin = np.cos(angles)[None, :, None, :], sign * np.sin(angles)[None, :, None, :]
    if interleaved:                                   # llama2.c: (x[2i], x[2i+1]) turned by angle i
        even, odd = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = even * cos - odd * sin
        out[..., 1::2] = even * sin + odd * cos
        return out
    cos, sin = np.concatenate([cos, cos], axis=-1), np.concatenate([sin, sin], axis=-1)
    rotate_half = np.concatenate([-x[..., D // 2:], x[..., :D // 2]], axis=-1)
    return x * cos + rotate_half * sin                # transformers' apply_rotary_pos_emb


def swiglu_reference(gate, up):
    return gate / (1 + np.exp(-gate)) * up


def swiglu_backward_reference(dout, gate, up):
    s = 1 / (1 + np.exp(-gate))
    return dout * up * s * (1 + gate * (1 - s)), dout * gate * s


def test_reference_gradients_match_central_differences(rng):
    x, weight, dout = rng.normal(size=(2, 3, 7)), rng.normal(size=7), rng.normal(size=(2, 3, 7))
    numeric = [finite_difference_gradient(lambda: np.sum(dout * rmsnorm_reference(x, weight)[0]), a)
               for a in (x, weight)]
    for analytic, expected in zip(rmsnorm_backward_reference(dout, x, weight), numeric):
        assert relative_error(analytic, expected) < 1e-7

    q, dq = rng.normal(size=(1, 5, 2, 6)), rng.normal(size=(1, 5, 2, 6))
    for interleaved in (False, True):
        numeric = finite_difference_gradient(lambda: np.sum(dq * rope_reference(q, 500.0, 3, interleaved)), q)
        assert relative_error(rope_reference(dq, 500.0, 3, interleaved, sign=-1.0), numeric) < 1e-7

    gate, up, dout = rng.normal(0, 3, (4, 5)), rng.normal(size=(4, 5)), rng.normal(size=(4, 5))
    numeric = [finite_difference_gradient(lambda: np.sum(dout * swiglu_reference(gate, up)), a) for a in (gate, up)]
    for analytic, expected in zip(swiglu_backward_reference(dout, gate, up), numeric):
        assert relative_error(analytic, expected) < 1e-7


# ---- RMSNorm ---------------------------------------------------------------------------------------------

# Rows held by one warp (3 to 512 floats at 4 per load), by 2 warps (768, 1000; 1001 floats one at a time) and by
# 8 warps (4096, Llama 7B's width): the kernels' layouts (gpt2_cupy.ops.rmsnorm.row_layout). Fewer rows when wide.
@pytest.mark.parametrize("columns", [3, 31, 33, 100, 768, 1000, 1001, 4096])
def test_rmsnorm_forward_and_backward(rng, to_device, to_host, columns):
    x = rng.normal(0.5, 2.0, (3, 37 if columns < 4096 else 7, columns)).astype(np.float32)
    weight = rng.normal(1.0, 0.3, columns).astype(np.float32)
    dout = rng.normal(size=x.shape).astype(np.float32)
    start = rng.normal(size=columns).astype(np.float32)  # dweight's value before: the backward adds into it
    x64, weight64, dout64 = x.astype(np.float64), weight.astype(np.float64), dout.astype(np.float64)
    y_ref, rstd_ref = rmsnorm_reference(x64, weight64)
    dx_ref, _ = rmsnorm_backward_reference(dout64, x64, weight64)

    y, rstd = rmsnorm_forward(to_device(x), to_device(weight))
    dweight = to_device(start)
    dx = rmsnorm_backward(to_device(dout), to_device(x), to_device(weight), rstd, dweight=dweight)
    assert relative_error(to_host(y), y_ref) < 1e-5
    assert relative_error(to_host(rstd), rstd_ref) < 1e-5
    assert relative_error(to_host(dx), dx_ref) < 1e-5
    terms = (dout64 * x64 * rstd_ref[..., None]).reshape(-1, columns)
    assert_within_summation_bound(to_host(dweight), terms, start=start)


def test_rmsnorm_layouts_of_wide_rows(to_device):
    aligned = to_device(np.zeros(4, np.float32))
    assert row_layout("rmsnorm", 4096, (aligned,)) == (4, 4, 8)      # 8 warps per row, 4 float4s per thread
    assert row_layout("rmsnorm", 768, (aligned,)) == (4, 3, 2)
    assert row_layout("rmsnorm", 1001, (aligned,)) == (1, 16, 2)     # not a multiple of 4: a float per load
    assert row_layout("rmsnorm", 4096, (aligned[1:],)) == (1, 16, 8)  # 4 bytes past a 16-byte boundary
    with pytest.raises(ValueError, match="longer than the kernels hold"):
        row_layout("rmsnorm_forward", 32 * 32 * 16 + 1, (aligned,))


def test_rmsnorm_of_wide_rows_that_do_not_start_on_16_bytes(rng, to_device, to_host):
    # Views 4 bytes past a 16-byte boundary, rows of 4096: one float per load, 8 warps per row.
    x, dout = (to_device(rng.normal(size=5 * 4096 + 1).astype(np.float32))[1:].reshape(5, 4096) for _ in range(2))
    weight = rng.normal(1.0, 0.3, 4096).astype(np.float32)
    assert row_layout("rmsnorm", 4096, (x, dout))[0] == 1
    x64, dout64, weight64 = (to_host(a).astype(np.float64) for a in (x, dout, to_device(weight)))
    y, rstd = rmsnorm_forward(x, to_device(weight))
    dweight = to_device(np.zeros(4096, np.float32))
    dx = rmsnorm_backward(dout, x, to_device(weight), rstd, dweight=dweight)
    assert relative_error(to_host(y), rmsnorm_reference(x64, weight64)[0]) < 1e-5
    dx_ref, dweight_ref = rmsnorm_backward_reference(dout64, x64, weight64)
    assert relative_error(to_host(dx), dx_ref) < 1e-5
    assert relative_error(to_host(dweight), dweight_ref) < 1e-5


def test_rmsnorm_weight_gradient_is_the_same_bit_for_bit_on_every_run(rng, to_device, to_host):
    x, dout = (to_device(rng.normal(size=(600, 200)).astype(np.float32)) for _ in range(2))
    weight = to_device(rng.normal(size=200).astype(np.float32))
    _, rstd = rmsnorm_forward(x, weight)
    runs = []
    for _ in range(2):
        dweight = to_device(np.zeros(200, np.float32))
        rmsnorm_backward(dout, x, weight, rstd, dweight=dweight)
        runs.append(to_host(dweight))
    assert np.array_equal(runs[0], runs[1])


def test_rmsnorm_of_zeros_is_zero_and_eps_is_used(to_device, to_host):
    y, rstd = rmsnorm_forward(to_device(np.zeros((2, 64), np.float32)), to_device(np.ones(64, np.float32)), eps=1e-4)
    assert np.array_equal(to_host(y), np.zeros((2, 64)))
    assert np.allclose(to_host(rstd), 100.0, rtol=1e-6)  # 1 / sqrt(0 + 1e-4)


def test_rmsnorm_errors_name_the_argument(to_device):
    x, weight = to_device(np.zeros((2, 8), np.float32)), to_device(np.ones(7, np.float32))
    with pytest.raises(ValueError, match="rmsnorm_forward: weight"):
        rmsnorm_forward(x, weight)
    _, rstd = rmsnorm_forward(x, to_device(np.ones(8, np.float32)))
    with pytest.raises(TypeError, match="dweight is None"):
        rmsnorm_backward(x, x, to_device(np.ones(8, np.float32)), rstd, dweight=None)


# ---- RoPE ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("shape, theta, start", [((2, 7, 3, 64), 10000.0, 0), ((1, 33, 2, 128), 500000.0, 0),
                                                 ((3, 5, 4, 16), 10000.0, 17), ((1, 1, 5, 6), 10.0, 40)])
def test_rope_forward_and_backward(rng, to_device, to_host, shape, theta, start, interleaved):
    x = rng.normal(size=shape).astype(np.float32)
    dout = rng.normal(size=shape).astype(np.float32)
    y = rope_forward(to_device(x), theta=theta, start=start, interleaved=interleaved)
    dx = rope_backward(to_device(dout), theta=theta, start=start, interleaved=interleaved)
    x64, dout64 = x.astype(np.float64), dout.astype(np.float64)
    assert relative_error(to_host(y), rope_reference(x64, theta, start, interleaved)) < 1e-5
    assert relative_error(to_host(dx), rope_reference(dout64, theta, start, interleaved, sign=-1.0)) < 1e-5


def test_rope_pairings_differ_and_in_place_works(rng, to_device, to_host):
    x = rng.normal(size=(1, 6, 2, 8)).astype(np.float32)
    half = to_host(rope_forward(to_device(x), start=1))
    neighbours = to_host(rope_forward(to_device(x), start=1, interleaved=True))
    assert np.abs(half - neighbours).max() > 0.1
    device_x = to_device(x)
    rope_forward(device_x, start=1, out=device_x)
    assert np.array_equal(to_host(device_x), half)


def test_rope_with_a_cache_offset_equals_the_whole_sequence(rng, to_device, to_host):
    """Positions 5..8 rotated with start=5 are rows 5..8 of the whole sequence rotated from 0."""
    x = rng.normal(size=(2, 9, 3, 32)).astype(np.float32)
    whole = to_host(rope_forward(to_device(x), theta=500000.0))
    tail = to_host(rope_forward(to_device(np.ascontiguousarray(x[:, 5:])), theta=500000.0, start=5))
    assert np.array_equal(tail, whole[:, 5:])


def test_inverse_frequencies_are_float32_of_the_exact_values():
    for head_dim, theta in ((64, 10000.0), (128, 500000.0)):
        exact = theta ** (-np.arange(0, head_dim, 2) / head_dim)
        got = inverse_frequencies_host(head_dim, theta)
        assert got.dtype == np.float32
        assert relative_error(got / exact, np.ones_like(exact)) < 3e-7  # a few units in the last place


def test_rope_angles_are_float32_products_at_long_positions(rng, to_device, to_host):
    """At positions 20001..20003 the op agrees with float64 rotations by its float32 angles; float16 angles would be
    off by radians (float16 numbers near 20000 are 16 apart: all three positions round to 20000)."""
    x = rng.normal(size=(1, 3, 1, 8)).astype(np.float32)
    got = to_host(rope_forward(to_device(x), start=20001))
    inv_freq = inverse_frequencies_host(8, 10000.0)
    angles = (np.arange(20001, 20004, dtype=np.float32)[:, None] * inv_freq[None, :]).astype(np.float64)
    cos, sin = np.cos(angles)[None, :, None, :], np.sin(angles)[None, :, None, :]
    x64 = x.astype(np.float64)
    a, b = x64[..., :4], x64[..., 4:]
    expected = np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)
    assert relative_error(got, expected) < 1e-5
    half_angles = np.arange(20001, 20004).astype(np.float16)[:, None] * inv_freq.astype(np.float16)[None, :]
    assert np.abs(half_angles.astype(np.float64) - angles).max() > 1.0


def test_permuted_weights_make_interleaved_rope_give_the_same_scores(rng, to_device, to_host):
    """q kᵀ with rotate_half and weights W equals q kᵀ with the interleaved pairing and permuted W."""
    heads, head_dim, channels, T = 2, 8, 12, 5
    x = rng.normal(size=(1, T, channels)).astype(np.float32)
    wq, wk = (rng.normal(size=(heads * head_dim, channels)).astype(np.float32) for _ in range(2))

    def scores(wq, wk, interleaved):
        q, k = ((x @ w.T).reshape(1, T, heads, head_dim) for w in (wq, wk))
        q, k = (to_host(rope_forward(to_device(a), interleaved=interleaved)).astype(np.float64) for a in (q, k))
        return np.einsum("bthd,bshd->bhts", q, k)

    expected = scores(wq, wk, False)
    permuted = scores(permute_for_interleaved(wq, heads), permute_for_interleaved(wk, heads), True)
    assert relative_error(permuted, expected) < 1e-5
    assert relative_error(scores(wq, wk, True), expected) > 0.1  # the wrong pairing is another model


def test_rope_refuses_odd_head_sizes(to_device):
    with pytest.raises(ValueError, match="must be even"):
        rope_forward(to_device(np.zeros((1, 2, 1, 5), np.float32)))


# ---- SwiGLU ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(1,), (3,), (5,), (257,), (4099,), (2, 37, 84)])
@pytest.mark.parametrize("misaligned", [False, True])
def test_swiglu_forward_and_backward(rng, to_device, to_host, shape, misaligned):
    gate, up, dout = (rng.normal(0, 3, shape).astype(np.float32) for _ in range(3))
    if misaligned:  # views one float into a fresh array: not 16-byte aligned, the one-element kernels
        gate, up, dout = (to_device(np.concatenate([[0], a.ravel()]).astype(np.float32))[1:].reshape(shape)
                          for a in (gate, up, dout))
        host = [to_host(a) for a in (gate, up, dout)]
    else:
        host = [gate, up, dout]
        gate, up, dout = (to_device(a) for a in (gate, up, dout))
    gate64, up64, dout64 = (a.astype(np.float64) for a in host)
    y = swiglu_forward(gate, up)
    dgate, dup = swiglu_backward(dout, gate, up)
    floor = 0.1  # near zero, an error relative to |reference| + 0.1 (float32 terms carry an absolute error)
    for got, expected in ((y, swiglu_reference(gate64, up64)),
                          *zip((dgate, dup), swiglu_backward_reference(dout64, gate64, up64))):
        assert np.max(np.abs(to_host(got) - expected) / (np.abs(expected) + floor)) < 1e-5


def test_swiglu_saturates_without_nan(to_device, to_host):
    gate = to_device(np.array([-1000.0, -100.0, 0.0, 100.0, 1000.0], np.float32))
    up = to_device(np.full(5, 2.0, np.float32))
    y = to_host(swiglu_forward(gate, up))
    dgate, dup = (to_host(a) for a in swiglu_backward(to_device(np.ones(5, np.float32)), gate, up))
    assert np.array_equal(y, [-0.0, -0.0, 0.0, 200.0, 2000.0])
    assert np.array_equal(dgate, [0.0, 0.0, 1.0, 2.0, 2.0])  # silu'(0) = 1/2, times up = 2
    assert np.array_equal(dup, [-0.0, -0.0, 0.0, 100.0, 1000.0])


def test_swiglu_refuses_shapes_that_differ(to_device):
    with pytest.raises(ValueError, match="swiglu_forward: up"):
        swiglu_forward(to_device(np.zeros((2, 3), np.float32)), to_device(np.zeros((3, 2), np.float32)))


def _bits(array):
    return np.asarray(array).view(np.uint16)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_rope_of_heads_sliced_from_one_product(rng, to_device, to_host, dtype):
    """q and k as slices of one (B, T, (H + 2 H_kv) D) product's output: the bf16 kernel reads them where they
    lie (rows H D + 2 H_kv D apart), float32 ones are copied first; both equal the contiguous copies' result."""
    from ml_dtypes import bfloat16
    B, T, H, H_kv, D = 2, 5, 4, 2, 16
    wide = rng.standard_normal((B, T, (H + 2 * H_kv) * D)).astype(bfloat16 if dtype == "bfloat16" else np.float32)
    device = to_device(wide)
    for start, heads in ((0, H), (H * D, H_kv)):
        view = device[..., start:start + heads * D].reshape(B, T, heads, D)
        got = to_host(rope_forward(view, theta=500000.0, start=3))
        expected = to_host(rope_forward(to_device(np.ascontiguousarray(to_host(view))), theta=500000.0, start=3))
        assert np.array_equal(got.view(np.uint8), expected.view(np.uint8))


def test_swiglu_of_the_two_halves_of_one_product(rng, to_device, to_host):
    """gate and up as the two halves of one (B, T, 2 I) bf16 array: read where they lie, the bits of the
    contiguous copies; against float64 within one bf16 rounding."""
    from ml_dtypes import bfloat16
    both = rng.standard_normal((2, 3, 2 * 40)).astype(bfloat16)
    device = to_device(both)
    gate, up = device[..., :40], device[..., 40:]
    got = to_host(swiglu_forward(gate, up))
    expected = to_host(swiglu_forward(*(to_device(np.ascontiguousarray(to_host(x))) for x in (gate, up))))
    assert np.array_equal(_bits(got), _bits(expected))
    g, u = both[..., :40].astype(np.float64), both[..., 40:].astype(np.float64)
    exact = g / (1 + np.exp(-g)) * u
    assert np.all(np.abs(got.astype(np.float64) - exact) <= 2 ** -8 * np.abs(exact) + 1e-6)

