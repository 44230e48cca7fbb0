"""bf16 storage and autocast: every op of GPT-2 in bf16 against float64, and the model against itself in float32.

The references are float64 numpy computed from the same bf16-rounded inputs, so that what is measured is
what the op adds: its float32 arithmetic and the one rounding of its result to bf16. bf16 keeps 8
significant bits: rounding to nearest moves a value by at most 2⁻⁸ of itself (BF16_ROUNDING). A bound
`within_one_rounding(got, reference, float32_error)` says: |got - reference| ≤ 2⁻⁸ |reference| plus the
float32 arithmetic's own error (itself carried through the rounding).
"""

import math

import ml_dtypes
import numpy as np
import pytest

import gpt2_cupy as torch
from gpt2_cupy import amp, backend
from gpt2_cupy.model import GPT, GPTConfig
from gpt2_cupy.nn import functional as F
from gpt2_cupy.testing import FLOAT32_UNIT_ROUNDOFF, summation_bound

BF16 = np.dtype(ml_dtypes.bfloat16)
BF16_ROUNDING = 2.0 ** -8      # bf16's unit roundoff: half of its last place, 8 significant bits
TENSOR_CORE_ADDITION = 2.0 ** -23  # a tensor core's float32 sum cuts the addends' bits below the largest: 1 ulp


def bf16_inputs(rng, *shape, scale=1.0):
    """A float32 array of random values that are exactly bf16 numbers (the bf16 op's inputs, and the
    reference's)."""
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(BF16).astype(np.float32)


def within_one_rounding(got, reference, float32_error=0.0):
    """got (bf16) is reference rounded once to bf16, give or take the float32 arithmetic before the rounding."""
    got64 = np.asarray(backend.asnumpy(got), dtype=np.float64)
    error = np.abs(got64 - reference)
    bound = BF16_ROUNDING * (np.abs(reference) + float32_error) + float32_error
    worst = error.argmax()
    assert np.all(error <= bound), (f"largest error {error.max():.3g} at {np.unravel_index(worst, error.shape)}, "
                                    f"bound there {np.broadcast_to(bound, error.shape).ravel()[worst]:.3g}")


def tensor(array, dtype=BF16, requires_grad=False):
    return torch.Tensor(backend.xp.asarray(np.asarray(array).astype(dtype)), requires_grad=requires_grad)


def host(t):
    backend.synchronize()
    return backend.asnumpy(t._data if isinstance(t, torch.Tensor) else t)


# ---- the dtype and conversions ------------------------------------------------------------------------------

def test_bfloat16_is_ml_dtypes_bfloat16_with_torch_names():
    assert torch.bfloat16 is np.dtype(ml_dtypes.bfloat16)
    x = torch.tensor([1.0, 2.5, -3.0])
    y = x.to(torch.bfloat16)
    assert y.dtype == torch.bfloat16 and x.bfloat16().dtype == torch.bfloat16 and y.float().dtype == np.float32
    assert y.to("bfloat16") is y and x.to(torch.float32) is x
    assert "dtype=torch.bfloat16" in repr(y) and "dtype" not in repr(x)
    for made in (torch.zeros(2, 3, dtype=torch.bfloat16), torch.ones(2, 3, dtype=torch.bfloat16),
                 torch.empty(2, 3, dtype=torch.bfloat16), torch.full((2, 3), 1.5, dtype=torch.bfloat16),
                 torch.tensor([[1.0, 2.0, 3.0]] * 2, dtype=torch.bfloat16)):
        assert made.dtype == torch.bfloat16 and made.shape == (2, 3)
    assert host(torch.full((2,), 1.5, dtype=torch.bfloat16)).tolist() == [1.5, 1.5]
    assert torch.tensor([1 / 3], dtype=torch.bfloat16).item() == float(np.float32(1 / 3).astype(BF16))
    with pytest.raises(NotImplementedError, match="float16"):
        x.to(torch.float16)


