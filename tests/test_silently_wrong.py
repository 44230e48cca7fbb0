"""PyTorch code that ran but gave wrong numbers (issue 43): each test fails on the code before the fix.

References are float64 numpy, written out by hand from the rules PyTorch documents.
"""

import numpy as np
import pytest

import gpt2_cupy as torch
import gpt2_cupy.nn as nn
from gpt2_cupy import backend
from gpt2_cupy.nn import functional as F


def host(t):
    return backend.asnumpy(t.detach().data if isinstance(t, torch.Tensor) else t).astype(np.float64)


# ---- a tensor from a non-contiguous array --------------------------------------------------------------------

def test_a_linear_weight_from_a_transposed_numpy_array():
    """nn.Parameter(torch.tensor(a.T)): numpy.array keeps a.T's Fortran order; it was read as row-major."""
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    linear = nn.Linear(3, 4, bias=False)
    linear.weight = nn.Parameter(torch.tensor(a.T))
    x = np.linspace(-1, 1, 6).reshape(2, 3)
    assert np.allclose(host(linear(torch.tensor(x))), x @ a.astype(np.float64), rtol=1e-6)


@pytest.mark.parametrize("make", ["tensor", "as_tensor", "from_numpy"])
@pytest.mark.parametrize("layout", ["fortran", "transposed", "sliced", "offset", "broadcast"])
def test_factories_read_any_numpy_layout(make, layout):
    base = np.arange(60, dtype=np.float32).reshape(6, 10)
    array = {"fortran": np.asfortranarray(base), "transposed": base.T, "sliced": base[1::2, ::3],
             "offset": base.reshape(-1)[7:37].reshape(5, 6), "broadcast": np.broadcast_to(base[2], (4, 10))}[layout]
    if make == "from_numpy" and layout == "broadcast":
        array = array.copy()  # numpy's broadcast views are read-only; torch.from_numpy warns about those
    t = getattr(torch, make)(array)
    expected = array.astype(np.float64)
    assert np.array_equal(host(t), expected)
    # an operation on the tensor (a generated kernel), a matrix product (a kernel of its own) and a reduction
    assert np.allclose(host(t * 2 + 1), expected * 2 + 1)
    assert np.allclose(host(t @ torch.ones(t.shape[1], 3)), expected @ np.ones((t.shape[1], 3)))
    assert np.allclose(host(t.sum(0)), expected.sum(0))
    if make == "tensor":
        assert t.is_contiguous()  # torch.tensor always copies, into row-major order


def test_tensor_copies_and_from_numpy_shares():
    array = np.zeros(3, np.float32)
    copied, shared = torch.tensor(array), torch.from_numpy(array)
    array[0] = 5
    assert host(copied)[0] == 0
    if backend.name == "cpu":  # on a GPU from_numpy is a copy to device memory
        assert host(shared)[0] == 5


# ---- indexed assignment inside a graph -----------------------------------------------------------------------

def test_c_indexed_assignment_of_a_graph_value_is_recorded():
    """a[0] = w * 2 was written into a's array without a graph: w received only the direct term."""
    w = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    a = torch.zeros(2, 3)
    a[0] = w * 2
    c = np.array([[1.0, -2.0, 4.0], [5.0, 6.0, 7.0]])
    loss = (a * torch.tensor(c)).sum() + w.sum()
    loss.backward()
    assert np.allclose(host(w.grad), 2 * c[0] + 1)   # d/dw of Σ c·a + Σ w with a[0] = 2w


def test_c_overwritten_elements_send_no_gradient_back():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], requires_grad=True)
    v = torch.tensor([10.0, 20.0], requires_grad=True)
    a = x * 1
    a[[0, 1], [2, 0]] = v * 3     # an advanced index
    a[1, 1:] = v                  # a basic one (a view)
    c = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    (a * torch.tensor(c)).sum().backward()
    expected_x = c.copy()
    expected_x[0, 2] = expected_x[1, 0] = 0
    expected_x[1, 1:] = 0
    assert np.allclose(host(x.grad), expected_x)
    assert np.allclose(host(v.grad), [3 * c[0, 2] + c[1, 1], 3 * c[1, 0] + c[1, 2]])
    assert np.allclose(host(a), [[1, 2, 30], [60, 10, 20]])


def test_c_in_place_subtraction_at_an_advanced_index_of_a_non_leaf():
    """Zero-to-Hero's manual backward: dlogits[range(n), Yb] -= 1 on softmax's output, a non-leaf."""
    logits = torch.tensor(np.linspace(-2, 2, 12).reshape(3, 4), requires_grad=True)
    targets = torch.tensor([0, 3, 1])
    dlogits = F.softmax(logits, 1)
    dlogits[range(3), targets] -= 1
    dlogits /= 3
    z = np.linspace(-2, 2, 12).reshape(3, 4)
    expected = np.exp(z) / np.exp(z).sum(1, keepdims=True)
    expected[range(3), [0, 3, 1]] -= 1
    assert np.allclose(host(dlogits), expected / 3, atol=1e-6)
    # PyTorch's own loss gradient is the same
    F.cross_entropy(logits, targets).backward()
    assert np.allclose(host(logits.grad), expected / 3, atol=1e-6)


