"""Autograd, one graph per result: Tensor, Function, no_grad.

    x = Tensor(array, requires_grad=True)      a backend array (._data) with a gradient (.grad, a Tensor)
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

This module is the engine, and Tensor here is what the engine needs of it: its array, its gradient, its
place in the graph, backward(). The operations (x + y, x.view(...), x.softmax(dim)) are Functions built on
the engine, in gpt2_cupy.tensor_ops and gpt2_cupy.nn.functional; gpt2_cupy.tensor puts them on Tensor as
methods, so that this module imports none of them.
"""

import contextlib
import weakref

import numpy

from gpt2_cupy import backend
from gpt2_cupy.ops.arrays import storage_of
# converted: a float32 gradient buffer for a bf16 argument, say
from gpt2_cupy.elementwise import contiguous, converted as _as_dtype, elementwise
from gpt2_cupy.ops.residual import residual_forward

_grad_enabled = True    # switched off inside `with no_grad():`

_DTYPE_NAMES = {"float32": "torch.float32", "float64": "torch.float64", "int32": "torch.int32",
                "int64": "torch.int64", "bool": "torch.bool", "uint8": "torch.uint8", "float16": "torch.float16",
                "bfloat16": "torch.bfloat16"}

SECOND_BACKWARD = (
    "Trying to backward through the graph a second time (or directly access saved tensors after they have "
    "already been freed). Saved intermediate values of the graph are freed when you call .backward() or "
    "autograd.grad(). Specify retain_graph=True if you need to backward through the graph a second time or "
    "if you need to access saved tensors after calling backward.")