def test_every_bf16_widens_exactly_into_a_new_array_into_out_from_a_view_and_at_graph_replays():
    """converted(x, float32): each bf16's 16 bits followed by 16 zero bits (a NaN stays a NaN), as a new array,
    into out=, from a transposed view, and under a CUDA graph: recorded at capture, run at each replay."""
    from gpt2_cupy.elementwise import converted

    xp = backend.xp
    bits = np.arange(65536, dtype=np.uint32)
    expected = (bits << 16).view(np.float32)

    def bf16_array(selected_bits):
        return xp.asarray(selected_bits.astype(np.uint16).view(BF16))

    def assert_same_floats(got, want):
        got = backend.asnumpy(got)
        assert got.dtype == np.float32 and got.shape == want.shape
        nan = np.isnan(want)
        np.testing.assert_array_equal(np.isnan(got), nan)
        np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))

    x = bf16_array(bits)
    assert_same_floats(converted(x, np.float32), expected)
    out = xp.zeros(65536, dtype=np.float32)
    assert converted(x, np.float32, out=out) is out
    assert_same_floats(out, expected)
    assert_same_floats(converted(x.reshape(256, 256).T, np.float32), expected.reshape(256, 256).T)

    source, out = bf16_array(bits[:1024]), xp.zeros(1024, dtype=np.float32)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        converted(source, np.float32, out=out)
    assert not backend.asnumpy(out).any()   # recorded, not run
    for start in (0, 16000, 64512):
        backend.copy_into(source, bf16_array(bits[start:start + 1024]))
        g.replay()
        assert_same_floats(out, expected[start:start + 1024])


def test_to_bfloat16_rounds_as_ml_dtypes_and_converts_back_exactly(rng):
    """float32 -> bf16 rounds to nearest, ties to even, bit for bit as ml_dtypes does (the GPU's
    __float2bfloat16_rn); infinities and overflow to infinity kept; NaN stays NaN (its payload bits may
    differ: the GPU writes the canonical NaN). bf16 -> float32 is exact."""
    special = np.array([1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, -(1 + 2.0 ** -8), 3.3961e38, 3.4e38, -3.4e38, np.inf,
                        -np.inf, 0.0, -0.0, 1e-40, -2.0 ** -130, 2.0 ** -126], dtype=np.float32)
    spread = rng.standard_normal(2000) * 10.0 ** rng.integers(-38, 38, 2000)
    values = np.concatenate([special, spread.astype(np.float32), [np.nan]]).astype(np.float32)
    with np.errstate(over="ignore"):
        expected = values.astype(BF16)
    got = host(torch.Tensor(backend.xp.asarray(values)).to(torch.bfloat16))
    assert got.dtype == BF16
    finite_or_infinite = ~np.isnan(values)
    np.testing.assert_array_equal(got.view(np.uint16)[finite_or_infinite], expected.view(np.uint16)[finite_or_infinite])
    assert np.isnan(got[-1].astype(np.float32))
    assert list(got.view(np.uint16)[:3]) == [0x3F80, 0x3F82, 0xBF80]   # ties go to the even neighbour
    back = host(torch.Tensor(backend.xp.asarray(got)).float())
    np.testing.assert_array_equal(back.view(np.uint32)[finite_or_infinite],
                                  got.astype(np.float32).view(np.uint32)[finite_or_infinite])


def test_to_is_differentiable_and_the_gradient_converts_back(rng):
    x = torch.Tensor(backend.xp.asarray(rng.standard_normal((3, 5)).astype(np.float32)), requires_grad=True)
    dout = bf16_inputs(rng, 3, 5)
    y = x.to(torch.bfloat16)
    y.backward(tensor(dout))
    assert x.grad.dtype == np.float32
    np.testing.assert_array_equal(host(x.grad), dout)   # bf16 values are float32 values: exact


# ---- generated kernels: elementwise, reductions, views -----------------------------------------------------------

