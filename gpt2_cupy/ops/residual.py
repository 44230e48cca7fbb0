"""The residual connection of a GPT-2 block, out = x + branch, and the gradients around it.

    out = residual_forward(x, branch)        x + branch, elementwise; x, branch: (B, T, C) float32
    dx_skip, dbranch = residual_backward(dout)
                                             the add node's backward: both inputs receive dout itself
    dx = fork_backward(dout, dx_branch)      dout + dx_branch, elementwise: the gradient of x, which
                                             the block used twice (skip path and branch)

In the backward of a block, out = x + f(x), the order is: residual_backward(dout) hands dout to the
branch, the branch's own backward turns it into dx_branch, and fork_backward adds the skip path's dout.
residual_backward returns the same array twice, not copies: write into neither while the other is still
needed. `out=` writes into an existing array, which may be one of the inputs (fork_backward(dout,
dx_branch, out=dx_branch) sums in place, without a new allocation).

The kernels are kernels/residual.cu, taught in chapters/03_gelu_residual.ipynb. Arrays that start at a
16-byte aligned address go through the float4 kernel, the others through the one-element-per-thread one.
"""

import numpy as np

from gpt2_cupy import backend, kernels

THREADS_PER_BLOCK = 256
_LARGEST_SIZE = 2**31 - 1  # the kernels index with int


def residual_forward(x, branch, out=None):
    """x + branch, elementwise. x, branch: float32, C-contiguous, one shape (in the model (B, T, C))."""
    return _add("residual_forward", ("x", x), ("branch", branch), out)


def residual_backward(dout):
    """The add node's backward: the gradient of out goes unchanged to x and to branch (the same array)."""
    _check_array("residual_backward", "dout", dout)
    return dout, dout


def fork_backward(dout, dx_branch, out=None):
    """dx = dout + dx_branch: the gradient of a value used twice is the sum of what each use sends back."""
    return _add("fork_backward", ("dout", dout), ("dx_branch", dx_branch), out)


def _add(operation, first, second, out):
    (first_name, a), (second_name, b) = first, second
    _check_array(operation, first_name, a)
    _check_array(operation, second_name, b)
    if a.shape != b.shape:
        raise ValueError(f"{operation}: {first_name} has shape {a.shape} but {second_name} has shape {b.shape}; "
                         "they must be equal")
    if out is None:
        out = backend.xp.empty_like(a)
    else:
        _check_array(operation, "out", out)
        if out.shape != a.shape:
            raise ValueError(f"{operation}: out has shape {out.shape} but {first_name} has shape {a.shape}; "
                             "they must be equal")
    _launch((out, a, b), a.size)
    return out


def _check_array(operation, name, array):
    if not isinstance(array, backend.xp.ndarray):
        raise TypeError(f"{operation}: {name} is a {type(array).__name__}; expected a {backend.xp.__name__} array "
                        f"(the active backend is {backend.name})")
    if array.dtype != np.float32:
        raise TypeError(f"{operation}: {name} has dtype {array.dtype}; the residual kernels take float32 only")
    if not array.flags.c_contiguous:
        raise ValueError(f"{operation}: {name} (shape {array.shape}, strides {array.strides}) is not C-contiguous; "
                         "the kernels index memory as one flat array, so pass xp.ascontiguousarray(...)")
    if array.size > _LARGEST_SIZE:
        raise ValueError(f"{operation}: {name} has {array.size} elements; the kernels index with int, "
                         f"at most {_LARGEST_SIZE}")


def _address(array):
    return array.data.ptr if backend.name == "cuda" else array.ctypes.data


def _launch(arrays, n):
    if n == 0:
        return
    if all(_address(array) % 16 == 0 for array in arrays):
        kernel, threads = kernels.function("residual", "residual_add_float4"), (n + 3) // 4
    else:
        kernel, threads = kernels.function("residual", "residual_add"), n
    blocks = (threads + THREADS_PER_BLOCK - 1) // THREADS_PER_BLOCK
    kernel((blocks,), (THREADS_PER_BLOCK,), (*arrays, np.int32(n)))
