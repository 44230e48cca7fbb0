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

A gradient has its tensor's dtype, as in PyTorch: bf16 activations (gpt2_cupy.amp) receive bf16 gradients,
float32 parameters float32 ones. The ops add parameter gradients in float32; for a parameter of another
dtype ctx.grad_buffer hands out a float32 buffer, which the Node converts to the parameter's dtype.
"""

import contextlib
import copy
import threading
import weakref

import numpy

from gpt2_cupy import backend
from gpt2_cupy.ops.arrays import storage_of
# converted: a float32 gradient buffer for a bf16 argument, say
from gpt2_cupy.elementwise import contiguous, converted as _as_dtype

_grad_enabled = True    # switched off inside `with no_grad():`


class _RandomState:
    """"rng": dropout's (seed, offset) device array; "seed"; "init": numpy's generator for weights. The process's,
    or, in a thread that called use_own_random_state (a simulated rank of distributed.run_simulated), its own."""

    def __init__(self):
        self.process, self.threads = {}, threading.local()

    def _current(self):
        own = getattr(self.threads, "state", None)
        return self.process if own is None else own

    def __getitem__(self, key):
        return self._current()[key]

    def __setitem__(self, key, value):
        self._current()[key] = value

    def __contains__(self, key):
        return key in self._current()

    def get(self, key, default=None):
        return self._current().get(key, default)


_dropout_state = _RandomState()
_dropout_part = threading.local()  # .index, .parts: this thread's rows' place in the global batch (dropout_batch_part)

_DTYPE_NAMES = {"float32": "torch.float32", "float64": "torch.float64", "int32": "torch.int32",
                "int64": "torch.int64", "bool": "torch.bool", "uint8": "torch.uint8", "float16": "torch.float16",
                "bfloat16": "torch.bfloat16"}

SECOND_BACKWARD = (
    "Trying to backward through the graph a second time (or directly access saved tensors after they have "
    "already been freed). Saved intermediate values of the graph are freed when you call .backward() or "
    "autograd.grad(). Specify retain_graph=True if you need to backward through the graph a second time or "
    "if you need to access saved tensors after calling backward.")


class Tensor:
    """A backend array with a gradient: .data (float32 or bfloat16, unless it holds ids or a mask), .grad,
    .requires_grad, .grad_fn."""

    def __init__(self, data, requires_grad=False):
        if isinstance(data, Tensor):
            data = data.data
        if isinstance(data, numpy.generic):  # a numpy number keeps its type
            data = backend.xp.asarray(data)
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
        if self.requires_grad:
            raise RuntimeError("Can't call numpy() on Tensor that requires grad. Use tensor.detach().numpy() instead.")
        return backend.asnumpy(self.data)

    def item(self):
        """The value of a one-element tensor (any shape) as a Python number (on a GPU: waits for it, a host copy)."""
        if self.data.size != 1:
            raise RuntimeError(f"a Tensor with {self.data.size} elements cannot be converted to Scalar")
        return backend.asnumpy(self.data).reshape(()).item()

    def tolist(self):
        return backend.asnumpy(self.data).tolist()

    def detach(self):
        """The same array, outside every graph."""
        return Tensor(self.data)

    def dim(self):
        return self.data.ndim

    def __len__(self):
        if self.data.ndim == 0:
            raise TypeError("len() of a 0-d tensor")
        return self.data.shape[0]

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __repr__(self):
        values = numpy.array2string(backend.asnumpy(self.data), separator=", ", prefix="tensor(", precision=4)
        extra = ""
        if self.dtype not in (numpy.float32, numpy.int64, numpy.bool_):
            extra += f", dtype={_DTYPE_NAMES.get(self.dtype.name, self.dtype.name)}"
        if self.grad_fn is not None:
            extra += f", grad_fn=<{self.grad_fn.name()}>"
        elif self.requires_grad:
            extra += ", requires_grad=True"
        return f"tensor({values}{extra})"

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

    # ---- operators and methods: the Functions live in gpt2_cupy.tensor_ops -------------------------------
    __hash__ = object.__hash__  # == is elementwise (a bool tensor), so a tensor hashes by identity

    def __add__(self, other):
        return _ops().binary("add", self, other)

    def __radd__(self, other):
        return _ops().binary("add", other, self)

    def __sub__(self, other):
        return _ops().binary("sub", self, other)

    def __rsub__(self, other):
        return _ops().binary("sub", other, self)

    def __mul__(self, other):
        return _ops().binary("mul", self, other)

    def __rmul__(self, other):
        return _ops().binary("mul", other, self)

    def __truediv__(self, other):
        return _ops().binary("div", self, other)

    def __rtruediv__(self, other):
        return _ops().binary("div", other, self)

    def __pow__(self, other):
        return _ops().binary("pow", self, other)

    def __rpow__(self, other):
        return _ops().binary("pow", other, self)

    def __matmul__(self, other):
        return _ops().matmul(self, other)

    def __rmatmul__(self, other):
        return _ops().matmul(other, self)

    def __neg__(self):
        return _ops().unary("neg", self)

    def __eq__(self, other):
        return _ops().compare("eq", self, other)

    def __ne__(self, other):
        return _ops().compare("ne", self, other)

    def __lt__(self, other):
        return _ops().compare("lt", self, other)

    def __le__(self, other):
        return _ops().compare("le", self, other)

    def __gt__(self, other):
        return _ops().compare("gt", self, other)

    def __ge__(self, other):
        return _ops().compare("ge", self, other)

    def __invert__(self):
        if self.dtype != numpy.bool_:
            raise TypeError("~ (bitwise not) is only supported here for bool tensors")
        return self == False  # noqa: E712  (elementwise: a bool tensor)

    def __and__(self, other):
        return _ops().logical("and", self, other)

    def __or__(self, other):
        return _ops().logical("or", self, other)

    def __bool__(self):
        if self.data.size != 1:
            raise RuntimeError(f"Boolean value of Tensor with more than one value is ambiguous")
        return bool(self.item())

    def __format__(self, format_spec):
        # f"{loss:.4f}" of a 0-d tensor formats its value, as PyTorch's does; other shapes format as objects
        if self.data.ndim == 0:
            return self.item().__format__(format_spec)
        return object.__format__(self, format_spec)

    def __float__(self):
        return float(self.item())

    def __int__(self):
        return int(self.item())

    def __index__(self):
        if self.dtype.kind not in "iu" or self.data.size != 1:
            raise TypeError("only integer tensors of a single element can be converted to an index")
        return int(self.item())

    def __getitem__(self, key):
        return _ops().index(self, key)

    def __setitem__(self, key, value):
        _ops().index_put(self, key, value)

    def exp(self):
        return _ops().unary("exp", self)

    def log(self):
        return _ops().unary("log", self)

    def sqrt(self):
        return _ops().unary("sqrt", self)

    def rsqrt(self):
        return _ops().unary("rsqrt", self)

    def tanh(self):
        return _ops().unary("tanh", self)

    def sigmoid(self):
        return _ops().unary("sigmoid", self)

    def relu(self):
        return _ops().unary("relu", self)

    def abs(self):
        return _ops().unary("abs", self)

    def pow(self, exponent):
        return _ops().binary("pow", self, exponent)

    def clamp(self, min=None, max=None):
        return _ops().clamp(self, min, max)

    clip = clamp

    def masked_fill(self, mask, value):
        return _ops().masked_fill(self, mask, value)

    # In place, as PyTorch's methods ending in _: each writes into self's array (every view of it sees the
    # change), bumps its storage's version and returns self.
    def add_(self, other, alpha=1):
        return _ops().add_(self, other, alpha)

    def sub_(self, other, alpha=1):
        return _ops().add_(self, other, -alpha, name="sub_")

    def mul_(self, other):
        return _ops().binary_("mul", self, other)

    def div_(self, other):
        return _ops().binary_("div", self, other)

    def zero_(self):
        return _ops().fill_(self, 0)

    def fill_(self, value):
        return _ops().fill_(self, value)

    def copy_(self, src, non_blocking=False):
        return _ops().copy_(self, src)

    def clamp_(self, min=None, max=None):
        return _ops().clamp_(self, min, max)

    clip_ = clamp_

    def masked_fill_(self, mask, value):
        return _ops().masked_fill_(self, mask, value)

    __iadd__ = add_   # x += y changes x itself, as in PyTorch (without them Python would rebind x to x + y)
    __isub__ = sub_
    __imul__ = mul_
    __itruediv__ = div_

    @property
    def _version(self):
        """How many in-place operations have written into this tensor's storage (PyTorch's x._version)."""
        return storage_version(self.data)

    def tril(self, diagonal=0):
        return _ops().Triangle.apply(self, diagonal, False)

    def triu(self, diagonal=0):
        return _ops().Triangle.apply(self, diagonal, True)

    def sum(self, dim=None, keepdim=False, dtype=None):
        return _ops().sum(self, dim, keepdim, dtype)

    def mean(self, dim=None, keepdim=False, dtype=None):
        return _ops().mean(self, dim, keepdim, dtype)

    def var(self, dim=None, unbiased=True, keepdim=False, *, correction=None):
        return _ops().var(self, dim, unbiased, keepdim, correction)

    def std(self, dim=None, unbiased=True, keepdim=False, *, correction=None):
        return _ops().std(self, dim, unbiased, keepdim, correction)

    def max(self, dim=None, keepdim=False):
        return _ops().extreme("max", self, dim, keepdim)

    def min(self, dim=None, keepdim=False):
        return _ops().extreme("min", self, dim, keepdim)

    def argmax(self, dim=None, keepdim=False):
        return _ops().argextreme("max", self, dim, keepdim)

    def argmin(self, dim=None, keepdim=False):
        return _ops().argextreme("min", self, dim, keepdim)

    def softmax(self, dim):
        from gpt2_cupy.nn import functional
        return functional.softmax(self, dim)

    def log_softmax(self, dim):
        return _ops().log_softmax(self, dim)

    def topk(self, k, dim=-1, largest=True, sorted=True):
        return _ops().topk(self, k, dim, largest, sorted)

    def view(self, *shape):
        return _ops().view(self, _sizes(shape))

    def reshape(self, *shape):
        return _ops().reshape(self, _sizes(shape))

    def permute(self, *dims):
        return _ops().permute(self, _sizes(dims))

    def transpose(self, dim0, dim1):
        return _ops().transpose(self, dim0, dim1)

    @property
    def T(self):
        return _ops().permute(self, tuple(reversed(range(self.ndim))))

    def unsqueeze(self, dim):
        return _ops().unsqueeze(self, dim)

    def squeeze(self, dim=None):
        return _ops().squeeze(self, dim)

    def flatten(self, start_dim=0, end_dim=-1):
        return _ops().flatten(self, start_dim, end_dim)

    def expand(self, *sizes):
        return _ops().expand(self, _sizes(sizes))

    def expand_as(self, other):
        return _ops().expand(self, other.shape)

    def view_as(self, other):
        return _ops().view(self, other.shape)

    def contiguous(self):
        return _ops().contiguous(self)

    def clone(self):
        return _ops().clone(self)

    def is_contiguous(self):
        return bool(self.data.flags.c_contiguous)

    def split(self, split_size, dim=-1):
        from gpt2_cupy.nn import functional
        return functional.split(self, split_size, dim)

    def to(self, *arguments, dtype=None, device=None, **options):
        """.to(dtype), .to(device) or both; one backend runs everything, so a device changes nothing. A new
        dtype is a copy whose gradient is converted back (bfloat16: rounded to nearest, ties to even)."""
        for argument in arguments:
            if isinstance(argument, Tensor):
                dtype = argument.dtype
            elif argument in ("bfloat16", "float16") or isinstance(argument, (numpy.dtype, type)):
                dtype = argument
        if dtype is None:
            return self
        if numpy.dtype(dtype) == numpy.float16:
            raise NotImplementedError(f"to: dtype {dtype} is not supported; tensors are float32, bfloat16, "
                                      "int32/int64 or bool")
        return _ops().to_dtype(self, dtype)

    def float(self):
        return self.to(numpy.float32)

    def bfloat16(self):
        return self.to("bfloat16")

    def half(self):
        return self.to(numpy.float16)

    def long(self):
        return self.to(numpy.int64)

    def int(self):
        return self.to(numpy.int32)

    def bool(self):
        return self.to(numpy.bool_)

    def type_as(self, other):
        return self.to(other.dtype)

    def cuda(self, device=None):
        return self

    def cpu(self):
        return self

    def pin_memory(self):
        """Itself: page-locked host copies are for overlapping copies to the GPU; every tensor here already
        lives on the one backend, so there is nothing to pin (and .to(device, non_blocking=True) copies nothing)."""
        return self

    device = property(lambda self: backend.name)
    is_cuda = property(lambda self: backend.name == "cuda")


def _ops():
    from gpt2_cupy import tensor_ops  # imported on first use: it imports this module
    return tensor_ops


def _sizes(sizes):
    """view(2, 3) and view((2, 3)) alike: the sizes as one tuple."""
    return tuple(sizes[0]) if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)) else tuple(sizes)


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
        # a Function that serves several operations (Binary: add, mul, ...) names the one it ran in ctx.name
        operation = getattr(self.ctx, "name", None)
        return (operation.capitalize() if operation else self.function.__name__) + "Backward"

    @property
    def next_functions(self):
        return tuple(edge if edge is not None else (None, 0) for edge in self.next_edges)

    def __repr__(self):
        return f"<{self.name()}>"

    def apply(self, douts):
        """The gradients of the inputs, from the gradients of the outputs (None where none arrived)."""
        douts = [backend.xp.zeros(shape, dtype) if dout is None else dout
                 for dout, (shape, dtype) in zip(douts, self.output_shapes)]
        if not self.function.accepts_strided:
            douts = [contiguous(dout) for dout in douts]
        self.ctx.intermediate_buffers = {}
        gradients = self.function.backward(self.ctx, *douts)
        gradients = list(gradients) if isinstance(gradients, tuple) else [gradients]
        for index, buffer in self.ctx.intermediate_buffers.items():  # what ops added into ctx.grad_buffer(i)
            buffer = _as_dtype(buffer, self.ctx._input_dtypes[index])
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


def _add(a, b, out=None):
    """a + b into a new array (intermediate gradients are shared, never written into in place), or into out:
    chapter 03's residual kernel for float32, the generated elementwise kernel for bf16 (one rounding)."""
    a, b = contiguous(a), contiguous(b)
    if a.dtype == numpy.float32 and b.dtype == numpy.float32:
        from gpt2_cupy.ops.residual import residual_forward
        return residual_forward(a, b, out=out)
    from gpt2_cupy.elementwise import elementwise
    dtype = a.dtype if out is None else out.dtype
    return elementwise("add_gradients", "a + b", [a, _as_dtype(b, a.dtype)], compute_dtype=dtype, out=out)


