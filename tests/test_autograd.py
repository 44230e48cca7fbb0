"""Autograd, one graph per result (chapter 11): gpt2_cupy.autograd.

The rules, each measured: gradients of a tensor used twice are summed; a leaf's .grad buffer is added into
in place (the optimizer's views into its flat buffer stay valid); nothing is recorded under no_grad; a
backward walks only its own graph, frees what it saved, and raises PyTorch's errors where PyTorch does; a
graph nobody differentiates is freed with its result. The references are float64 numpy products of the
same numbers.
"""

import ast
import gc
import pathlib
import weakref

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
    n = tensor._data.size
    return F.linear(tensor.reshape(1, n), Tensor(weights.reshape(1, n))).reshape(())


def test_gradient_of_a_linear_chain_matches_numpy(rng, to_device, to_host):
    x64, w64, u64 = rng.normal(size=(3, 5)), rng.normal(size=(4, 5)), rng.normal(size=(3, 4))
    x = Tensor(to_device(x64.astype(np.float32)), requires_grad=True)
    weight = Tensor(to_device(w64.astype(np.float32)), requires_grad=True)
    loss = weighted_sum(F.linear(x, weight), to_device(u64.astype(np.float32)))
    loss.backward()
    assert relative_error(to_host(loss._data), np.sum(u64 * (x64 @ w64.T))) < TOLERANCE
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


def test_saved_arrays_are_freed_by_backward_and_intermediate_gradients_never_kept(rng, to_device):
    x = Tensor(to_device(rng.normal(size=(2, 3)).astype(np.float32)), requires_grad=True)
    hidden = F.linear(x, Tensor(to_device(rng.normal(size=(3, 3)).astype(np.float32))))
    loss = weighted_sum(hidden, to_device(np.ones(6, np.float32)))
    nodes = autograd.topological_order(loss.grad_fn)
    assert [node.name() for node in nodes] == ["ReshapeBackward", "LinearBackward", "ReshapeBackward",
                                               "LinearBackward"]
    assert [len(node.ctx.saved_tensors) for node in nodes] == [0, 2, 0, 2]
    loss.backward()
    assert all(node.ctx.freed for node in nodes)            # the activations are gone
    with pytest.raises(RuntimeError, match="Trying to backward through the graph a second time"):
        nodes[1].ctx.saved_tensors
    assert hidden.grad is None and loss.grad is None        # intermediate: used, never kept
    assert x.grad is not None                                # a leaf keeps its gradient


def test_no_grad_records_nothing(rng, to_device):
    x = Tensor(to_device(rng.normal(size=(2, 3)).astype(np.float32)), requires_grad=True)
    weight = Tensor(to_device(rng.normal(size=(3, 3)).astype(np.float32)), requires_grad=True)
    with no_grad():
        y = F.linear(x, weight) + x
    assert y.grad_fn is None and not y.requires_grad and y.is_leaf
    assert autograd.is_grad_enabled()


def test_two_losses_each_add_their_gradient(rng, to_device, to_host):
    # Row 1 of the table: l1.backward(); l2.backward() must both add into .grad.
    x64, w64, u1, u2 = rng.normal(size=(3, 5)), rng.normal(size=(4, 5)), rng.normal(size=(3, 4)), rng.normal(size=(3, 4))
    x = Tensor(to_device(x64.astype(np.float32)))
    weight = Tensor(to_device(w64.astype(np.float32)), requires_grad=True)
    l1 = weighted_sum(F.linear(x, weight), to_device(u1.astype(np.float32)))
    l2 = weighted_sum(F.linear(x, weight), to_device(u2.astype(np.float32)))
    l1.backward()
    l2.backward()
    assert relative_error(to_host(weight.grad), (u1 + u2).T @ x64) < TOLERANCE
    # Two losses over one shared call: the first backward frees what that call saved, as PyTorch's does.
    y = F.linear(x, weight)
    l1, l2 = (weighted_sum(y, to_device(u.astype(np.float32))) for u in (u1, u2))
    l1.backward()
    with pytest.raises(RuntimeError, match="retain_graph=True"):
        l2.backward()


def test_a_second_backward_raises_unless_the_graph_is_retained(rng, to_device, to_host):
    x64, w64, u64 = rng.normal(size=(3, 5)), rng.normal(size=(4, 5)), rng.normal(size=(3, 4))
    weight = Tensor(to_device(w64.astype(np.float32)), requires_grad=True)
    x = Tensor(to_device(x64.astype(np.float32)))
    loss = weighted_sum(F.linear(x, weight), to_device(u64.astype(np.float32)))
    loss.backward(retain_graph=True)
    loss.backward()                                          # retained: a second pass adds again
    assert relative_error(to_host(weight.grad), 2 * u64.T @ x64) < TOLERANCE
    with pytest.raises(RuntimeError, match=r"Trying to backward through the graph a second time"):
        loss.backward()
    assert relative_error(to_host(weight.grad), 2 * u64.T @ x64) < TOLERANCE  # nothing added by the failed one


