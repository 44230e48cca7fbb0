"""In-place operations: values against float64 numpy, writes seen through every reference and view, PyTorch's
autograd rules (the leaf error, the version check of saved tensors, gradients through an in-place operation
on an intermediate tensor against central differences), and a replayed CUDA graph capture."""

import numpy as np
import pytest

import gpt2_cupy
import gpt2_cupy as torch
from gpt2_cupy import graphs
from gpt2_cupy.autograd import Tensor
from gpt2_cupy.testing import relative_error
from test_functional import check_op

TOLERANCE = 1e-6  # one float32 rounding of each element


def normal(*shape, seed=0):
    return np.random.default_rng(seed).normal(size=shape)


def tensor(array, to_device, requires_grad=False):
    return Tensor(to_device(np.asarray(array).astype(np.float32)), requires_grad=requires_grad)


# ---- values --------------------------------------------------------------------------------------------------

X, ROW, COLUMN = normal(3, 4), normal(4, seed=1), normal(3, 1, seed=2)
MASK = normal(1, 4, seed=3) > 0  # broadcast over the rows

CASES = {
    "add_ broadcast": (lambda x, t: x.add_(t(ROW)), lambda x: x + ROW),
    "add_ alpha": (lambda x, t: x.add_(t(COLUMN), alpha=0.5), lambda x: x + 0.5 * COLUMN),
    "add_ number": (lambda x, t: x.add_(2.5), lambda x: x + 2.5),
    "sub_ alpha": (lambda x, t: x.sub_(t(ROW), alpha=3), lambda x: x - 3 * ROW),
    "mul_ broadcast": (lambda x, t: x.mul_(t(COLUMN)), lambda x: x * COLUMN),
    "mul_ 0-d tensor": (lambda x, t: x.mul_(t(np.float64(-1.5))), lambda x: x * -1.5),
    "div_ broadcast": (lambda x, t: x.div_(t(ROW)), lambda x: x / ROW),
    "div_ number": (lambda x, t: x.div_(4), lambda x: x / 4),
    "zero_": (lambda x, t: x.zero_(), lambda x: np.zeros_like(x)),
    "fill_": (lambda x, t: x.fill_(-0.75), lambda x: np.full_like(x, -0.75)),
    "fill_ 0-d tensor": (lambda x, t: x.fill_(t(np.float64(3.0))), lambda x: np.full_like(x, 3.0)),
    "copy_ broadcast": (lambda x, t: x.copy_(t(ROW)), lambda x: np.broadcast_to(ROW, x.shape)),
    "copy_ from int64": (lambda x, t: x.copy_(torch.tensor([[1, -2, 3, 40]])),
                         lambda x: np.broadcast_to([1.0, -2.0, 3.0, 40.0], x.shape)),
    "clamp_ both": (lambda x, t: x.clamp_(-0.5, 0.5), lambda x: np.clip(x, -0.5, 0.5)),
    "clamp_ min": (lambda x, t: x.clamp_(min=0.1), lambda x: np.maximum(x, 0.1)),
    "clamp_ max": (lambda x, t: x.clamp_(max=-0.1), lambda x: np.minimum(x, -0.1)),
    "masked_fill_": (lambda x, t: x.masked_fill_(torch.tensor(MASK), -9.0), lambda x: np.where(MASK, -9.0, x)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_method_writes_into_self_and_returns_it(case, to_device, to_host):
    method, reference = CASES[case]
    x = tensor(X, to_device)
    array = x._data
    result = method(x, lambda a: tensor(a, to_device))
    assert result is x and x._data is array  # the same tensor, the same memory
    assert relative_error(to_host(x._data), reference(X.astype(np.float32).astype(np.float64))) < TOLERANCE
    assert x._version == 1


def test_copy_converts_to_the_destination_dtype_as_pytorch(to_device, to_host):
    ids = torch.zeros(4, dtype=torch.long)
    ids.copy_(tensor([1.9, -1.9, 0.2, 7.0], to_device))
    assert ids.dtype == np.int64 and to_host(ids._data).tolist() == [1, -1, 0, 7]  # truncated toward 0
    flags = torch.zeros(3, dtype=torch.bool).copy_(tensor([0.0, 2.0, -0.5], to_device))
    assert to_host(flags._data).tolist() == [False, True, True]


def test_integer_tensor_keeps_integer_arithmetic(to_device, to_host):
    counts = torch.tensor([1, 2, 3])
    counts.mul_(3).add_(1)
    assert counts.dtype == np.int64 and to_host(counts._data).tolist() == [4, 7, 10]


# ---- every reference sees the write ----------------------------------------------------------------------

def test_other_references_and_views_see_the_change(to_device, to_host):
    x = tensor(X, to_device)
    alias, flat, row = x, x.view(12), x[1]
    x.add_(1.0)
    expected = X.astype(np.float32) + np.float32(1)
    assert np.array_equal(to_host(alias._data), expected)
    assert np.array_equal(to_host(flat._data), expected.reshape(12))
    assert np.array_equal(to_host(row._data), expected[1])
    row.mul_(0.0)  # through a view, into the tensor it was taken from
    expected[1] = 0
    assert np.array_equal(to_host(x._data), expected)
    assert x._version == flat._version == row._version == 2  # one counter per storage
    assert x.detach()._version == 2


@pytest.mark.parametrize("statement, reference", [
    ("x += y", lambda x, y: x + y), ("x -= y", lambda x, y: x - y),
    ("x *= y", lambda x, y: x * y), ("x /= y", lambda x, y: x / y)])
def test_augmented_assignment_changes_the_tensor_itself(statement, reference, to_device, to_host):
    x, y = tensor(X, to_device), tensor(ROW, to_device)
    alias, identity = x, id(x)
    namespace = {"x": x, "y": y}
    exec(statement, namespace)
    assert id(namespace["x"]) == identity  # not rebound to a new tensor
    assert relative_error(to_host(alias._data), reference(X.astype(np.float32), ROW.astype(np.float32))) < TOLERANCE


# ---- errors ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("operation", [
    lambda w: w.add_(1.0), lambda w: w.mul_(2.0), lambda w: w.zero_(), lambda w: w.fill_(1.0),
    lambda w: w.copy_(torch.ones(3)), lambda w: w.clamp_(0.0), lambda w: w.masked_fill_(torch.ones(3) > 0, 0.0),
    lambda w: w.__iadd__(1.0)])