def test_elementwise_in_bf16_rounds_once_and_follows_pytorch_promotion(rng):
    a, b = bf16_inputs(rng, 4, 1, 6), bf16_inputs(rng, 5, 6)
    ta, tb = tensor(a), tensor(b)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    # one float32 operation, exact or within 2^-24 of the exact result, then one rounding to bf16
    within_one_rounding((ta * tb)._data, a64 * b64)
    within_one_rounding((ta + tb)._data, a64 + b64, FLOAT32_UNIT_ROUNDOFF * np.abs(a64 + b64))
    denominator = tb.abs() + 1                                          # itself bf16: |b| + 1 rounded once
    assert host(denominator).tobytes() == (np.abs(b64) + 1).astype(BF16).tobytes()
    quotient = a64 / host(denominator).astype(np.float64)
    within_one_rounding((ta / denominator)._data, quotient, FLOAT32_UNIT_ROUNDOFF * np.abs(quotient))
    within_one_rounding((ta * 0.1)._data, a64 * np.float32(0.1), FLOAT32_UNIT_ROUNDOFF * np.abs(a64))  # 0.1 in float32
    within_one_rounding(ta.exp()._data, np.exp(a64), 4 * FLOAT32_UNIT_ROUNDOFF * np.exp(a64))           # expf: 2 ulp
    assert (ta * tb).dtype == BF16 and (ta * 2.5).dtype == BF16 and (2 - ta).dtype == BF16
    assert (ta + tensor(b, np.float32)).dtype == np.float32           # bf16 with float32: float32, as PyTorch
    assert (ta > 0).dtype == np.bool_
    np.testing.assert_array_equal(host(ta > 0), a > 0)
    assert torch.equal(ta.T.contiguous().T.contiguous(), ta)          # views and copies move bits exactly
    np.testing.assert_array_equal(host(torch.cat([ta, ta], dim=1)).astype(np.float32), np.concatenate([a, a], 1))


def test_gradients_of_bf16_elementwise_ops_are_bf16(rng):
    a = tensor(bf16_inputs(rng, 4, 6), requires_grad=True)
    b = tensor(bf16_inputs(rng, 6), np.float32, requires_grad=True)
    ((a * b).sum() + (a * a).mean()).backward()
    assert a.grad.dtype == BF16 and b.grad.dtype == np.float32         # each gradient in its tensor's dtype
    a64, b64 = host(a).astype(np.float64), host(b).astype(np.float64)
    expected_a = b64 + 2 * a64 / a64.size
    assert np.all(np.abs(host(a.grad).astype(np.float64) - expected_a) <= 3 * BF16_ROUNDING * np.abs(expected_a) + 1e-6)
    np.testing.assert_allclose(host(b.grad), a64.sum(0), rtol=3 * BF16_ROUNDING, atol=1e-6)


@pytest.mark.parametrize("dims", [(1,), (2,), (0,), (0, 2), None])
def test_reductions_of_bf16_sum_in_float32_and_round_once(rng, dims):
    x = bf16_inputs(rng, 5, 300, 7)
    t = tensor(x)
    x64 = x.astype(np.float64)
    axes = tuple(range(3)) if dims is None else dims
    total = t.sum(dims) if dims is not None else t.sum()
    assert total.dtype == BF16
    count = math.prod(x.shape[d] for d in axes)
    # a float32 sum in any order, then one rounding (a bf16 running sum would be off by ~2^-8 per addition)
    float32_error = count * FLOAT32_UNIT_ROUNDOFF * np.abs(x64).sum(axis=axes)
    within_one_rounding(total._data, x64.sum(axis=axes), float32_error)
    within_one_rounding(t.mean(dims)._data, x64.mean(axis=axes), 2 * float32_error / count)
    values, indices = t.max(dim=1)
    assert values.dtype == BF16
    np.testing.assert_array_equal(host(values).astype(np.float32), x.max(axis=1))
    np.testing.assert_array_equal(host(indices), x.argmax(axis=1))


