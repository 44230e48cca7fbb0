"""GELU, the activation in GPT-2's MLP, forward and backward, elementwise on float32 arrays.

    y = gelu_forward(x)                       GELU(x), GPT-2's tanh approximation
    y = gelu_forward(x, approximate="none")   the exact x * Phi(x), with erf
    dx = gelu_backward(dout, x)               dout * GELU'(x), where x is the input of the forward

Any shape works (in the model: (B, T, 4C), the MLP's hidden activations); dout and out have x's shape.
`out=` writes into an existing array, which may be the input itself (x, or dout for the backward).

The kernels are kernels/gelu.cu, taught in chapters/03_gelu_residual.ipynb. Arrays that start at a
16-byte aligned address (every freshly allocated array does) go through the float4 kernels, four
elements per thread; any other array through the one-element-per-thread kernels.
"""

import numpy as np

from .arrays import check, launch_elementwise, output

APPROXIMATIONS = {"tanh": 0, "none": 1}  # the kernels' `exact` flag, named as in torch.nn.functional.gelu


def gelu_forward(x, approximate="tanh", out=None):
    """GELU(x), elementwise. x: float32, C-contiguous, any shape. Returns y (or out) of x's shape."""
    exact = _exact_flag("gelu_forward", approximate)
    check("gelu_forward", x=(x, ("...",)))
    out = output("gelu_forward", out, x.shape)
    launch_elementwise("gelu", "gelu_forward", (out, x), x.size, np.int32(exact))
    return out


def gelu_backward(dout, x, approximate="tanh", out=None):
    """dx = dout * GELU'(x), elementwise. dout: the gradient of the forward's output; x: its input, one shape."""
    exact = _exact_flag("gelu_backward", approximate)
    check("gelu_backward", dout=(dout, ("...",)), x=(x, ("...",)))
    out = output("gelu_backward", out, x.shape)
    launch_elementwise("gelu", "gelu_backward", (out, x, dout), x.size, np.int32(exact))
    return out


def _exact_flag(operation, approximate):
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"{operation}: approximate={approximate!r}; use 'tanh' (GPT-2's GELU) "
                         "or 'none' (the exact erf form)")
    return APPROXIMATIONS[approximate]
