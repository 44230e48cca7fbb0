"""More of PyTorch's surface: torch.prod, torch.einsum, scatter and scatter_add, nn.BatchNorm1d and F.batch_norm,
each against float64 numpy (np.prod, np.einsum, scatter by loops, a batch norm written out), gradients against
central finite differences of the float64 reference or against analytic float64 ones; against PyTorch too where
it is installed."""

import numpy as np
import pytest

import gpt2_cupy as torch
import gpt2_cupy.nn as nn
from gpt2_cupy import backend, tensor_ops
from gpt2_cupy.dtypes import BFLOAT16
from gpt2_cupy.nn import functional as F
from gpt2_cupy.testing import finite_difference_gradient, relative_error, torch_or_none


def host(t):
    return backend.asnumpy(t.detach().data).astype(np.float64)


def gradients_of(function, arrays, weights):
    """The gradients of sum(function(*tensors) * weights) with respect to each float64 array, by autograd."""
    tensors = [torch.tensor(a, requires_grad=True) for a in arrays]
    (function(*tensors) * torch.tensor(weights)).sum().backward()
    return [host(t.grad) for t in tensors]


def numeric_gradients(reference, arrays, weights):
    """The same gradients by central differences of the float64 reference."""
    return [finite_difference_gradient(lambda: float((reference(*arrays) * weights).sum()), a) for a in arrays]


# ---- prod ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dim, keepdim", [(None, False), (0, False), (1, True), (-1, False), (2, True)])
def test_prod_against_numpy(rng, dim, keepdim):
    x64 = rng.uniform(0.5, 1.5, (3, 4, 5))
    got = torch.tensor(x64).prod() if dim is None else torch.tensor(x64).prod(dim, keepdim=keepdim)
    reference = np.prod(x64) if dim is None else np.prod(x64, axis=dim, keepdims=keepdim)
    assert got.shape == np.shape(reference)
    assert relative_error(host(got), reference) < 1e-6
    assert relative_error(host(torch.prod(torch.tensor(x64), 1)), np.prod(x64, axis=1)) < 1e-6


def test_prod_types():
    """Integers and bools give int64 (exactly), floats keep their dtype, dtype= converts the input first."""
    ints = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32)
    assert torch.prod(ints).dtype == torch.int64 and torch.prod(ints).item() == 720
    assert ints.prod(1).tolist() == [6, 120]
    assert torch.tensor([True, False]).prod().dtype == torch.int64
    assert torch.prod(ints, dtype=torch.float32).dtype == torch.float32
    assert torch.tensor([1.5, 2.0]).prod().dtype == torch.float32
    assert torch.tensor(3.0).prod(0).item() == 3.0
    with pytest.raises(TypeError, match="prod\\(\\): argument 'dim' must be int"):
        ints.prod((0, 1))


def products_of_the_others(x64, axis):
    """d prod / d x[k] along axis: the product of every other element of the slice, by deleting it (no division)."""
    moved = np.moveaxis(x64, axis, -1)
    others = np.empty_like(moved)
    for position in np.ndindex(moved.shape):
        others[position] = np.prod(np.delete(moved[position[:-1]], position[-1]))
    return np.moveaxis(others, -1, axis)


def test_prod_gradient_against_finite_differences(rng):
    x64 = rng.uniform(0.5, 1.5, (3, 4))
    w = rng.standard_normal(3)
    (got,) = gradients_of(lambda x: x.prod(1), [x64], w)
    (numeric,) = numeric_gradients(lambda x: np.prod(x, axis=1), [x64], w)
    assert relative_error(got, numeric) < 1e-5


@pytest.mark.parametrize("row", [[2.0, 0.0, 3.0, 0.5], [0.0, 0.0, 3.0, 2.0], [0.0, 1.5, 0.0, 0.0],
                                 [0.0, 0.0, 0.0, 0.0], [1.5, 2.0, 0.5, 0.0]])
