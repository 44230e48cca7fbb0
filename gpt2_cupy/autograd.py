"""Autograd, one graph per result: Tensor, Function, no_grad, and the random state that dropout draws from.

    x = Tensor(array, requires_grad=True)      a backend array (.data) with a gradient slot (.grad)
    y = SomeFunction.apply(x, ...)             runs SomeFunction.forward; if a gradient is wanted, y.grad_fn
                                               is a Node that remembers the call and where its inputs came from
    loss.backward()                            walks the Nodes that reach loss, each after all its consumers

Each result of a recorded call holds its Node (`.grad_fn`, as in PyTorch). A Node holds the Function, its
ctx, and one edge per input: the Node that produced that input, or the leaf itself (a parameter, or any
tensor the user made with requires_grad=True). The graph of a result is what its grad_fn reaches, and
nothing else: backward() sorts just those Nodes (a depth-first search, as micrograd does) and calls their
backwards in that order. Two losses are two graphs; the backward of one leaves the other as it was.

A graph lives as long as the tensors that hold it: a forward that nobody differentiates is freed with its
result, activations included. backward() frees what each Node saved as soon as its backward has run, so a
second backward through it raises PyTorch's error, unless the first was called with retain_graph=True.

A Function is PyTorch's torch.autograd.Function pattern: static forward(ctx, *arrays) and
backward(ctx, *douts), ctx carrying what the backward needs (ctx.save_for_backward, ctx.needs_input_grad).
forward receives the backend arrays of its Tensor arguments (other arguments unchanged) and returns an
array or a tuple of arrays; backward returns one gradient per forward argument (None where there is none).

Gradients are summed, never overwritten: a tensor used twice receives the sum of what each use sends back
(chapter 03's fork). A leaf keeps its .grad buffer and is added into in place. A parameter's gradient is
usually added by the op itself, into the buffer ctx.grad_buffer(i) hands it. When a leaf has no .grad yet
and an optimizer reserved a place for it in its flat gradient buffer (leaf._grad_slot), that place becomes
its .grad: an optimisation the graph does not depend on.
"""

import contextlib

import numpy

from gpt2_cupy import backend

_grad_enabled = True    # switched off inside `with no_grad():`
_dropout_state = {}     # "rng": dropout's (seed, offset) device array; "init": numpy's generator for weights

SECOND_BACKWARD = (
    "Trying to backward through the graph a second time (or directly access saved tensors after they have "
    "already been freed). Saved intermediate values of the graph are freed when you call .backward() or "
    "autograd.grad(). Specify retain_graph=True if you need to backward through the graph a second time or "
    "if you need to access saved tensors after calling backward.")


