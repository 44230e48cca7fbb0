"""Every F op (chapter 11): forward against float64 numpy, backward through the tape against finite differences.

For each op, out = F.op(inputs) runs on the active backend; out.backward(dout) pushes a random upstream
gradient through the tape, and each input's .grad is compared with the central finite-difference
gradient of L = Σ dout · reference(inputs), the float64 numpy reference, on tiny shapes (sizes not
multiples of anything).
"""

import math

import numpy as np
import pytest

from gpt2_cupy import backend, functional as F
from gpt2_cupy.autograd import Tensor
from gpt2_cupy.random import manual_seed
from gpt2_cupy.testing import finite_difference_gradient, relative_error
from tests import references
from tests.references import gelu as gelu_reference

FORWARD_TOLERANCE = 1e-5
BACKWARD_TOLERANCE = 1e-4   # float32 sums of a few terms against an O(h²) finite difference in float64


def check_op(function, reference, inputs, to_device, to_host, requires_grad=None, rng=None, forward=None):
    """function(*tensors) against reference(*float64 arrays): the output, then every input's gradient."""
    rng = rng or np.random.default_rng(7)
    requires_grad = requires_grad or [True] * len(inputs)
    tensors = [Tensor(to_device(a.astype(np.float32)), requires_grad=r) for a, r in zip(inputs, requires_grad)]
    out = function(*tensors)
    expected = reference(*inputs)
    assert relative_error(to_host(out._data), expected) < (forward or FORWARD_TOLERANCE)
    dout = rng.normal(size=expected.shape)
    out.backward(to_device(dout.astype(np.float32)).reshape(dout.shape))  # (to_device makes 0-d arrays 1-d)
    for index, (tensor, array) in enumerate(zip(tensors, inputs)):
        if not requires_grad[index]:
            continue
        numeric = finite_difference_gradient(lambda: np.sum(dout * reference(*inputs)), array)
        error = relative_error(to_host(tensor.grad), numeric)
        assert error < BACKWARD_TOLERANCE, f"input {index}: relative error {error:.3g}"


# ---- float64 references ----------------------------------------------------------------------------------


