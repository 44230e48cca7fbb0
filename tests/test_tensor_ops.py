"""Tensor's operations: values against numpy, gradients against float64 central differences, PyTorch's errors.

check_op (tests/test_functional.py) runs an operation on float32 tensors of the active backend, pushes a
random upstream gradient through the tape, and compares each input's .grad with the finite-difference
gradient of Σ dout · reference(inputs), the reference a float64 numpy function.
"""

import math

import numpy as np
import pytest

import gpt2_cupy as torch
from gpt2_cupy.nn import functional as F
from test_functional import check_op, softmax_reference


def normal(*shape, seed=0):
    return np.random.default_rng(seed).normal(size=shape)


def positive(*shape, seed=0):
    return np.random.default_rng(seed).uniform(0.5, 2.0, size=shape)


# ---- arithmetic with broadcasting -------------------------------------------------------------------------

@pytest.mark.parametrize("operation, reference", [
    (lambda a, b: a + b, np.add), (lambda a, b: a - b, np.subtract), (lambda a, b: a * b, np.multiply),
    (lambda a, b: a / b, np.divide), (lambda a, b: a ** b, np.power)])
def test_binary_operators_broadcast_with_gradients(operation, reference, to_device, to_host):
    a, b = positive(3, 1, 4), positive(5, 4, seed=1)  # gradients of b are summed over 3 copies, of a over 5
    check_op(operation, reference, [a, b], to_device, to_host)


@pytest.mark.parametrize("operation, reference", [
    (lambda x: 2.5 - x, lambda x: 2.5 - x), (lambda x: 2.0 / x, lambda x: 2.0 / x),
    (lambda x: 3 * x + 1, lambda x: 3 * x + 1), (lambda x: x ** 3, lambda x: x ** 3),
    (lambda x: 2 ** x, lambda x: 2.0 ** x), (lambda x: -x, lambda x: -x), (lambda x: x / 4, lambda x: x / 4)])
def test_python_numbers_on_either_side(operation, reference, to_device, to_host):
    check_op(operation, reference, [normal(4, 3) + 3.0], to_device, to_host)  # positive, for 2.0 / x


def test_cube_of_negative_numbers(to_device, to_host):
    check_op(lambda x: x ** 3, lambda x: x ** 3, [normal(7)], to_device, to_host)


@pytest.mark.parametrize("name, reference, inputs", [
    ("exp", np.exp, normal(3, 5)), ("log", np.log, positive(3, 5)), ("sqrt", np.sqrt, positive(3, 5)),
    ("rsqrt", lambda x: 1 / np.sqrt(x), positive(3, 5)), ("tanh", np.tanh, normal(3, 5)),
    ("sigmoid", lambda x: 1 / (1 + np.exp(-x)), normal(3, 5)), ("relu", lambda x: np.maximum(x, 0), normal(3, 5)),
    ("abs", np.abs, normal(3, 5))])
def test_functions(name, reference, inputs, to_device, to_host):
    check_op(lambda x: getattr(x, name)(), reference, [inputs], to_device, to_host)
    check_op(lambda x: getattr(torch, name)(x), reference, [inputs], to_device, to_host)


def test_silu_and_clamp(to_device, to_host):
    x = normal(4, 6)
    check_op(F.silu, lambda x: x / (1 + np.exp(-x)), [x], to_device, to_host)
    check_op(lambda x: x.clamp(-0.5, 0.7), lambda x: np.clip(x, -0.5, 0.7), [x], to_device, to_host)
    check_op(lambda x: torch.clamp(x, min=0.1), lambda x: np.maximum(x, 0.1), [x], to_device, to_host)


