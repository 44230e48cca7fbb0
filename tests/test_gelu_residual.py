"""GELU and the residual connection (chapter 03): gpt2_cupy.ops.gelu and gpt2_cupy.ops.residual.

Each op runs on the active backend and is compared with a float64 numpy reference, whose own gradient is
checked against central finite differences. The error measure is the chapter's:

    error = max |result - reference| / (|reference| + 0.1)

a relative error where |reference| >> 0.1 and ten times the absolute error near zero, where float32
results carry an absolute error set by the size of the terms they are computed from (GELU's derivative
crosses zero near x = -0.75; 1 + tanh(u) cancels for x below about -3). Sizes are not multiples of the
block size (256) nor, for the float4 kernels, of 4; some inputs are views that start 4 bytes past a
16-byte boundary, which the ops send through the one-element-per-thread kernels.
"""

import math

import numpy as np
import pytest

from gpt2_cupy import backend
from gpt2_cupy.ops.gelu import gelu_backward, gelu_forward
from gpt2_cupy.ops.residual import fork_backward, residual_backward, residual_forward
from gpt2_cupy.testing import finite_difference_gradient, torch_or_none
from tests.references import CUBIC, SQRT_2_OVER_PI, gelu as gelu_reference, gelu_derivative as gelu_derivative_reference

TOLERANCE = 1e-5
FLOOR = 0.1
SIZES = [1, 3, 4, 5, 255, 257, 1023, 4099]
SHAPES = [(n,) for n in SIZES] + [(2, 37, 84), (3, 5, 7)]
# Zero, the minimum of GELU (where its derivative crosses zero), the cancelling tail, large values.
SPECIAL = [0.0, -0.0, 1e-30, -0.7524614, -0.75, -3.0, -5.2, -10.0, 10.0, -20.0, 20.0, 0.5]


def error(result, reference):
    result = np.asarray(result, dtype=np.float64)
    return float(np.max(np.abs(result - reference) / (np.abs(reference) + FLOOR), initial=0.0))


def inputs(rng, shape):
    """float32 x with the special values first, and dy in [-1, 1]."""
    n = math.prod(shape)
    x = np.concatenate([SPECIAL, rng.normal(0.0, 3.0, n)])[:n].astype(np.float32).reshape(shape)
    dy = rng.uniform(-1.0, 1.0, shape).astype(np.float32)
    return x, dy


def misaligned(to_device, array):
    """A contiguous device copy of `array` whose address is 4 bytes past a 16-byte boundary."""
    step = 4 // array.itemsize                          # elements in 4 bytes
    buffer = to_device(np.zeros(array.size + 4 * step, dtype=array.dtype))
    view = buffer[step:array.size + step].reshape(array.shape)
    view[...] = to_device(array)
    assert backend.address(view) % 16 == 4 and view.flags.c_contiguous
    return view


# ---- the references themselves -------------------------------------------------------------------------

@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_reference_derivative_matches_central_differences(approximate, rng):
    x = rng.normal(0.0, 2.0, 200)
    x = np.concatenate([x, [-0.75, 0.0, -4.0, 4.0]])
    h = 1e-6
    numeric = (gelu_reference(x + h, approximate) - gelu_reference(x - h, approximate)) / (2 * h)
    assert error(numeric, gelu_derivative_reference(x, approximate)) < 1e-8


def test_tanh_reference_is_the_textbook_formula():
    x = np.linspace(-3, 3, 101)
    textbook = 0.5 * x * (1 + np.tanh(SQRT_2_OVER_PI * (x + CUBIC * x**3)))
    np.testing.assert_allclose(gelu_reference(x, "tanh"), textbook, rtol=1e-14, atol=1e-15)


def test_tanh_approximation_is_close_to_the_exact_gelu():
    x = np.linspace(-6, 6, 1001)
    assert np.max(np.abs(gelu_reference(x, "tanh") - gelu_reference(x, "none"))) < 5e-4


# ---- gelu_forward, gelu_backward ---------------------------------------------------------------------

@pytest.mark.parametrize("approximate", ["tanh", "none"])
@pytest.mark.parametrize("shape", SHAPES)
def test_gelu_forward_matches_float64(approximate, shape, rng, to_device, to_host):
    x, _ = inputs(rng, shape)
    y = gelu_forward(to_device(x), approximate=approximate)
    assert y.shape == shape and y.dtype == np.float32
    assert error(to_host(y), gelu_reference(x.astype(np.float64), approximate)) < TOLERANCE


@pytest.mark.parametrize("approximate", ["tanh", "none"])
@pytest.mark.parametrize("shape", SHAPES)
def test_gelu_backward_matches_float64(approximate, shape, rng, to_device, to_host):
    x, dy = inputs(rng, shape)
    dx = gelu_backward(to_device(dy), to_device(x), approximate=approximate)
    expected = dy * gelu_derivative_reference(x.astype(np.float64), approximate)
    assert error(to_host(dx), expected) < TOLERANCE