def test_c_a_leaf_that_requires_grad_refuses_with_pytorchs_error():
    w = torch.tensor([1.0, 2.0], requires_grad=True)
    with pytest.raises(RuntimeError, match="a leaf Variable that requires grad is being used in an in-place"):
        w[0] = 5.0
    with torch.no_grad():
        w[0] = 5.0
    assert host(w)[0] == 5


# ---- generators ------------------------------------------------------------------------------------------------

def test_d_manual_seed_returns_the_default_generator():
    g = torch.manual_seed(42)
    assert isinstance(g, torch.Generator) and g is torch.default_generator and g.initial_seed() == 42
    assert torch.initial_seed() == 42


@pytest.mark.parametrize("draw", [
    lambda g: torch.randn(5, generator=g), lambda g: torch.rand(5, generator=g),
    lambda g: torch.randint(0, 100, (5,), generator=g), lambda g: torch.randperm(20, generator=g),
    lambda g: torch.multinomial(torch.ones(10), 5, replacement=True, generator=g),
    lambda g: torch.normal(0.0, 1.0, (5,), generator=g),
    lambda g: torch.empty(5).normal_(generator=g), lambda g: torch.empty(5).uniform_(generator=g),
    lambda g: nn.init.normal_(torch.empty(5), generator=g),
], ids=["randn", "rand", "randint", "randperm", "multinomial", "normal", "normal_", "uniform_", "init.normal_"])
def test_d_generator_is_honoured_and_leaves_the_default_alone(draw):
    """The same seeded generator gives the same numbers whatever the default generator did in between;
    the default generator's stream is not consumed by a draw from another generator."""
    torch.manual_seed(0)
    first = host(draw(torch.Generator().manual_seed(2147483647)))
    after_default = host(torch.rand(3))
    torch.manual_seed(0)
    torch.rand(7)  # the default generator moves on
    second = host(draw(torch.Generator().manual_seed(2147483647)))
    assert np.array_equal(first, second)
    torch.manual_seed(0)
    draw(torch.Generator().manual_seed(1))
    assert np.array_equal(host(torch.rand(3)), after_default)
    other = host(draw(torch.Generator().manual_seed(7)))
    assert not np.array_equal(first, other)


def test_d_get_state_and_set_state_repeat_the_numbers():
    g = torch.Generator().manual_seed(5)
    torch.randn(3, generator=g)
    state = g.get_state()
    assert state.dtype == torch.uint8
    expected = host(torch.randn(4, generator=g))
    g.set_state(state)
    assert np.array_equal(host(torch.randn(4, generator=g)), expected)
    torch.manual_seed(3)
    saved = torch.get_rng_state()
    x = host(torch.rand(2))
    torch.set_rng_state(saved)
    assert np.array_equal(host(torch.rand(2)), x)


def test_d_seed_chooses_and_reports_a_seed():
    g = torch.Generator()
    chosen = g.seed()
    assert g.initial_seed() == chosen
    assert np.array_equal(host(torch.rand(3, generator=g)), host(torch.rand(3, generator=torch.Generator().manual_seed(chosen))))


# ---- .grad is a Tensor ---------------------------------------------------------------------------------------

def _trained_linear():
    torch.manual_seed(0)
    layer = nn.Linear(4, 3)
    x = torch.tensor(np.linspace(-1, 1, 8).reshape(2, 4))
    (layer(x) ** 2).sum().backward()
    return layer, x


def test_b_grad_is_a_tensor_with_pytorchs_statistics():
    """p.grad.std() was numpy's biased std: the lectures' gradient statistics came out wrong, silently."""
    layer, _ = _trained_linear()
    g = host(layer.weight.grad)
    assert isinstance(layer.weight.grad, torch.Tensor)
    assert np.isclose(layer.weight.grad.std().item(), g.std(ddof=1), rtol=1e-5)
    assert np.isclose(layer.weight.grad.mean().item(), g.mean(), rtol=1e-5, atol=1e-7)
    assert np.isclose(layer.weight.grad.abs().max().item(), np.abs(g).max(), rtol=1e-6)


def test_b_grad_in_place_and_none():
    layer, x = _trained_linear()
    before = host(layer.weight.grad)
    layer.weight.grad.zero_()
    assert not host(layer.weight.grad).any()
    (layer(x) ** 2).sum().backward()   # accumulates into the zeroed gradient
    assert np.allclose(host(layer.weight.grad), before, rtol=1e-5)
    layer.weight.grad = None
    assert layer.weight.grad is None
    with pytest.raises(RuntimeError, match="different size"):
        layer.weight.grad = torch.zeros(2, 2)
    with pytest.raises(TypeError, match="Tensor or None"):
        layer.weight.grad = [1.0]


def test_b_sgd_through_data_as_in_the_lectures():
    layer, _ = _trained_linear()
    w, g = host(layer.weight), host(layer.weight.grad)
    for p in layer.parameters():
        p.data += -0.1 * p.grad
    assert np.allclose(host(layer.weight), w - 0.1 * g, rtol=1e-6)