def _accumulate(tensor, gradient):
    """tensor.grad += gradient, for a leaf: in place into its buffer (which the optimizer may own)."""
    gradient = _as_dtype(contiguous(gradient), tensor.dtype)
    if tensor.grad is None:
        tensor.grad = _new_leaf_gradient(tensor, gradient)
    else:
        _add(tensor.grad, gradient, out=tensor.grad)


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
        # kernels, so that a CUDA graph's capture records them (on the CPU executor too)
        if gradient is not None:
            from gpt2_cupy.elementwise import elementwise
            elementwise("leaf_gradient", "a", [gradient], compute_dtype=slot.array.dtype, out=slot.array)
        elif not slot.zeroed:
            backend.fill_zero(slot.array)
        slot.zeroed = False
        return slot.array
    if gradient is not None:
        return backend.xp.array(gradient, copy=True)
    return backend.xp.zeros(tensor.shape, dtype=tensor.dtype)


# ---- versions: what in-place operations wrote -------------------------------------------------------------

_versions = {}  # id(storage) -> [weak reference to the storage, how many in-place writes it has had]


def storage_version(array):
    """The version of array's storage: 0 until an in-place operation writes into it or into any view of it."""
    storage = storage_of(array)
    entry = _versions.get(id(storage))
    return entry[1] if entry is not None and entry[0]() is storage else 0