@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_misaligned_arrays_take_the_one_element_per_thread_kernels(approximate, rng, to_device, to_host):
    x, dy = inputs(rng, (1029,))
    y = gelu_forward(misaligned(to_device, x), approximate=approximate)
    assert error(to_host(y), gelu_reference(x.astype(np.float64), approximate)) < TOLERANCE
    dx = gelu_backward(to_device(dy), misaligned(to_device, x), approximate=approximate)
    assert error(to_host(dx), dy * gelu_derivative_reference(x.astype(np.float64), approximate)) < TOLERANCE


@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_bf16_eight_per_thread_gives_the_bits_of_one_per_thread(approximate, rng, to_device, to_host):
    """bf16 arrays on 16 bytes take the eight-elements-per-thread kernels, misaligned ones the one-element
    kernels: both compute each element in float32 and round it once, so their bits agree (1029 elements:
    128 groups of 8 and a tail of 5), and they are within one bf16 rounding of float64."""
    from ml_dtypes import bfloat16
    x, dy = (a.astype(bfloat16) for a in inputs(rng, (1029,)))
    aligned_y = to_host(gelu_forward(to_device(x), approximate=approximate))
    loose_y = to_host(gelu_forward(misaligned(to_device, x), approximate=approximate))
    assert np.array_equal(aligned_y.view(np.uint16), loose_y.view(np.uint16))
    expected = gelu_reference(x.astype(np.float64), approximate)
    assert np.all(np.abs(aligned_y.astype(np.float64) - expected) <= 2 ** -8 * np.abs(expected) + 1e-6)
    aligned_dx = to_host(gelu_backward(to_device(dy), to_device(x), approximate=approximate))
    loose_dx = to_host(gelu_backward(misaligned(to_device, dy), misaligned(to_device, x), approximate=approximate))
    assert np.array_equal(aligned_dx.view(np.uint16), loose_dx.view(np.uint16))
    expected = dy.astype(np.float64) * gelu_derivative_reference(x.astype(np.float64), approximate)
    assert np.all(np.abs(aligned_dx.astype(np.float64) - expected) <= 2 ** -8 * np.abs(expected) + 1e-5)


def test_gelu_default_is_the_tanh_approximation(rng, to_device, to_host):
    x, dy = inputs(rng, (513,))
    np.testing.assert_array_equal(to_host(gelu_forward(to_device(x))),
                                  to_host(gelu_forward(to_device(x), approximate="tanh")))
    np.testing.assert_array_equal(to_host(gelu_backward(to_device(dy), to_device(x))),
                                  to_host(gelu_backward(to_device(dy), to_device(x), approximate="tanh")))
    # and the two approximations really are different functions
    assert not np.array_equal(to_host(gelu_forward(to_device(x))),
                              to_host(gelu_forward(to_device(x), approximate="none")))


def test_gelu_in_place_and_into_out(rng, to_device, to_host):
    x, dy = inputs(rng, (2, 37, 84))
    expected_y = gelu_reference(x.astype(np.float64), "tanh")
    expected_dx = dy * gelu_derivative_reference(x.astype(np.float64), "tanh")
    # copies: on the CPU backend to_device hands back the numpy array itself
    x_device = to_device(x.copy())
    assert gelu_forward(x_device, out=x_device) is x_device
    assert error(to_host(x_device), expected_y) < TOLERANCE
    x_device, dy_device = to_device(x.copy()), to_device(dy.copy())
    assert gelu_backward(dy_device, x_device, out=dy_device) is dy_device
    assert error(to_host(dy_device), expected_dx) < TOLERANCE


def test_gelu_of_an_empty_array(to_device, to_host):
    empty = to_device(np.zeros((0, 4), dtype=np.float32))
    assert gelu_forward(empty).shape == (0, 4)
    assert gelu_backward(empty, empty).shape == (0, 4)


def test_gelu_matches_pytorch(rng, to_device, to_host):
    torch = torch_or_none() or pytest.skip("PyTorch is not installed")
    x, dy = inputs(rng, (3, 5, 64))
    for approximate in ("tanh", "none"):
        x_torch = torch.tensor(x.astype(np.float64), requires_grad=True)
        y_torch = torch.nn.functional.gelu(x_torch, approximate=approximate)
        y_torch.backward(torch.tensor(dy.astype(np.float64)))
        y = gelu_forward(to_device(x), approximate=approximate)
        dx = gelu_backward(to_device(dy), to_device(x), approximate=approximate)
        assert error(to_host(y), y_torch.detach().numpy()) < TOLERANCE
        assert error(to_host(dx), x_torch.grad.numpy()) < TOLERANCE


# ---- residual_forward, residual_backward, fork_backward --------------------------------------------------