# ---- the ops of GPT-2 ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["wgmma and mma.sync", "mma.sync", "float32 kernel for small products"])
def test_linear_in_bf16_on_tensor_cores(rng, monkeypatch, path):
    """y = x Wᵀ + b: exact bf16 products summed in float32 on tensor cores (1 ulp per addition), the float32
    bias added, one rounding to bf16. dx likewise; dW and db summed in float32 and kept in float32. On an
    H100 or H200 (and the executor) all three take wgmma; elsewhere all three mma.sync. Products
    below SMALL_PRODUCT multiply-adds run on the float32 kernel instead, within the same bound."""
    from gpt2_cupy import dispatch

    monkeypatch.setattr(dispatch, "SMALL_PRODUCT", 1 << 40 if path.startswith("float32") else 0)
    if path == "mma.sync":
        monkeypatch.setattr(backend, "runs_wgmma", lambda: False)
    elif path.startswith("wgmma") and not backend.runs_wgmma():
        pytest.skip("this GPU has no wgmma (compute capability 9.0 only)")
    N, C_in, C_out = 12, 40, 24
    x, w, b = bf16_inputs(rng, 2, 6, C_in), bf16_inputs(rng, C_out, C_in, scale=0.2), rng.standard_normal(C_out)
    dout = bf16_inputs(rng, 2, 6, C_out)
    tx, tw = tensor(x, requires_grad=True), tensor(w, requires_grad=True)
    tb = torch.Tensor(backend.xp.asarray(b.astype(np.float32)), requires_grad=True)
    y = F.linear(tx, tw, tb)
    assert y.dtype == BF16
    x64, w64, d64 = (v.astype(np.float64).reshape(-1, v.shape[-1]) for v in (x, w, dout))
    b64 = b.astype(np.float32).astype(np.float64)
    products = (C_in + 2) * TENSOR_CORE_ADDITION * (np.abs(x64) @ np.abs(w64).T + np.abs(b64))
    within_one_rounding(host(y).reshape(N, C_out), x64 @ w64.T + b64, products)
    y.backward(tensor(dout))
    assert tx.grad.dtype == BF16 and tw.grad.dtype == BF16 and tb.grad.dtype == np.float32
    within_one_rounding(host(tx.grad).reshape(N, C_in), d64 @ w64,
                        (C_out + 1) * TENSOR_CORE_ADDITION * np.abs(d64) @ np.abs(w64))
    # the weight's gradient: float32 sums (N terms), rounded once to bf16 because this weight is bf16
    within_one_rounding(tw.grad, d64.T @ x64, (N + 1) * TENSOR_CORE_ADDITION * np.abs(d64).T @ np.abs(x64))
    assert np.all(np.abs(host(tb.grad) - d64.sum(0)) <= summation_bound(d64))