class Tensor:
    """A backend array with a gradient: .data (float32 unless it holds ids), .grad, .requires_grad, .grad_fn."""

    def __init__(self, data, requires_grad=False):
        if isinstance(data, Tensor):
            data = data.data
        if not isinstance(data, backend.xp.ndarray):
            data = backend.xp.asarray(data, dtype=numpy.float32)
        self.data, self.grad = data, None
        self._requires_grad = bool(requires_grad)
        self.grad_fn = None     # the Node that made this tensor; None for a leaf
        self.output_nr = 0      # which of that Node's outputs it is

    shape = property(lambda self: tuple(self.data.shape))
    ndim = property(lambda self: self.data.ndim)
    dtype = property(lambda self: self.data.dtype)
    is_leaf = property(lambda self: self.grad_fn is None, doc="made by the user, not by a recorded call")

    @property
    def requires_grad(self):
        return self._requires_grad

    @requires_grad.setter
    def requires_grad(self, value):
        if not self.is_leaf:
            raise RuntimeError("you can only change requires_grad flags of leaf variables.")
        self._requires_grad = bool(value)

    def requires_grad_(self, requires_grad=True):
        self.requires_grad = requires_grad
        return self

    def size(self, dim=None):
        return self.shape if dim is None else self.shape[dim]

    def numel(self):
        return int(self.data.size)

    def numpy(self):
        return backend.asnumpy(self.data)

    def item(self):
        """The value of a one-element tensor as a Python float (on a GPU: waits for it, a host copy)."""
        return float(backend.asnumpy(self.data))

    def detach(self):
        """The same array, outside every graph."""
        return Tensor(self.data)

    def __repr__(self):
        grad_fn = f", grad_fn=<{self.grad_fn.name()}>" if self.grad_fn is not None else ""
        return f"Tensor(shape={self.shape}, dtype={self.dtype}, requires_grad={self.requires_grad}{grad_fn})"

    def backward(self, gradient=None, retain_graph=None):
        """d self / d every leaf of self's graph that requires grad, summed into its .grad.

        gradient: d loss / d self, needed unless self has one element (then it is 1). retain_graph=True
        keeps the saved arrays, for a second backward through the same graph.
        """
        if not self.requires_grad:
            raise RuntimeError("element 0 of tensors does not require grad and does not have a grad_fn")
        if gradient is None:
            if self.data.size != 1:
                raise RuntimeError(f"grad can be implicitly created only for scalar outputs; backward was called "
                                   f"on a tensor of shape {self.shape} (pass the gradient of the output)")
            gradient = backend.xp.ones(self.data.shape, dtype=self.data.dtype)
        elif isinstance(gradient, Tensor):
            gradient = gradient.data
        if tuple(gradient.shape) != self.shape:
            raise RuntimeError(f"backward: the gradient has shape {tuple(gradient.shape)}, the tensor {self.shape}")
        if self.grad_fn is None:
            _accumulate(self, gradient)  # a leaf: d self / d self
        else:
            run_backward(self.grad_fn, self.output_nr, gradient, retain_graph=bool(retain_graph))

    # The movements the model needs; their Functions live in gpt2_cupy.nn.functional.
    def __add__(self, other):
        from gpt2_cupy.nn import functional
        return functional.add(self, other)

    def reshape(self, *shape):
        from gpt2_cupy.nn import functional
        return functional.reshape(self, shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape)

    view = reshape

    def transpose(self, dim0, dim1):
        from gpt2_cupy.nn import functional
        return functional.transpose(self, dim0, dim1)

    def split(self, split_size, dim=-1):
        from gpt2_cupy.nn import functional
        return functional.split(self, split_size, dim)

    def contiguous(self):
        return self  # every Tensor here is C-contiguous already: the kernels need it


# ---- the graph ---------------------------------------------------------------------------------------------

class Node:
    """One recorded call: the grad_fn of its outputs.

    next_edges holds, per input of the call, where that input's gradient goes: (Node, output index) for a
    tensor another call made, (AccumulateGrad, 0) for a leaf that requires grad, None otherwise. A Node never
    refers to its own outputs, so a graph is a tree of references from the result down: dropping the result
    frees it all.
    """

    def __init__(self, function, ctx, next_edges, outputs):
        self.function, self.ctx, self.next_edges = function, ctx, next_edges
        self.output_shapes = [(array.shape, array.dtype) for array in outputs]

    def name(self):
        return self.function.__name__ + "Backward"

    @property
    def next_functions(self):
        return tuple(edge if edge is not None else (None, 0) for edge in self.next_edges)

    def __repr__(self):
        return f"<{self.name()}>"

    def apply(self, douts):
        """The gradients of the inputs, from the gradients of the outputs (None where none arrived)."""
        douts = [backend.xp.zeros(shape, dtype) if dout is None else dout
                 for dout, (shape, dtype) in zip(douts, self.output_shapes)]
        self.ctx.intermediate_buffers = {}
        gradients = self.function.backward(self.ctx, *douts)
        gradients = list(gradients) if isinstance(gradients, tuple) else [gradients]
        for index, buffer in self.ctx.intermediate_buffers.items():  # what ops added into ctx.grad_buffer(i)
            gradients[index] = buffer if gradients[index] is None else _add(gradients[index], buffer)
        return gradients