def softmax_reference(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def layer_norm_reference(x, weight, bias):
    return references.layer_norm(x, weight, bias)[0]


def attention_reference(q, k, v, causal=True):
    T, d = q.shape[-2:]
    scores = q @ np.swapaxes(k, -1, -2) / math.sqrt(d)
    if causal:
        scores = np.where(np.tril(np.ones((T, T), bool)), scores, -np.inf)
    return softmax_reference(scores) @ v


def cross_entropy_reference(logits, targets, ignore_index):
    kept = targets != ignore_index
    shifted = logits - logits.max(axis=-1, keepdims=True)
    log_probabilities = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    return -log_probabilities[kept, targets[kept]].mean()


# ---- the ops ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bias", [True, False])
def test_linear(bias, rng, to_device, to_host):
    inputs = [rng.normal(size=(3, 2, 5)), rng.normal(size=(7, 5))] + ([rng.normal(size=7)] if bias else [])
    check_op(lambda x, w, b=None: F.linear(x, w, b), lambda x, w, b=0.0: x @ w.T + b, inputs, to_device, to_host)


@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_gelu(approximate, rng, to_device, to_host):
    check_op(lambda x: F.gelu(x, approximate=approximate), lambda x: gelu_reference(x, approximate),
             [rng.normal(0.0, 2.0, size=(3, 37))], to_device, to_host)


def test_add(rng, to_device, to_host):
    check_op(lambda a, b: a + b, lambda a, b: a + b, [rng.normal(size=(2, 3, 5)), rng.normal(size=(2, 3, 5))],
             to_device, to_host)


def test_reshape_and_transpose(rng, to_device, to_host):
    check_op(lambda x: x.view(2, 3, 4, 5).transpose(1, 2).reshape(8, 15),
             lambda x: np.swapaxes(x.reshape(2, 3, 4, 5), 1, 2).reshape(8, 15),
             [rng.normal(size=(6, 20))], to_device, to_host)


def test_split_sends_each_piece_its_gradient(rng, to_device, to_host):
    # The second piece is unused: its part of the gradient is zero.
    check_op(lambda x: (lambda q, k, v: q + v)(*x.split(4, dim=2)),
             lambda x: x[..., 0:4] + x[..., 8:12], [rng.normal(size=(2, 3, 12))], to_device, to_host)


def test_split_gives_views_and_in_place_writes_reach_x(rng, to_device, to_host):
    """As PyTorch's: the pieces share x's memory; a piece changed in place changes x, and the gradient of the
    graph's input follows the write (the doubled piece's part of it doubles)."""
    values = rng.normal(size=(3, 6))
    source = Tensor(to_device(values.astype(np.float32)), requires_grad=True)
    x = source * 1.0
    first, second = x.split(3, dim=1)
    assert first._data.base is not None and not first.is_contiguous()
    first.mul_(2.0)
    expected = values.copy()
    expected[:, :3] *= 2
    np.testing.assert_allclose(to_host(x._data), expected, rtol=1e-6)
    weights = rng.normal(size=(3, 6))
    (x * Tensor(to_device(weights.astype(np.float32)))).sum().backward()
    expected_grad = weights.copy()
    expected_grad[:, :3] *= 2
    np.testing.assert_allclose(to_host(source.grad), expected_grad, rtol=1e-6)


def test_split_hands_on_gradients_that_already_lie_side_by_side(to_device):
    """Gradients that are the pieces of one array of x's shape are that array, joined without a copy; others
    are concatenated."""
    from gpt2_cupy.autograd import Context
    from gpt2_cupy.nn.functional import Split
    x = to_device(np.arange(24, dtype=np.float32).reshape(2, 12))
    keys = tuple((slice(None), slice(start, start + 4)) for start in (0, 4, 8))
    ctx = Context([])
    Split.forward(ctx, x, keys)
    gradient = to_device(np.ones((2, 12), np.float32))
    joined, _ = Split.backward(ctx, *(gradient[key] for key in keys))
    assert joined is gradient
    separate = [to_device(np.full((2, 4), i, np.float32)) for i in range(3)]
    joined, _ = Split.backward(ctx, *separate)
    assert joined is not gradient and np.array_equal(np.asarray(backend.asnumpy(joined)),
                                                     np.repeat(np.arange(3.0), 4)[None].repeat(2, 0))


def test_gradients_of_heads_with_a_single_key_head_lie_side_by_side(to_device):
    """q (2 heads) and k, v (1 head each) cut from one (B, T, 4 d) array: k's and v's head axis has size 1, whose
    stride numpy and CuPy choose differently and which means nothing. Their gradient buffers are still views of
    one new array, at the places q, k and v have in theirs."""
    from gpt2_cupy.ops.arrays import empty_like_views, storage_of
    B, T, d = 2, 5, 8
    packed = to_device(np.zeros((B, T, 4 * d), np.float32))
    q = packed[..., :2 * d].reshape(B, T, 2, d).swapaxes(1, 2)
    k, v = (packed[..., start:start + d].reshape(B, T, 1, d).swapaxes(1, 2) for start in (2 * d, 3 * d))
    if isinstance(k, np.ndarray):                     # give the size-1 axis a stride of its own, as CuPy may
        k = np.ndarray(k.shape, k.dtype, buffer=packed, offset=2 * d * 4, strides=(k.strides[0], 12345 * 4,
                                                                                  *k.strides[2:]))
    dq, dk, dv = empty_like_views(q, k, v)
    assert storage_of(dq) is storage_of(dk) is storage_of(dv) and storage_of(dq).shape == (B, T, 4 * d)
    offsets = [(backend.address(g) - backend.address(storage_of(g))) // 4 for g in (dq, dk, dv)]
    assert offsets == [0, 2 * d, 3 * d]


def test_softmax(rng, to_device, to_host):
    check_op(lambda x: F.softmax(x, dim=-1), softmax_reference, [rng.normal(size=(2, 3, 33))], to_device, to_host)


@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm(bias, rng, to_device, to_host):
    inputs = [rng.normal(size=(2, 3, 19)), rng.normal(size=19)] + ([rng.normal(size=19)] if bias else [])
    check_op(lambda x, w, b=None: F.layer_norm(x, (19,), w, b),
             lambda x, w, b=0.0: layer_norm_reference(x, w, b), inputs, to_device, to_host)


def test_dyt(rng, to_device, to_host):
    inputs = [rng.normal(size=(2, 3, 19)), np.array([0.7]), rng.normal(size=19), rng.normal(size=19)]
    check_op(F.dyt, lambda x, alpha, w, b: w * np.tanh(alpha * x) + b, inputs, to_device, to_host)


def test_embedding(rng, to_device, to_host):
    ids = rng.integers(0, 7, size=(2, 5))
    ids[0, :3] = 4  # a row used several times: its gradient is summed
    check_op(lambda w: F.embedding(to_device(ids), w), lambda w: w[ids], [rng.normal(size=(7, 4))],
             to_device, to_host)


def test_scaled_dot_product_attention(rng, to_device, to_host):
    q, k, v = (rng.normal(size=(1, 2, 5, 32)) for _ in range(3))  # head sizes: 32 or 64
    check_op(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), attention_reference,
             [q, k, v], to_device, to_host)


def test_relu_attention(rng, to_device, to_host):
    q, k, v = (rng.normal(size=(1, 2, 5, 32)) for _ in range(3))

    def reference(q, k, v):
        scores = q @ np.swapaxes(k, -1, -2) / math.sqrt(32)
        return np.where(np.tril(np.ones((5, 5), bool)), np.maximum(scores, 0.0), 0.0) @ v

    check_op(lambda q, k, v: F.relu_attention(q, k, v, is_causal=True), reference, [q, k, v], to_device, to_host)


def test_cross_entropy(rng, to_device, to_host):
    targets = rng.integers(0, 11, size=6)
    targets[2] = -1
    check_op(lambda logits: F.cross_entropy(logits, to_device(targets), ignore_index=-1),
             lambda logits: cross_entropy_reference(logits, targets, -1), [rng.normal(size=(6, 11))],
             to_device, to_host)


def row_cross_entropy_reference(logits, targets, ignore_index):
    """Each row's loss, 0 where the target is ignored: PyTorch's reduction="none"."""
    shifted = logits - logits.max(axis=-1, keepdims=True)
    log_probabilities = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    kept = targets != ignore_index
    return np.where(kept, -log_probabilities[np.arange(len(targets)), np.where(kept, targets, 0)], 0.0)


@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_cross_entropy_reductions(reduction, rng, to_device, to_host):
    targets = rng.integers(0, 11, size=7)
    targets[3] = -100
    reduce = np.sum if reduction == "sum" else (lambda rows: rows)
    check_op(lambda logits: F.cross_entropy(logits, to_device(targets), reduction=reduction),
             lambda logits: reduce(row_cross_entropy_reference(logits, targets, -100)), [rng.normal(size=(7, 11))],
             to_device, to_host)


def test_cross_entropy_refuses_a_target_out_of_range(rng, to_device):
    logits = Tensor(to_device(rng.normal(size=(4, 11)).astype(np.float32)), requires_grad=True)
    for bad in (11, -2):
        targets = np.array([1, bad, 3, -1])
        with pytest.raises(IndexError, match=rf"cross_entropy: Target {bad} is out of bounds: target\[1\]"):
            F.cross_entropy(logits, to_device(targets), ignore_index=-1).item()  # raised at the read
    with pytest.raises(ValueError, match="cross_entropy: reduction='average' is not a valid value"):
        F.cross_entropy(logits, to_device(np.zeros(4, np.int64)), reduction="average")
    with pytest.raises(ValueError, match=r"cross_entropy: input must be \(N, C\).*got input \(4, 11\) and target \(3,\)"):
        F.cross_entropy(logits, to_device(np.zeros(3, np.int64)))


def test_gelu_is_exact_by_default_as_in_pytorch(rng, to_device, to_host):
    x64 = rng.normal(size=(3, 37)) * 3
    x = Tensor(to_device(x64.astype(np.float32)))
    assert relative_error(to_host(F.gelu(x)._data), gelu_reference(x64, "none")) < FORWARD_TOLERANCE
    # The tanh form differs from the exact one by up to ~5e-4 on this range: a check that could tell them apart.
    assert np.abs(gelu_reference(x64, "tanh") - gelu_reference(x64, "none")).max() > 1e-4
    with pytest.raises(ValueError, match="gelu: approximate='erf'"):
        F.gelu(x, approximate="erf")


def test_scaled_dot_product_attention_is_not_causal_by_default(rng, to_device, to_host):
    q, k, v = (rng.normal(size=(1, 2, 5, 32)) for _ in range(3))
    check_op(F.scaled_dot_product_attention, lambda q, k, v: attention_reference(q, k, v, causal=False),
             [q, k, v], to_device, to_host)
    tensors = [Tensor(to_device(a.astype(np.float32))) for a in (q, k, v)]
    same_scale = F.scaled_dot_product_attention(*tensors, is_causal=True, scale=1 / math.sqrt(32))
    assert relative_error(to_host(same_scale._data), attention_reference(q, k, v)) < FORWARD_TOLERANCE
    with pytest.raises(RuntimeError, match="Explicit attn_mask should not be set when is_causal=True"):
        F.scaled_dot_product_attention(*tensors, attn_mask=Tensor(to_device(np.ones((5, 5), bool))), is_causal=True)


def masked_attention_reference(q, k, v, mask, scale):
    """PyTorch's math path in float64: a bool mask keeps where True, a float mask is added to the scores."""
    scores = q @ np.swapaxes(k, -1, -2) * scale
    scores = np.where(mask, scores, -np.inf) if mask.dtype == bool else scores + mask
    return softmax_reference(scores) @ v


@pytest.mark.parametrize("head_size", [16, 32])
@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_scaled_dot_product_attention_with_a_mask_and_a_scale(rng, to_device, to_host, head_size, mask_kind):
    """What the fused kernels do not take runs PyTorch's math path: a mask broadcast over (B, H), another
    scale, another head size; the gradients of q, k and v against float64 central differences."""
    q, k, v = (rng.normal(size=(2, 2, 5, head_size)) for _ in range(3))
    mask = rng.random((1, 1, 5, 5)) < 0.7
    mask[..., 0] = True  # every query sees a key: no row of the softmax is empty
    if mask_kind == "float":
        mask = np.where(mask, rng.normal(size=mask.shape), -np.inf)
    device_mask = Tensor(to_device(mask if mask_kind == "bool" else mask.astype(np.float32)))
    check_op(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=device_mask, scale=0.3),
             lambda q, k, v: masked_attention_reference(q, k, v, mask, 0.3), [q, k, v], to_device, to_host)