class Tensor:
    """A backend array with a gradient: ._data (float32 or bfloat16, unless it holds ids or a mask), .grad,
    .requires_grad, .grad_fn. .data is the same values as a Tensor outside the graph, as PyTorch's."""

    def __init__(self, data, requires_grad=False):
        if isinstance(data, Tensor):
            data = data._data
        if isinstance(data, numpy.generic):  # a numpy number keeps its type
            data = backend.xp.asarray(data)
        if not isinstance(data, backend.xp.ndarray):
            data = backend.xp.asarray(data, dtype=numpy.float32)
        self._data, self._grad = data, None
        self._requires_grad = bool(requires_grad)
        self.grad_fn = None     # the Node that made this tensor; None for a leaf
        self.output_nr = 0      # which of that Node's outputs it is

    shape = property(lambda self: tuple(self._data.shape))
    ndim = property(lambda self: self._data.ndim)
    dtype = property(lambda self: self._data.dtype)
    is_leaf = property(lambda self: self.grad_fn is None, doc="made by the user, not by a recorded call")

    @property
    def requires_grad(self):
        return self._requires_grad

    @requires_grad.setter
    def requires_grad(self, value):
        if not self.is_leaf:
            raise RuntimeError("you can only change requires_grad flags of leaf variables.")
        self._requires_grad = bool(value)

    @property
    def data(self):
        """The values as a Tensor over the same storage, outside every graph (requires_grad False), as
        PyTorch's .data: `p.data.std()` is the Tensor's (unbiased) std, and `p.data += -lr * p.grad`,
        `p.data.zero_()`, `p.data[...] = x` write into p's own memory (an optimizer's flat buffer, say).
        The package's code reads the backend array itself as `tensor._data`."""
        return Tensor(self._data)

    @data.setter
    def data(self, value):
        """p.data = t: p takes t's storage (an optimizer over p copies it into its flat buffer at its next step)."""
        if not isinstance(value, Tensor):
            raise TypeError(f"Variable data has to be a tensor, but got {type(value).__name__}")
        self._data = value._data

    @property
    def grad(self):
        """The gradient, a Tensor (None until a backward reaches this leaf). Its array may be a view into
        an optimizer's flat gradient buffer: writes into it (grad.zero_(), grad *= s) land there."""
        return self._grad

    @grad.setter
    def grad(self, value):
        if isinstance(value, backend.xp.ndarray):  # the engine and optimizers hand over arrays
            value = Tensor(value)
        elif value is not None and not isinstance(value, Tensor):
            raise TypeError(f"assigned grad expected to be a Tensor or None but got grad of type "
                            f"{type(value).__name__}")
        if value is not None and value.shape != self.shape:
            raise RuntimeError("assigned grad has data of a different size")
        if value is not None and value.dtype != self.dtype:
            raise RuntimeError("assigned grad has data of a different type")
        self._grad = value

    def _grad_array(self):
        """The gradient's backend array, or None."""
        return None if self._grad is None else self._grad._data

    def requires_grad_(self, requires_grad=True):
        self.requires_grad = requires_grad
        return self

    def size(self, dim=None):
        return self.shape if dim is None else self.shape[dim]

    def numel(self):
        return int(self._data.size)

    nelement = numel

    def element_size(self):
        """Bytes per element."""
        return self._data.itemsize

    def data_ptr(self):
        """The address of the first element (device memory on a GPU, host memory on the CPU)."""
        return backend.address(self._data)

    def is_floating_point(self):
        return self.dtype.kind == "f" or self.dtype.name == "bfloat16"

    def new_zeros(self, *size, dtype=None, device=None, requires_grad=False):
        return Tensor(backend.xp.zeros(as_sizes(size), dtype=self.dtype if dtype is None else dtype),
                      requires_grad=requires_grad)

    def new_ones(self, *size, dtype=None, device=None, requires_grad=False):
        return Tensor(backend.xp.ones(as_sizes(size), dtype=self.dtype if dtype is None else dtype),
                      requires_grad=requires_grad)

    def new_full(self, size, fill_value, dtype=None, device=None, requires_grad=False):
        return Tensor(backend.xp.full(tuple(size), fill_value, dtype=self.dtype if dtype is None else dtype),
                      requires_grad=requires_grad)

    def numpy(self):
        if self.requires_grad:
            raise RuntimeError("Can't call numpy() on Tensor that requires grad. Use tensor.detach().numpy() instead.")
        return backend.asnumpy(self._data)

    def item(self):
        """The value of a one-element tensor (any shape) as a Python number (on a GPU: waits for it, a host copy)."""
        if self._data.size != 1:
            raise RuntimeError(f"a Tensor with {self._data.size} elements cannot be converted to Scalar")
        return backend.asnumpy(self._data).reshape(()).item()

    # No __array_priority__: `array += tensor` (array a backend array) stays numpy's or CuPy's in-place add,
    # reading the tensor through __array__ or __cuda_array_interface__, so that the array keeps its memory.
    def __array__(self, dtype=None, copy=None):
        """numpy.asarray(tensor): its values on the host, as torch's; refused while it requires grad."""
        values = self.numpy()
        return values if dtype is None else values.astype(dtype)

    @property
    def __cuda_array_interface__(self):
        """CuPy's cupy.asarray(tensor) and cupy.asnumpy(tensor) read the device array (on a GPU only)."""
        if not backend.ON_GPU:
            raise AttributeError("__cuda_array_interface__: the tensor lives in host memory (the CPU backend)")
        if self.requires_grad:
            raise RuntimeError("Can't get __cuda_array_interface__ on Variable that requires grad. "
                               "If gradients aren't required, use var.detach() to get Variable that doesn't require grad.")
        return self._data.__cuda_array_interface__

    def tolist(self):
        return backend.asnumpy(self._data).tolist()

    def detach(self):
        """The same array, outside every graph."""
        return Tensor(self._data)

    def dim(self):
        return self._data.ndim

    def __len__(self):
        if self._data.ndim == 0:
            raise TypeError("len() of a 0-d tensor")
        return self._data.shape[0]

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __repr__(self):
        values = numpy.array2string(backend.asnumpy(self._data), separator=", ", prefix="tensor(", precision=4)
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
            if self._data.size != 1:
                raise RuntimeError(f"grad can be implicitly created only for scalar outputs; backward was called "
                                   f"on a tensor of shape {self.shape} (pass the gradient of the output)")
            gradient = backend.xp.ones(self._data.shape, dtype=self._data.dtype)
        elif isinstance(gradient, Tensor):
            gradient = gradient._data
        if tuple(gradient.shape) != self.shape:
            raise RuntimeError(f"backward: the gradient has shape {tuple(gradient.shape)}, the tensor {self.shape}")
        if self.grad_fn is None:
            _accumulate(self, gradient)  # a leaf: d self / d self
        else:
            run_backward(self.grad_fn, self.output_nr, gradient, retain_graph=bool(retain_graph))

    @property
    def _version(self):
        """How many in-place operations have written into this tensor's storage (PyTorch's x._version)."""
        return storage_version(self._data)

    def retain_grad(self):
        """Keep this non-leaf's gradient in .grad after backward (a leaf keeps its own anyway)."""
        if not self.requires_grad:
            raise RuntimeError("can't retain_grad on Tensor that has requires_grad=False")
        if self.grad_fn is not None:
            self.grad_fn.retained[self.output_nr] = weakref.ref(self)

    # == is elementwise (a bool tensor: gpt2_cupy.tensor), so a tensor hashes by identity
    __hash__ = object.__hash__