def test_prod_gradient_with_zeros_in_the_slice(rng, row):
    """One zero: its gradient is the product of the rest, the others' 0. Two or more: every gradient 0."""
    x64 = np.array([row, [1.0, 2.0, 0.5, 3.0], row[::-1]])
    w = rng.standard_normal(3)
    (got,) = gradients_of(lambda x: x.prod(1), [x64], w)
    expected = products_of_the_others(x64, 1) * w[:, None]
    assert np.all(np.isfinite(got))
    assert np.allclose(got, expected, rtol=1e-6, atol=1e-7)
    (got_all,) = gradients_of(lambda x: x.prod(0, keepdim=True), [x64.T.copy()], w[None, :])
    assert np.allclose(got_all, expected.T, rtol=1e-6, atol=1e-7)


def test_prod_of_everything_gradient_with_one_zero():
    x64 = np.array([[2.0, 0.0], [3.0, 0.5]])
    (got,) = gradients_of(lambda x: x.prod(), [x64], np.array(1.0))
    assert np.allclose(got, [[0.0, 3.0], [0.0, 0.0]])


# ---- einsum ----------------------------------------------------------------------------------------------------------

EINSUM_CASES = [
    ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),       # a batched matrix product
    ("bhqd,bhkd->bhqk", [(2, 3, 4, 5), (2, 3, 6, 5)]),   # attention scores
    ("ij,jk", [(3, 4), (4, 2)]),                    # implicit output
    ("ij", [(2, 3)]), ("ji", [(2, 3)]), ("ba", [(2, 3)]),    # implicit: sorted letters
    ("ij->", [(2, 3)]), ("ij->j", [(2, 3)]),        # sums
    ("ii->i", [(4, 4)]), ("ii", [(4, 4)]),          # diagonal, trace
    ("iij->ji", [(3, 3, 2)]), ("iii->i", [(3, 3, 3)]),
    ("ij,ij->ij", [(2, 3), (2, 3)]), ("i,i", [(5,), (5,)]), ("i,j->ij", [(3,), (4,)]),
    ("...ij,...jk", [(2, 1, 3, 4), (5, 4, 2)]),     # a broadcasting ellipsis
    ("...ij,...jk->...ik", [(2, 3, 4), (4, 2)]), ("i...->...", [(3, 2, 4)]), ("...", [(2, 3)]),
    ("ij,jk,kl->il", [(2, 3), (3, 4), (4, 5)]),     # three operands
    ("abc,cd,a,db->", [(2, 3, 4), (4, 5), (2,), (5, 3)]),
    ("Ab,bA->A", [(3, 4), (4, 3)]), ("bB", [(2, 3)]),   # uppercase letters, sorted before lowercase
    (" i j , j k -> i k ", [(2, 3), (3, 4)]),        # spaces
]


@pytest.mark.parametrize("equation, shapes", EINSUM_CASES)
def test_einsum_and_its_gradients_against_numpy(rng, equation, shapes):
    arrays = [rng.standard_normal(shape) for shape in shapes]
    reference = np.einsum(equation.replace(" ", ""), *arrays)
    got = torch.einsum(equation, *[torch.tensor(a) for a in arrays])
    assert got.shape == reference.shape
    assert relative_error(host(got), reference) < 1e-5
    w = rng.standard_normal(reference.shape)
    got_gradients = gradients_of(lambda *ts: torch.einsum(equation, *ts), arrays, w)
    numeric = numeric_gradients(lambda *xs: np.einsum(equation.replace(" ", ""), *xs), arrays, w)
    for got_gradient, numeric_gradient in zip(got_gradients, numeric):
        assert relative_error(got_gradient, numeric_gradient) < 1e-5


def test_einsum_takes_the_operands_as_one_list(rng):
    a, b = rng.standard_normal((2, 3)), rng.standard_normal((3, 4))
    got = torch.einsum("ij,jk->ik", [torch.tensor(a), torch.tensor(b)])
    assert relative_error(host(got), a @ b) < 1e-6


