"""The autograd tape (chapter 11): gpt2_cupy.autograd.

The tape's rules, each measured: gradients of a tensor used twice are summed; a leaf's .grad buffer is
added into in place (the optimizer's views into its flat buffer stay valid); nothing is recorded under
no_grad; after backward the tape, the saved activations and the intermediate gradients are gone.
The references are float64 numpy products of the same numbers.
"""

import numpy as np
import pytest

from gpt2_cupy import autograd, backend
from gpt2_cupy import functional as F
from gpt2_cupy.autograd import Function, Tensor, no_grad
from gpt2_cupy.ops.residual import residual_forward
from gpt2_cupy.testing import relative_error

TOLERANCE = 1e-5


def weighted_sum(tensor, weights):
    """Σ weights · tensor as a scalar Tensor (a Linear with one output row): dL/dtensor = weights."""
    n = tensor.data.size
    return F.linear(tensor.reshape(1, n), Tensor(weights.reshape(1, n))).reshape(())


def test_gradient_of_a_linear_chain_matches_numpy(rng, to_device, to_host):
    x64, w64, u64 = rng.normal(size=(3, 5)), rng.normal(size=(4, 5)), rng.normal(size=(3, 4))
    x = Tensor(to_device(x64.astype(np.float32)), requires_grad=True)
    weight = Tensor(to_device(w64.astype(np.float32)), requires_grad=True)
    loss = weighted_sum(F.linear(x, weight), to_device(u64.astype(np.float32)))
    loss.backward()
    assert relative_error(to_host(loss.data), np.sum(u64 * (x64 @ w64.T))) < TOLERANCE
    assert relative_error(to_host(x.grad), u64 @ w64) < TOLERANCE          # dL/dx = u W
    assert relative_error(to_host(weight.grad), u64.T @ x64) < TOLERANCE   # dL/dW = uᵀ x


def test_a_tensor_used_twice_receives_the_sum_of_its_gradients(rng, to_device, to_host):
    # y = x W₁ᵀ + x W₂ᵀ + x: x feeds three uses, so dL/dx = u W₁ + u W₂ + u (chapter 03's fork, three ways).
    x64, w1, w2, u64 = (rng.normal(size=s) for s in [(2, 6), (6, 6), (6, 6), (2, 6)])
    x = Tensor(to_device(x64.astype(np.float32)), requires_grad=True)
    weights = [Tensor(to_device(w.astype(np.float32))) for w in (w1, w2)]
    y = F.linear(x, weights[0]) + F.linear(x, weights[1]) + x
    weighted_sum(y, to_device(u64.astype(np.float32))).backward()
    assert relative_error(to_host(x.grad), u64 @ w1 + u64 @ w2 + u64) < TOLERANCE


def test_add_of_a_tensor_with_itself_doubles_its_gradient(rng, to_device, to_host):
    x64, u64 = rng.normal(size=7), rng.normal(size=7)
    x = Tensor(to_device(x64.astype(np.float32)), requires_grad=True)
    y = x + x
    z = y + x          # y's gradient array is handed to both y's inputs and to x again: no aliasing errors
    weighted_sum(z + y, to_device(u64.astype(np.float32))).backward()
    assert relative_error(to_host(x.grad), 5 * u64) < TOLERANCE


def test_leaf_gradients_are_added_in_place_into_the_existing_buffer(rng, to_device, to_host):
    # As the optimizer sets them up: every .grad a view into one flat buffer.
    x64, w64, u64 = rng.normal(size=(3, 5)), rng.normal(size=(4, 5)), rng.normal(size=(3, 4))
    flat = to_device(np.zeros(20 + 4, np.float32))
    weight = Tensor(to_device(w64.astype(np.float32)), requires_grad=True)
    bias = Tensor(to_device(np.zeros(4, np.float32)), requires_grad=True)
    weight.grad, bias.grad = flat[:20].reshape(4, 5), flat[20:]
    buffers = (weight.grad, bias.grad)
    x = Tensor(to_device(x64.astype(np.float32)))
    for _ in range(2):  # two backward passes add up, as micro-batches do
        weighted_sum(F.linear(x, weight, bias), to_device(u64.astype(np.float32))).backward()
    assert weight.grad is buffers[0] and bias.grad is buffers[1]
    assert relative_error(to_host(flat[:20]).reshape(4, 5), 2 * u64.T @ x64) < TOLERANCE
    assert relative_error(to_host(flat[20:]), 2 * u64.sum(axis=0)) < TOLERANCE


