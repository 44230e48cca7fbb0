"""scaled_dot_product_attention's scale, attn_mask and dropout_p on the fused kernels (kernels/attention.cu's
_general versions, chapter 08), against float64 numpy.

The reference is PyTorch's math backend written in numpy: S = scale q kᵀ, a bool mask's False (or a float
mask's -inf) removes a key, a float mask is added, softmax over the keys, a row with no key left gives 0
(PyTorch >= 2.5's _safe_softmax: output 0 and gradient 0, not NaN), then dropout's kept weights times 1/(1-p).
Dropout's mask comes from the numpy Philox of chapter 07 (test_dropout.uniform_reference): element
(b, h, i, j) of the (B, H, T, T) weights takes the uniform number of its flat index. Gradients are central
finite differences of the same function with the same fixed mask. Every call is checked to run the fused
kernels (grad_fn F.Attention), not the Tensor-operation fallback.
"""

import math

import numpy as np
import pytest

from gpt2_cupy import backend
from gpt2_cupy.autograd import Tensor
from gpt2_cupy.random import dropout_rng_state, manual_seed
from gpt2_cupy.nn import functional as F
from gpt2_cupy.ops.attention import attention_backward, attention_forward
from gpt2_cupy.ops.dropout import new_rng_state
from gpt2_cupy.testing import finite_difference_gradient, relative_error

from test_dropout import uniform_reference

FORWARD_TOLERANCE = 1e-5
BACKWARD_TOLERANCE = 1e-4   # float32 sums against an O(h²) central difference in float64


def reference(q, k, v, scale, mask=None, keep=None, p=0.0, causal=False):
    """PyTorch's math attention in float64; k, v may have fewer heads (grouped), repeated per query head."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    if k.ndim == 4 and k.shape[1] != q.shape[1]:
        k, v = (np.repeat(a, q.shape[1] // a.shape[1], axis=1) for a in (k, v))
    scores = q @ np.swapaxes(k, -1, -2) * scale
    if mask is not None:
        scores = np.where(mask, scores, -np.inf) if mask.dtype == bool else scores + mask
    if causal:
        T = q.shape[-2]
        scores = np.where(np.tril(np.ones((T, T), bool)), scores, -np.inf)
    nothing_visible = np.all(scores == -np.inf, axis=-1, keepdims=True)
    scores = np.where(nothing_visible, 0.0, scores)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights = np.where(nothing_visible, 0.0, weights / weights.sum(axis=-1, keepdims=True))
    if keep is not None:
        weights = weights * keep / (1.0 - p)
    return weights @ v


def dropout_keep(shape, p, seed, offset):
    """Which weights dropout keeps: Philox of (seed, offset, flat index into the weights' shape) >= p."""
    return uniform_reference(math.prod(shape), seed, offset).reshape(shape) >= np.float32(p)


def check_fused(function, reference_function, inputs, to_device, to_host, rng):
    """function(q, k, v Tensors) runs the fused kernels and matches reference_function(float64 q, k, v): the
    output and the gradients of q, k and v (central differences of the reference)."""
    tensors = [Tensor(to_device(a.astype(np.float32)), requires_grad=True) for a in inputs]
    out = function(*tensors)
    assert out.grad_fn.function is F.Attention, "the fused kernels did not run"
    expected = reference_function(*inputs)
    error = relative_error(to_host(out.data), expected)
    assert error < FORWARD_TOLERANCE, f"forward: relative error {error:.3g}"
    dout = rng.normal(size=expected.shape)
    out.backward(to_device(dout.astype(np.float32)))
    for name, tensor, array in zip("qkv", tensors, inputs):
        numeric = finite_difference_gradient(lambda: np.sum(dout * reference_function(*inputs)), array)
        error = relative_error(to_host(tensor.grad), numeric)
        assert error < BACKWARD_TOLERANCE, f"d{name}: relative error {error:.3g}"


def inputs(rng, B=2, H=3, T=19, d=8, key_heads=None):
    key_shape = (B, key_heads or H, T, d)
    return [rng.normal(size=(B, H, T, d)), rng.normal(size=key_shape), rng.normal(size=key_shape)]


# ---- the mask ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mask_shape", [(19, 19), (1, 1, 19, 19), (2, 1, 19, 19), (2, 3, 19, 19), (3, 1, 19)])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_mask_of_every_broadcast_shape(rng, to_device, to_host, mask_shape, kind):
    """A mask broadcast to (B, H, T, T) from each shape, read through strides; (3, 1, 19): every query of a
    head sees the same keys (the query axis broadcast). The diagonal stays visible: no row is empty here."""
    q, k, v = inputs(rng)
    keep = rng.random(mask_shape) < 0.6
    keep[..., np.arange(min(mask_shape[-2:])), np.arange(min(mask_shape[-2:]))] = True
    keep[..., 0] = True
    mask = keep if kind == "bool" else np.where(keep, rng.normal(size=mask_shape), -np.inf)
    device_mask = Tensor(to_device(mask if kind == "bool" else mask.astype(np.float32)))
    check_fused(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=device_mask),
                lambda q, k, v: reference(q, k, v, 1 / math.sqrt(8), mask), [q, k, v], to_device, to_host, rng)


