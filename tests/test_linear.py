"""gpt2_cupy.ops.linear against float64 numpy, central finite differences and (when installed) PyTorch.

Tolerances: float32 against float64, relative error (max |got - ref| / max |ref|) < 1e-4 for what goes through
a matrix product, < 1e-5 for the elementwise bias add. The bias gradient is a float32 sum, checked column by
column against the rounding-error bound of any float32 summation order: |error| <= gamma_(n-1) * sum |terms|,
gamma_k = k u / (1 - k u), u = 2^-24 (Higham, Accuracy and Stability of Numerical Algorithms, section 4.2).
Sizes are not multiples of the kernels' block sizes (256 threads, 32-column strips, 512 rows per block).
"""

import numpy as np
import pytest

from gpt2_cupy.ops.linear import bias_add, bias_backward, linear_backward, linear_forward
from gpt2_cupy.testing import assert_within_summation_bound, finite_difference_gradient, relative_error, torch_or_none


def forward_reference(x, weight, bias):
    y = x @ weight.T
    return y if bias is None else y + bias


def backward_reference(dout, x, weight):
    dout_rows, x_rows = dout.reshape(-1, dout.shape[-1]), x.reshape(-1, x.shape[-1])
    return dout @ weight, dout_rows.T @ x_rows, dout_rows.sum(axis=0)


def random_layer(rng, B, T, C_in, C_out):
    return (rng.standard_normal((B, T, C_in)).astype(np.float32),
            (rng.standard_normal((C_out, C_in)) / np.sqrt(C_in)).astype(np.float32),
            rng.standard_normal(C_out).astype(np.float32),
            rng.standard_normal((B, T, C_out)).astype(np.float32))


def test_reference_backward_matches_central_finite_differences(rng):
    """The float64 formulas dx = dy W, dW = dyᵀ x, db = Σ dy are the gradient of L = Σ y * dy."""
    x, weight, bias, g = (a.astype(np.float64) for a in random_layer(rng, 2, 3, 4, 5))
    dx, dweight, dbias = backward_reference(g, x, weight)
    for analytic, array in ((dx, x), (dweight, weight), (dbias, bias)):
        numeric = finite_difference_gradient(lambda: np.sum(forward_reference(x, weight, bias) * g), array)
        assert relative_error(analytic, numeric) < 1e-7


@pytest.mark.parametrize("C_out", [68, 70])  # 16-byte loads (a multiple of 4), and one float per lane
def test_linear_forward_and_backward_match_float64(rng, to_device, to_host, C_out):
    x, weight, bias, dy = random_layer(rng, 3, 37, 45, C_out)
    y = linear_forward(to_device(x), to_device(weight), to_device(bias))
    assert y.shape == (3, 37, C_out)
    x64, weight64, bias64, dy64 = (a.astype(np.float64) for a in (x, weight, bias, dy))
    assert relative_error(to_host(y), forward_reference(x64, weight64, bias64)) < 1e-4

    dweight, dbias = to_device(np.zeros_like(weight)), to_device(np.zeros_like(bias))
    dx = linear_backward(to_device(dy), to_device(x), to_device(weight), dweight=dweight, dbias=dbias)
    dx_reference, dweight_reference, _ = backward_reference(dy64, x64, weight64)
    assert dx.shape == x.shape
    assert relative_error(to_host(dx), dx_reference) < 1e-4
    assert relative_error(to_host(dweight), dweight_reference) < 1e-4
    assert_within_summation_bound(to_host(dbias), dy.reshape(-1, C_out), np.zeros(C_out))


def test_linear_without_bias(rng, to_device, to_host):
    x, weight, _, dy = random_layer(rng, 2, 19, 33, 41)
    y = linear_forward(to_device(x), to_device(weight))
    assert relative_error(to_host(y), x.astype(np.float64) @ weight.T.astype(np.float64)) < 1e-4
    dweight = to_device(np.zeros_like(weight))
    dx = linear_backward(to_device(dy), to_device(x), to_device(weight), dweight=dweight)
    dx_reference, dweight_reference, _ = backward_reference(*(a.astype(np.float64) for a in (dy, x, weight)))
    assert relative_error(to_host(dx), dx_reference) < 1e-4
    assert relative_error(to_host(dweight), dweight_reference) < 1e-4


def test_backward_adds_into_parameter_gradients_and_sets_dx(rng, to_device, to_host):
    """dweight and dbias keep what they held (+=); dx's old contents are replaced (=)."""
    x, weight, bias, dy = random_layer(rng, 2, 23, 30, 44)
    dweight_before = rng.standard_normal(weight.shape).astype(np.float32)
    dbias_before = rng.standard_normal(bias.shape).astype(np.float32)
    dweight, dbias = to_device(dweight_before.copy()), to_device(dbias_before.copy())
    dx = to_device(np.full(x.shape, 1e6, dtype=np.float32))
    returned = linear_backward(to_device(dy), to_device(x), to_device(weight), dweight=dweight, dbias=dbias, out=dx)
    assert returned is dx
    dx_reference, dweight_reference, _ = backward_reference(*(a.astype(np.float64) for a in (dy, x, weight)))
    assert relative_error(to_host(dx), dx_reference) < 1e-4
    assert relative_error(to_host(dweight), dweight_before.astype(np.float64) + dweight_reference) < 1e-4
    assert_within_summation_bound(to_host(dbias), dy.reshape(-1, 44), dbias_before)


def test_forward_writes_into_out(rng, to_device, to_host):
    x, weight, bias, _ = random_layer(rng, 1, 13, 20, 36)
    out = to_device(np.full((1, 13, 36), np.nan, dtype=np.float32))
    assert linear_forward(to_device(x), to_device(weight), to_device(bias), out=out) is out
    reference = forward_reference(*(a.astype(np.float64) for a in (x, weight, bias)))
    assert relative_error(to_host(out), reference) < 1e-4