def test_comparisons_give_bool_tensors(to_device):
    x = torch.tensor([[1.0, 2.0, 3.0]])
    y = torch.tensor([[2.0], [1.0]])
    for operation, reference in [(lambda a, b: a == b, np.equal), (lambda a, b: a != b, np.not_equal),
                                 (lambda a, b: a < b, np.less), (lambda a, b: a <= b, np.less_equal),
                                 (lambda a, b: a > b, np.greater), (lambda a, b: a >= b, np.greater_equal)]:
        got = operation(x, y)
        assert got.dtype == torch.bool
        np.testing.assert_array_equal(got.numpy(), reference(x.numpy(), y.numpy()))
    np.testing.assert_array_equal((x > 1.5).numpy(), [[False, True, True]])
    np.testing.assert_array_equal((2 < x).numpy(), [[False, False, True]])
    np.testing.assert_array_equal(((x > 1.5) & (x < 2.5)).numpy(), [[False, True, False]])
    np.testing.assert_array_equal((~(x > 1.5)).numpy(), [[True, False, False]])


def test_type_promotion_follows_pytorch():
    ints, floats, flags = torch.tensor([1, 2]), torch.tensor([1.0, 2.0]), torch.tensor([True, False])
    small = torch.tensor([1, 2], dtype=torch.int32)
    assert (ints + 1).dtype == torch.int64 and (ints + 1.5).dtype == torch.float32
    assert (ints / 2).dtype == torch.float32 and (ints + floats).dtype == torch.float32
    assert (small + 1).dtype == torch.int32 and (small + ints).dtype == torch.int64
    assert (flags + flags).dtype == torch.bool and (flags + 1).dtype == torch.int64
    assert (small * torch.tensor(3)).dtype == torch.int32  # a 0-d tensor of the same category does not widen
    assert ints.exp().dtype == torch.float32 and (ints ** 2).tolist() == [1, 4]
    np.testing.assert_array_equal((torch.tensor([7, -7]) / 2).numpy(), [3.5, -3.5])


def test_broadcast_error_names_operation_arguments_and_shapes():
    with pytest.raises(ValueError, match=r"add: the shapes do not broadcast: self \(2, 3\), other \(4,\)"):
        torch.zeros(2, 3) + torch.zeros(4)
    with pytest.raises(ValueError, match=r"mul: .*self \(5,\), other \(2, 3\)"):
        torch.zeros(5) * torch.zeros(2, 3)


# ---- matrix products ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape_a, shape_b", [
    ((3, 4), (4, 5)), ((2, 3, 4), (4, 5)), ((2, 1, 3, 4), (5, 4, 2)), ((4,), (4, 5)), ((2, 3, 4), (4,)),
    ((4,), (4,)), ((1, 3, 4), (2, 4, 5))])
def test_matmul_batched_and_broadcasting(shape_a, shape_b, to_device, to_host):
    check_op(lambda a, b: a @ b, np.matmul, [normal(*shape_a), normal(*shape_b, seed=1)], to_device, to_host)


def test_matmul_errors():
    with pytest.raises(RuntimeError, match=r"mat1 and mat2 shapes cannot be multiplied \(input \(2, 3\), other \(4, 5\)"):
        torch.zeros(2, 3) @ torch.zeros(4, 5)
    with pytest.raises(ValueError, match=r"matmul: the shapes do not broadcast: input \(2,\), other \(3,\)"):
        torch.zeros(2, 3, 4) @ torch.zeros(3, 4, 5)


# ---- reductions -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dim", [None, 0, 1, -1, (0, 2)])
@pytest.mark.parametrize("keepdim", [False, True])
def test_sum_mean_var_std(dim, keepdim, to_device, to_host):
    x = normal(3, 4, 5)
    axis = dim
    check_op(lambda x: x.sum(dim, keepdim=keepdim), lambda x: x.sum(axis=axis, keepdims=keepdim), [x],
             to_device, to_host)
    check_op(lambda x: x.mean(dim, keepdim=keepdim), lambda x: x.mean(axis=axis, keepdims=keepdim), [x],
             to_device, to_host)
    check_op(lambda x: x.var(dim, keepdim=keepdim), lambda x: x.var(axis=axis, ddof=1, keepdims=keepdim), [x],
             to_device, to_host)
    check_op(lambda x: x.var(dim, keepdim=keepdim, correction=0), lambda x: x.var(axis=axis, keepdims=keepdim),
             [x], to_device, to_host)
    check_op(lambda x: x.std(dim, unbiased=False, keepdim=keepdim), lambda x: x.std(axis=axis, keepdims=keepdim),
             [x], to_device, to_host)