def test_float_mask_of_finite_values_over_several_tiles(rng, to_device, to_host):
    """A float mask of finite values (an ALiBi-like bias), T = 70: two key tiles, the second partial."""
    q, k, v = inputs(rng, B=1, H=2, T=70, d=4)
    bias = -0.3 * np.abs(np.arange(70)[:, None] - np.arange(70)[None, :]) + rng.normal(size=(2, 1, 1))  # (H, T, T)
    device_bias = Tensor(to_device(bias.astype(np.float32)))
    tensors = [Tensor(to_device(a.astype(np.float32)), requires_grad=True) for a in (q, k, v)]
    out = F.scaled_dot_product_attention(*tensors, attn_mask=device_bias)
    assert out.grad_fn.function is F.Attention
    expected = reference(q, k, v, 0.5, bias.astype(np.float32).astype(np.float64))
    assert relative_error(to_host(out.data), expected) < FORWARD_TOLERANCE


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_a_row_with_every_key_masked_gives_zeros_as_pytorch(rng, to_device, to_host, kind):
    """PyTorch's math backend (>= 2.5, _safe_softmax) gives 0, not NaN, for a query with no key left, and a
    zero gradient through it; the fused kernels do the same, and so does the Tensor-operation fallback."""
    q, k, v = inputs(rng, B=1, H=2, T=9, d=8)
    keep = rng.random((9, 9)) < 0.7
    keep[:, 0] = True
    keep[4] = False                                    # query 4 sees nothing
    mask = keep if kind == "bool" else np.where(keep, 0.25, -np.inf)
    device_mask = Tensor(to_device(mask if kind == "bool" else mask.astype(np.float32)))
    attend = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=device_mask)  # noqa: E731
    check_fused(attend, lambda q, k, v: reference(q, k, v, 1 / math.sqrt(8), mask), [q, k, v], to_device, to_host,
                rng)
    tensors = [Tensor(to_device(a.astype(np.float32)), requires_grad=True) for a in (q, k, v)]
    out = attend(*tensors)
    out.sum().backward()
    assert np.all(to_host(out.data)[:, :, 4] == 0.0) and np.all(to_host(tensors[0].grad)[:, :, 4] == 0.0)
    fallback = F._attention_from_operations(*tensors, device_mask, 0.0, False, 1 / math.sqrt(8))
    assert relative_error(to_host(fallback.data), to_host(out.data)) < FORWARD_TOLERANCE


# ---- the scale --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("scale", [0.3, 2.0, 0.0, -0.7])
@pytest.mark.parametrize("is_causal", [False, True])
def test_any_scale(rng, to_device, to_host, scale, is_causal):
    """Any float: 0 gives uniform weights, a negative one reverses the order of the scores (the plain kernels'
    unscaled running maximum would be the wrong one there)."""
    q, k, v = inputs(rng, B=1, H=2, T=13, d=8)
    check_fused(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale),
                lambda q, k, v: reference(q, k, v, scale, causal=is_causal), [q, k, v], to_device, to_host, rng)


# ---- dropout ----------------------------------------------------------------------------------------------

