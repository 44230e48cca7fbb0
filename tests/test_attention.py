"""Causal self-attention (chapter 08): gpt2_cupy.ops.attention, fused and naive, softmax and ReLU variants.

Every result is compared with a float64 numpy reference, whose backward is itself checked against central
finite differences; the fused kernels' gradients are also checked against finite differences directly.
Sequence lengths 1, 17, 65 and 1000 are not multiples of the kernels' 64- or 128-row tiles; head sizes 32
and 64 are the two the kernels are built for. The op uses one number of rows per block for each kernel;
both candidates (ROW_CHOICES) are checked too, launched directly. The error measure is max |result - reference| / max |reference|.
"""

import math

import numpy as np
import pytest

from gpt2_cupy import backend
from gpt2_cupy.ops import attention as attention_ops
from gpt2_cupy.ops.attention import (FORWARD_ROWS, ROW_CHOICES, attention_backward, attention_backward_naive,
                                     attention_forward, attention_forward_naive)
from gpt2_cupy.testing import finite_difference_gradient, relative_error, torch_or_none

TOLERANCE = 1e-5
VARIANTS = ("softmax", "relu")


def reference_forward(q, k, v, causal=True, variant="softmax"):
    """(out, P) in float64: S = q kᵀ / √d; softmax or ReLU of S on the visible keys; out = P v."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    T, d = q.shape[-2:]
    scores = q @ np.swapaxes(k, -1, -2) / math.sqrt(d)
    visible = np.tril(np.ones((T, T), bool)) if causal else np.ones((T, T), bool)
    if variant == "softmax":
        scores = np.where(visible, scores, -np.inf)
        p = np.exp(scores - scores.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
    else:
        p = np.where(visible, np.maximum(scores, 0.0), 0.0)
    return p @ v, p


def reference_backward(dout, q, k, v, causal=True, variant="softmax"):
    """(dq, dk, dv) in float64, from the graph: dV = Pᵀ dO, dP = dO Vᵀ, dS, dQ = dS K / √d, dK = dSᵀ Q / √d."""
    dout, q, k, v = (np.asarray(a, np.float64) for a in (dout, q, k, v))
    _, p = reference_forward(q, k, v, causal, variant)
    dv = np.swapaxes(p, -1, -2) @ dout
    dp = dout @ np.swapaxes(v, -1, -2)
    if variant == "softmax":
        ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True))
    else:
        ds = np.where(p > 0, dp, 0.0)  # ReLU's derivative: 1 where the (visible) score is positive
    ds /= math.sqrt(q.shape[-1])
    return ds @ k, np.swapaxes(ds, -1, -2) @ q, dv


def random_inputs(rng, shape):
    return [rng.normal(size=shape).astype(np.float32) for _ in range(4)]  # q, k, v, dout


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("causal", [True, False])
def test_reference_backward_matches_finite_differences(rng, variant, causal):
    q, k, v, dout = (a.astype(np.float64) for a in random_inputs(rng, (2, 5, 3)))

    def loss():
        return float((dout * reference_forward(q, k, v, causal, variant)[0]).sum())

    expected = reference_backward(dout, q, k, v, causal, variant)
    for array, gradient in zip((q, k, v), expected):
        assert relative_error(gradient, finite_difference_gradient(loss, array)) < 1e-7


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("d", [32, 64])
def test_fused_gradients_match_finite_differences(rng, to_device, to_host, variant, d):
    T = 5
    q, k, v, dout = random_inputs(rng, (1, T, d))
    out, lse = attention_forward(to_device(q), to_device(k), to_device(v), variant=variant)
    got = attention_backward(to_device(dout), to_device(q), to_device(k), to_device(v), out, lse, variant=variant)
    q64, k64, v64 = (a.astype(np.float64) for a in (q, k, v))

    def loss():
        return float((dout * reference_forward(q64, k64, v64, True, variant)[0]).sum())

    for name, array, gradient in zip("qkv", (q64, k64, v64), got):
        error = relative_error(to_host(gradient), finite_difference_gradient(loss, array))
        assert error < 1e-5, f"d{name}: {error:.3g}"


CASES = [(T, d, variant) for T in (1, 17, 65) for d in (32, 64) for variant in VARIANTS]
CASES += [(1000, 64, variant) for variant in VARIANTS]


@pytest.mark.parametrize("T, d, variant", CASES)
def test_fused_matches_float64(rng, to_device, to_host, T, d, variant):
    heads = 2 if T < 1000 else 1
    q, k, v, dout = random_inputs(rng, (heads, T, d))
    out, lse = attention_forward(to_device(q), to_device(k), to_device(v), variant=variant)
    expected, p = reference_forward(q, k, v, True, variant)
    assert relative_error(to_host(out), expected) < TOLERANCE
    if variant == "softmax":
        scores = np.where(np.tril(np.ones((T, T), bool)), q.astype(np.float64) @ np.swapaxes(k, -1, -2), -np.inf)
        scores /= math.sqrt(d)
        largest = scores.max(axis=-1)
        lse_expected = largest + np.log(np.exp(scores - largest[..., None]).sum(axis=-1))
        assert relative_error(to_host(lse), lse_expected) < TOLERANCE
    else:
        assert lse is None
    got = attention_backward(to_device(dout), to_device(q), to_device(k), to_device(v), out, lse, variant=variant)
    references = reference_backward(dout, q, k, v, True, variant)
    for name, gradient, reference in zip("qkv", got, references):
        if np.abs(reference).max() == 0:
            # T = 1, softmax: dq = dk = 0 (one key, P = 1 whatever S is); the kernel's P (dP - rowdot) is
            # rounding, to be measured against the size of the gradients that are not zero.
            # (ReLU with every score negative: all three are 0, exactly.)
            error = np.abs(to_host(gradient)).max() / max(max(np.abs(r).max() for r in references), 1.0)
        else:
            error = relative_error(to_host(gradient), reference)
        assert error < TOLERANCE, f"d{name}: {error:.3g}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_not_causal_and_leading_axes(rng, to_device, to_host, variant):
    for shape in [(2, 3, 33, 32), (40, 64)]:
        q, k, v, dout = random_inputs(rng, shape)
        out, lse = attention_forward(to_device(q), to_device(k), to_device(v), causal=False, variant=variant)
        assert out.shape == shape
        assert relative_error(to_host(out), reference_forward(q, k, v, False, variant)[0]) < TOLERANCE
        got = attention_backward(to_device(dout), to_device(q), to_device(k), to_device(v), out, lse,
                                 causal=False, variant=variant)
        for gradient, reference in zip(got, reference_backward(dout, q, k, v, False, variant)):
            assert relative_error(to_host(gradient), reference) < TOLERANCE


@pytest.mark.parametrize("variant", VARIANTS)
def test_naive_matches_float64(rng, to_device, to_host, variant):
    q, k, v, dout = random_inputs(rng, (2, 3, 65, 32))
    out, p = attention_forward_naive(to_device(q), to_device(k), to_device(v), variant=variant)
    expected, p_expected = reference_forward(q, k, v, True, variant)
    assert relative_error(to_host(out), expected) < TOLERANCE
    assert relative_error(to_host(p), p_expected) < TOLERANCE
    got = attention_backward_naive(to_device(dout), to_device(q), to_device(k), to_device(v), p, variant=variant)
    for gradient, reference in zip(got, reference_backward(dout, q, k, v, True, variant)):
        assert relative_error(to_host(gradient), reference) < TOLERANCE


ONE_PASS_CASES = [(T, d, variant, causal) for T in (1, 17, 130) for d in (32, 64) for variant in VARIANTS
                  for causal in (True, False)]


@pytest.mark.parametrize("T, d, variant, causal", ONE_PASS_CASES)
def test_one_pass_backward_matches_float64(rng, to_device, to_host, T, d, variant, causal):
    # deterministic=False: dq added by the dk, dv kernel with atomics, into zeros; 130 keys are two tiles
    # of 64 and a partial one, so three blocks add into each query tile.
    q, k, v, dout = random_inputs(rng, (2, T, d))
    out, lse = attention_forward(to_device(q), to_device(k), to_device(v), causal=causal, variant=variant)
    got = attention_backward(to_device(dout), to_device(q), to_device(k), to_device(v), out, lse, causal=causal,
                             variant=variant, deterministic=False)
    references = reference_backward(dout, q, k, v, causal, variant)
    scale = max(max(np.abs(r).max() for r in references), 1.0)
    for name, gradient, reference in zip("qkv", got, references):
        # as in test_fused_matches_float64: an all-zero reference (T = 1) is measured against the others
        error = relative_error(to_host(gradient), reference) if np.abs(reference).max() else \
            np.abs(to_host(gradient)).max() / scale
        assert error < TOLERANCE, f"d{name}: {error:.3g}"


def test_backward_is_deterministic(rng, to_device, to_host):
    q, k, v, dout = (to_device(a) for a in random_inputs(rng, (2, 100, 64)))
    out, lse = attention_forward(q, k, v)
    first = [to_host(g) for g in attention_backward(dout, q, k, v, out, lse)]
    second = [to_host(g) for g in attention_backward(dout, q, k, v, out, lse)]
    assert all(np.array_equal(a, b) for a, b in zip(first, second))


def test_tiles_above_the_diagonal_are_never_read(rng, to_device, to_host):
    # NaN in every key and value after the first block of queries: those queries must not see them, so
    # the kernel must skip those tiles rather than multiply them by a zero probability.
    rows = FORWARD_ROWS
    q, k, v, _ = random_inputs(rng, (1, rows + 6, 32))
    k[0, rows:], v[0, rows:] = np.nan, np.nan
    for variant in VARIANTS:
        out, _ = attention_forward(to_device(q), to_device(k), to_device(v), variant=variant)
        expected, _ = reference_forward(q[:, :rows], k[:, :rows], v[:, :rows], variant=variant)
        assert relative_error(to_host(out)[:, :rows], expected) < TOLERANCE


@pytest.mark.parametrize("rows", ROW_CHOICES)
@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("causal", [True, False])
def test_every_rows_per_block_choice(rng, to_device, to_host, rows, d, causal):
    # Each kernel launched directly with 64 and 128 rows per block (the op uses one of them; the
    # benchmark times both), on 130 rows: two blocks of 64 and a partial one, or one of 128 and a partial one.
    # At d = 128 the backward's tiles of 128 rows do not fit in a block's shared memory: it takes 32.
    heads, T = 2, 130
    for variant in VARIANTS:
        q, k, v, dout = (to_device(a) for a in random_inputs(rng, (heads, T, d)))
        out, dq, dk, dv = (backend.xp.empty_like(q) for _ in range(4))
        lse, rowdot = (backend.xp.empty((heads, T), dtype=np.float32) for _ in range(2))
        shape = attention_ops.LaunchShape.of(q, k, v)
        attention_ops._forward(out, lse, q, k, v, shape, causal, variant, rows)
        if variant == "softmax":
            attention_ops._rowdot(rowdot, dout, out, shape)
        else:
            lse = rowdot = dout
        attention_ops._dk_dv(dk, dv, dout, q, k, v, lse, rowdot, shape, causal, variant, rows)
        attention_ops._dq(dq, dout, q, k, v, lse, rowdot, shape, causal, variant, rows)
        host = [to_host(a) for a in (q, k, v, dout)]
        assert relative_error(to_host(out), reference_forward(*host[:3], causal, variant)[0]) < TOLERANCE
        for name, gradient, reference in zip("qkv", (dq, dk, dv), reference_backward(host[3], *host[:3], causal,
                                                                                    variant)):
            error = relative_error(to_host(gradient), reference)
            assert error < TOLERANCE, f"{variant}, d{name}: {error:.3g}"


def test_bad_arguments(to_device):
    q = to_device(np.zeros((2, 8, 32), np.float32))
    with pytest.raises(TypeError, match="attention_forward: k"):
        attention_forward(q, to_device(np.zeros((2, 8, 32), np.float64)), q)
    with pytest.raises(ValueError, match="attention_forward: v"):
        attention_forward(q, q, to_device(np.zeros((2, 9, 32), np.float32)))
    with pytest.raises(ValueError, match="head size d .* from 1 to 256, got 257"):
        attention_forward(*(to_device(np.zeros((8, 257), np.float32)),) * 3)
    with pytest.raises(ValueError, match="variant"):
        attention_forward(q, q, q, variant="sigmoid")
    out, _ = attention_forward(q, q, q)
    with pytest.raises(ValueError, match="attention_backward: .*lse"):
        attention_backward(q, q, q, q, out, None)
    with pytest.raises(ValueError, match="attention_backward: lse"):
        attention_backward(q, q, q, q, out, to_device(np.zeros((2, 7), np.float32)))


def test_against_torch(rng, to_device, to_host):
    torch = torch_or_none()
    if torch is None or backend.name != "cuda":
        pytest.skip("needs PyTorch and a GPU (the comparison runs on the GPU machine)")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    q, k, v, dout = random_inputs(rng, (2, 3, 1000, 64))
    tensors = [torch.tensor(a, device="cuda", requires_grad=True) for a in (q, k, v)]
    expected = torch.nn.functional.scaled_dot_product_attention(*tensors, is_causal=True)
    expected.backward(torch.tensor(dout, device="cuda"))
    out, lse = attention_forward(to_device(q), to_device(k), to_device(v))
    assert relative_error(to_host(out), expected.detach().cpu().numpy()) < TOLERANCE
    got = attention_backward(to_device(dout), to_device(q), to_device(k), to_device(v), out, lse)
    for gradient, tensor in zip(got, tensors):
        assert relative_error(to_host(gradient), tensor.grad.cpu().numpy()) < TOLERANCE


# ---- any head size, grouped-query attention ----------------------------------------------------------------

def grouped_reference(dout, q, k, v, causal=True, variant="softmax"):
    """(out, dq, dk, dv) in float64 for k, v with fewer heads (axis -3) than q: each key and value head repeated for
    its group (query head h reads h // group), then dk and dv summed back over each group."""
    group = q.shape[-3] // k.shape[-3]
    k_repeated, v_repeated = (np.repeat(a, group, axis=-3) for a in (k, v))
    out, _ = reference_forward(q, k_repeated, v_repeated, causal, variant)
    dq, dk, dv = reference_backward(dout, q, k_repeated, v_repeated, causal, variant)
    grouped = k.shape[:-2] + (group,) + k.shape[-2:]
    return out, dq, dk.reshape(grouped).sum(axis=-3), dv.reshape(grouped).sum(axis=-3)


def check_against_grouped_reference(to_device, to_host, q, k, v, dout, causal, variant="softmax", deterministic=True):
    arrays = [to_device(a) for a in (q, k, v)]
    out, lse = attention_forward(*arrays, causal=causal, variant=variant)
    got = attention_backward(to_device(dout), *arrays, out, lse, causal=causal, variant=variant,
                             deterministic=deterministic)
    expected = grouped_reference(dout, q, k, v, causal, variant)
    for name, result, reference in zip(("out", "dq", "dk", "dv"), (out, *got), expected):
        error = relative_error(to_host(result), reference)
        assert error < TOLERANCE, f"{name}: {error:.3g}"
    return got


# Head sizes below, between and at the tile widths 32, 64, 128 and 256; 1 and 200 are not multiples of 4
# (rows that do not start on 16 bytes), 256 runs the backward with 32 rows per block. 67 queries: a full tile
# of 64 and a partial one (and three blocks of 32).
@pytest.mark.parametrize("d", [1, 16, 48, 80, 128, 200, 256])
@pytest.mark.parametrize("causal", [True, False])
def test_every_head_size_matches_float64(rng, to_device, to_host, d, causal):
    q, k, v, dout = random_inputs(rng, (1, 2, 67, d))
    check_against_grouped_reference(to_device, to_host, q, k, v, dout, causal)


@pytest.mark.parametrize("d", [1, 48, 200])
def test_head_sizes_between_the_tile_widths_in_the_relu_variant(rng, to_device, to_host, d):
    q, k, v, dout = random_inputs(rng, (2, 40, d))
    check_against_grouped_reference(to_device, to_host, q, k, v, dout, True, variant="relu")


GROUPED_CASES = [(heads, key_heads, d, causal) for heads, key_heads in ((4, 2), (3, 1), (4, 1)) for d in (48, 64)
                 for causal in (True, False)]


@pytest.mark.parametrize("heads, key_heads, d, causal", GROUPED_CASES)
def test_grouped_query_attention_matches_float64(rng, to_device, to_host, heads, key_heads, d, causal):
    # Query head h reads key-value head h // (heads / key_heads); dk and dv sum over the group.
    q, dout = (rng.normal(size=(2, heads, 70, d)).astype(np.float32) for _ in range(2))
    k, v = (rng.normal(size=(2, key_heads, 70, d)).astype(np.float32) for _ in range(2))
    dk_shape = check_against_grouped_reference(to_device, to_host, q, k, v, dout, causal)[1].shape
    assert dk_shape == (2, key_heads, 70, d)                  # one gradient per key head, not per query head


@pytest.mark.parametrize("variant", VARIANTS)
def test_grouped_one_pass_backward_matches_float64(rng, to_device, to_host, variant):
    q, dout = (rng.normal(size=(1, 4, 130, 64)).astype(np.float32) for _ in range(2))
    k, v = (rng.normal(size=(1, 2, 130, 64)).astype(np.float32) for _ in range(2))
    check_against_grouped_reference(to_device, to_host, q, k, v, dout, True, variant, deterministic=False)


def test_grouped_backward_is_deterministic(rng, to_device, to_host):
    q, dout = (to_device(rng.normal(size=(1, 4, 100, 48)).astype(np.float32)) for _ in range(2))
    k, v = (to_device(rng.normal(size=(1, 1, 100, 48)).astype(np.float32)) for _ in range(2))
    out, lse = attention_forward(q, k, v)
    first, second = ([to_host(g) for g in attention_backward(dout, q, k, v, out, lse)] for _ in range(2))
    assert all(np.array_equal(a, b) for a, b in zip(first, second))


def test_one_pass_at_head_size_256_runs_the_two_passes(rng, to_device, to_host):
    # At D = 256 the one-pass kernel's tiles need 295 KiB of shared memory, more than a block may have.
    assert not attention_ops.one_pass_fits(256) and attention_ops.one_pass_fits(128)
    q, k, v, dout = (to_device(a) for a in random_inputs(rng, (1, 70, 256)))
    out, lse = attention_forward(q, k, v)
    one_pass = attention_backward(dout, q, k, v, out, lse, deterministic=False)
    two_passes = attention_backward(dout, q, k, v, out, lse)
    assert all(np.array_equal(to_host(a), to_host(b)) for a, b in zip(one_pass, two_passes))


def test_grouped_heads_that_do_not_divide_are_refused(to_device):
    q = to_device(np.zeros((1, 4, 8, 32), np.float32))
    k = to_device(np.zeros((1, 3, 8, 32), np.float32))
    with pytest.raises(ValueError, match="attention_forward: k and v have 3 heads .* does not divide q's 4"):
        attention_forward(q, k, k)
    with pytest.raises(ValueError, match="attention_forward: v"):
        attention_forward(q, to_device(np.zeros((1, 2, 8, 32), np.float32)), k)


# ---- F.scaled_dot_product_attention: PyTorch's enable_gqa, every head size on the fused kernels ------------

def test_scaled_dot_product_attention_with_enable_gqa(rng, to_device, to_host):
    from gpt2_cupy import Tensor
    from gpt2_cupy.nn import functional as F

    q, dout = (rng.normal(size=(2, 4, 9, 80)).astype(np.float32) for _ in range(2))
    k, v = (rng.normal(size=(2, 2, 9, 80)).astype(np.float32) for _ in range(2))
    expected = grouped_reference(dout, q, k, v, causal=True)
    tensors = [Tensor(to_device(a), requires_grad=True) for a in (q, k, v)]
    out = F.scaled_dot_product_attention(*tensors, is_causal=True, enable_gqa=True)
    assert out.grad_fn.function is F.Attention  # the fused kernels
    out.backward(Tensor(to_device(dout)))
    for name, result, reference in zip(("out", "dq", "dk", "dv"), (out.data, *(t.grad for t in tensors)), expected):
        assert relative_error(to_host(result), reference) < TOLERANCE, name
    # The math path (a mask) repeats the key and value heads and gives the same attention.
    mask = Tensor(to_device(np.tril(np.ones((9, 9), bool))))
    through_operations = F.scaled_dot_product_attention(*(Tensor(to_device(a)) for a in (q, k, v)), attn_mask=mask,
                                                        enable_gqa=True)
    assert relative_error(to_host(through_operations.data), expected[0]) < TOLERANCE


def test_scaled_dot_product_attention_head_count_errors_are_pytorchs(to_device):
    from gpt2_cupy import Tensor
    from gpt2_cupy.nn import functional as F

    q = Tensor(to_device(np.zeros((1, 4, 8, 16), np.float32)))
    k2, k3 = (Tensor(to_device(np.zeros((1, heads, 8, 16), np.float32))) for heads in (2, 3))
    with pytest.raises(RuntimeError, match=r"The size of tensor a \(4\) must match the size of tensor b \(2\) at "
                                           "non-singleton dimension 1"):
        F.scaled_dot_product_attention(q, k2, k2)                  # enable_gqa=False, PyTorch's default
    with pytest.raises(RuntimeError, match="Number of heads in key and value must divide the number of heads in query"):
        F.scaled_dot_product_attention(q, k3, k3, enable_gqa=True)


@pytest.mark.parametrize("d", [8, 100, 256])
def test_model_head_sizes_run_the_fused_kernels(rng, to_device, d):
    # No head size up to 256 falls back to a path that writes the (T, T) scores.
    from gpt2_cupy import Tensor
    from gpt2_cupy.nn import functional as F

    q, k, v = (Tensor(to_device(rng.normal(size=(1, 2, 5, d)).astype(np.float32)), requires_grad=True)
               for _ in range(3))
    assert F.scaled_dot_product_attention(q, k, v, is_causal=True).grad_fn.function is F.Attention


def _heads_of(qkv, B, T, H, d, key_heads):
    """q (B, H, T, d), k, v (B, key_heads, T, d): views of one (B, T, (H + 2 key_heads) d) product's output."""
    xp = np if isinstance(qkv, np.ndarray) else backend.xp
    q, k, v = xp.split(qkv, [H * d, (H + key_heads) * d], axis=-1)
    return (q.reshape(B, T, H, d).swapaxes(1, 2), k.reshape(B, T, key_heads, d).swapaxes(1, 2),
            v.reshape(B, T, key_heads, d).swapaxes(1, 2))


@pytest.mark.parametrize("d, H, key_heads", [(64, 3, 3), (32, 4, 2), (20, 2, 1), (6, 2, 2)])
@pytest.mark.parametrize("variant", VARIANTS)
def test_heads_read_and_written_where_they_lie(rng, to_device, to_host, d, H, key_heads, variant):
    """q, k, v as views of one product's output (no copy), out made with its heads side by side, and dq, dk, dv
    one array laid out as q, k, v: the same results as the float64 reference. d = 6 (rows not on 16 bytes:
    float by float) and 20 (float4s in a 32-wide tile) take the kernels' narrow-head paths."""
    B, T = 2, 70
    qkv = rng.normal(size=(B, T, (H + 2 * key_heads) * d)).astype(np.float32)
    dout = rng.normal(size=(B, T, H * d)).astype(np.float32)         # the next product's gradient, (B, T, C)
    device_qkv, device_dout = to_device(qkv), to_device(dout)
    q, k, v = _heads_of(device_qkv, B, T, H, d, key_heads)
    dout_heads = device_dout.reshape(B, T, H, d).swapaxes(1, 2)
    out, lse = attention_forward(q, k, v, variant=variant)
    assert out.swapaxes(1, 2).flags.c_contiguous                          # (B, T, H, d) memory: heads side by side
    dq, dk, dv = attention_backward(dout_heads, q, k, v, out, lse, variant=variant)
    assert dq.base is not None and all(g.base is dq.base for g in (dk, dv))   # one (B, T, 3 C) array
    group = H // key_heads
    host_q, host_k, host_v = _heads_of(qkv, B, T, H, d, key_heads)
    expanded = [np.repeat(x, group, axis=1) for x in (host_k, host_v)]   # key head j serves query heads j·group..
    assert relative_error(to_host(out), reference_forward(host_q, *expanded, variant=variant)[0]) < TOLERANCE
    reference_dq, reference_dk, reference_dv = reference_backward(dout.reshape(B, T, H, d).swapaxes(1, 2), host_q,
                                                                  *expanded, variant=variant)
    summed = [r.reshape(B, key_heads, group, T, d).sum(axis=2) for r in (reference_dk, reference_dv)]
    for name, got, reference in zip("qkv", (dq, dk, dv), (reference_dq, *summed)):
        assert relative_error(to_host(got), reference) < TOLERANCE, f"d{name}"


def test_unaligned_views_are_copied(rng, to_device, to_host):
    """Heads of 64 whose rows start 4 bytes past 16 (a view one float into a wider array): the float4 path
    would read across rows, so the op copies them first and gives the reference's result."""
    B, H, T, d = 1, 2, 33, 64
    wide = rng.normal(size=(4, B, H, T, d + 1)).astype(np.float32)
    q, k, v, dout = (to_device(np.ascontiguousarray(x))[..., 1:] for x in wide)
    out, lse = attention_forward(q, k, v)
    host = [to_host(x) for x in (q, k, v, dout)]
    assert relative_error(to_host(out), reference_forward(*host[:3])[0]) < TOLERANCE
    for got, reference in zip(attention_backward(dout, q, k, v, out, lse), reference_backward(host[3], *host[:3])):
        assert relative_error(to_host(got), reference) < TOLERANCE