def test_layernorm_gelu_dropout_in_bf16(rng):
    """bf16 in, bf16 out, float32 statistics and parameter gradients; each output rounded once."""
    B, T, C = 2, 3, 40
    x = (bf16_inputs(rng, B, T, C, scale=2.0) + 1).astype(BF16).astype(np.float32)
    weight = rng.standard_normal(C).astype(np.float32)
    bias = rng.standard_normal(C).astype(np.float32)
    tx = tensor(x, requires_grad=True)
    tw, tb = (torch.Tensor(backend.xp.asarray(v), requires_grad=True) for v in (weight, bias))
    y = F.layer_norm(tx, (C,), tw, tb)
    assert y.dtype == BF16
    x64 = x.astype(np.float64)
    mean, var = x64.mean(-1, keepdims=True), x64.var(-1, keepdims=True)
    x_hat = (x64 - mean) / np.sqrt(var + 1e-5)
    reference = x_hat * weight + bias
    # float32 mean and variance of C values (C ulps each), then three float32 operations: within 1e-5 of the
    # row's scale |x_hat w| + |b|
    within_one_rounding(y._data, reference, 1e-5 * (np.abs(x_hat * weight) + np.abs(bias)))
    dout = bf16_inputs(rng, B, T, C)
    y.backward(tensor(dout))
    g = dout * weight
    dx = (g - g.mean(-1, keepdims=True) - x_hat * (g * x_hat).mean(-1, keepdims=True)) / np.sqrt(var + 1e-5)
    assert tx.grad.dtype == BF16 and tw.grad.dtype == np.float32 and tb.grad.dtype == np.float32
    within_one_rounding(tx.grad, dx, 1e-5 * np.abs(g).max() / np.sqrt(var + 1e-5))
    np.testing.assert_allclose(host(tw.grad), (dout * x_hat).sum((0, 1)), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(host(tb.grad), dout.astype(np.float64).sum((0, 1)), rtol=1e-6, atol=1e-6)

    # GELU (tanh): float32's tanhf and arithmetic within 1e-5 relative (plus 1e-7 near zero), then one rounding
    z = bf16_inputs(rng, 5, 37, scale=3.0)
    z64 = z.astype(np.float64)
    gelu = 0.5 * z64 * (1 + np.tanh(math.sqrt(2 / math.pi) * (z64 + 0.044715 * z64 ** 3)))
    within_one_rounding(F.gelu(tensor(z), approximate="tanh")._data, gelu, 1e-5 * np.abs(gelu) + 1e-7)
    exact = 0.5 * z64 * (1 + np.vectorize(math.erf)(z64 / math.sqrt(2)))
    within_one_rounding(F.gelu(tensor(z))._data, exact, 1e-5 * np.abs(exact) + 1e-7)

    # dropout: the float32 op's mask (the same Philox numbers), each kept value scaled and rounded once
    torch.manual_seed(3)
    kept32 = host(F.dropout(tensor(z, np.float32), 0.25))
    torch.manual_seed(3)
    kept16 = F.dropout(tensor(z), 0.25)
    assert kept16.dtype == BF16
    np.testing.assert_array_equal(host(kept16).view(np.uint16), kept32.astype(BF16).view(np.uint16))


def test_embedding_under_autocast_gives_bf16_rows_and_float32_gradients(rng):
    table = rng.standard_normal((50, 16)).astype(np.float32)
    weight = torch.nn.Parameter(backend.xp.asarray(table))
    ids = backend.xp.asarray(rng.integers(0, 50, (3, 9)))
    with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
        rows = F.embedding(ids, weight)
    assert rows.dtype == BF16
    ids_host = backend.asnumpy(ids)
    np.testing.assert_array_equal(host(rows).view(np.uint16), table[ids_host].astype(BF16).view(np.uint16))
    dout = bf16_inputs(rng, 3, 9, 16)
    rows.backward(tensor(dout))
    expected = np.zeros((50, 16))
    np.add.at(expected, ids_host.reshape(-1), dout.reshape(-1, 16).astype(np.float64))
    assert weight.grad.dtype == np.float32
    assert np.all(np.abs(host(weight.grad) - expected) <= 27 * FLOAT32_UNIT_ROUNDOFF * np.abs(expected) + 1e-7)
    assert F.embedding(ids, weight).dtype == np.float32                     # outside the block: the table's dtype


def test_cross_entropy_of_bf16_logits_is_float32(rng):
    """log-sum-exp and loss in float32 from exact bf16 logits (within 1e-5 relative); the gradient bf16,
    (softmax - onehot) / count rounded once."""
    N, V = 20, 77
    logits = bf16_inputs(rng, N, V, scale=3.0)
    targets = rng.integers(0, V, N)
    targets[3] = -1
    t = tensor(logits, requires_grad=True)
    loss = F.cross_entropy(t, backend.xp.asarray(targets), ignore_index=-1)
    assert loss.dtype == np.float32
    x = logits.astype(np.float64)
    lse = np.log(np.exp(x - x.max(1, keepdims=True)).sum(1)) + x.max(1)
    counted = targets != -1
    reference = (lse - x[np.arange(N), np.where(counted, targets, 0)])[counted].mean()
    assert abs(loss.item() - reference) <= 1e-5 * abs(reference)
    loss.backward()
    probabilities = np.exp(x - lse[:, None])
    probabilities[np.arange(N)[counted], targets[counted]] -= 1
    gradient = np.where(counted[:, None], probabilities / counted.sum(), 0.0)
    assert t.grad.dtype == BF16
    within_one_rounding(t.grad, gradient, 1e-6 / counted.sum())
    none = F.cross_entropy(t.detach(), backend.xp.asarray(targets), ignore_index=-1, reduction="none")
    assert none.dtype == np.float32
    np.testing.assert_allclose(host(none)[counted], (lse - x[np.arange(N), np.where(counted, targets, 0)])[counted],
                               rtol=1e-5)


@pytest.mark.parametrize("head_size, causal", [(32, True), (16, False)])
def test_attention_and_softmax_take_bf16_through_float32_kernels(rng, head_size, causal):
    """bf16 q, k, v converted exactly, attended in float32 (chapter 08's kernels, or the math path for
    head sizes they do not take), the output rounded once; the gradients bf16."""
    B, H, T = 1, 2, 7
    q, k, v = (bf16_inputs(rng, B, H, T, head_size) for _ in range(3))
    tq, tk, tv = (tensor(a, requires_grad=True) for a in (q, k, v))
    out = F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
    assert out.dtype == BF16
    scores = q.astype(np.float64) @ k.astype(np.float64).transpose(0, 1, 3, 2) / math.sqrt(head_size)
    if causal:
        scores = np.where(np.tril(np.ones((T, T), bool)), scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    # float32 attention is within 1e-5 of float64 on these sizes (chapter 08); then one rounding
    within_one_rounding(out._data, weights @ v.astype(np.float64), 1e-5 * np.abs(v).max())
    out.backward(tensor(bf16_inputs(rng, B, H, T, head_size)))
    assert tq.grad.dtype == tk.grad.dtype == tv.grad.dtype == BF16
    grouped = F.scaled_dot_product_attention(tq, tk[:, :1], tv[:, :1], is_causal=causal, enable_gqa=True)
    widened = F.scaled_dot_product_attention(tq.float(), tk[:, :1].float(), tv[:, :1].float(), is_causal=causal,
                                             enable_gqa=True)
    assert torch.equal(grouped, widened.to(torch.bfloat16))   # the same float32 kernels, rounded once
    scores = scores.astype(BF16).astype(np.float64)                  # softmax's own bf16 input
    probabilities = F.softmax(tensor(scores), dim=-1)
    assert probabilities.dtype == BF16
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    within_one_rounding(probabilities._data, weights / weights.sum(-1, keepdims=True), 1e-6)


# ---- autocast ------------------------------------------------------------------------------------------------

def test_autocast_runs_products_in_bf16_with_float32_parameters_and_gradients(rng):
    torch.manual_seed(1)
    layer = torch.nn.Linear(24, 16)
    x = torch.Tensor(backend.xp.asarray(bf16_inputs(rng, 5, 24)), requires_grad=True)
    other = torch.Tensor(backend.xp.asarray(bf16_inputs(rng, 16, 3)))
    with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
        y = layer(x)
        z = y @ other                                   # bf16 @ float32: both in bf16 inside the block
    assert y.dtype == BF16 and z.dtype == BF16 and layer.weight.dtype == np.float32
    w64, b64 = (host(p).astype(np.float32).astype(BF16).astype(np.float64) for p in (layer.weight, layer.bias))
    x64 = host(x).astype(np.float64)
    b64 = host(layer.bias).astype(np.float64)                # the bias is added in float32, not rounded first
    within_one_rounding(y._data, x64 @ w64.T + b64, 26 * TENSOR_CORE_ADDITION * (np.abs(x64) @ np.abs(w64).T + 1))
    z.sum().backward()
    assert layer.weight.grad.dtype == np.float32 and layer.bias.grad.dtype == np.float32
    assert x.grad.dtype == np.float32                    # a float32 input's gradient: float32 sums, unrounded
    assert torch.is_autocast_enabled() is False and torch.get_autocast_dtype("cuda") == np.float32


def test_autocast_nests_disables_decorates_and_caches_weights_per_block(rng):
    layer = torch.nn.Linear(8, 4)
    x = torch.Tensor(backend.xp.asarray(rng.standard_normal((3, 8)).astype(np.float32)))
    ctx = torch.amp.autocast(device_type="cuda", dtype=torch.bfloat16)
    assert torch.autocast is torch.amp.autocast is torch.cuda.amp.autocast
    with ctx:
        assert layer(x).dtype == BF16 and torch.is_autocast_enabled()
        first = amp.product_input(layer.weight)
        assert amp.product_input(layer.weight) is first            # converted once per block
        with torch.autocast(device_type="cuda", enabled=False):
            assert layer(x).dtype == np.float32                    # an inner block turns it off...
            with ctx:                                              # ...the same object nests inside itself
                assert layer(x).dtype == BF16
        assert layer(x).dtype == BF16                              # ...and the outer block is back
        layer.weight._data = backend.xp.zeros((4, 8), np.float32)   # a replaced .data is converted again
        assert not host(amp.product_input(layer.weight)).any()
    assert layer(x).dtype == np.float32 and not amp._weight_cache  # the cache ends with the outermost block
    with ctx:                                                      # one object serves many blocks
        assert layer(x).dtype == BF16

    @torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    def forward(inputs):
        return layer(inputs)
    assert forward(x).dtype == BF16 and layer(x).dtype == np.float32
    for no_op in (torch.autocast(device_type="cuda"), torch.autocast(device_type="cuda", dtype=torch.float32),
                  torch.autocast(device_type="cpu", dtype=torch.bfloat16),
                  torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=False)):
        with no_op:
            assert layer(x).dtype == np.float32
    with pytest.raises(NotImplementedError, match="float16"):
        torch.autocast(device_type="cuda", dtype=torch.float16)
    with pytest.raises(RuntimeError, match="unsupported autocast device_type 'tpu'"):
        torch.autocast(device_type="tpu")
    assert torch.cuda.is_bf16_supported() == (backend.name == "cuda" and
                                              int(backend.xp.cuda.Device().compute_capability) >= 80)


def test_mixed_dtypes_outside_autocast_are_refused_with_the_argument_named(rng):
    x = tensor(bf16_inputs(rng, 3, 8))
    weight = torch.Tensor(backend.xp.asarray(rng.standard_normal((4, 8)).astype(np.float32)))
    with pytest.raises(TypeError, match="linear_forward: weight has dtype float32; it must be bfloat16"):
        F.linear(x, weight)
    with pytest.raises(RuntimeError, match="same dtype"):
        x @ weight.T
    # RMSNorm runs bf16 forward (Llama's generation); its backward takes float32 only, and says so
    weight = torch.Tensor(backend.xp.ones(8, np.float32), requires_grad=True)
    with pytest.raises(TypeError, match="rmsnorm_backward: dout has dtype bfloat16; it must be float32"):
        F.rms_norm(x, (8,), weight).float().sum().backward()


# ---- GPT-2 ----------------------------------------------------------------------------------------------------

TINY = GPTConfig(block_size=16, vocab_size=96, n_layer=2, n_head=2, n_embd=64)


def _loss_and_gradients(model, optimizer, idx, targets):
    optimizer.zero_grad()
    _, loss = model(idx, targets)
    loss.backward()
    return loss, host(optimizer.flat_grads).astype(np.float64)


def test_gpt2_tiny_under_autocast_matches_float32(rng):
    """The same model and batch, float32 and bf16 autocast. Each bf16 activation is rounded once per op
    (2^-8 relative); through two blocks and the loss these move the loss by far less than 1 % (2.5 units
    of 2^-8; measured 2e-5 relative at initialisation), and, being independent from element to element,
    they turn the gradient by little: cosine similarity above 0.999 (measured 0.99998)."""
    torch.manual_seed(0)
    model = GPT(TINY)
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95))
    idx = backend.xp.asarray(rng.integers(0, TINY.vocab_size, (4, 16)))
    targets = backend.xp.asarray(rng.integers(0, TINY.vocab_size, (4, 16)))
    loss32, gradient32 = _loss_and_gradients(model, optimizer, idx, targets)
    with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
        logits, loss = model(idx, targets)
    assert logits.dtype == BF16 and loss.dtype == np.float32
    optimizer.zero_grad()
    loss.backward()
    gradient16 = host(optimizer.flat_grads).astype(np.float64)
    assert all(p.grad is not None and p.grad.dtype == np.float32 for p in model.parameters())
    assert abs(loss.item() - loss32.item()) <= 0.01 * loss32.item()
    cosine = gradient16 @ gradient32 / (np.linalg.norm(gradient16) * np.linalg.norm(gradient32))
    assert cosine > 0.999, cosine
    # the float32 model afterwards: the same bits as before the bf16 step (nothing of autocast stays behind)
    loss_again, gradient_again = _loss_and_gradients(model, optimizer, idx, targets)
    assert loss_again.item() == loss32.item()
    np.testing.assert_array_equal(gradient_again, gradient32)