def test_in_place_on_a_leaf_that_requires_grad_raises(operation, to_device, to_host):
    w = tensor([1.0, 2.0, 3.0], to_device, requires_grad=True)
    with pytest.raises(RuntimeError, match="a leaf Variable that requires grad is being used in an in-place"):
        operation(w)
    assert to_host(w._data).tolist() == [1.0, 2.0, 3.0] and w._version == 0


def test_no_grad_writes_a_parameter_in_place(to_device, to_host):
    weight = torch.nn.Parameter(tensor(ROW, to_device))
    gradient = tensor(normal(4, seed=5), to_device)
    with torch.no_grad():
        weight.mul_(0.5).add_(gradient, alpha=-0.1)  # what an optimizer step does
    expected = ROW.astype(np.float32) * np.float32(0.5) - np.float32(0.1) * normal(4, seed=5).astype(np.float32)
    assert relative_error(to_host(weight._data), expected) < TOLERANCE
    assert weight.is_leaf and weight.requires_grad and weight.grad_fn is None
    (weight * weight).sum().backward()  # still a parameter: d Σw² / dw = 2w
    assert relative_error(to_host(weight.grad), 2 * expected) < TOLERANCE


def test_shapes_and_types_that_do_not_fit_raise(to_device):
    with pytest.raises(RuntimeError, match=r"output with shape \[4\] doesn't match the broadcast shape \[3, 4\]"):
        tensor(ROW, to_device).add_(tensor(X, to_device))
    with pytest.raises(RuntimeError, match="result type Float can't be cast to the desired output type Long"):
        torch.tensor([1, 2]).mul_(2.5)
    with pytest.raises(RuntimeError, match="result type Float can't be cast to the desired output type Long"):
        torch.tensor([1, 2]).div_(2)
    with pytest.raises(RuntimeError, match="add_: unsupported operation: more than one element of the written-to "
                                           "tensor refers to a single memory location"):
        tensor(ROW, to_device).expand(3, 4).add_(1.0)
    square = tensor(normal(4, 4), to_device)
    with pytest.raises(RuntimeError, match="some elements of the input tensor and the written-to tensor refer to a "
                                           "single memory location"):
        square.add_(square.T)
    with pytest.raises(RuntimeError, match="expected mask to be a bool tensor"):
        tensor(X, to_device).masked_fill_(tensor(MASK, to_device), 0.0)
    with pytest.raises(RuntimeError, match="At least one of 'min' or 'max'"):
        tensor(X, to_device).clamp_()


# ---- autograd ------------------------------------------------------------------------------------------------