@pytest.mark.parametrize("kind", ["max", "min"])
def test_max_min_over_dim_route_the_gradient_to_the_picked_element(kind, to_device, to_host):
    x = normal(3, 6, 4)
    for dim in (0, 1, -1):
        check_op(lambda x: getattr(x, kind)(dim=dim).values, lambda x: getattr(x, kind)(axis=dim), [x],
                 to_device, to_host)
        check_op(lambda x: getattr(x, kind)(dim, keepdim=True)[0],
                 lambda x: getattr(x, kind)(axis=dim, keepdims=True), [x], to_device, to_host)
        np.testing.assert_array_equal(getattr(torch.tensor(x), kind)(dim).indices.numpy(),
                                      getattr(x, f"arg{kind}")(axis=dim))
    check_op(lambda x: getattr(x, kind)(), lambda x: getattr(x, kind)(), [x], to_device, to_host)


def test_argmax_and_reduction_dtypes():
    x = torch.tensor([[1.0, 5.0, 2.0], [7.0, 0.0, 7.0]])
    assert x.argmax().item() == 3 and x.argmax(dim=1).tolist() == [1, 0]
    assert x.argmin(dim=0, keepdim=True).tolist() == [[0, 1, 0]]
    assert torch.tensor([[1, 2], [3, 4]]).sum().item() == 10 and (x > 1).sum().dtype == torch.int64
    with pytest.raises(RuntimeError, match="mean\\(\\): could not infer output dtype"):
        torch.tensor([1, 2]).mean()
    with pytest.raises(IndexError, match="Dimension out of range"):
        x.sum(dim=2)


@pytest.mark.parametrize("dim", [0, 1, 2, -1])
def test_softmax_and_log_softmax_over_any_dim(dim, to_device, to_host):
    def softmax(x):
        return np.moveaxis(softmax_reference(np.moveaxis(x, dim, -1)), -1, dim)

    x = normal(3, 4, 5)
    check_op(lambda x: F.softmax(x, dim=dim), softmax, [x], to_device, to_host)
    check_op(lambda x: F.log_softmax(x, dim=dim), lambda x: np.log(softmax(x)), [x], to_device, to_host)
    check_op(lambda x: x.softmax(dim), softmax, [x], to_device, to_host)


# ---- masks ------------------------------------------------------------------------------------------------------------

def test_where_masked_fill_tril_triu(to_device, to_host):
    x, y = normal(4, 5), normal(5, seed=1)
    condition = x > 0.1
    check_op(lambda x, y: torch.where(torch.tensor(condition), x, y), lambda x, y: np.where(condition, x, y),
             [x, y], to_device, to_host)
    mask = np.triu(np.ones((4, 5), bool), 1)
    check_op(lambda x: x.masked_fill(torch.tensor(mask), -3.0), lambda x: np.where(mask, -3.0, x), [x],
             to_device, to_host)
    scores = normal(2, 4, 4)
    causal = torch.tril(torch.ones(4, 4))
    check_op(lambda s: F.softmax(s.masked_fill(causal == 0, float("-inf")), dim=-1),
             lambda s: softmax_reference(np.where(np.tril(np.ones((4, 4))) == 0, -np.inf, s)), [scores],
             to_device, to_host)
    check_op(lambda x: x.tril(1), lambda x: np.tril(x, 1), [x], to_device, to_host)
    check_op(lambda x: torch.triu(x, -1), lambda x: np.triu(x, -1), [x], to_device, to_host)


# ---- indexing ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("key", [
    (slice(1, 3),), (Ellipsis, 2), (slice(None), [0, 2, 2]), ([3, 0, 3],), (1, slice(None, None, 2)),
    (None, slice(0, 2), -1)])