def test_only_tensors_that_require_grad_get_one(rng, to_device):
    x = Tensor(to_device(rng.normal(size=(2, 3)).astype(np.float32)))
    weight = Tensor(to_device(rng.normal(size=(3, 3)).astype(np.float32)), requires_grad=True)
    weighted_sum(F.linear(x, weight), to_device(np.ones(6, np.float32))).backward()
    assert x.grad is None and weight.grad is not None


def test_the_tape_saved_arrays_and_intermediate_gradients_are_freed(rng, to_device):
    x = Tensor(to_device(rng.normal(size=(2, 3)).astype(np.float32)), requires_grad=True)
    hidden = F.linear(x, Tensor(to_device(rng.normal(size=(3, 3)).astype(np.float32))))
    loss = weighted_sum(hidden, to_device(np.ones(6, np.float32)))
    entries = list(autograd._tape)
    assert len(entries) == 4  # linear, reshape, linear, reshape
    loss.backward()
    assert autograd._tape == []
    assert hidden.grad is None and loss.grad is None        # intermediate: used, then dropped
    assert all(ctx.saved_tensors == () for _, ctx, _, _ in entries)
    assert x.grad is not None                                # a leaf keeps its gradient


def test_no_grad_records_nothing(rng, to_device):
    x = Tensor(to_device(rng.normal(size=(2, 3)).astype(np.float32)), requires_grad=True)
    weight = Tensor(to_device(rng.normal(size=(3, 3)).astype(np.float32)), requires_grad=True)
    with no_grad():
        y = F.linear(x, weight) + x
    assert autograd._tape == [] and not y.requires_grad
    assert autograd.is_grad_enabled()


def test_calls_that_do_not_reach_the_loss_are_skipped(rng, to_device, to_host):
    x64 = rng.normal(size=4)
    x = Tensor(to_device(x64.astype(np.float32)), requires_grad=True)
    _unused = x + x
    weighted_sum(x, to_device(np.full(4, 3.0, np.float32))).backward()
    assert relative_error(to_host(x.grad), np.full(4, 3.0)) < TOLERANCE


def test_a_custom_function_follows_the_torch_pattern(rng, to_device, to_host):
    class Scale(Function):  # y = 3 x, written with the residual op: x + x + x
        @staticmethod
        def forward(ctx, x):
            return residual_forward(residual_forward(x, x), x)

        @staticmethod
        def backward(ctx, dout):
            return residual_forward(residual_forward(dout, dout), dout)

    x64 = rng.normal(size=5)
    x = Tensor(to_device(x64.astype(np.float32)), requires_grad=True)
    y = Scale.apply(x)
    weighted_sum(y, to_device(np.arange(5, dtype=np.float32))).backward()
    assert relative_error(to_host(y.data), 3 * x64) < TOLERANCE
    assert relative_error(to_host(x.grad), 3 * np.arange(5.0)) < TOLERANCE


def test_backward_needs_a_scalar_or_a_gradient(rng, to_device):
    x = Tensor(to_device(rng.normal(size=(2, 3)).astype(np.float32)), requires_grad=True)
    y = x + x
    with pytest.raises(RuntimeError, match="scalar"):
        y.backward()
    autograd._tape.clear()


def test_tensor_basics(to_device):
    t = Tensor(to_device(np.zeros((2, 3), np.float32)))
    assert t.shape == (2, 3) and t.ndim == 2 and t.size(1) == 3 and t.numel() == 6
    assert isinstance(t.data, backend.xp.ndarray) and t.grad is None and not t.requires_grad