def test_b_an_assigned_gradient_reaches_the_optimizer():
    layer, _ = _trained_linear()
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.5)
    w = host(layer.weight)
    layer.weight.grad = torch.ones(3, 4)
    layer.bias.grad = None
    b = host(layer.bias)
    optimizer.step()
    assert np.allclose(host(layer.weight), w - 0.5)
    assert np.allclose(host(layer.bias), b)   # no gradient: left as it is, as PyTorch's optimizers do
    assert isinstance(layer.weight.grad, torch.Tensor)
    layer.weight.data = torch.zeros(3, 4)     # a new .data: the optimizer copies it into its buffer
    layer.weight.grad = torch.ones(3, 4)
    optimizer.step()
    assert np.allclose(host(layer.weight), -0.5)


def test_b_grad_reads_as_an_array_on_the_host():
    layer, _ = _trained_linear()
    assert np.array_equal(np.asarray(layer.weight.grad), backend.asnumpy(layer.weight.grad.data))
    assert np.array_equal(backend.asnumpy(layer.weight.grad), backend.asnumpy(layer.weight.grad.data))


def test_c_assignment_drops_leading_axes_of_size_one_as_pytorch():
    """logits[i] = model(x[[i]]): a (1, C) value into a (C,) row, recorded in the graph."""
    w = torch.tensor(np.linspace(-1, 1, 5)[None, :], requires_grad=True)
    rows = torch.zeros(3, 5)
    for i in range(3):
        rows[i] = w * (i + 1)
    (rows * torch.tensor(np.arange(15.0).reshape(3, 5))).sum().backward()
    expected = sum((i + 1) * np.arange(15.0).reshape(3, 5)[i] for i in range(3))
    assert np.allclose(host(w.grad), expected[None, :])


@pytest.mark.parametrize("upper", [False, True])
@pytest.mark.parametrize("diagonal", [-1, 0, 1, 2])
def test_triangles_of_a_bool_tensor(upper, diagonal):
    """triu of a bool tensor (Llama's causal mask, torch.triu(torch.ones(T, T, dtype=torch.bool), 1)) compared
    rows and columns converted to bool: every row after the first came out all False."""
    ones = torch.ones(5, 6, dtype=torch.bool)
    got = torch.triu(ones, diagonal) if upper else torch.tril(ones, diagonal)
    expected = np.triu(np.ones((5, 6), bool), diagonal) if upper else np.tril(np.ones((5, 6), bool), diagonal)
    assert got.dtype == torch.bool and np.array_equal(backend.asnumpy(got.data), expected)


def test_b_an_update_through_data_is_in_place():
    layer, _ = _trained_linear()
    array = layer.weight._data
    layer.weight.data += -0.1 * layer.weight.grad
    assert layer.weight._data is array   # the same memory (an optimizer's flat buffer, a state_dict's entry)


def test_b_data_is_a_tensor_with_pytorchs_statistics():
    """p.data.std() as in the lectures' update-to-data ratio: the Tensor's unbiased std, not numpy's biased one."""
    layer, _ = _trained_linear()
    weight64 = host(layer.weight)
    data = layer.weight.data
    assert isinstance(data, torch.Tensor) and not data.requires_grad and data.grad_fn is None
    assert data.std().item() == pytest.approx(weight64.std(ddof=1), rel=1e-6)
    assert abs(data.std().item() - weight64.std()) > 1e-3 * weight64.std()   # the biased std would differ
    assert np.allclose(host(layer.weight.grad.data.std()), host(layer.weight.grad).std(ddof=1), rtol=1e-6)


def test_b_an_update_through_data_lands_in_the_optimizers_flat_buffer():
    layer, _ = _trained_linear()
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    optimizer.step()                        # packs the parameters into its flat buffer
    w, g = host(layer.weight), host(layer.weight.grad)
    layer.weight.data += -0.1 * layer.weight.grad
    flat = backend.asnumpy(optimizer.flat_params).astype(np.float64)
    assert np.allclose(host(layer.weight), w - 0.1 * g, rtol=1e-6)
    assert np.isin(host(layer.weight).ravel(), flat).all()   # the new values are in the buffer itself
    layer.bias.data.zero_()
    assert not host(layer.bias).any()
    layer.weight.grad.zero_()
    optimizer.step()                        # the step reads the buffer: the values written through .data stay
    assert np.allclose(host(layer.weight), w - 0.1 * g, rtol=1e-6)


def test_b_assigning_data_takes_the_tensors_storage_or_raises_as_pytorch():
    layer, _ = _trained_linear()
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.5)
    new = torch.ones(3, 4)
    layer.weight.data = new
    assert layer.weight._data is new._data and layer.weight.requires_grad
    layer.weight.grad = torch.ones(3, 4)
    optimizer.step()                        # copied into the optimizer's buffer, then stepped
    assert np.allclose(host(layer.weight), 0.5)
    with pytest.raises(TypeError, match="Variable data has to be a tensor, but got ndarray"):
        layer.weight.data = np.zeros((3, 4), np.float32)
