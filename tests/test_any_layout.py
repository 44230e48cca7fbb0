"""Every public op and module reads its inputs through their layout: transposed, sliced, offset, broadcast
(zero strides) and Fortran-ordered arrays give the same answer as contiguous ones (issue 43).

Each case is (a callable over Tensors, a float64 numpy reference over arrays, the inputs' shapes and value
ranges). Every input of a case is made in every layout, holding the same values; the result is checked
against the float64 reference, and, for differentiable cases, the gradients are checked against those of
contiguous inputs (whose own correctness the op's own tests check against references).

test_every_public_name_is_covered lists the public names of gpt2_cupy, gpt2_cupy.nn, nn.functional and
Tensor's methods: each is a case here or is named in NOT_READING_TENSORS with why, so that a new op cannot
be added without its layout test.
"""

import inspect
import math

import numpy as np
import pytest

import gpt2_cupy as torch
import gpt2_cupy.nn as nn
from gpt2_cupy import backend
from gpt2_cupy.nn import functional as F

LAYOUTS = ["contiguous", "transposed", "sliced", "offset", "broadcast", "fortran"]
erf = np.vectorize(math.erf)


def laid_out(values, layout):
    """A backend array holding `values` (float32 or int64) in the given layout."""
    xp = backend.xp
    if layout == "contiguous" or values.ndim == 0:
        return xp.asarray(values)
    if layout == "transposed":  # a transpose of the reversed-axes array: strides in reverse order
        return xp.asarray(np.ascontiguousarray(values.transpose(tuple(reversed(range(values.ndim)))))).transpose(
            tuple(reversed(range(values.ndim))))
    if layout == "sliced":  # every other element of a longer last axis, starting from its second
        big = np.zeros(values.shape[:-1] + (2 * values.shape[-1] + 1,), values.dtype)
        big[..., 1::2] = values
        return xp.asarray(big)[..., 1::2]
    if layout == "offset":  # contiguous, three elements into its buffer
        flat = np.zeros(values.size + 3, values.dtype)
        flat[3:] = values.reshape(-1)
        return xp.asarray(flat)[3:].reshape(values.shape)
    if layout == "fortran":
        return xp.asfortranarray(xp.asarray(values))
    raise ValueError(layout)


def broadcastable(values):
    """values with every row equal to the first (so that a zero-stride broadcast of it holds them)."""
    return np.broadcast_to(values[:1], values.shape).copy() if values.ndim else values


def make(values, layout):
    if layout == "broadcast":
        if values.ndim == 0:
            return torch.as_tensor(backend.xp.asarray(values))
        return torch.as_tensor(backend.xp.broadcast_to(backend.xp.asarray(values[:1]), values.shape))
    return torch.as_tensor(laid_out(values, layout))


def host(t):
    if isinstance(t, (tuple, list)):
        return [host(item) for item in t]
    if isinstance(t, torch.Tensor):
        t = t.detach()
        return backend.asnumpy(t.float().data if t.dtype == torch.bfloat16 else t.data).astype(np.float64)
    return np.asarray(t, dtype=np.float64)


def softmax(x, axis=-1):
    e = np.exp(x - x.max(axis, keepdims=True))
    return e / e.sum(axis, keepdims=True)


def layer_norm(x, w, b, eps=1e-5):
    mean = x.mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(x.var(-1, keepdims=True) + eps) * w + b


def scattered(a, index, src, add):
    """a with src's elements written (or added) at index along axis 1 (index and src 2-D)."""
    out = a.copy()
    rows = np.arange(index.shape[0])[:, None]
    if add:
        np.add.at(out, (rows, index), src[:, :index.shape[1]])
    else:
        out[rows, index] = src[:, :index.shape[1]]
    return out