class AccumulateGrad:
    """The end of an edge at a leaf: its gradient is added into leaf.grad (PyTorch's name)."""

    def __init__(self, variable):
        self.variable = variable

    def name(self):
        return "AccumulateGrad"


def topological_order(root):
    """Every Node reachable from root, each before the Nodes that made its inputs (iterative depth-first search).

    Reversed post-order: a Node is appended after all the Nodes below it, so reversing puts every consumer
    before its producers, and a Node's backward runs once all the gradients of its outputs have arrived.
    """
    order, visited = [], {root}
    stack = [(root, iter(root.next_edges))]
    while stack:
        node, edges = stack[-1]
        for edge in edges:
            if edge is not None and isinstance(edge[0], Node) and edge[0] not in visited:
                visited.add(edge[0])
                stack.append((edge[0], iter(edge[0].next_edges)))
                break
        else:
            stack.pop()
            order.append(node)
    return order[::-1]


def run_backward(root, output_nr, gradient, retain_graph=False):
    """Push gradient (d loss / d root's output output_nr) through every Node that root reaches."""
    pending = {root: [None] * len(root.output_shapes)}  # gradients that arrived for each Node's outputs
    pending[root][output_nr] = gradient
    for node in topological_order(root):
        douts = pending.pop(node, None)
        if douts is None:
            continue
        gradients = node.apply(douts)
        for edge, input_gradient in zip(node.next_edges, gradients):
            if edge is None or input_gradient is None:
                continue
            target, index = edge
            if isinstance(target, AccumulateGrad):
                _accumulate(target.variable, input_gradient)
            else:
                arrived = pending.setdefault(target, [None] * len(target.output_shapes))
                arrived[index] = input_gradient if arrived[index] is None else _add(arrived[index], input_gradient)
        if not retain_graph:
            node.ctx.free_saved()


def _add(a, b):
    """a + b into a new array (intermediate gradients are shared, never written into in place)."""
    from gpt2_cupy.ops.residual import residual_forward
    return residual_forward(a, b)


def _accumulate(tensor, gradient):
    """tensor.grad += gradient, for a leaf: in place into its buffer (which the optimizer may own)."""
    from gpt2_cupy.ops.residual import residual_forward

    if tensor.grad is None:
        tensor.grad = _new_leaf_gradient(tensor, gradient)
    else:
        residual_forward(tensor.grad, gradient, out=tensor.grad)


class GradientSlot:
    """The place an optimizer reserved for a parameter's gradient: a view into its flat gradient buffer.

    zeroed: the optimizer knows it holds zeros (it filled the whole buffer at zero_grad), so handing it out
    as a fresh gradient buffer needs no memset of its own.
    """

    def __init__(self, array, owner):
        self.array, self.owner, self.zeroed = array, owner, False


def _new_leaf_gradient(tensor, gradient=None):
    """A new .grad for a leaf: a copy of gradient, or zeros when gradient is None; in its slot if it has one."""
    slot = getattr(tensor, "_grad_slot", None)
    if slot is not None and slot.array.shape == tensor.data.shape:
        if gradient is not None:
            slot.array[...] = gradient
        elif not slot.zeroed:
            slot.array.fill(0)
        slot.zeroed = False
        return slot.array
    if gradient is not None:
        return backend.xp.array(gradient, copy=True)
    return backend.xp.zeros(tensor.shape, dtype=numpy.float32)