def test_indexing_reads_and_scatters_the_gradient_back(key, to_device, to_host):
    key = key if len(key) > 1 else key[0]
    check_op(lambda x: x[key], lambda x: x[tuple(np.array(k) if isinstance(k, list) else k
                                                 for k in (key if isinstance(key, tuple) else (key,)))],
             [normal(4, 5, 3)], to_device, to_host)


def test_boolean_mask_and_tensor_indices(to_device, to_host):
    x = normal(4, 5)
    mask = x > 0
    check_op(lambda t: t[torch.tensor(mask)], lambda t: t[mask], [x], to_device, to_host)
    ids = np.array([[0, 3], [3, 3]])
    check_op(lambda t: t[torch.tensor(ids)], lambda t: t[ids], [x], to_device, to_host)


def test_index_errors_and_assignment():
    x = torch.zeros(3, 4)
    with pytest.raises(IndexError, match="index 5 is out of bounds for dimension 1 with size 4"):
        x[:, torch.tensor([0, 5])]
    with pytest.raises(IndexError, match="index 3 is out of bounds for dimension 0 with size 3"):
        x[3]
    with pytest.raises(ValueError, match="step must be greater than zero"):
        x[::-1]
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    logits[logits < 2.0] = -float("inf")  # as nanoGPT's generate does after topk
    assert logits.tolist() == [[-math.inf, 3.0, 2.0]]


# ---- movement ---------------------------------------------------------------------------------------------------------

def test_views_and_their_gradients(to_device, to_host):
    x = normal(2, 3, 4)
    check_op(lambda x: x.view(6, 4).transpose(0, 1).contiguous().view(-1), lambda x: x.reshape(6, 4).T.reshape(-1),
             [x], to_device, to_host)
    check_op(lambda x: x.permute(2, 0, 1).reshape(4, 6), lambda x: x.transpose(2, 0, 1).reshape(4, 6), [x],
             to_device, to_host)
    check_op(lambda x: x.unsqueeze(1).expand(2, 5, 3, 4), lambda x: np.broadcast_to(x[:, None], (2, 5, 3, 4)), [x],
             to_device, to_host)
    check_op(lambda x: x[:, :1].squeeze(1).flatten(), lambda x: x[:, 0].reshape(-1), [x], to_device, to_host)
    check_op(lambda x: x[0].T * 2, lambda x: x[0].T * 2, [x], to_device, to_host)
    check_op(lambda x, y: torch.cat([x, y], dim=1), lambda x, y: np.concatenate([x, y], 1),
             [x, normal(2, 2, 4, seed=1)], to_device, to_host)
    check_op(lambda x, y: torch.stack([x, y], dim=-1), lambda x, y: np.stack([x, y], -1),
             [x, normal(2, 3, 4, seed=1)], to_device, to_host)


def test_view_of_a_non_contiguous_tensor_raises_pytorchs_error():
    x = torch.zeros(2, 3, 4)
    assert x.transpose(0, 1).view(3, 2, 2, 2).shape == (3, 2, 2, 2)  # splits the last axis only: a view
    assert not x.transpose(1, 2).is_contiguous()
    with pytest.raises(RuntimeError, match=r"view size is not compatible with input tensor's size and stride"):
        x.transpose(1, 2).view(2, 12)
    assert x.transpose(1, 2).reshape(2, 12).shape == (2, 12)  # reshape copies instead
    with pytest.raises(RuntimeError, match=r"shape '\[5, -1\]' is invalid for input of size 24"):
        x.view(5, -1)
    with pytest.raises(RuntimeError, match="The expanded size of the tensor"):
        x.expand(2, 5, 4)


def test_views_share_memory():
    x = torch.arange(6).view(2, 3)
    y = x.T
    x[0, 0] = 7
    assert y[0, 0].item() == 7


# ---- conversions, factories, sampling -------------------------------------------------------------------------------