def test_a_saved_tensor_modified_in_place_raises_at_backward(to_device, to_host):
    x = tensor(ROW, to_device, requires_grad=True)
    y = x.exp()  # exp saves its output y for the backward
    z = y * 2.0
    y.mul_(2.0)
    assert y._version == 1
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation: \[torch\.(cuda\.)?FloatTensor \[4\]\] "
                                           r"is at version 1; expected version 0 instead"):
        z.sum().backward()


def test_setitem_also_counts_as_an_in_place_write(to_device):
    x = tensor(ROW, to_device, requires_grad=True)
    y = x.tanh()  # saves its output
    with torch.no_grad():
        y[0] = 5.0
    with pytest.raises(RuntimeError, match="is at version 1; expected version 0"):
        y.sum().backward()


def test_without_the_in_place_write_the_same_graph_runs(to_device, to_host):
    x = tensor(ROW, to_device, requires_grad=True)
    y = x.exp()
    z = y * 2.0
    y2 = y * 1.0
    y2.mul_(2.0)  # a copy of y changes, y itself keeps its version
    z.sum().backward()
    assert relative_error(to_host(x.grad), 2 * np.exp(ROW)) < 1e-5


def test_gradients_through_in_place_operations_on_an_intermediate(to_device, to_host):
    def function(a, b, c):
        h = a * 1.5
        h.mul_(b)
        h.add_(c, alpha=-0.5)
        h /= b + 3.0
        h.clamp_(min=-10.0, max=10.0)  # bounds the values never reach: the gradient passes everywhere
        h.masked_fill_(torch.tensor(MASK), 0.25)
        h -= a
        return h

    def reference(a, b, c):
        h = (a * 1.5 * b - 0.5 * c) / (b + 3.0)
        return np.where(MASK, 0.25, h) - a

    a, b, c = normal(3, 4, seed=6), np.random.default_rng(7).uniform(0.5, 2.0, size=(4,)), normal(3, 1, seed=8)
    check_op(function, reference, [a, b, c], to_device, to_host)


def test_copy_and_fill_cut_the_old_values_out_of_the_gradient(to_device, to_host):
    def copied(a, b):
        h = a * 2.0
        h.copy_(b)  # h's old values no longer matter: a gets zero, b the sum over the broadcast rows
        return h * a

    check_op(copied, lambda a, b: np.broadcast_to(b, a.shape) * a, [normal(3, 4, seed=9), normal(4, seed=10)],
             to_device, to_host)
    a = tensor(X, to_device, requires_grad=True)
    h = a * 2.0
    h.fill_(3.0)
    h.sum().backward()
    assert not to_host(a.grad).any() and a.grad.shape == (3, 4)


def test_in_place_with_an_operand_that_requires_grad_joins_the_graph(to_device, to_host):
    total = torch.zeros(3, 4)
    w = tensor(ROW, to_device, requires_grad=True)
    total.add_(w, alpha=2.0)
    total.mul_(w)
    assert total.requires_grad and not total.is_leaf and total.grad_fn.name() == "MulBackward"
    total.sum().backward()  # Σ 2w² over 3 rows: d/dw = 12 w
    assert relative_error(to_host(w.grad), 12 * ROW) < 1e-5


def test_gradients_through_in_place_operations_on_views(to_device, to_host):
    # Writes into a row, a transposed column block and a strided slice of h: the base's gradient (PyTorch's
    # CopySlices) and the views' own, against central differences of the same function in float64
    def function(a, b, c):
        h = a * 1.0
        h[1].mul_(b)                 # a row: b (4,)
        h.T[1:3].add_(c.T)           # columns 1 and 2, through a transpose: c (3, 2)
        h[:, ::2].clamp_(max=0.5)    # every other column
        return h * a

    def reference(a, b, c):
        h = a.copy()
        h[1] = h[1] * b
        h[:, 1:3] = h[:, 1:3] + c
        h[:, ::2] = np.minimum(h[:, ::2], 0.5)
        return h * a

    a, b, c = normal(3, 4, seed=13), normal(4, seed=14), normal(3, 2, seed=15)
    check_op(function, reference, [a, b, c], to_device, to_host)


def test_in_place_into_a_view_of_a_tensor_outside_the_graph_joins_it(to_device, to_host):
    total = torch.zeros(3, 4)
    w = tensor(ROW, to_device, requires_grad=True)
    total[1:].add_(w)               # rows 1 and 2 now depend on w
    assert total.requires_grad and total.grad_fn.name() == "CopySlicesBackward"
    (total * total).sum().backward()  # Σ over 2 rows of w²: d/dw = 4 w
    assert relative_error(to_host(w.grad), 4 * ROW) < 1e-6
    expected = np.zeros((3, 4))
    expected[1:] = ROW
    assert relative_error(to_host(total._data), expected) < 1e-6


