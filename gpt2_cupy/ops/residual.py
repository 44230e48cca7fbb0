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

from .arrays import check, launch_elementwise, output


def residual_forward(x, branch, out=None):
    """x + branch, elementwise. x, branch: float32, C-contiguous, one shape (in the model (B, T, C))."""
    return _add("residual_forward", "x", x, "branch", branch, out)


def residual_backward(dout):
    """The add node's backward: the gradient of out goes unchanged to x and to branch (the same array)."""
    check("residual_backward", dout=(dout, ("...",)))
    return dout, dout


def fork_backward(dout, dx_branch, out=None):
    """dx = dout + dx_branch: the gradient of a value used twice is the sum of what each use sends back."""
    return _add("fork_backward", "dout", dout, "dx_branch", dx_branch, out)


def _add(operation, first_name, first, second_name, second, out):
    check(operation, **{first_name: (first, ("...",)), second_name: (second, ("...",))})
    out = output(operation, out, first.shape)
    launch_elementwise("residual", "residual_add", (out, first, second), first.size)
    return out
