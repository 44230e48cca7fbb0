"""DyT, Dynamic Tanh (Zhu, Chen, He, LeCun and Liu, 2025), forward and backward, on float32 arrays (chapter 05b).

    y = dyt_forward(x, alpha, weight, bias)          weight * tanh(alpha * x) + bias
    dx = dyt_backward(dout, x, alpha, weight, dalpha=dalpha, dweight=dweight, dbias=dbias)

A drop-in replacement for LayerNorm with no row statistics. Shapes: x, y, dout, dx (..., C); weight and
bias (C,), bias may be None; alpha, the learnable scale of the input, a float32 device array of shape (1,)
(a device array, not a Python number: it changes at every optimizer step, and the kernels read it where it
lives). The backward returns dx and ADDS into dalpha (shape (1,)), dweight and dbias (may be None),
deterministically: per-block partial sums, then a fixed-order sum (kernels/dyt.cu).

The backward is one launch of dyt_backward_columns<WIDTH, ROW_SLOTS, ROWS_AT_ONCE>: each thread owns a group of
WIDTH columns over many rows, loading ROWS_AT_ONCE rows before computing them, and the last block to finish a
stripe of columns adds the partial sums (a counter per stripe, kept here per device).
"""

import math

import numpy as np

from gpt2_cupy import backend, kernels
from gpt2_cupy.ops.arrays import (LARGEST_GRID_Y, THREADS_PER_BLOCK, WARP_SIZE, ceil_div, check, counters, output,
                                  row_width)
from gpt2_cupy.ops.layernorm import require_gradient_buffers, row_layout

ROW_SLOTS = 8            # blocks of (32, 8) threads: a warp per row slot
ROWS_PER_BLOCK = 128     # 16 rows per thread (bench/layernorm.py times 64 to 256); a fixed number, so the order
                         # of the sums is the same on every GPU
ROWS_AT_ONCE = 4         # rows a thread loads before computing them: 8 float4 loads in flight per thread
NAMES = tuple(f"dyt_backward_columns<{width}, {ROW_SLOTS}, {ROWS_AT_ONCE}>" for width in (4, 1))


def _kernel(name):
    return kernels.function("dyt", name, name_expressions=NAMES)


def dyt_forward(x, alpha, weight, bias, *, out=None):
    """y = weight * tanh(alpha * x) + bias, weight and bias along the last axis."""
    sizes = check("dyt_forward", x=(x, ("...", "C")), alpha=(alpha, (1,)), weight=(weight, ("C",)),
                  bias=(bias, ("C",)))
    out = output("dyt_forward", out, x.shape)
    n, columns = x.size, sizes["C"]
    if n == 0:
        return out
    arrays = (out, x, alpha, weight, weight if bias is None else bias)
    name, threads = (("dyt_forward_float4", n // 4) if row_width(columns, out, x, weight, arrays[4]) == 4
                     else ("dyt_forward", n))
    _kernel(name)((ceil_div(threads, THREADS_PER_BLOCK),), (THREADS_PER_BLOCK,),
                  (*arrays, np.int32(n), np.int32(columns), np.int32(bias is not None)))
    return out


def dyt_backward(dout, x, alpha, weight, *, dalpha, dweight, dbias=None, out=None):
    """dx = dout * weight * alpha * (1 - tanh(alpha x)^2); adds into dalpha, dweight, dbias. Returns dx."""
    require_gradient_buffers("dyt_backward", dalpha=dalpha, dweight=dweight)
    sizes = check("dyt_backward", dout=(dout, ("...", "C")), x=(x, ("...", "C")), alpha=(alpha, (1,)),
                  weight=(weight, ("C",)), dalpha=(dalpha, (1,)), dweight=(dweight, ("C",)), dbias=(dbias, ("C",)))
    out = output("dyt_backward", out, x.shape)
    rows, columns = math.prod(sizes["..."]), sizes["C"]
    row_layout("dyt_backward", columns, (dout, x, out, weight))  # refuses C past LayerNorm's limit
    if rows == 0 or columns == 0:
        return out
    width = row_width(columns, dout, x, out, weight)
    launch_backward_columns(_kernel(f"dyt_backward_columns<{width}, {ROW_SLOTS}, {ROWS_AT_ONCE}>"), width, ROW_SLOTS,
                            ROWS_PER_BLOCK, out, dalpha, dweight, dbias, dout, x, alpha, weight, rows, columns)
    return out


def launch_backward_columns(kernel, width, row_slots, rows_per_block, out, dalpha, dweight, dbias, dout, x, alpha,
                            weight, rows, columns):
    """Launches `kernel`, a dyt_backward_columns<width, row_slots, ...> of kernels/dyt.cu, over blocks of
    (32, row_slots) threads that each take rows_per_block rows of a stripe of 32 * width columns (more past
    LARGEST_GRID_Y blocks of rows), with the partial sums and counters it finishes with."""
    stripes = ceil_div(columns, WARP_SIZE * width)
    rows_per_block = max(rows_per_block, ceil_div(rows, LARGEST_GRID_Y))  # beyond 4 million rows, longer blocks
    row_blocks = ceil_div(rows, rows_per_block)
    partials = backend.xp.empty((2 * row_blocks * columns + stripes * row_blocks,), dtype=np.float32)
    weight_partials = partials[:row_blocks * columns]
    bias_partials = partials[row_blocks * columns:2 * row_blocks * columns]
    alpha_partials = partials[2 * row_blocks * columns:]
    kernel(
        (stripes, row_blocks), (WARP_SIZE, row_slots),
        (out, dalpha, dweight, weight if dbias is None else dbias, weight_partials, bias_partials, alpha_partials,
         counters(stripes + 1), dout, x, alpha, weight, np.int32(rows), np.int32(columns),
         np.int32(rows_per_block), np.int32(dbias is not None)))