_TENSOR_TYPES = {"float32": "FloatTensor", "float64": "DoubleTensor", "bfloat16": "BFloat16Tensor",
                 "float16": "HalfTensor", "int64": "LongTensor", "int32": "IntTensor", "bool": "BoolTensor",
                 "uint8": "ByteTensor"}


def type_name(dtype):
    """PyTorch's name of a tensor type of dtype on the active backend: 'torch.cuda.FloatTensor', 'torch.LongTensor'."""
    prefix = "torch.cuda." if backend.ON_GPU else "torch."
    return prefix + _TENSOR_TYPES.get(dtype.name, dtype.name)


def as_sizes(sizes):
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
        self.retained = {}  # output index -> weak reference to the output that called retain_grad()

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
        for index, reference in node.retained.items():  # retain_grad(): the gradient that reached it
            output = reference()
            if output is not None and douts[index] is not None:
                output.grad = douts[index].copy() if output.grad is None else _add(output.grad._data, douts[index])
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
        return residual_forward(a, b, out=out)
    dtype = a.dtype if out is None else out.dtype
    return elementwise("add_gradients", "a + b", [a, _as_dtype(b, a.dtype)], compute_dtype=dtype, out=out)


def _accumulate(tensor, gradient):
    """tensor.grad += gradient, for a leaf: in place into its buffer (which the optimizer may own)."""
    gradient = _as_dtype(contiguous(gradient), tensor.dtype)
    if tensor.grad is None:
        tensor.grad = _new_leaf_gradient(tensor, gradient)
    else:
        _add(tensor.grad._data, gradient, out=tensor.grad._data)


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
    if slot is not None and slot.array.shape == tensor._data.shape:
        # kernels, so that a CUDA graph's capture records them (on the CPU executor too)
        if gradient is not None:
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


def _modified_error(array, version, expected):
    return RuntimeError(
        f"one of the variables needed for gradient computation has been modified by an inplace operation: "
        f"[{type_name(array.dtype)} {list(array.shape)}] is at version {version}; expected version {expected} instead. "
        f"Hint: the operation that saved it ran before the in-place operation changed it; clone() it before "
        f"the in-place operation, or do that operation out of place.")


def _check_view_is_current(tensor):
    """A view's grad_fn says how it was taken from its base. After an in-place write into the base (or into
    another view of it) the view's values changed without its grad_fn knowing: as PyTorch, the grad_fn is
    taken again from the base's current place in the graph. A view that does not know its base is refused."""
    node = tensor.grad_fn
    if node is not None and getattr(node.ctx, "is_view", False) and \
            storage_version(tensor._data) != node.ctx.view_version:
        if getattr(tensor, "_base", None) is not None:
            regenerate_view(tensor)
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
        return leaf.grad._data


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
        arrays = [a._data if isinstance(a, Tensor) else a for a in arguments]
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


# ---- views: a view's place in the graph follows in-place writes into its base ------------------------------

class View(Function):
    """A view of new shape, strides or both: forward gives an array over the same memory; backward moves the
    upstream gradient back with `undo`."""
    accepts_strided = True

    @staticmethod
    def forward(ctx, x, name, make, undo):
        ctx.name, ctx.undo = name, undo
        out = make(x)
        ctx.is_view, ctx.view_version = storage_of(out) is storage_of(x), storage_version(x)
        return out

    @staticmethod
    def backward(ctx, dout):
        return ctx.undo(dout), None, None, None


def take_place(x, result):
    """x stands for result in the graph from now on (its own array unchanged)."""
    x.grad_fn, x.output_nr, x._requires_grad = result.grad_fn, result.output_nr, result.requires_grad


def regenerate_view(view):
    """view's grad_fn made again from its base's current place in the graph: after an in-place write into
    the base (or into any view of it), the old grad_fn would miss that write."""
    take_place(view, View.apply(view._base, "view", view._view_of_base, view._grad_to_base))