def test_dropout_keeps_one_minus_p_of_the_weights_and_the_mask_is_philoxs(to_device, to_host):
    """q = k = 0 makes every weight 1/T, and v = the identity (d = T) makes out[b, h, i, j] = Z_ij / T: the
    kernel's whole dropout mask, read back. It must equal numpy's Philox mask element for element, and keep
    1 - p of the 4 x 128 x 128 = 65536 weights to within 5 standard deviations, sqrt(p (1 - p) / n) = 0.0018:
    p = 0.29 or 0.31 would already be 5.5 of them away, so a wrong p cannot pass, nor can chance fail it
    (5 sigma: 6e-7)."""
    B, H, T, p, seed, offset = 1, 4, 128, 0.3, 1234, 2**33 + 5
    q = k = to_device(np.zeros((B, H, T, T), np.float32))
    v = to_device(np.broadcast_to(np.eye(T, dtype=np.float32), (B, H, T, T)))
    out, _ = attention_forward(q, k, v, causal=False, dropout_p=p, rng_state=to_device(np.array([seed, offset],
                                                                                                 np.uint64)))
    kept = to_host(out) * T * np.float32(1 - p)
    assert np.all((np.abs(kept - 1) < 1e-5) | (kept == 0))
    kept = kept > 0.5
    assert np.array_equal(kept, dropout_keep((B, H, T, T), p, seed, offset))
    n = kept.size
    assert abs(kept.mean() - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n)


@pytest.mark.parametrize("is_causal", [False, True])
def test_dropout_forward_and_backward_with_the_regenerated_mask(rng, to_device, to_host, is_causal):
    """The forward against the float64 reference with numpy's Philox mask for the rng state the call used; the
    backward (which regenerates the mask from the saved state, after the global one moved on) against central
    differences of that same fixed-mask function."""
    q, k, v = inputs(rng, B=2, H=2, T=21, d=8)
    p = 0.25
    manual_seed(77)
    seed, offset = (int(x) for x in backend.asnumpy(dropout_rng_state()))
    keep = dropout_keep((2, 2, 21, 21), p, seed, offset)
    check_fused(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=is_causal),
                lambda q, k, v: reference(q, k, v, 1 / math.sqrt(8), keep=keep, p=p, causal=is_causal),
                [q, k, v], to_device, to_host, rng)
    assert int(backend.asnumpy(dropout_rng_state())[1]) == offset + 2 * 2 * 21 * 21   # one number per weight


def test_two_calls_draw_different_masks_and_the_same_state_the_same_mask(rng, to_device, to_host):
    q, k, v = (Tensor(to_device(a.astype(np.float32))) for a in inputs(rng, B=1, H=2, T=16, d=8))
    manual_seed(5)
    first = to_host(F.scaled_dot_product_attention(q, k, v, dropout_p=0.5).data)
    second = to_host(F.scaled_dot_product_attention(q, k, v, dropout_p=0.5).data)
    manual_seed(5)
    again = to_host(F.scaled_dot_product_attention(q, k, v, dropout_p=0.5).data)
    assert np.array_equal(first, again)
    assert relative_error(second, first) > 0.1
    # The fallback (weights written out, then F.dropout) draws the same numbers for the same elements.
    manual_seed(5)
    fallback = F._attention_from_operations(q, k, v, None, 0.5, False, 1 / math.sqrt(8))
    assert relative_error(to_host(fallback.data), first) < FORWARD_TOLERANCE


# ---- all of it together, grouped heads, other head sizes, the one-pass backward ---------------------------

@pytest.mark.parametrize("d", [3, 80, 200])
def test_mask_scale_and_dropout_with_grouped_heads(rng, to_device, to_host, d):
    """q with 4 heads, k and v with 2 (enable_gqa), head sizes 3 (a 32-wide tile, not a multiple of 4), 80
    (a 128-wide tile) and 200 (a 256-wide tile, whose backward runs 32 rows per block), a (B, 1, T, T) bool
    mask, scale 0.4 and dropout 0.2 at once. One sequence at d = 200: its finite differences are the slow part."""
    B, H, T, p = 1 if d > 128 else 2, 4, 11, 0.2
    q, k, v = inputs(rng, B=B, H=H, T=T, d=d, key_heads=2)
    mask = rng.random((B, 1, T, T)) < 0.6
    mask[..., 0] = True
    device_mask = Tensor(to_device(mask))
    manual_seed(3)
    seed, offset = (int(x) for x in backend.asnumpy(dropout_rng_state()))
    keep = dropout_keep((B, H, T, T), p, seed, offset)
    check_fused(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=device_mask, dropout_p=p,
                                                               scale=0.4, enable_gqa=True),
                lambda q, k, v: reference(q, k, v, 0.4, mask, keep, p), [q, k, v], to_device, to_host, rng)


