"""RMSNorm over the last axis, forward and backward, on float32 arrays (chapter 17, Llama's norm).

    y, rstd = rmsnorm_forward(x, weight, eps=1e-6)
    dx = rmsnorm_backward(dout, x, weight, rstd, dweight=dweight)

Shapes: x, y, dout, dx (..., C), in Llama (B, T, C); weight (C,); rstd (...,), one per row, saved by the
forward for the backward (rstd = 1 / sqrt(mean(x^2) + eps)). The backward returns dx and ADDS the weight's
gradient into dweight, deterministically (a fixed order of additions, no atomics).

Kernels (kernels/rmsnorm.cu): rmsnorm_forward and rmsnorm_backward, a warp per row; rmsnorm_weight_gradient,
blocks of 32 columns that walk the rows.
"""

import math

import numpy as np

from gpt2_cupy import backend, kernels
from gpt2_cupy.ops.arrays import WARP_SIZE, ceil_div, check, output

WARPS_PER_BLOCK = 8    # the row kernels: 256 threads, eight rows at a time per block
STRIPES = 8            # rmsnorm_weight_gradient: blocks of (32, 8) threads (kernels/rmsnorm.cu's STRIPES)


def rmsnorm_forward(x, weight, *, eps=1e-6, out=None):
    """y = x / sqrt(mean(x^2) + eps) * weight over the last axis; returns (y, rstd)."""
    sizes = check("rmsnorm_forward", x=(x, ("...", "C")), weight=(weight, ("C",)))
    out = output("rmsnorm_forward", out, x.shape)
    rows, columns = math.prod(sizes["..."]), sizes["C"]
    rstd = backend.xp.empty(sizes["..."], dtype=np.float32)
    if rows and columns:
        kernels.function("rmsnorm", "rmsnorm_forward")(
            (ceil_div(rows, WARPS_PER_BLOCK),), (WARPS_PER_BLOCK * WARP_SIZE,),
            (out, rstd, x, weight, np.int32(rows), np.int32(columns), np.float32(eps)))
    return out, rstd


def rmsnorm_backward(dout, x, weight, rstd, *, dweight, out=None):
    """dx of RMSNorm; dweight += sum over rows of dout * x * rstd. Returns dx."""
    if dweight is None:
        raise TypeError("rmsnorm_backward: dweight is None; pass the weight's gradient buffer, into which the "
                        "gradient is added")
    sizes = check("rmsnorm_backward", dout=(dout, ("...", "C")), x=(x, ("...", "C")), weight=(weight, ("C",)),
                  rstd=(rstd, ("...",)), dweight=(dweight, ("C",)))
    out = output("rmsnorm_backward", out, x.shape)
    rows, columns = math.prod(sizes["..."]), sizes["C"]
    if rows and columns:
        kernels.function("rmsnorm", "rmsnorm_backward")(
            (ceil_div(rows, WARPS_PER_BLOCK),), (WARPS_PER_BLOCK * WARP_SIZE,),
            (out, dout, x, weight, rstd, np.int32(rows), np.int32(columns)))
        kernels.function("rmsnorm", "rmsnorm_weight_gradient")(
            (ceil_div(columns, WARP_SIZE),), (WARP_SIZE, STRIPES),
            (dweight, dout, x, rstd, np.int32(rows), np.int32(columns)))
    return out