def test_conversions():
    x = torch.tensor([[1.5, -2.0]], requires_grad=True)
    with pytest.raises(RuntimeError, match=r"Can't call numpy\(\) on Tensor that requires grad"):
        x.numpy()
    assert x.detach().numpy().tolist() == [[1.5, -2.0]]
    assert x.to(torch.int64).tolist() == [[1, -2]] and x.long().dtype == torch.int64
    assert x.to("cpu") is x and x.to(torch.float32) is x
    assert torch.tensor([[[4.0]]]).item() == 4.0 and isinstance(torch.tensor([3]).item(), int)
    with pytest.raises(RuntimeError, match="a Tensor with 2 elements cannot be converted to Scalar"):
        x.item()
    assert x.dim() == 2 and len(x) == 1 and x.size(1) == 2
    with pytest.raises(TypeError, match="len\\(\\) of a 0-d tensor"):
        len(torch.tensor(1.0))
    assert repr(torch.tensor([1.0, 2.5])) == "tensor([1. , 2.5])"
    assert repr(x * 1) == "tensor([[ 1.5, -2. ]], grad_fn=<MulBackward>)"
    assert repr(torch.tensor([1, 2], dtype=torch.int32)) == "tensor([1, 2], dtype=torch.int32)"


def test_factories_seeded_by_manual_seed():
    assert torch.zeros(2, 3).tolist() == [[0.0] * 3] * 2 and torch.ones((2,), dtype=torch.long).tolist() == [1, 1]
    assert torch.full((2,), 7).dtype == torch.int64 and torch.full((1,), 0.5).tolist() == [0.5]
    assert torch.arange(4).tolist() == [0, 1, 2, 3] and torch.arange(0, 1, 0.5).dtype == torch.float32
    assert torch.empty(3, 2).shape == (3, 2)
    x = torch.randn(2, 3)
    assert torch.zeros_like(x).shape == (2, 3) and torch.ones_like(x).sum().item() == 6.0
    assert torch.full_like(x, 2.0).mean().item() == 2.0
    draws = []
    for _ in range(2):
        torch.manual_seed(5)
        draws.append((torch.rand(4).tolist(), torch.randn(3).tolist(), torch.randint(0, 10, (5,)).tolist()))
    assert draws[0] == draws[1]
    values = torch.rand(10_000).numpy()
    assert 0 <= values.min() and values.max() < 1 and abs(values.mean() - 0.5) < 0.02


def test_topk_and_multinomial(to_device, to_host):
    x = torch.tensor([[0.1, 0.9, 0.5, 0.7], [3.0, 1.0, 2.0, 0.0]])
    values, indices = torch.topk(x, 2)
    np.testing.assert_allclose(values.numpy(), [[0.9, 0.7], [3.0, 2.0]], rtol=1e-7)
    assert indices.tolist() == [[1, 3], [0, 2]]
    check_op(lambda x: x.topk(2, dim=0).values, lambda x: -np.sort(-x, axis=0)[:2], [normal(5, 3)],
             to_device, to_host)
    torch.manual_seed(0)
    probabilities = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.0, 0.5]])
    samples = torch.multinomial(probabilities, num_samples=1)
    assert samples.shape == (2, 1) and samples[0, 0].item() == 1 and samples[1, 0].item() in (0, 2)
    counts = np.bincount(torch.multinomial(torch.tensor([0.2, 0.8]), 2000, replacement=True).numpy(), minlength=2)
    assert abs(counts[1] / 2000 - 0.8) < 0.05


def test_a_sum_keeps_none_of_its_operands_for_the_backward_and_a_product_keeps_both(rng, to_device):
    """Activations live as long as the graph: x + y needs none of them to differentiate, x * y both."""
    x = torch.tensor(rng.standard_normal((4, 5)).astype(np.float32), requires_grad=True)
    y = torch.tensor(rng.standard_normal((4, 5)).astype(np.float32), requires_grad=True)
    assert [a is None for a in (x + y).grad_fn.ctx.saved_tensors] == [True, True, True]
    assert [a is None for a in (x * y).grad_fn.ctx.saved_tensors] == [False, False, True]