def test_the_one_pass_backward_takes_the_options_too(rng, to_device, to_host):
    """deterministic=False (dq added with atomics) gives the gradients of the two-pass backward."""
    q, k, v, dout = (to_device(a.astype(np.float32)) for a in inputs(rng, B=1, H=2, T=70, d=8) + [
        rng.normal(size=(1, 2, 70, 8))])
    mask = to_device((rng.random((70, 70)) < 0.5) | np.eye(70, dtype=bool))
    options = dict(causal=False, scale=0.6, attn_mask=mask, dropout_p=0.3, rng_state=new_rng_state(9))
    out, lse = attention_forward(q, k, v, **options)
    two_pass = attention_backward(dout, q, k, v, out, lse, **options)
    one_pass = attention_backward(dout, q, k, v, out, lse, deterministic=False, **options)
    for name, a, b in zip("qkv", two_pass, one_pass):
        assert relative_error(to_host(b), to_host(a)) < FORWARD_TOLERANCE, name


# ---- errors -----------------------------------------------------------------------------------------------

def test_bad_masks_and_probabilities_are_refused(to_device):
    q = Tensor(to_device(np.zeros((1, 2, 5, 8), np.float32)))
    with pytest.raises(TypeError, match="Expected attn_mask dtype to be bool or float"):
        F.scaled_dot_product_attention(q, q, q, attn_mask=Tensor(to_device(np.ones((5, 5), np.int32))))
    with pytest.raises(ValueError, match=r"attn_mask of shape \(5, 4\) does not broadcast"):
        F.scaled_dot_product_attention(q, q, q, attn_mask=Tensor(to_device(np.ones((5, 4), bool))))
    with pytest.raises(ValueError, match=r"attn_mask of shape \(3, 1, 5, 5\) does not broadcast"):
        F.scaled_dot_product_attention(q, q, q, attn_mask=Tensor(to_device(np.ones((3, 1, 5, 5), bool))))
    with pytest.raises(ValueError, match="dropout_p = 1.5"):
        F.scaled_dot_product_attention(q, q, q, dropout_p=1.5)
    with pytest.raises(ValueError, match="scale, attn_mask and dropout_p are for the softmax variant"):
        attention_forward(q._data, q._data, q._data, variant="relu", scale=0.5)
    with pytest.raises(ValueError, match="rng_state"):
        attention_forward(q._data, q._data, q._data, dropout_p=0.1)
    with pytest.raises(TypeError, match="attn_mask must be bool .* or float32"):
        attention_forward(q._data, q._data, q._data, attn_mask=to_device(np.zeros((5, 5), np.float64)))


def test_rows_of_a_batch_draw_the_weights_of_their_place_in_it(rng, to_device, to_host):
    """A rank's rows under data parallelism: rows 1-2 of a batch of 3 with dropout_start at row 1's first weight
    drop the weights the whole batch drops there (numpy's Philox), and their gradients are the whole's rows."""
    q, k, v = inputs(rng, B=3, H=2, T=11, d=8)
    p, seed, offset = 0.3, 21, 8
    state = to_device(np.array([seed, offset], np.uint64))
    start = 1 * 2 * 11 * 11
    keep = dropout_keep((3, 2, 11, 11), p, seed, offset)[1:]
    part = [to_device(a[1:].astype(np.float32)) for a in (q, k, v)]
    out, lse = attention_forward(*part, causal=True, dropout_p=p, rng_state=state, dropout_start=start)
    expected = reference(q[1:], k[1:], v[1:], 1 / math.sqrt(8), keep=keep, p=p, causal=True)
    assert relative_error(to_host(out), expected) < FORWARD_TOLERANCE
    whole = [to_device(a.astype(np.float32)) for a in (q, k, v)]
    whole_out, whole_lse = attention_forward(*whole, causal=True, dropout_p=p, rng_state=state)
    dout = rng.normal(size=(3, 2, 11, 8)).astype(np.float32)
    whole_gradients = attention_backward(to_device(dout), *whole, whole_out, whole_lse, causal=True, dropout_p=p,
                                         rng_state=state)
    part_gradients = attention_backward(to_device(dout[1:]), *part, out, lse, causal=True, dropout_p=p,
                                        rng_state=state, dropout_start=start)
    for part_gradient, whole_gradient in zip(part_gradients, whole_gradients):
        np.testing.assert_allclose(to_host(part_gradient), to_host(whole_gradient)[1:], rtol=1e-5, atol=1e-6)