@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
def test_attention_in_bf16_takes_the_tensor_cores_above_its_size(rng, monkeypatch, heads):
    """F.scaled_dot_product_attention on bf16 heads: the tensor-core kernels (chapter 16b) from
    dispatch.TENSOR_CORE_ATTENTION multiply-adds on, chapter 08's float32 kernels below it; both against float64
    softmax attention from the same bf16 inputs, within bf16's rounding of P and of the output."""
    from gpt2_cupy import dispatch

    H, H_kv = heads
    B, T, d = 1, 40, 32
    q, k, v = (bf16_inputs(rng, B, h, T, d) for h in (H, H_kv, H_kv))
    k64, v64 = (np.repeat(a.astype(np.float64), H // H_kv, axis=1) for a in (k, v))
    scores = q.astype(np.float64) @ k64.transpose(0, 1, 3, 2) / np.sqrt(d)
    scores = np.where(np.tril(np.ones((T, T), bool)), scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    reference = weights @ v64
    for work, node in ((0, "TensorCoreAttentionBackward"), (1 << 40, "CastBackward")):
        monkeypatch.setattr(dispatch, "TENSOR_CORE_ATTENTION", work)
        y = F.scaled_dot_product_attention(tensor(q, requires_grad=True), tensor(k), tensor(v), is_causal=True,
                                           enable_gqa=H != H_kv)
        assert y.dtype == BF16 and y.grad_fn.name() == node
        bound = 2 * 2.0 ** -8 * (weights @ np.abs(v64)) + 1e-6
        assert np.all(np.abs(host(y).astype(np.float64) - reference) <= bound)


def test_an_empty_bf16_sum_is_zeros_plus_bias_at_every_graph_replay(rng):
    # K = 0: no kernel multiplies; out is zeroed by a kernel, so that a captured graph zeroes it at each replay
    from gpt2_cupy.dispatch import bf16_product

    xp = backend.xp
    a, b = xp.zeros((5, 0), dtype=BF16), xp.zeros((0, 9), dtype=BF16)
    bias = rng.standard_normal(9).astype(np.float32)
    out, device_bias = xp.asarray(np.full((5, 9), 7.0, np.float32)), xp.asarray(bias)   # made before the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        bf16_product(a, b, out, bias=device_bias)
    for _ in range(2):
        out[...] = 7.0
        g.replay()
        np.testing.assert_array_equal(backend.asnumpy(out), np.broadcast_to(bias, (5, 9)))