def bump_version(array):
    """An in-place operation wrote into array: every tensor that shares its storage is one version further."""
    storage = storage_of(array)
    key = id(storage)
    entry = _versions.get(key)
    if entry is None or entry[0]() is not storage:
        # the entry leaves with its storage (id() may then be given to another array)
        entry = _versions[key] = [weakref.ref(storage, lambda _, key=key: _versions.pop(key, None)), 0]
    entry[1] += 1


_TENSOR_TYPES = {"float32": "FloatTensor", "float64": "DoubleTensor", "bfloat16": "BFloat16Tensor",
                 "float16": "HalfTensor", "int64": "LongTensor", "int32": "IntTensor", "bool": "BoolTensor",
                 "uint8": "ByteTensor"}


def _modified_error(array, version, expected):
    kind = _TENSOR_TYPES.get(array.dtype.name, array.dtype.name)
    prefix = "torch.cuda." if backend.name == "cuda" else "torch."
    return RuntimeError(
        f"one of the variables needed for gradient computation has been modified by an inplace operation: "
        f"[{prefix}{kind} {list(array.shape)}] is at version {version}; expected version {expected} instead. "
        f"Hint: the operation that saved it ran before the in-place operation changed it; clone() it before "
        f"the in-place operation, or do that operation out of place.")