def test_einsum_broadcasts_axes_of_size_one(rng):
    """A label of size 1 in one operand and n in another broadcasts, as PyTorch's (numpy's einsum refuses)."""
    a, b = rng.standard_normal((2, 1)), rng.standard_normal((3, 4))
    got = torch.einsum("ik,jk->ij", torch.tensor(a), torch.tensor(b))
    assert relative_error(host(got), np.broadcast_to(a, (2, 4)) @ b.T) < 1e-6
    c, d = rng.standard_normal((1, 3, 4)), rng.standard_normal((2, 2, 3))
    got = torch.einsum("bij,bjk->bik", torch.tensor(d), torch.tensor(c))
    assert relative_error(host(got), np.matmul(d, c)) < 1e-6


def test_einsum_of_integers_is_exact():
    a, b = np.arange(6).reshape(2, 3), np.arange(12).reshape(3, 4)
    got = torch.einsum("ij,jk->ik", torch.tensor(a), torch.tensor(b))
    assert got.dtype == torch.int64 and got.tolist() == (a @ b).tolist()


@pytest.mark.parametrize("equation, shapes", [("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),
                                              ("bhqd,bhkd->bhqk", [(2, 3, 4, 5), (2, 3, 6, 5)])])
def test_einsum_contracts_pairs_by_matmul(monkeypatch, rng, equation, shapes):
    """A pair's contraction is one batched matrix product, not a broadcast product summed."""
    calls = []
    original = tensor_ops.matmul
    monkeypatch.setattr(tensor_ops, "matmul", lambda a, b: calls.append((a.shape, b.shape)) or original(a, b))
    torch.einsum(equation, *[torch.tensor(rng.standard_normal(shape)) for shape in shapes])
    assert len(calls) == 1


@pytest.mark.parametrize("equation, shapes, message", [
    ("ij,jk", [(2, 3)], "fewer operands were provided than specified in the equation"),
    ("ij", [(2, 3), (3, 2)], "more operands were provided than specified in the equation"),
    ("ij.k", [(2, 3, 4)], "found '.' for operand 0 that is not part of any ellipsis"),
    ("...i...", [(2, 3)], "found '.' for operand 0 for which an ellipsis was already found"),
    ("i1", [(2, 3)], "invalid subscript given at index 1 in the equation string, subscripts must be in \\[a-zA-Z\\]"),
    ("ij->i!", [(2, 3)], "invalid subscript given at index 5"),
    ("ijk", [(2, 3)], "the number of subscripts in the equation \\(3\\) does not match the number of dimensions "
                      "\\(2\\) for operand 0 and no ellipsis was given"),
    ("ijk...", [(2, 3)], "the number of subscripts in the equation \\(3\\) is more than the number of dimensions "
                         "\\(2\\) for operand 0"),
    ("ij->ii", [(2, 3)], "output subscript i appears more than once in the output"),
    ("ij->k", [(2, 3)], "output subscript k does not appear in the equation for any input operand"),
    ("ij->i..i", [(2, 3)], "found '.' for output that is not part of any ellipsis \\(...\\)"),
    ("...ij->......", [(2, 3)], "found '.' for output but an ellipsis \\(...\\) was already found"),
    ("ii->i", [(2, 3)], "subscript i is repeated for operand 0 but the sizes don't match, 3 != 2"),
    ("ij,jk->ik", [(2, 3), (4, 5)], "subscript j has size 4 for operand 1 which does not broadcast with previously "
                                    "seen size 3"),
    ("...i,...i", [(2, 3), (4, 3)], "dimension 0 covered by ellipsis in operand 1 has size 4 which does not "
                                    "broadcast with previously seen ellipsis with size 2 for the respective dimension"),
])
def test_einsum_errors(equation, shapes, message):
    with pytest.raises(RuntimeError, match="einsum\\(\\): " + message):
        torch.einsum(equation, *[torch.zeros(*shape) for shape in shapes])


def test_einsum_without_operands():
    with pytest.raises(ValueError, match="einsum\\(\\): must specify the equation string and at least one operand"):
        torch.einsum("ij")


# ---- scatter, scatter_add ----------------------------------------------------------------------------------------------

def scatter_reference(x, dim, index, src, add):
    """numpy, by loops over index's positions: x[p with its dim-th coordinate index[p]] = (or +=) src[p]."""
    out = x.copy()
    for position in np.ndindex(index.shape):
        target = list(position)
        target[dim] = index[position]
        value = src[position] if isinstance(src, np.ndarray) else src
        out[tuple(target)] = out[tuple(target)] + value if add else value
    return out


def scatter_gradients_reference(x_shape, dim, index, src_shape, w, add):
    """d sum(out * w): to x, w where nothing was written (everywhere for scatter_add); to src, w read back at
    each position that was written from it (gather's), 0 in src's unused part."""
    to_x = w.copy()
    to_src = np.zeros(src_shape)
    for position in np.ndindex(index.shape):
        target = list(position)
        target[dim] = index[position]
        to_src[position] = w[tuple(target)]
        if not add:
            to_x[tuple(target)] = 0.0
    return to_x, to_src


SCATTER_CASES = [((3, 5), 0, (2, 5), (2, 5)), ((3, 5), 1, (3, 2), (3, 4)), ((4, 3, 2), 1, (2, 3, 2), (3, 3, 2)),
                 ((4, 3, 2), -1, (4, 2, 2), (4, 3, 3)), ((4, 3, 2), 0, (3, 2, 1), (5, 2, 2))]


def scatter_index(rng, x_shape, dim, index_shape, unique):
    """int64 positions along dim; unique: no two positions of one slice the same (the written value is then
    well defined for scatter, as PyTorch asks)."""
    size = x_shape[dim]
    if not unique:
        return rng.integers(0, size, index_shape)
    moved = np.moveaxis(np.empty(index_shape, np.int64), dim, -1)
    for position in np.ndindex(moved.shape[:-1]):
        moved[position] = rng.permutation(size)[:moved.shape[-1]]
    return np.ascontiguousarray(np.moveaxis(moved, -1, dim))


@pytest.mark.parametrize("add", [False, True])
@pytest.mark.parametrize("x_shape, dim, index_shape, src_shape", SCATTER_CASES)
def test_scatter_and_its_gradients_against_loops(rng, x_shape, dim, index_shape, src_shape, add):
    x64, src64 = rng.standard_normal(x_shape), rng.standard_normal(src_shape)
    index = scatter_index(rng, x_shape, dim % len(x_shape), index_shape, unique=not add)
    positive = dim % len(x_shape)
    operation = torch.scatter_add if add else torch.scatter
    got = operation(torch.tensor(x64), dim, torch.tensor(index), torch.tensor(src64))
    assert relative_error(host(got), scatter_reference(x64, positive, index, src64, add)) < 1e-6
    method = torch.tensor(x64).scatter_add if add else torch.tensor(x64).scatter
    assert relative_error(host(method(dim, torch.tensor(index), torch.tensor(src64))), host(got)) == 0
    w = rng.standard_normal(x_shape)
    got_x, got_src = gradients_of(lambda x, s: operation(x, dim, torch.tensor(index), s), [x64, src64], w)
    to_x, to_src = scatter_gradients_reference(x_shape, positive, index, src_shape, w, add)
    assert np.allclose(got_x, to_x, rtol=1e-6, atol=1e-7) and np.allclose(got_src, to_src, rtol=1e-6, atol=1e-7)


def test_scatter_add_adds_repeated_positions():
    index = torch.tensor([[0, 0, 2, 0]])
    got = torch.zeros(3).scatter_add(0, index[0], torch.tensor([1.0, 2.0, 4.0, 8.0]))
    assert host(got).tolist() == [11.0, 0.0, 4.0]


def test_scatter_of_a_number_and_in_place(rng):
    x64 = rng.standard_normal((2, 4))
    index = np.array([[1], [3]])
    got = torch.tensor(x64).scatter(1, torch.tensor(index), 7.5)
    assert relative_error(host(got), scatter_reference(x64, 1, index, 7.5, False)) < 1e-6
    x = torch.tensor(x64)
    assert x.scatter_(1, torch.tensor(index), value=7.5) is x
    assert relative_error(host(x), host(got)) == 0
    src64 = rng.standard_normal((2, 1))
    x.scatter_add_(1, torch.tensor(index), torch.tensor(src64))
    assert relative_error(host(x), scatter_reference(host(got), 1, index, src64, True)) < 1e-6


@pytest.mark.parametrize("add", [False, True])
def test_scatter_in_place_inside_a_graph(rng, add):
    """scatter_ on a non-leaf is recorded: the leaf's gradient passes through where nothing was written."""
    x64, src64 = rng.standard_normal((3, 4)), rng.standard_normal((1, 4))
    index = np.array([[2, 0, 1, 2]])
    w = rng.standard_normal((3, 4))

    def in_place(x, s):
        y = x * 2.0
        return y.scatter_add_(0, torch.tensor(index), s) if add else y.scatter_(0, torch.tensor(index), s)

    got_x, got_src = gradients_of(in_place, [x64, src64], w)
    to_x, to_src = scatter_gradients_reference((3, 4), 0, index, (1, 4), w, add)
    assert np.allclose(got_x, 2.0 * to_x, rtol=1e-6) and np.allclose(got_src, to_src, rtol=1e-6)
    leaf = torch.tensor(x64, requires_grad=True)
    with pytest.raises(RuntimeError, match="a leaf Variable that requires grad is being used in an in-place"):
        leaf.scatter_(0, torch.tensor(index), torch.tensor(src64))


@pytest.mark.parametrize("index, src, message", [
    ([[3, 0]], None, "index 3 is out of bounds for dimension 0 with size 3"),
    ([[-1, 0]], None, "index -1 is out of bounds for dimension 0 with size 3"),
    ([0, 1], None, "Index tensor must have the same number of dimensions as self tensor"),
    ([[0, 1, 2]], None, "Expected index \\[1, 3\\] to be smaller than self \\[3, 2\\] apart from dimension 0 and "
                        "to be smaller size than src \\[2, 2\\]"),
    ([[0, 1]], "int", "scatter\\(\\): Expected self.dtype to be equal to src.dtype"),
])
def test_scatter_errors(index, src, message):
    src = torch.ones(2, 2, dtype=torch.int64) if src == "int" else torch.ones(2, 2)
    with pytest.raises(RuntimeError, match=message):
        torch.zeros(3, 2).scatter(0, torch.tensor(index), src)


def test_scatter_shape_errors_of_a_number_and_of_scatter_add():
    with pytest.raises(RuntimeError, match="Expected index \\[1, 3\\] to be smaller than self \\[3, 2\\] apart from "
                                           "dimension 0$"):
        torch.zeros(3, 2).scatter(0, torch.tensor([[0, 1, 2]]), 1.0)
    with pytest.raises(RuntimeError, match="Index tensor must have the same number of dimensions as src tensor"):
        torch.zeros(3, 2).scatter_add(0, torch.tensor([[0, 1]]), torch.ones(2))
    with pytest.raises(TypeError, match="scatter_add\\(\\): argument 'src' must be Tensor, not float"):
        torch.zeros(3, 2).scatter_add(0, torch.tensor([[0, 1]]), 1.0)
    assert torch.zeros(2).scatter(0, torch.zeros(0, dtype=torch.int64), 5.0).tolist() == [0.0, 0.0]


def test_scatter_index_must_be_int64():
    with pytest.raises(RuntimeError, match="scatter\\(\\): Expected dtype int64 for index"):
        torch.zeros(3).scatter(0, torch.tensor([0, 1], dtype=torch.int32), torch.ones(2))
    with pytest.raises(RuntimeError, match="index 5 is out of bounds for dimension 0 with size 3"):
        torch.zeros(3).scatter_add_(0, torch.tensor([5]), torch.ones(1))


# ---- batch norm ----------------------------------------------------------------------------------------------------------

def batch_norm_reference(x, weight, bias, mean=None, var=None, eps=1e-5):
    """float64: (x - mean) / sqrt(var + eps) * weight + bias per channel (axis 1); the batch's mean and biased
    variance over every other axis unless given."""
    axes = (0,) + tuple(range(2, x.ndim))
    shape = (1, -1) + (1,) * (x.ndim - 2)
    mean = x.mean(axis=axes) if mean is None else mean
    var = x.var(axis=axes) if var is None else var
    return (x - mean.reshape(shape)) / np.sqrt(var.reshape(shape) + eps) * weight.reshape(shape) + bias.reshape(shape)


@pytest.mark.parametrize("shape", [(8, 3), (4, 3, 5)])
@pytest.mark.parametrize("momentum", [0.1, None])
def test_batchnorm1d_training_and_running_statistics(rng, shape, momentum):
    layer = nn.BatchNorm1d(3, momentum=momentum)
    weight, bias = rng.uniform(0.5, 1.5, 3), rng.standard_normal(3)
    layer.weight.data.copy_(torch.tensor(weight))
    layer.bias.data.copy_(torch.tensor(bias))
    running_mean, running_var = np.zeros(3), np.ones(3)
    axes = (0,) + tuple(range(2, len(shape)))
    count = np.prod(shape) // 3
    for step in range(1, 4):
        x64 = rng.standard_normal(shape) * 2 + step
        got = layer(torch.tensor(x64))
        assert relative_error(host(got), batch_norm_reference(x64, weight, bias)) < 1e-5
        factor = 1.0 / step if momentum is None else momentum  # None: the plain average of the batches
        running_mean = (1 - factor) * running_mean + factor * x64.mean(axis=axes)
        running_var = (1 - factor) * running_var + factor * x64.var(axis=axes) * count / (count - 1)
    assert relative_error(host(layer.running_mean), running_mean) < 1e-5
    assert relative_error(host(layer.running_var), running_var) < 1e-5
    assert layer.num_batches_tracked.dtype == torch.int64 and layer.num_batches_tracked.item() == 3
    layer.eval()
    x64 = rng.standard_normal(shape)
    got = layer(torch.tensor(x64))
    assert relative_error(host(got), batch_norm_reference(x64, weight, bias, running_mean, running_var)) < 1e-5
    assert layer.num_batches_tracked.item() == 3  # evaluation changes no statistics


@pytest.mark.parametrize("shape", [(6, 3), (3, 3, 4)])
def test_batch_norm_gradients_against_finite_differences(rng, shape):
    arrays = [rng.standard_normal(shape), rng.uniform(0.5, 1.5, 3), rng.standard_normal(3)]
    w = rng.standard_normal(shape)
    got = gradients_of(lambda x, g, b: F.batch_norm(x, None, None, g, b, training=True), arrays, w)
    numeric = numeric_gradients(batch_norm_reference, arrays, w)
    for got_gradient, numeric_gradient in zip(got, numeric):
        assert relative_error(got_gradient, numeric_gradient) < 1e-4


def test_batch_norm_in_evaluation_uses_the_running_statistics(rng):
    x64, mean, var = rng.standard_normal((5, 3, 2)), rng.standard_normal(3), rng.uniform(0.5, 2, 3)
    got = F.batch_norm(torch.tensor(x64), torch.tensor(mean), torch.tensor(var))
    assert relative_error(host(got), batch_norm_reference(x64, np.ones(3), np.zeros(3), mean, var)) < 1e-5
    w = rng.standard_normal((5, 3, 2))
    (got_gradient,) = gradients_of(lambda x: F.batch_norm(x, torch.tensor(mean), torch.tensor(var)), [x64], w)
    assert relative_error(got_gradient, w / np.sqrt(var + 1e-5).reshape(1, 3, 1)) < 1e-5


def test_batchnorm1d_buffers_and_state_dict(rng):
    layer = nn.BatchNorm1d(4)
    assert list(layer.state_dict()) == ["weight", "bias", "running_mean", "running_var", "num_batches_tracked"]
    assert [name for name, _ in layer.named_parameters()] == ["weight", "bias"]
    assert [name for name, _ in layer.named_buffers()] == ["running_mean", "running_var", "num_batches_tracked"]
    layer(torch.tensor(rng.standard_normal((5, 4))))
    copy = nn.BatchNorm1d(4)
    copy.load_state_dict(layer.state_dict())
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        assert host(getattr(copy, name)).tolist() == host(getattr(layer, name)).tolist()
    assert layer.to("cuda") is layer and layer.cuda() is layer and layer.running_mean.shape == (4,)
    assert repr(layer) == "BatchNorm1d(4, eps=1e-05, momentum=0.1, affine=True, track_running_stats=True)"


def test_batchnorm1d_without_running_statistics_or_affine(rng):
    layer = nn.BatchNorm1d(3, affine=False, track_running_stats=False).eval()
    assert layer.running_mean is None and layer.parameters() == [] and list(layer.state_dict()) == []
    x64 = rng.standard_normal((6, 3))
    assert relative_error(host(layer(torch.tensor(x64))), batch_norm_reference(x64, np.ones(3), np.zeros(3))) < 1e-5


def test_batch_norm_errors():
    with pytest.raises(ValueError, match="expected 2D or 3D input \\(got 4D input\\)"):
        nn.BatchNorm1d(3)(torch.zeros(2, 3, 4, 5))
    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training, got input size "
                                         "torch.Size\\(\\[1, 3\\]\\)"):
        nn.BatchNorm1d(3)(torch.zeros(1, 3))
    with pytest.raises(RuntimeError, match="running_mean should contain 4 elements not 3"):
        F.batch_norm(torch.zeros(2, 4), torch.zeros(3), torch.ones(3))


