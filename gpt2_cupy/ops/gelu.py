"""GELU, the activation in GPT-2's MLP, forward and backward, elementwise on float32 arrays.

    y = gelu_forward(x)                       GELU(x), GPT-2's tanh approximation
    y = gelu_forward(x, approximate="none")   the exact x * Phi(x), with erf
    dx = gelu_backward(dout, x)               dout * GELU'(x), where x is the input of the forward

Any shape works (in the model: (B, T, 4C), the MLP's hidden activations); dout and out have x's shape.
`out=` writes into an existing array, which may be the input itself (x, or dout for the backward).

The kernels are kernels/gelu.cu, taught in chapters/03_gelu_residual.ipynb. Arrays that start at a
16-byte aligned address (every freshly allocated array does) go through the float4 kernels, four
elements per thread; any other array through the one-element-per-thread kernels. bf16 arrays (a model
trained in bf16, gpt2_cupy.amp) are computed in float32 and rounded once: eight elements per thread by
16-byte loads when aligned, else through the one-element kernels' bf16 versions, with the same bits.
"""

import numpy as np

from gpt2_cupy import kernels

from .arrays import (BFLOAT16, FLOAT32, THREADS_PER_BLOCK, ceil_div, check, float4_aligned, output, storage_c_type,
                     storage_dtype)

APPROXIMATIONS = {"tanh": 0, "none": 1}  # the kernels' `exact` flag, named as in torch.nn.functional.gelu


def gelu_forward(x, approximate="tanh", out=None):
    """GELU(x), elementwise. x: float32 or bf16, C-contiguous, any shape. Returns y (or out) of x's shape and dtype."""
    exact = _exact_flag("gelu_forward", approximate)
    dtype = storage_dtype("gelu_forward", "x", x)
    check("gelu_forward", x=(x, ("...",), dtype))
    out = output("gelu_forward", out, x.shape, dtype=dtype)
    _launch("gelu_forward", (out, x), x.size, np.int32(exact))
    return out


def gelu_backward(dout, x, approximate="tanh", out=None):
    """dx = dout * GELU'(x), elementwise. dout: the gradient of the forward's output; x: its input, one shape."""
    exact = _exact_flag("gelu_backward", approximate)
    dtype = storage_dtype("gelu_backward", "dout", dout)
    check("gelu_backward", dout=(dout, ("...",), dtype), x=(x, ("...",), dtype))
    out = output("gelu_backward", out, x.shape, dtype=dtype)
    _launch("gelu_backward", (out, x, dout), x.size, np.int32(exact))
    return out


def _launch(name, arrays, n, exact):
    """name_float4 for float32 arrays that start on 16 bytes (four elements per thread), name_bf16x8 for bf16
    ones (eight per thread, the same bits as one per thread), else name<floatX> (one per thread)."""
    if n == 0:
        return
    dtype = arrays[0].dtype
    if dtype == FLOAT32 and float4_aligned(*arrays):
        kernel, threads = kernels.function("gelu", name + "_float4"), ceil_div(n, 4)
    elif dtype == BFLOAT16 and float4_aligned(*arrays):
        kernel, threads = kernels.function("gelu", name + "_bf16x8"), ceil_div(n, 8)
    else:
        instance = f"{name}<{storage_c_type(dtype)}>"
        kernel, threads = kernels.function("gelu", instance, name_expressions=(instance,)), n
    kernel((ceil_div(threads, THREADS_PER_BLOCK),), (THREADS_PER_BLOCK,), (*arrays, np.int32(n), exact))


def _exact_flag(operation, approximate):
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"{operation}: approximate={approximate!r}; use 'tanh' (GPT-2's GELU) "
                         "or 'none' (the exact erf form)")
    return APPROXIMATIONS[approximate]