def _check_view_is_current(tensor):
    """A view's grad_fn says how it was taken from its base. After an in-place write into the base (or into
    another view of it) the view's values changed without its grad_fn knowing: as PyTorch, the grad_fn is
    taken again from the base's current place in the graph. A view that does not know its base is refused."""
    node = tensor.grad_fn
    if node is not None and getattr(node.ctx, "is_view", False) and \
            storage_version(tensor.data) != node.ctx.view_version:
        if getattr(tensor, "_base", None) is not None:
            _ops().regenerate_view(tensor)
            return
        raise NotImplementedError(
            "a view used after an in-place operation changed the tensor it was taken from: its gradient would miss "
            "that operation (PyTorch rebuilds the view's grad_fn; this library does not). Take the view again "
            "after the in-place operation.")


class Context:
    """What forward leaves for backward: saved arrays, the arguments' gradient needs and their buffers."""

    def __init__(self, inputs):
        self.needs_input_grad = tuple(t is not None and t.requires_grad for t in inputs)
        for t in inputs:
            if t is not None and t.requires_grad:
                _check_view_is_current(t)
        # Leaves only (their .grad is the buffer an op adds into); never an intermediate tensor, whose
        # array would then stay alive as long as the graph even when the backward does not need it.
        self._leaves = [t if t is not None and t.is_leaf else None for t in inputs]
        self._input_shapes = [t.shape if t is not None else None for t in inputs]
        self._input_dtypes = [t.dtype if t is not None else None for t in inputs]
        self._saved = ()
        self._saved_versions = ()       # each saved array's storage version when it was saved
        self._freed = False             # saved arrays were freed: reading them raises
        self.freed = False              # a backward without retain_graph has run through this call
        self.intermediate_buffers = {}  # grad_buffer()s of non-leaf arguments, added by the Node afterwards

    def save_for_backward(self, *arrays):
        self._saved = arrays
        self._saved_versions = tuple(storage_version(a) if isinstance(a, backend.xp.ndarray) else None
                                     for a in arrays)

    @property
    def saved_tensors(self):
        """The saved arrays, as they were when saved: an in-place write into one since then raises, as in
        PyTorch, rather than giving a gradient computed from the wrong values."""
        if self._freed:
            raise RuntimeError(SECOND_BACKWARD)
        for array, expected in zip(self._saved, self._saved_versions):
            if expected is not None and storage_version(array) != expected:
                raise _modified_error(array, storage_version(array), expected)
        return self._saved

    def free_saved(self):
        """Drop the saved arrays after the backward has used them (a second backward then raises)."""
        self._saved, self._freed, self.freed = (), bool(self._saved), True

    def grad_buffer(self, index):
        """The float32 buffer an op adds argument `index`'s gradient into: a float32 leaf's own .grad (zeroed
        when new).

        backward returns None for that argument: its gradient is already in place. For an intermediate
        tensor, or one of another dtype (a bf16 weight), the buffer is a new zeroed array that the Node
        sends on afterwards, in the argument's dtype; for a tensor that needs no gradient, a scratch array
        that is thrown away.
        """
        leaf = self._leaves[index]
        if not self.needs_input_grad[index] or leaf is None or leaf.dtype != numpy.float32:
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
    """One differentiable operation: subclasses define static forward(ctx, ...) and backward(ctx, *douts).

    accepts_strided: forward and backward take arrays of any strides (views). False, the default, hands
    them C-contiguous arrays (copying views first): what a kernel that indexes flat memory needs.
    """

    accepts_strided = False

    @classmethod
    def apply(cls, *arguments, **options):
        inputs = [a if isinstance(a, Tensor) else None for a in arguments]
        ctx = Context(inputs)
        arrays = [a.data if isinstance(a, Tensor) else a for a in arguments]
        if not cls.accepts_strided:
            arrays = [contiguous(a) for a in arrays]
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