# ---- against PyTorch, where it is installed ---------------------------------------------------------------------------

def test_against_pytorch(rng):
    reference = torch_or_none()
    if reference is None:
        pytest.skip("PyTorch is not installed")
    x64 = rng.standard_normal((4, 3, 5))
    x64[0, 1, 2] = 0.0
    ours, theirs = torch.tensor(x64, requires_grad=True), reference.tensor(x64, requires_grad=True)
    for function in (lambda t: t.prod(2), lambda t: reference_or_ours(t).einsum("bij,bkj->bik", t, t),
                     lambda t: reference_or_ours(t).nn.functional.batch_norm(t, None, None, training=True)):
        ours.grad = theirs.grad = None
        got, expected = function(ours), function(theirs)
        assert relative_error(host(got), expected.detach().numpy()) < 1e-5
        # A weighted sum: the gradient of a plain sum through a normalisation is zero, and a relative error
        # against PyTorch's rounding-level 1e-17 would mean nothing.
        weights = rng.standard_normal(tuple(expected.shape))
        (got * torch.tensor(weights)).sum().backward()
        (expected * reference.tensor(weights)).sum().backward()
        assert relative_error(host(ours.grad), theirs.grad.numpy()) < 1e-4


def reference_or_ours(t):
    """The package a tensor comes from: gpt2_cupy for ours, torch for PyTorch's."""
    return torch if isinstance(t, torch.Tensor) else torch_or_none()


def test_module_to_bfloat16_converts_floating_buffers_and_keeps_integer_ones():
    """As torch.nn.Module.to(dtype): a BatchNorm's running statistics follow the parameters to bf16; the count
    of batches tracked stays int64; the values are the float32 ones rounded to bf16."""
    norm = nn.BatchNorm1d(3)
    norm.running_mean._data[...] = backend.xp.asarray(np.array([0.1, -2.5, 3.0], dtype=np.float32))
    norm.to(torch.bfloat16)
    assert norm.weight.dtype == BFLOAT16 and norm.running_mean.dtype == BFLOAT16 and norm.running_var.dtype == BFLOAT16
    assert norm.num_batches_tracked.dtype == np.int64
    got = backend.asnumpy(norm.running_mean._data).astype(np.float64)
    np.testing.assert_array_equal(got, np.array([0.1, -2.5, 3.0], dtype=np.float32).astype(BFLOAT16).astype(np.float64))
