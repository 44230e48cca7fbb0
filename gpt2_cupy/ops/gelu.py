"""GELU, the activation in GPT-2's MLP, forward and backward, elementwise on float32 arrays.

    y = gelu_forward(x)                       GELU(x), GPT-2's tanh approximation
    y = gelu_forward(x, approximate="none")   the exact x * Phi(x), with erf
    dx = gelu_backward(x, dy)                 dy * GELU'(x), where x is the input of the forward

Any shape works (in the model: (B, T, 4C), the MLP's hidden activations); dy and out have x's shape.
`out=` writes into an existing array, which may be the input itself (x, or dy for the backward).

The kernels are kernels/gelu.cu, taught in chapters/03_gelu_residual.ipynb. Arrays that start at a
16-byte aligned address (every freshly allocated array does) go through the float4 kernels, four
elements per thread; any other array through the one-element-per-thread kernels.
"""

import numpy as np

from gpt2_cupy import backend, kernels

THREADS_PER_BLOCK = 256
APPROXIMATIONS = {"tanh": 0, "none": 1}  # the kernels' `exact` flag, named as in torch.nn.functional.gelu
_LARGEST_SIZE = 2**31 - 1  # the kernels index with int


def gelu_forward(x, approximate="tanh", out=None):
    """GELU(x), elementwise. x: float32, C-contiguous, any shape. Returns y (or out) of x's shape."""
    exact = _exact_flag("gelu_forward", approximate)
    _check_array("gelu_forward", "x", x)
    out = _output("gelu_forward", out, x)
    _launch("gelu_forward", (out, x), x.size, exact)
    return out


def gelu_backward(x, dy, approximate="tanh", out=None):
    """dx = dy * GELU'(x), elementwise. x: the forward's input; dy: the gradient of its output, x's shape."""
    exact = _exact_flag("gelu_backward", approximate)
    _check_array("gelu_backward", "x", x)
    _check_array("gelu_backward", "dy", dy)
    if dy.shape != x.shape:
        raise ValueError(f"gelu_backward: dy has shape {dy.shape} but x has shape {x.shape}; they must be equal")
    out = _output("gelu_backward", out, x)
    _launch("gelu_backward", (out, x, dy), x.size, exact)
    return out


def _exact_flag(operation, approximate):
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"{operation}: approximate={approximate!r}; use 'tanh' (GPT-2's GELU) "
                         "or 'none' (the exact erf form)")
    return APPROXIMATIONS[approximate]


def _check_array(operation, name, array):
    if not isinstance(array, backend.xp.ndarray):
        raise TypeError(f"{operation}: {name} is a {type(array).__name__}; expected a {backend.xp.__name__} array "
                        f"(the active backend is {backend.name})")
    if array.dtype != np.float32:
        raise TypeError(f"{operation}: {name} has dtype {array.dtype}; the GELU kernels take float32 only")
    if not array.flags.c_contiguous:
        raise ValueError(f"{operation}: {name} (shape {array.shape}, strides {array.strides}) is not C-contiguous; "
                         "the kernels index memory as one flat array, so pass xp.ascontiguousarray(...)")
    if array.size > _LARGEST_SIZE:
        raise ValueError(f"{operation}: {name} has {array.size} elements; the kernels index with int, "
                         f"at most {_LARGEST_SIZE}")


def _output(operation, out, x):
    if out is None:
        return backend.xp.empty_like(x)
    _check_array(operation, "out", out)
    if out.shape != x.shape:
        raise ValueError(f"{operation}: out has shape {out.shape} but x has shape {x.shape}; they must be equal")
    return out


def _address(array):
    return array.data.ptr if backend.name == "cuda" else array.ctypes.data


def _launch(kernel_name, arrays, n, exact):
    if n == 0:
        return
    if all(_address(array) % 16 == 0 for array in arrays):
        kernel, threads = kernels.function("gelu", kernel_name + "_float4"), (n + 3) // 4
    else:
        kernel, threads = kernels.function("gelu", kernel_name), n
    blocks = (threads + THREADS_PER_BLOCK - 1) // THREADS_PER_BLOCK
    kernel((blocks,), (THREADS_PER_BLOCK,), (*arrays, np.int32(n), np.int32(exact)))