def use_own_random_state():
    """From now on this thread draws from generators of its own, copies of the process's: a simulated rank (a
    thread of distributed.run_simulated) seeds and advances them as a process of its own would."""
    process = _dropout_state.process
    own = {"rng": process["rng"].copy(), "seed": process["seed"], "init": copy.deepcopy(process["init"])} \
        if "rng" in process else {}
    _dropout_state.threads.state = own


@contextlib.contextmanager
def dropout_batch_part(index, parts):
    """Inside the block this thread's batch is part `index` of `parts` equal parts of a global batch, along the
    leading axis of every tensor that dropout drops (rank `index` of `parts` under data parallelism): each
    dropout draws the random numbers of its elements' places in the global tensor, and moves the generator past
    all the parts, so that the parts together draw what one process draws for the whole batch."""
    if not 0 <= index < parts:
        raise ValueError(f"dropout_batch_part: index must be in [0, {parts - 1}], got {index}")
    previous = getattr(_dropout_part, "place", (0, 1))
    _dropout_part.place = (index, parts)
    try:
        yield
    finally:
        _dropout_part.place = previous


def dropout_draw(count):
    """(start, advance) of a dropout over `count` elements of this thread's batch: the stream index of its first
    element, and how far the generator's offset moves past it (count, or the whole global batch's)."""
    index, parts = getattr(_dropout_part, "place", (0, 1))
    return index * count, parts * count