@pytest.mark.parametrize("is_causal", [False, True])
def test_scaled_dot_product_attention_of_any_head_size(rng, to_device, to_host, is_causal):
    q, k, v = (rng.normal(size=(1, 2, 6, 24)) for _ in range(3))
    check_op(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=is_causal),
             lambda q, k, v: attention_reference(q, k, v, causal=is_causal), [q, k, v], to_device, to_host)


def test_scaled_dot_product_attention_dropout_drops_weights_as_f_dropout_does(rng, to_device):
    """dropout_p > 0 is F.dropout on the attention weights, drawn from the same generator."""
    q, k, v = (Tensor(to_device(rng.normal(size=(1, 2, 8, 32)).astype(np.float32))) for _ in range(3))
    manual_seed(11)
    dropped = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    manual_seed(11)
    weights = F.softmax((q @ k.transpose(-2, -1)) * (1 / math.sqrt(32)), dim=-1)
    expected = F.dropout(weights, 0.5) @ v
    assert relative_error(backend.asnumpy(dropped._data), backend.asnumpy(expected._data)) < FORWARD_TOLERANCE
    undropped = F.scaled_dot_product_attention(q, k, v)
    assert not np.allclose(backend.asnumpy(dropped._data), backend.asnumpy(undropped._data))


def test_dropout_scales_kept_elements_and_the_backward_uses_the_same_mask(rng, to_device, to_host):
    p = 0.25
    manual_seed(1234)
    x64 = rng.uniform(1.0, 2.0, size=(4, 1000))   # never zero: zeros in y mark dropped elements
    x = Tensor(to_device(x64.astype(np.float32)), requires_grad=True)
    y = F.dropout(x, p=p, training=True)
    y_host = to_host(y._data)
    kept = y_host != 0
    assert relative_error(y_host[kept], x64[kept] / (1 - p)) < FORWARD_TOLERANCE
    assert abs((~kept).mean() - p) < 0.03           # 4000 draws: the dropped fraction is near p
    dout = rng.normal(size=x64.shape)
    y.backward(to_device(dout.astype(np.float32)))
    assert relative_error(to_host(x.grad), dout * kept / (1 - p)) < FORWARD_TOLERANCE
    manual_seed(1234)                               # the same seed gives the same mask
    again = to_host(F.dropout(Tensor(to_device(x64.astype(np.float32))), p=p)._data)
    assert np.array_equal(again != 0, kept)
    assert F.dropout(x, p=p, training=False) is x   # evaluation: the identity


# ---- bad input -------------------------------------------------------------------------------------------

def test_bad_input_names_the_op_and_the_argument(rng, to_device):
    x = Tensor(to_device(rng.normal(size=(2, 3)).astype(np.float32)))
    with pytest.raises(ValueError, match="add"):
        x + Tensor(to_device(np.zeros((3, 2), np.float32)))
    with pytest.raises(IndexError, match="softmax: Dimension out of range"):
        F.softmax(x, dim=2)
    with pytest.raises(ValueError, match="layer_norm: normalized_shape"):
        F.layer_norm(x, (2,), x, x)
    with pytest.raises(ValueError, match="dropout: p"):
        F.dropout(x, p=1.0)
    with pytest.raises(TypeError, match="embedding: idx"):
        F.embedding(to_device(np.zeros(3, np.float32)), x)
    with pytest.raises(TypeError, match="linear_forward: weight"):
        F.linear(x, Tensor(to_device(np.zeros((3, 3), np.float64))))