def test_in_place_on_a_view_of_a_leaf_that_requires_grad_raises(to_device, to_host):
    a = tensor(X, to_device, requires_grad=True)
    with pytest.raises(RuntimeError, match="a view of a leaf Variable that requires grad is being used in an "
                                           "in-place operation"):
        a[0].mul_(2.0)
    with torch.no_grad():   # outside the graph it is a plain write
        a.T[0].mul_(2.0)
    expected = X.astype(np.float32).copy()
    expected[:, 0] *= 2
    assert np.array_equal(to_host(a._data), expected)


# ---- non-contiguous tensors: writes by strides ------------------------------------------------------------------

VIEWS = {  # the view of a (3, 4) Tensor, and the same view of a numpy array
    "transpose": (lambda x: x.T, lambda x: x.T),
    "row": (lambda x: x[1], lambda x: x[1]),
    "column": (lambda x: x[:, 2], lambda x: x[:, 2]),
    "strided slice": (lambda x: x[::2, 1::2], lambda x: x[::2, 1::2]),
    "permuted 3-d": (lambda x: x.view(3, 2, 2).permute(2, 0, 1), lambda x: x.reshape(3, 2, 2).transpose(2, 0, 1)),
}


@pytest.mark.parametrize("view", list(VIEWS))
@pytest.mark.parametrize("case", ["mul_ number", "add_ tensor", "copy_", "clamp_", "masked_fill_"])
def test_in_place_on_a_view_writes_through_to_every_alias(view, case, rng, to_device, to_host):
    x = tensor(X, to_device)
    alias = x.view(12)
    v = VIEWS[view][0](x)
    expected = X.astype(np.float32).astype(np.float64)
    target = VIEWS[view][1](expected)  # the same view of the reference
    other = rng.normal(size=v.shape)
    mask = rng.normal(size=v.shape) > 0
    result = {"mul_ number": lambda: v.mul_(-3.0), "add_ tensor": lambda: v.add_(tensor(other, to_device)),
              "copy_": lambda: v.copy_(tensor(other, to_device)), "clamp_": lambda: v.clamp_(-0.3, 0.4),
              "masked_fill_": lambda: v.masked_fill_(torch.tensor(mask), 7.0)}[case]()
    target[...] = {"mul_ number": lambda: target * -3.0, "add_ tensor": lambda: target + other.astype(np.float32),
                   "copy_": lambda: other.astype(np.float32), "clamp_": lambda: np.clip(target, -0.3, 0.4),
                   "masked_fill_": lambda: np.where(mask, 7.0, target)}[case]()
    assert result is v and not v.is_contiguous() or view == "row"
    assert relative_error(to_host(x._data), expected) < TOLERANCE
    assert relative_error(to_host(alias._data), expected.reshape(12)) < TOLERANCE
    assert relative_error(to_host(v._data), target) < TOLERANCE
    assert x._version == 1 and v._version == 1


# ---- CUDA graphs ---------------------------------------------------------------------------------------------

def test_in_place_operations_are_captured_and_run_at_each_replay(to_device, to_host):
    start, step = normal(1000, seed=11).astype(np.float32), normal(1000, seed=12).astype(np.float32)
    x, y = Tensor(to_device(start)), Tensor(to_device(step))
    scratch = Tensor(to_device(start))
    scratch.mul_(0.5).add_(y).clamp_(-1.0, 1.0)  # the warm-up: the kernels are compiled before the capture
    g = gpt2_cupy.cuda.CUDAGraph()
    with gpt2_cupy.cuda.graph(g):
        x.mul_(0.5).add_(y).clamp_(-1.0, 1.0)
    assert np.array_equal(to_host(x._data), start)  # recorded, not run
    expected = start.astype(np.float64)
    for _ in range(2):
        g.replay()
        expected = np.clip(expected * 0.5 + step, -1.0, 1.0)
        assert relative_error(to_host(x._data), expected) < 1e-6


def test_a_view_taken_before_an_in_place_write_into_its_base_follows_the_write(to_device, to_host):
    a = tensor(X, to_device, requires_grad=True)
    h = a * 1.0
    row, column = h[0], h.T[3]  # their grad_fns were taken from h as it was
    h.mul_(2.0)
    (row * 3.0 + column[0]).sum().backward()  # row 0 is 2a now: d/da = 6 on row 0, and 2 · 4 at a[0, 3]
    expected = np.zeros((3, 4))
    expected[0] = 6.0
    expected[0, 3] += 8.0
    assert np.array_equal(to_host(a.grad), expected)