class Context:
    """What forward leaves for backward: saved arrays, the arguments' gradient needs and their buffers."""

    def __init__(self, inputs):
        self.needs_input_grad = tuple(t is not None and t.requires_grad for t in inputs)
        # Leaves only (their .grad is the buffer an op adds into); never an intermediate tensor, whose
        # array would then stay alive as long as the graph even when the backward does not need it.
        self._leaves = [t if t is not None and t.is_leaf else None for t in inputs]
        self._input_shapes = [t.shape if t is not None else None for t in inputs]
        self._saved = ()
        self._freed = False             # saved arrays were freed: reading them raises
        self.freed = False              # a backward without retain_graph has run through this call
        self.intermediate_buffers = {}  # grad_buffer()s of non-leaf arguments, added by the Node afterwards

    def save_for_backward(self, *arrays):
        self._saved = arrays

    @property
    def saved_tensors(self):
        if self._freed:
            raise RuntimeError(SECOND_BACKWARD)
        return self._saved

    def free_saved(self):
        """Drop the saved arrays after the backward has used them (a second backward then raises)."""
        self._saved, self._freed, self.freed = (), bool(self._saved), True

    def grad_buffer(self, index):
        """The buffer an op adds argument `index`'s gradient into: a leaf's own .grad (zeroed when new).

        backward returns None for that argument: its gradient is already in place. For an intermediate
        tensor the buffer is a new zeroed array that the Node sends on afterwards; for a tensor that needs
        no gradient, a scratch array that is thrown away.
        """
        leaf = self._leaves[index]
        if not self.needs_input_grad[index] or leaf is None:
            buffer = backend.xp.zeros(self._input_shapes[index], dtype=numpy.float32)
            if self.needs_input_grad[index]:
                self.intermediate_buffers[index] = buffer
            return buffer
        if leaf.grad is None:
            leaf.grad = _new_leaf_gradient(leaf)
        return leaf.grad


def _edge(tensor):
    if tensor is None or not tensor.requires_grad:
        return None
    if tensor.grad_fn is None:
        return (AccumulateGrad(tensor), 0)
    return (tensor.grad_fn, tensor.output_nr)


class Function:
    """One differentiable operation: subclasses define static forward(ctx, ...) and backward(ctx, *douts)."""

    @classmethod
    def apply(cls, *arguments, **options):
        inputs = [a if isinstance(a, Tensor) else None for a in arguments]
        ctx = Context(inputs)
        arrays = [a.data if isinstance(a, Tensor) else a for a in arguments]
        results = cls.forward(ctx, *arrays, **options)
        single = not isinstance(results, tuple)
        results = (results,) if single else results
        record = _grad_enabled and any(ctx.needs_input_grad)
        outputs = [Tensor(r, requires_grad=record) for r in results]
        if record:
            node = Node(cls, ctx, [_edge(t) for t in inputs], results)
            for index, output in enumerate(outputs):
                output.grad_fn, output.output_nr = node, index
        return outputs[0] if single else tuple(outputs)


@contextlib.contextmanager
def no_grad():
    """Inside the block nothing is recorded: for evaluation and generation (no activations kept)."""
    global _grad_enabled
    previous, _grad_enabled = _grad_enabled, False
    try:
        yield
    finally:
        _grad_enabled = previous


def is_grad_enabled():
    return _grad_enabled


def manual_seed(seed):
    """Seed dropout (its masks: the counter-based generator from (seed, offset 0)) and initialisation."""
    _dropout_state["rng"] = backend.xp.array([int(seed), 0], dtype=numpy.uint64)
    _dropout_state["seed"] = int(seed)
    _dropout_state["init"] = numpy.random.default_rng(int(seed))


def init_generator():
    """The numpy generator that nn's layers draw their initial weights from (seeded by manual_seed)."""
    if "init" not in _dropout_state:
        manual_seed(0)
    return _dropout_state["init"]


def dropout_rng_state():
    """The (seed, offset) device array of dropout's generator (seed 0 until manual_seed is called)."""
    if "rng" not in _dropout_state:
        manual_seed(0)
    return _dropout_state["rng"]


def initial_seed():
    dropout_rng_state()
    return _dropout_state["seed"]