def batch_norm(x, w, b, eps=1e-5):
    """Over the batch and length axes of x (N, C, L), with the batch's biased variance."""
    mean, var = x.mean((0, 2), keepdims=True), x.var((0, 2), keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w[:, None] + b[:, None]


def attention(q, k, v, causal=True):
    scores = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    if causal:
        scores = np.where(np.tril(np.ones(scores.shape[-2:], bool)), scores, -np.inf)
    return softmax(scores) @ v


def cross_entropy(logits, targets):
    z = logits - logits.max(-1, keepdims=True)
    return -(z[np.arange(len(targets)), targets] - np.log(np.exp(z).sum(-1))).mean()


def rope_half(x, theta=10000.0):  # x (B, T, H, D), channel i paired with i + D/2
    B, T, H, D = x.shape
    inverse = theta ** (-np.arange(0, D // 2) * 2.0 / D)
    angles = np.arange(T)[:, None] * inverse[None, :]
    cos, sin = np.cos(angles)[None, :, None, :], np.sin(angles)[None, :, None, :]
    first, second = x[..., :D // 2], x[..., D // 2:]
    return np.concatenate([first * cos - second * sin, second * cos + first * sin], -1)


# Shapes: M (4, 6), V (6,) for a vector, S (3, 4, 6) for a batch, I for int64 ids; R... the value range.
ANY, POSITIVE, UNIT = (-2.0, 2.0), (0.5, 2.0), (-0.9, 0.9)
M, S = (4, 6), (3, 4, 6)


def case(name, function, reference, *inputs, grad=True, atol=1e-5, rtol=1e-4):
    """inputs: (shape, range) for floats, ("ids", shape, high) for int64 ids."""
    return pytest.param(function, reference, inputs, grad, atol, rtol, id=name)


UNARY_REFERENCES = {
    "exp": (np.exp, ANY), "log": (np.log, POSITIVE), "sqrt": (np.sqrt, POSITIVE), "rsqrt": (lambda a: 1 / np.sqrt(a), POSITIVE),
    "tanh": (np.tanh, ANY), "sigmoid": (lambda a: 1 / (1 + np.exp(-a)), ANY), "relu": (lambda a: np.maximum(a, 0), ANY),
    "abs": (np.abs, ANY), "neg": (np.negative, ANY), "square": (np.square, ANY), "sign": (np.sign, ANY),
    "sin": (np.sin, ANY), "cos": (np.cos, ANY), "tan": (np.tan, UNIT), "asin": (np.arcsin, UNIT),
    "acos": (np.arccos, UNIT), "atan": (np.arctan, ANY), "sinh": (np.sinh, ANY), "cosh": (np.cosh, ANY),
    "log10": (np.log10, POSITIVE), "log2": (np.log2, POSITIVE), "log1p": (np.log1p, POSITIVE),
    "expm1": (np.expm1, ANY), "exp2": (np.exp2, ANY), "erf": (erf, ANY), "reciprocal": (np.reciprocal, POSITIVE),
    "floor": (np.floor, ANY), "ceil": (np.ceil, ANY), "round": (np.round, ANY), "trunc": (np.trunc, ANY),
    "frac": (lambda a: a - np.trunc(a), ANY),
}
NO_GRADIENT = ("sign", "floor", "ceil", "round", "trunc")

CASES = [case(f"Tensor.{name}", (lambda name: lambda x: getattr(x, name)())(name), reference, (M, values),
              grad=name not in NO_GRADIENT) for name, (reference, values) in UNARY_REFERENCES.items()]
CASES += [case(f"torch.{name}", (lambda name: lambda x: getattr(torch, name)(x))(name), reference, (M, values),
               grad=name not in NO_GRADIENT) for name, (reference, values) in UNARY_REFERENCES.items()]
CASES += [
    # arithmetic, broadcasting one operand against the other
    case("add", lambda a, b: a + b, np.add, (S, ANY), (M, ANY)),
    case("sub", lambda a, b: a - b, np.subtract, (M, ANY), (M, ANY)),
    case("mul", lambda a, b: a * b, np.multiply, (S, ANY), (M, ANY)),
    case("div", lambda a, b: a / b, np.divide, (M, ANY), (M, POSITIVE)),
    case("pow", lambda a, b: a ** b, np.power, (M, POSITIVE), (M, ANY)),
    case("Tensor.pow", lambda a: a.pow(3), lambda a: a ** 3, (M, ANY)),
    case("rpow", lambda a: 2 ** a, lambda a: 2 ** a, (M, ANY)),
    case("scalar_ops", lambda a: (1 - a) * 3 / 2 + 1, lambda a: (1 - a) * 3 / 2 + 1, (M, ANY)),
    case("matmul", lambda a, b: a @ b, np.matmul, (S, ANY), ((6, 5), ANY)),
    case("torch.matmul", lambda a, b: torch.matmul(a, b), np.matmul, (S, ANY), ((3, 6, 5), ANY)),
    case("maximum", lambda a, b: torch.maximum(a, b), np.maximum, (M, ANY), (M, ANY)),
    case("minimum", lambda a, b: torch.minimum(a, b), np.minimum, (M, ANY), (M, ANY)),
    case("atan2", lambda a, b: torch.atan2(a, b), np.arctan2, (M, ANY), (M, POSITIVE)),
    case("comparisons", lambda a, b: torch.stack([(a < b), (a <= b), (a > b), (a >= b), (a == a), (a != b)]).float(),
         lambda a, b: np.stack([a < b, a <= b, a > b, a >= b, a == a, a != b]), (M, ANY), (M, ANY), grad=False),
    case("logical", lambda a: ((a > 0) & (a < 1) | ~(a > -1)).float(),
         lambda a: ((a > 0) & (a < 1)) | ~(a > -1), (M, ANY), grad=False),
    case("clamp", lambda a: a.clamp(-0.5, 0.5), lambda a: np.clip(a, -0.5, 0.5), (M, ANY)),
    case("torch.clamp", lambda a: torch.clamp(a, min=0.1), lambda a: np.maximum(a, 0.1), (M, ANY)),
    case("where", lambda a, b: torch.where(a > 0, a, b), lambda a, b: np.where(a > 0, a, b), (M, ANY), (M, ANY)),
    case("masked_fill", lambda a: a.masked_fill(a > 0.5, -1.0), lambda a: np.where(a > 0.5, -1.0, a), (M, ANY)),
    case("tril", lambda a: a.tril(), np.tril, (M, ANY)),
    case("triu", lambda a: torch.triu(a, 1), lambda a: np.triu(a, 1), (M, ANY)),
    # reductions
    case("sum", lambda a: a.sum(1), lambda a: a.sum(1), (S, ANY)),
    case("sum_all", lambda a: torch.sum(a), np.sum, (S, ANY)),
    case("sum_keepdims", lambda a: a.sum((0, 2), keepdims=True), lambda a: a.sum((0, 2), keepdims=True), (S, ANY)),
    case("mean", lambda a: a.mean(-1, keepdim=True), lambda a: a.mean(-1, keepdims=True), (S, ANY)),
    case("var", lambda a: a.var(0), lambda a: a.var(0, ddof=1), (M, ANY)),
    case("std", lambda a: torch.std(a), lambda a: a.std(ddof=1), (M, ANY)),
    case("max_dim", lambda a: a.max(1).values, lambda a: a.max(1), (M, ANY)),
    case("min_all", lambda a: a.min(), np.min, (M, ANY)),
    case("amax", lambda a: a.amax((0, 1)), lambda a: a.max((0, 1)), (S, ANY)),
    case("amin", lambda a: torch.amin(a, 1), lambda a: a.min(1), (M, ANY)),
    case("argmax", lambda a: a.argmax(1), lambda a: a.argmax(1), (M, ANY), grad=False),
    case("argmin", lambda a: torch.argmin(a), lambda a: a.argmin(), (M, ANY), grad=False),
    case("norm", lambda a: a.norm(), np.linalg.norm, (M, ANY)),
    case("cumsum", lambda a: a.cumsum(1), lambda a: a.cumsum(1), (M, ANY)),
    case("all_any", lambda a: torch.stack([torch.all(a > -1.5, 1), (a > 1.5).any(1)]).float(),
         lambda a: np.stack([(a > -1.5).all(1), (a > 1.5).any(1)]), (M, ANY), grad=False),
    case("allclose", lambda a, b: torch.tensor([torch.allclose(a, a + 1e-9), torch.isclose(a, b).all().item()]),
         lambda a, b: np.array([True, np.isclose(a, b).all()]), (M, ANY), (M, ANY), grad=False),
    case("softmax", lambda a: a.softmax(-1), softmax, (S, ANY)),
    case("softmax_dim1", lambda a: torch.softmax(a, 1), lambda a: softmax(a, 1), (S, ANY)),
    case("log_softmax", lambda a: torch.log_softmax(a, dim=0), lambda a: np.log(softmax(a, 0)), (S, ANY)),
    case("topk", lambda a: a.topk(2).values, lambda a: -np.sort(-a, -1)[..., :2], (M, ANY)),
    case("sort", lambda a: a.sort(1, descending=True).values, lambda a: -np.sort(-a, 1), (M, ANY)),
    case("argsort", lambda a: a.argsort(0), lambda a: np.argsort(a, 0, kind="stable"), (M, ANY), grad=False),
    case("unique", lambda a: (a > 0).long().unique(), lambda a: np.unique(a > 0), (M, ANY), grad=False),
    case("histc", lambda a: torch.histc(a, 4, -2, 2), lambda a: np.histogram(a, 4, (-2, 2))[0], (M, ANY), grad=False),
    case("histogram", lambda a: torch.histogram(a, 4, range=(-2.0, 2.0)).hist,
         lambda a: np.histogram(a, 4, (-2, 2))[0], (M, ANY), grad=False),
    case("bincount", lambda i: torch.bincount(i.reshape(-1)), lambda i: np.bincount(i.reshape(-1)), ("ids", M, 5),
         grad=False),
    case("multinomial_one_hot", lambda a: torch.multinomial(F.one_hot(a.argmax(1), 6).float(), 1).reshape(-1),
         lambda a: a.argmax(1), (M, ANY), grad=False),
    # movement
    case("reshape", lambda a: a.reshape(6, 4) * 1, lambda a: a.reshape(6, 4), (M, ANY)),
    case("flatten", lambda a: torch.flatten(a, 1) * 1, lambda a: a.reshape(3, 24), (S, ANY)),
    case("permute", lambda a: a.permute(2, 0, 1) + 0, lambda a: a.transpose(2, 0, 1), (S, ANY)),
    case("transpose", lambda a: torch.transpose(a, 0, 1) + 0, lambda a: a.T, (M, ANY)),
    case("T_t", lambda a: a.T + a.t(), lambda a: 2 * a.T, (M, ANY)),
    case("unsqueeze_squeeze", lambda a: torch.squeeze(torch.unsqueeze(a, 1) * 2), lambda a: 2 * a, (M, ANY)),
    case("expand", lambda a: a[:1].expand(3, 6) * 1, lambda a: np.broadcast_to(a[:1], (3, 6)), (M, ANY)),
    case("contiguous_clone", lambda a: a.contiguous() + a.clone(), lambda a: 2 * a, (M, ANY)),
    case("view_of_contiguous", lambda a: a.contiguous().view(-1) * 1, lambda a: a.reshape(-1), (M, ANY)),
    case("index", lambda a: a[1:, ::2] * a[[0, 2]][:, None, :2].sum(), lambda a: a[1:, ::2] * a[[0, 2]][:, None, :2].sum(),
         (M, ANY)),
    case("gather", lambda a, i: torch.gather(a, 1, i), lambda a, i: np.take_along_axis(a, i, 1), (M, ANY), ("ids", M, 6)),
    case("cat_stack", lambda a, b: torch.cat([a, torch.stack([b, b]).sum(0)], 1), lambda a, b: np.concatenate([a, 2 * b], 1),
         (M, ANY), (M, ANY)),
    case("split_chunk_unbind", lambda a: torch.cat([p.reshape(-1) for p in (*a.split(4, 1), *a.chunk(2, 0), *a.unbind(0))]),
         lambda a: np.concatenate([a[:, :4].reshape(-1), a[:, 4:].reshape(-1), a.reshape(-1), a.reshape(-1)]), (M, ANY)),
    case("flip", lambda a: a.flip(0, 1), lambda a: a[::-1, ::-1], (M, ANY)),
    case("index_select", lambda a, i: torch.index_select(a, 1, i), lambda a, i: a[:, i], (M, ANY), ("ids", (5,), 6)),
    case("masked_select", lambda a: a.masked_select(a > 0), lambda a: a[a > 0], (M, ANY)),
    case("nonzero", lambda a: torch.nonzero(a > 0).float(), lambda a: np.argwhere(a > 0), (M, ANY), grad=False),
    case("roll", lambda a: torch.roll(a, 2, 1), lambda a: np.roll(a, 2, 1), (M, ANY)),
    case("repeat", lambda a: a.repeat(2, 1, 3), lambda a: np.tile(a, (2, 1, 3)), (M, ANY)),
    case("repeat_interleave", lambda a: a.repeat_interleave(2, dim=0), lambda a: np.repeat(a, 2, 0), (M, ANY)),
    case("to_bfloat16", lambda a: a.to(torch.bfloat16).float(), lambda a: a, (M, ANY), atol=2e-2, rtol=1e-2),
    case("long_float", lambda a: (a * 4).long().float(), lambda a: np.trunc(a * 4), (M, ANY), grad=False),
    # nn.functional
    case("F.linear", lambda x, w, b: F.linear(x, w, b), lambda x, w, b: x @ w.T + b, (S, ANY), ((5, 6), ANY), ((5,), ANY)),
    case("F.gelu", lambda a: F.gelu(a), lambda a: 0.5 * a * (1 + erf(a / math.sqrt(2))), (M, ANY)),
    case("F.gelu_tanh", lambda a: F.gelu(a, approximate="tanh"),
         lambda a: 0.5 * a * (1 + np.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a ** 3))), (M, ANY)),
    case("F.relu_silu_sigmoid_tanh", lambda a: F.relu(a) + F.silu(a) + F.sigmoid(a) + F.tanh(a),
         lambda a: np.maximum(a, 0) + a / (1 + np.exp(-a)) + 1 / (1 + np.exp(-a)) + np.tanh(a), (M, ANY)),
    case("F.leaky_relu", lambda a: F.leaky_relu(a, 0.1), lambda a: np.where(a > 0, a, 0.1 * a), (M, ANY)),
    case("F.softplus", lambda a: F.softplus(a), lambda a: np.log1p(np.exp(a)), (M, ANY)),
    case("F.layer_norm", lambda x, w, b: F.layer_norm(x, (6,), w, b), layer_norm, (S, ANY), ((6,), ANY), ((6,), ANY)),
    case("F.rms_norm", lambda x, w: F.rms_norm(x, (6,), w, 1e-6),
         lambda x, w: x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * w, (S, ANY), ((6,), ANY)),
    case("F.dyt", lambda x, a, w, b: F.dyt(x, a, w, b), lambda x, a, w, b: w * np.tanh(a * x) + b,
         (S, ANY), ((1,), ANY), ((6,), ANY), ((6,), ANY)),
    case("F.embedding", lambda i, w: F.embedding(i, w), lambda i, w: w[i], ("ids", (2, 3), 5), ((5, 6), ANY)),
    case("F.softmax_log_softmax", lambda a: F.softmax(a, -1) + F.log_softmax(a, -1),
         lambda a: softmax(a) + np.log(softmax(a)), (S, ANY)),
    case("F.dropout_eval", lambda a: F.dropout(a, 0.5, training=False) * 1, lambda a: a, (M, ANY)),
    case("F.cross_entropy", lambda x, t: F.cross_entropy(x, t), cross_entropy, (M, ANY), ("ids", (4,), 6)),
    case("F.mse_l1", lambda a, b: F.mse_loss(a, b) + F.l1_loss(a, b),
         lambda a, b: ((a - b) ** 2).mean() + np.abs(a - b).mean(), (M, ANY), (M, ANY)),
    case("F.normalize", lambda a: F.normalize(a, dim=1), lambda a: a / np.linalg.norm(a, axis=1, keepdims=True),
         (M, ANY)),
    case("F.one_hot", lambda i: F.one_hot(i, 5).float(), lambda i: np.eye(5)[i], ("ids", M, 5), grad=False),
    case("F.swiglu", lambda g, u: F.swiglu(g, u), lambda g, u: g / (1 + np.exp(-g)) * u, (S, ANY), (S, ANY)),
    case("F.rope", lambda x: F.rope(x), rope_half, ((2, 3, 2, 8), ANY)),
    case("F.repeat_kv", lambda x: F.repeat_kv(x, 2), lambda x: np.repeat(x, 2, 1), ((2, 2, 3, 4), ANY)),
    case("F.scaled_dot_product_attention", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
         attention, ((2, 2, 5, 8), ANY), ((2, 2, 5, 8), ANY), ((2, 2, 5, 8), ANY)),
    case("F.sdpa_no_mask", lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
         lambda q, k, v: attention(q, k, v, False), ((2, 2, 5, 8), ANY), ((2, 2, 5, 8), ANY), ((2, 2, 5, 8), ANY)),
    case("F.causal_attention", lambda q, k, v: F.causal_attention(q, k, v), attention,
         ((1, 2, 5, 16), ANY), ((1, 2, 5, 16), ANY), ((1, 2, 5, 16), ANY)),
    case("F.relu_attention", lambda q, k, v: F.relu_attention(q, k, v),
         lambda q, k, v: (np.tril(np.maximum(q @ np.swapaxes(k, -1, -2) / math.sqrt(8), 0))) @ v,
         ((1, 2, 5, 8), ANY), ((1, 2, 5, 8), ANY), ((1, 2, 5, 8), ANY), atol=1e-4),
    case("F.split", lambda a: F.split(a, 2, dim=0)[1] * 1, lambda a: a[2:4], (M, ANY)),
    # products, scatters, batch norm
    case("prod", lambda a: a.prod(1) + torch.prod(a), lambda a: a.prod(1) + a.prod(), (M, (0.7, 1.3))),
    case("einsum", lambda a, b: torch.einsum("bij,jk->bki", a, b), lambda a, b: np.einsum("bij,jk->bki", a, b),
         (S, ANY), ((6, 5), ANY)),
    case("einsum_diagonal", lambda a: torch.einsum("ii->i", a[:, :4]) + torch.einsum("...ii", a[:, 2:]),
         lambda a: np.einsum("ii->i", a[:, :4]) + np.einsum("...ii", a[:, 2:]), (M, ANY)),
    case("scatter", lambda a, s: a.scatter(1, a.argsort(1)[:, :3], s),  # argsort: distinct places in each row
         lambda a, s: scattered(a, np.argsort(a, 1, kind="stable")[:, :3], s, add=False), (M, ANY), (M, ANY)),
    case("scatter_add", lambda a, i, s: torch.scatter_add(a, 1, i, s), lambda a, i, s: scattered(a, i, s, add=True),
         (M, ANY), ("ids", (4, 3), 6), (M, ANY)),
    case("F.batch_norm", lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True), batch_norm,
         (S, ANY), ((4,), ANY), ((4,), ANY)),
]


def values_of(spec, seed):
    random = np.random.default_rng(seed)
    if spec[0] == "ids":
        return random.integers(0, spec[2], spec[1]).astype(np.int64)
    shape, (low, high) = spec
    return random.uniform(low, high, shape).astype(np.float32)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("function, reference, inputs, grad, atol, rtol", CASES)
def test_op_reads_any_layout(function, reference, inputs, grad, atol, rtol, layout):
    arrays = [values_of(spec, seed) for seed, spec in enumerate(inputs)]
    if layout == "broadcast":
        arrays = [broadcastable(a) for a in arrays]
    tensors = [make(a, layout) for a in arrays]
    out = function(*tensors)
    expected = np.asarray(reference(*[a.astype(np.float64) if a.dtype == np.float32 else a for a in arrays]),
                          dtype=np.float64)
    assert np.allclose(host(out), expected, atol=atol, rtol=rtol), f"{layout}: {host(out)} vs {expected}"
    if not grad or layout in ("contiguous", "broadcast"):
        return
    # the gradients of the laid-out inputs are those of contiguous ones
    def gradients(make_input):
        leaves = [make_input(a).requires_grad_(a.dtype == np.float32) for a in arrays]
        result = function(*leaves)
        weights = torch.tensor(np.linspace(-1, 1, result.numel()).reshape(result.shape))
        (result.float() * weights).sum().backward()
        return [host(leaf.grad) if leaf.requires_grad else None for leaf in leaves]
    laid = gradients(lambda a: make(a, layout))
    plain = gradients(lambda a: make(a, "contiguous"))
    for got, want in zip(laid, plain):
        if want is not None:
            assert np.allclose(got, want, atol=atol, rtol=rtol)


MODULES = [
    pytest.param(lambda: nn.Linear(6, 5), "weight", lambda m, x: x @ m["weight"].T + m["bias"], id="Linear"),
    pytest.param(lambda: nn.Linear(6, 5, bias=False), "weight", lambda m, x: x @ m["weight"].T, id="Linear_no_bias"),
    pytest.param(lambda: nn.LayerNorm(6), "weight", lambda m, x: layer_norm(x, m["weight"], m["bias"]), id="LayerNorm"),
    pytest.param(lambda: nn.RMSNorm(6, eps=1e-6), "weight",
                 lambda m, x: x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * m["weight"], id="RMSNorm"),
    pytest.param(lambda: nn.DyT(6), "weight", lambda m, x: m["weight"] * np.tanh(m["alpha"] * x) + m["bias"], id="DyT"),
    pytest.param(lambda: nn.BatchNorm1d(4), "weight", lambda m, x: batch_norm(x, m["weight"], m["bias"]),
                 id="BatchNorm1d"),
    pytest.param(lambda: nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6)), "0.weight",
                 lambda m, x: np.tanh(x @ m["0.weight"].T + m["0.bias"]) @ m["2.weight"].T + m["2.bias"], id="Sequential"),
]
ACTIVATIONS = [
    pytest.param(nn.GELU(), lambda x: 0.5 * x * (1 + erf(x / math.sqrt(2))), id="GELU"),
    pytest.param(nn.ReLU(), lambda x: np.maximum(x, 0), id="ReLU"),
    pytest.param(nn.SiLU(), lambda x: x / (1 + np.exp(-x)), id="SiLU"),
    pytest.param(nn.Tanh(), np.tanh, id="Tanh"),
    pytest.param(nn.Sigmoid(), lambda x: 1 / (1 + np.exp(-x)), id="Sigmoid"),
    pytest.param(nn.LeakyReLU(0.2), lambda x: np.where(x > 0, x, 0.2 * x), id="LeakyReLU"),
    pytest.param(nn.Softmax(dim=-1), softmax, id="Softmax"),
    pytest.param(nn.LogSoftmax(dim=1), lambda x: np.log(softmax(x, 1)), id="LogSoftmax"),
    pytest.param(nn.Flatten(), lambda x: x.reshape(3, -1), id="Flatten"),
    pytest.param(nn.Identity(), lambda x: x, id="Identity"),
    pytest.param(nn.Dropout(0.3).eval(), lambda x: x, id="Dropout_eval"),
]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("module, reference", ACTIVATIONS)
def test_activation_module_reads_any_layout(module, reference, layout):
    x = values_of((S, ANY), 1)
    x = broadcastable(x) if layout == "broadcast" else x
    assert np.allclose(host(module(make(x, layout))), reference(x.astype(np.float64)), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("build, name, reference", MODULES)
def test_module_with_a_parameter_and_an_input_of_any_layout(build, name, reference, layout):
    """The issue's case: a parameter assigned from a transposed (or otherwise laid out) array."""
    torch.manual_seed(0)
    module = build()
    target = dict(module.named_parameters())[name]
    values = values_of((target.shape, ANY), 2)
    values = broadcastable(values) if layout == "broadcast" else values
    owner = module._owner_of(name)
    setattr(owner, name.rpartition(".")[2], nn.Parameter(make(values, layout)))
    x = values_of((S, ANY), 3)
    x = broadcastable(x) if layout == "broadcast" else x
    parameters = {n: host(p) for n, p in module.named_parameters()}
    assert np.allclose(host(module(make(x, layout))), reference(parameters, x.astype(np.float64)), atol=1e-5, rtol=1e-4)


def test_embedding_module_with_a_table_of_any_layout():
    for layout in LAYOUTS:
        table = values_of(((5, 6), ANY), 4)
        table = broadcastable(table) if layout == "broadcast" else table
        embedding = nn.Embedding(5, 6)
        embedding.weight = nn.Parameter(make(table, layout))
        ids = np.array([[0, 4, 2], [1, 1, 3]])
        assert np.array_equal(host(embedding(torch.tensor(ids))), table[ids].astype(np.float64)), layout


# ---- coverage: every public name is a case above, or named here with why it reads no tensor's layout -------------

COVERED_ELSEWHERE = {  # ops whose layout handling the cases above exercise under another name
    "concat", "concatenate", "clip", "stack", "gather", "sum", "mean", "var", "std", "max", "min", "chunk", "unbind",
    "histogram", "bincount", "unique", "topk", "multinomial", "masked_fill", "where", "matmul", "cat", "reshape",
    "permute", "transpose", "unsqueeze", "squeeze", "flatten", "allclose", "isclose", "histc", "softmax", "log_softmax",
    "argmax", "argmin", "clone", "tril", "triu", "pow", "maximum", "minimum", "atan2", "all", "any", "amax", "amin",
    "norm", "cumsum", "sort", "argsort", "flip", "roll", "repeat_interleave", "t", "split", "clamp", "numel",
    "equal", "is_floating_point", "detach",
}
NOT_READING_TENSORS = {  # names that take no tensor to read, or read one only through the ops above
    # dtypes and constants
    "float32", "float", "float16", "half", "bfloat16", "float64", "double", "int64", "long", "int32", "int", "uint8",
    "bool", "pi", "e", "inf", "nan", "dtype_of",
    # factories (they make tensors) and random state
    "tensor", "as_tensor", "from_numpy", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint",
    "randperm", "normal", "linspace", "logspace", "eye", "zeros_like", "ones_like", "empty_like", "rand_like",
    "randn_like", "full_like", "manual_seed", "seed", "initial_seed", "get_rng_state", "set_rng_state", "Generator",
    "default_generator",
    # settings, devices, modules of the package
    "autocast", "get_autocast_dtype", "is_autocast_enabled", "get_float32_matmul_precision",
    "set_float32_matmul_precision", "cuda", "backends", "compile", "device", "Size", "set_printoptions",
    "get_default_dtype", "set_default_dtype", "inference_mode", "no_grad", "is_grad_enabled", "is_tensor", "Tensor",
    "Function", "save", "load", "amp", "random", "nn", "optim", "functional", "autograd", "backend", "model", "utils",
    "devices",
}


def _public_names():
    names = {n for n in dir(torch) if not n.startswith("_") and not inspect.ismodule(getattr(torch, n, None))}
    names |= set(torch._FROM_AUTOGRAD) | set(torch._FROM_TENSOR_OPS) | set(torch._TENSOR_METHODS)
    return names


def test_every_public_name_is_covered():
    case_names = {p.id.split(".")[-1].split("_")[0] for p in CASES} | {p.id.split(".")[-1] for p in CASES}
    missing = {n for n in _public_names() if n not in case_names | COVERED_ELSEWHERE | NOT_READING_TENSORS}
    assert not missing, f"public names without a layout case: {sorted(missing)}"
    functional = {n for n, v in vars(F).items() if inspect.isfunction(v) and not n.startswith("_")
                  and v.__module__ == F.__name__}
    functional_cases = {p.id[2:] for p in CASES if p.id.startswith("F.")}
    functional_cases |= {part for name in functional_cases for part in name.split("_")}
    functional_covered = {"in_float32", "linear", "relu", "silu", "sigmoid", "tanh", "softmax", "log_softmax", "dropout",
                          "mse_loss", "l1_loss", "scaled_dot_product_attention", "layer_norm", "rms_norm",
                          "cross_entropy", "one_hot", "leaky_relu", "relu_attention", "causal_attention", "repeat_kv"}
    assert not (functional - functional_cases - functional_covered), sorted(functional - functional_cases - functional_covered)
    modules = {n for n in nn.__all__ if isinstance(getattr(nn, n), type) and issubclass(getattr(nn, n), nn.Module)}
    module_cases = {p.id.split("_")[0] for p in MODULES + ACTIVATIONS} | {"Embedding"}
    containers = {"Module", "ModuleList", "ModuleDict", "MSELoss", "CrossEntropyLoss"}  # losses: F's cases
    assert not (modules - module_cases - containers), sorted(modules - module_cases - containers)