def test_backward_of_a_result_made_under_no_grad_raises(rng, to_device):
    weight = Tensor(to_device(rng.normal(size=(4, 5)).astype(np.float32)), requires_grad=True)
    with no_grad():
        y = F.linear(Tensor(to_device(np.ones((3, 5), np.float32))), weight)
    with pytest.raises(RuntimeError, match="element 0 of tensors does not require grad and does not have a grad_fn"):
        weighted_sum(y, to_device(np.ones(12, np.float32))).backward()
    assert weight.grad is None


def test_a_graph_nobody_differentiates_is_freed_with_its_result(rng, to_device):
    # Row 4 of the table: three forwards and no backward keep nothing. Only references count here: the
    # graph has no cycles, so it goes when its result goes, without the garbage collector.
    weight = Tensor(to_device(rng.normal(size=(64, 64)).astype(np.float32)), requires_grad=True)
    x = Tensor(to_device(rng.normal(size=(8, 64)).astype(np.float32)))
    gc.disable()
    try:
        graphs = []
        for _ in range(3):
            hidden = F.gelu(F.linear(x, weight))
            loss = weighted_sum(hidden, to_device(np.ones(8 * 64, np.float32)))
            graphs.append([weakref.ref(node.ctx) for node in autograd.topological_order(loss.grad_fn)])
            saved = weakref.ref(hidden)
            del hidden, loss
        assert saved() is None
        assert all(ctx() is None for contexts in graphs for ctx in contexts)
    finally:
        gc.enable()


def test_a_backward_leaves_other_graphs_intact(rng, to_device, to_host):
    x64, w64, u64 = rng.normal(size=(3, 5)), rng.normal(size=(4, 5)), rng.normal(size=(3, 4))
    weight = Tensor(to_device(w64.astype(np.float32)), requires_grad=True)
    x = Tensor(to_device(x64.astype(np.float32)))
    u = to_device(u64.astype(np.float32))
    first, second = (weighted_sum(F.gelu(F.linear(x, weight), approximate="tanh"), u) for _ in range(2))
    saved_counts = [len(node.ctx.saved_tensors) for node in autograd.topological_order(second.grad_fn)]
    first.backward()
    assert [len(node.ctx.saved_tensors) for node in autograd.topological_order(second.grad_fn)] == saved_counts
    assert sum(saved_counts) == 5   # linear 2, gelu 1, the weighted sum's linear 2
    once = to_host(weight.grad).copy()
    second.backward()
    assert relative_error(to_host(weight.grad), 2 * once) < TOLERANCE


def test_each_node_runs_after_every_consumer_of_its_output(rng, to_device, to_host):
    # A diamond: h feeds two branches that meet again, so h's Node must wait for both of them.
    x64, w64, u64 = rng.normal(size=(2, 6)), rng.normal(size=(6, 6)), rng.normal(size=(2, 6))
    x = Tensor(to_device(x64.astype(np.float32)), requires_grad=True)
    weight = Tensor(to_device(w64.astype(np.float32)))
    h = F.linear(x, weight)
    y = F.linear(h, weight) + h
    order = autograd.topological_order(y.grad_fn)
    position = {node: i for i, node in enumerate(order)}
    for node in order:
        for edge in node.next_edges:
            if edge is not None and isinstance(edge[0], autograd.Node):
                assert position[edge[0]] > position[node]
    weighted_sum(y, to_device(u64.astype(np.float32))).backward()
    assert relative_error(to_host(x.grad), (u64 @ w64 + u64) @ w64) < TOLERANCE


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
    assert relative_error(to_host(y._data), 3 * x64) < TOLERANCE
    assert relative_error(to_host(x.grad), 3 * np.arange(5.0)) < TOLERANCE


def test_backward_needs_a_scalar_or_a_gradient(rng, to_device):
    x = Tensor(to_device(rng.normal(size=(2, 3)).astype(np.float32)), requires_grad=True)
    y = x + x
    with pytest.raises(RuntimeError, match="grad can be implicitly created only for scalar outputs"):
        y.backward()


def test_tensor_basics(to_device):
    t = Tensor(to_device(np.zeros((2, 3), np.float32)))
    assert t.shape == (2, 3) and t.ndim == 2 and t.size(1) == 3 and t.numel() == 6
    assert isinstance(t._data, backend.xp.ndarray) and t.grad is None and not t.requires_grad


def test_the_engine_imports_none_of_the_operations_built_on_it():
    """autograd.py is the engine: the operations (tensor_ops, nn.functional) and gpt2_cupy.tensor, which puts
    them on Tensor as methods, import it, never the other way round."""
    tree = ast.parse(pathlib.Path(autograd.__file__).read_text(encoding="utf-8"))
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert not imported & {"gpt2_cupy.tensor_ops", "gpt2_cupy.tensor", "gpt2_cupy.nn.functional", "gpt2_cupy.nn"}
    x = autograd.Tensor(backend.xp.asarray(np.arange(6.0, dtype=np.float32).reshape(2, 3)))
    expected = np.exp(np.arange(6.0).reshape(2, 3))
    expected /= expected.sum(-1, keepdims=True)
    assert np.allclose(backend.asnumpy(x.softmax(-1)._data), expected, rtol=1e-6)   # a method from nn.functional