@pytest.mark.parametrize("shape", SHAPES)
def test_residual_forward_is_the_float32_sum(shape, rng, to_device, to_host):
    x = rng.normal(size=shape).astype(np.float32)
    branch = rng.normal(size=shape).astype(np.float32)
    out = to_host(residual_forward(to_device(x), to_device(branch)))
    # one float32 addition, correctly rounded on both backends: exactly numpy's float32 sum
    np.testing.assert_array_equal(out, x + branch)
    assert error(out, x.astype(np.float64) + branch.astype(np.float64)) < TOLERANCE


def test_fork_backward_sums_both_gradients_also_in_place_and_misaligned(rng, to_device, to_host):
    dout = rng.normal(size=(2, 37, 21)).astype(np.float32)
    dx_branch = rng.normal(size=(2, 37, 21)).astype(np.float32)
    np.testing.assert_array_equal(to_host(fork_backward(to_device(dout), to_device(dx_branch))), dout + dx_branch)
    in_place = to_device(dx_branch.copy())  # on the CPU backend to_device does not copy
    assert fork_backward(to_device(dout), in_place, out=in_place) is in_place
    np.testing.assert_array_equal(to_host(in_place), dout + dx_branch)
    shifted = fork_backward(misaligned(to_device, dout), to_device(dx_branch))
    np.testing.assert_array_equal(to_host(shifted), dout + dx_branch)


def test_residual_backward_hands_dout_to_both_inputs(rng, to_device):
    dout = to_device(rng.normal(size=(2, 3, 8)).astype(np.float32))
    dx_skip, dbranch = residual_backward(dout)
    assert dx_skip is dout and dbranch is dout


def test_block_gradient_through_the_fork_matches_central_differences(rng, to_device, to_host):
    """out = x + gelu(x): dx = dout + gelu'(x) dout, from the ops, against float64 finite differences."""
    shape = (2, 3, 5)
    x = rng.normal(0.0, 1.5, shape)
    dout = rng.uniform(-1.0, 1.0, shape)

    def loss(x):
        return np.sum(dout * (x + gelu_reference(x, "tanh")))

    numeric = finite_difference_gradient(lambda: loss(x), x)

    x32, dout32 = to_device(x.astype(np.float32)), to_device(dout.astype(np.float32))
    dx_skip, dbranch = residual_backward(dout32)
    dx_branch = gelu_backward(dbranch, x32)
    dx = to_host(fork_backward(dx_skip, dx_branch))
    assert error(dx, numeric) < 1e-5  # x and dout rounded to float32 bound this, not the kernels
    # the skip path's gradient matters: without it the check fails
    assert error(to_host(dx_branch), numeric) > 0.1


# ---- clear errors ----------------------------------------------------------------------------------------

def test_wrong_dtype_is_a_type_error_naming_it(to_device):
    x64 = to_device(np.zeros(8, dtype=np.float64))
    x32 = to_device(np.zeros(8, dtype=np.float32))
    with pytest.raises(TypeError, match="float64"):
        gelu_forward(x64)
    with pytest.raises(TypeError, match="float16"):
        gelu_backward(to_device(np.zeros(8, dtype=np.float16)), x32)
    with pytest.raises(TypeError, match="int32"):
        residual_forward(x32, to_device(np.zeros(8, dtype=np.int32)))
    with pytest.raises(TypeError, match="float64"):
        fork_backward(x64, x32)


def test_mismatched_shapes_are_a_value_error_naming_both(to_device):
    a = to_device(np.zeros((2, 3), dtype=np.float32))
    b = to_device(np.zeros((3, 2), dtype=np.float32))
    with pytest.raises(ValueError, match=r"x has shape \(3, 2\).*dout has shape \(2, 3\)"):
        gelu_backward(a, b)
    with pytest.raises(ValueError, match=r"branch has shape \(3, 2\).*x has shape \(2, 3\)"):
        residual_forward(a, b)
    with pytest.raises(ValueError, match=r"\(3, 2\).*\(2, 3\)"):
        gelu_forward(a, out=b)
    with pytest.raises(ValueError, match=r"\(3, 2\).*\(2, 3\)"):
        fork_backward(a, a, out=b)


def test_non_contiguous_input_is_a_value_error(to_device):
    a = to_device(np.zeros((4, 6), dtype=np.float32))
    with pytest.raises(ValueError, match="C-contiguous"):
        gelu_forward(a.T)
    with pytest.raises(ValueError, match="C-contiguous"):
        residual_forward(a[:, ::2], a[:, ::2].copy())


def test_not_an_array_and_unknown_approximation(to_device):
    with pytest.raises(TypeError, match="list"):
        gelu_forward([1.0, 2.0])
    with pytest.raises(ValueError, match="approximate"):
        gelu_forward(to_device(np.zeros(4, dtype=np.float32)), approximate="erf")
