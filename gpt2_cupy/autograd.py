"""The autograd tape: Tensor, Function, no_grad, and the random state that dropout draws from.

    x = Tensor(array, requires_grad=True)      a backend array (.data) with a gradient slot (.grad)
    y = SomeFunction.apply(x, ...)             runs SomeFunction.forward and, if a gradient is wanted,
                                               appends one entry to the tape
    loss.backward()                            walks the tape backwards, calling each entry's backward

The tape is a list in the order the forward ran, so walking it backwards visits every node after all the
nodes that used its output: a topological order for free, no graph search. A Function is PyTorch's
torch.autograd.Function pattern: static forward(ctx, *arrays) and backward(ctx, *douts), ctx carrying
what the backward needs (ctx.save_for_backward). forward receives the backend arrays of its Tensor
arguments (other arguments unchanged) and returns an array or a tuple of arrays; backward returns one
gradient per forward argument (None where there is none).

Gradients are summed, never overwritten: a tensor used twice receives the sum of what each use sends
back (chapter 03's fork). Leaves (parameters) keep their .grad buffer for good and are added into in
place (the optimizer may have made it a view into one flat buffer); a parameter's gradient is usually
added by the op itself, into the buffer ctx.grad_buffer(i) hands it. Gradients of intermediate tensors
are freed as soon as their node's backward has used them, and so are the saved activations.

The tape is one list for the whole program, emptied by each backward: a forward that will not be
differentiated (evaluation, generation) belongs inside `with no_grad():`, or its entries, and the
activations they saved, stay alive until the next backward.
"""

import contextlib

import numpy

from gpt2_cupy import backend

_tape = []              # (function, ctx, inputs, outputs) of every recorded call, in forward order
_grad_enabled = True    # switched off inside `with no_grad():`
_dropout_state = {}     # "rng": dropout's (seed, offset) device array; "init": numpy's generator for weights


class Tensor:
    """A backend array with a gradient: .data (float32 unless it holds ids), .grad, .requires_grad."""

    def __init__(self, data, requires_grad=False):
        if isinstance(data, Tensor):
            data = data.data
        if not isinstance(data, backend.xp.ndarray):
            data = backend.xp.asarray(data, dtype=numpy.float32)
        self.data, self.grad, self.requires_grad = data, None, requires_grad
        self.is_leaf = True  # made by the user, not by a Function: its .grad is kept after backward

    shape = property(lambda self: tuple(self.data.shape))
    ndim = property(lambda self: self.data.ndim)
    dtype = property(lambda self: self.data.dtype)

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
        return Tensor(self.data)

    def __repr__(self):
        return f"Tensor(shape={self.shape}, dtype={self.dtype}, requires_grad={self.requires_grad})"

    def backward(self, gradient=None):
        """d self / d every tensor on the tape that needs it, summed into .grad; self a scalar by default."""
        if gradient is None:
            if self.data.size != 1:
                raise RuntimeError(f"backward: called on a tensor of shape {self.shape}; it needs a scalar "
                                   "(or pass the gradient of the output)")
            gradient = backend.xp.ones(self.data.shape, dtype=self.data.dtype)
        _accumulate(self, gradient)
        try:
            for function, ctx, inputs, outputs in reversed(_tape):
                douts = [output.grad for output in outputs]
                if all(dout is None for dout in douts):
                    continue  # nothing downstream of this call reached the loss
                douts = [backend.xp.zeros(out.shape, out.dtype) if dout is None else dout
                         for dout, out in zip(douts, outputs)]
                gradients = function.backward(ctx, *douts)
                gradients = gradients if isinstance(gradients, tuple) else (gradients,)
                for tensor, gradient in zip(inputs, gradients):
                    if tensor is not None and tensor.requires_grad and gradient is not None:
                        _accumulate(tensor, gradient)
                for index, buffer in ctx.intermediate_buffers.items():
                    _accumulate(inputs[index], buffer)
                for output in outputs:       # consumed: an intermediate gradient is not needed again
                    output.grad = None
                ctx.saved_tensors = ()        # nor are the activations this call saved
        finally:
            _tape.clear()

    # The movements the model needs; their Functions live in gpt2_cupy.functional.
    def __add__(self, other):
        from gpt2_cupy import functional
        return functional.add(self, other)

    def reshape(self, *shape):
        from gpt2_cupy import functional
        return functional.reshape(self, shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape)

    view = reshape

    def transpose(self, dim0, dim1):
        from gpt2_cupy import functional
        return functional.transpose(self, dim0, dim1)

    def split(self, split_size, dim=-1):
        from gpt2_cupy import functional
        return functional.split(self, split_size, dim)

    def contiguous(self):
        return self  # every Tensor here is C-contiguous already: the kernels need it


def _accumulate(tensor, gradient):
    """tensor.grad += gradient: in place for a leaf (its buffer may be a view the optimizer owns)."""
    from gpt2_cupy.ops.residual import residual_forward

    if tensor.grad is None:
        # A leaf gets its own copy; an intermediate tensor may share the array (Add hands dout to both
        # of its inputs), which is safe because intermediate gradients are never written into in place.
        tensor.grad = backend.xp.array(gradient, copy=True) if tensor.is_leaf else gradient
    elif tensor.is_leaf:
        residual_forward(tensor.grad, gradient, out=tensor.grad)
    else:
        tensor.grad = residual_forward(tensor.grad, gradient)


class Context:
    """What forward leaves for backward: saved arrays and the arguments' gradient needs and buffers."""

    def __init__(self, inputs):
        self._inputs = inputs
        self.needs_input_grad = tuple(t is not None and t.requires_grad for t in inputs)
        self.saved_tensors = ()
        self.intermediate_buffers = {}  # grad_buffer()s of non-leaf arguments, added by the tape afterwards

    def save_for_backward(self, *arrays):
        self.saved_tensors = arrays

    def grad_buffer(self, index):
        """The buffer an op adds argument `index`'s gradient into: a leaf's own .grad (zeroed when new).

        backward returns None for that argument: its gradient is already in place. For an intermediate
        tensor the buffer is a new zeroed array the tape adds afterwards; for a tensor that needs no
        gradient, a scratch array that is thrown away.
        """
        tensor = self._inputs[index]
        if not self.needs_input_grad[index] or not tensor.is_leaf:
            buffer = backend.xp.zeros(tensor.shape, dtype=numpy.float32)
            if self.needs_input_grad[index]:
                self.intermediate_buffers[index] = buffer
            return buffer
        if tensor.grad is None:
            tensor.grad = backend.xp.zeros(tensor.shape, dtype=numpy.float32)
        return tensor.grad


class Function:
    """One differentiable operation: subclasses define static forward(ctx, ...) and backward(ctx, *douts)."""

    @classmethod
    def apply(cls, *arguments, **options):
        inputs = [a if isinstance(a, Tensor) else None for a in arguments]
        ctx = Context(inputs)
        arrays = [a.data if isinstance(a, Tensor) else a for a in arguments]
        results = cls.forward(ctx, *arrays, **options)
        single = not isinstance(results, tuple)
        needs_grad = _grad_enabled and any(ctx.needs_input_grad)
        outputs = [Tensor(r, requires_grad=needs_grad) for r in ((results,) if single else results)]
        if needs_grad:
            for output in outputs:
                output.is_leaf = False
            _tape.append((cls, ctx, inputs, outputs))
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


def clear_tape():
    """Forget every recorded call: for a forward cut short (Ctrl-C), which no backward will walk."""
    _tape.clear()


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