@pytest.mark.parametrize("rows, columns, rows_per_block", [
    (1, 5, 512),        # a single row
    (111, 100, 32),     # 4 row ranges, WIDTH 4, a strip partly outside the matrix
    (111, 77, 32),      # WIDTH 1
    (1100, 36, 512),    # 3 row ranges, the last one short
    (300, 1, 64),       # one column
])
def test_bias_backward_within_summation_bound(rng, to_device, to_host, rows, columns, rows_per_block):
    dy = rng.standard_normal((rows, columns)).astype(np.float32)
    start = rng.standard_normal(columns).astype(np.float32)
    dbias = to_device(start.copy())
    bias_backward(to_device(dy), dbias, rows_per_block=rows_per_block)
    assert_within_summation_bound(to_host(dbias), dy, start)


def test_bias_backward_on_a_view_not_16_byte_aligned(rng, to_device, to_host):
    """A view that starts 4 bytes into its buffer cannot use 16-byte loads; the result must not suffer."""
    buffer = to_device(rng.standard_normal(1 + 97 * 64).astype(np.float32))
    dy = buffer[1:].reshape(97, 64)
    assert dy.flags.c_contiguous
    dbias = to_device(np.zeros(64, dtype=np.float32))
    bias_backward(dy, dbias, rows_per_block=32)
    assert_within_summation_bound(to_host(dbias), to_host(dy), np.zeros(64))


def test_bias_backward_sums_over_batch_and_time(rng, to_device, to_host):
    dy = rng.standard_normal((3, 29, 40)).astype(np.float32)
    dbias = to_device(np.zeros(40, dtype=np.float32))
    bias_backward(to_device(dy), dbias)
    assert_within_summation_bound(to_host(dbias), dy.reshape(-1, 40), np.zeros(40))


def test_bias_add_matches_float64(rng, to_device, to_host):
    y = rng.standard_normal((2, 37, 51)).astype(np.float32)
    bias = rng.standard_normal(51).astype(np.float32)
    y_device = to_device(y.copy())  # on the CPU, to_device would share y's memory
    assert bias_add(y_device, to_device(bias)) is y_device
    assert relative_error(to_host(y_device), y.astype(np.float64) + bias) < 1e-5


def test_errors_name_the_problem(to_device):
    x = to_device(np.zeros((2, 3, 4), dtype=np.float32))
    weight = to_device(np.zeros((5, 4), dtype=np.float32))
    with pytest.raises(ValueError, match=r"\(5, 6\).*\(2, 3, 4\)"):
        linear_forward(x, to_device(np.zeros((5, 6), dtype=np.float32)))
    with pytest.raises(ValueError, match=r"bias has shape \(4,\)"):
        linear_forward(x, weight, to_device(np.zeros(4, dtype=np.float32)))
    with pytest.raises(TypeError, match="float64"):
        linear_forward(to_device(np.zeros((2, 3, 4))), weight)
    with pytest.raises(ValueError, match="C-contiguous"):
        linear_forward(to_device(np.zeros((2, 4, 3), dtype=np.float32)).transpose(0, 2, 1), weight)
    with pytest.raises(ValueError, match=r"weight has shape \(5, 4\).*dout has shape \(2, 3, 4\)"):
        linear_backward(to_device(np.zeros((2, 3, 4), dtype=np.float32)), x, weight,
                        dweight=to_device(np.zeros((5, 4), dtype=np.float32)))
    with pytest.raises(ValueError, match=r"dweight has shape \(4, 5\)"):
        linear_backward(to_device(np.zeros((2, 3, 5), dtype=np.float32)), x, weight,
                        dweight=to_device(np.zeros((4, 5), dtype=np.float32)))
    with pytest.raises(TypeError, match="positional"):
        linear_backward(to_device(np.zeros((2, 3, 5), dtype=np.float32)), x, weight,
                        to_device(np.zeros((5, 4), dtype=np.float32)))  # parameter gradients by keyword only
    with pytest.raises(ValueError, match="dweight overlaps weight"):
        linear_backward(to_device(np.zeros((2, 3, 5), dtype=np.float32)), x, weight, dweight=weight)
    with pytest.raises(TypeError, match="must be a"):
        linear_forward(np.zeros((2, 3, 4), dtype=np.float32).tolist(), weight)


def test_matches_torch_linear_autograd(rng, to_device, to_host):
    torch = torch_or_none() or pytest.skip("PyTorch is not installed")
    x, weight, bias, dy = random_layer(rng, 2, 31, 24, 52)
    x_t, weight_t, bias_t = (torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in (x, weight, bias))
    y_t = torch.nn.functional.linear(x_t, weight_t, bias_t)
    y_t.backward(torch.tensor(dy, dtype=torch.float64))

    y = linear_forward(to_device(x), to_device(weight), to_device(bias))
    dweight, dbias = to_device(np.zeros_like(weight)), to_device(np.zeros_like(bias))
    dx = linear_backward(to_device(dy), to_device(x), to_device(weight), dweight=dweight, dbias=dbias)
    assert relative_error(to_host(y), y_t.detach().numpy()) < 1e-4
    assert relative_error(to_host(dx), x_t.grad.numpy()) < 1e-4
    assert relative_error(to_host(dweight), weight_t.grad.numpy()) < 1e-4
    assert_within_summation_bound(to_host(dbias), dy.reshape(-1, 52), np.zeros(52))
    assert relative_error(to_host(dbias), bias_t.grad.numpy()) < 1e-4
