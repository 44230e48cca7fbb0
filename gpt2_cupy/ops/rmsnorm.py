"""RMSNorm over the last axis, forward and backward, on float32 arrays (chapter 17a, Llama's norm); the forward
also on bf16 rows with a float32 or bf16 weight (a model converted to bf16 for generation).

    y, rstd = rmsnorm_forward(x, weight, eps=1e-6)
    dx = rmsnorm_backward(dout, x, weight, rstd, dweight=dweight)

Shapes: x, y, dout, dx (..., C), in Llama (B, T, C); weight (C,); rstd (...,), one per row, saved by the
forward for the backward (rstd = 1 / sqrt(mean(x^2) + eps)). The backward returns dx and ADDS the weight's
gradient into dweight, deterministically (a fixed order of additions, no atomics).

Kernels (kernels/rmsnorm.cu): rmsnorm_forward_registers<WIDTH, K, WARPS_PER_ROW> and
rmsnorm_backward_registers, the row held in registers by one warp or, for wide rows (Llama 7B's C = 4096), by a
block of several warps, read from memory once; the backward's blocks each write a row of partial dweight sums,
which column_sums_accumulate (gpt2_cupy.ops.layernorm) adds into dweight. The first layout of chapter 17a,
rmsnorm_forward, rmsnorm_backward and rmsnorm_weight_gradient (a warp per row, the row read twice, dweight
read again), is launched by first_layout_forward and first_layout_backward, which bench/llama.py times against it.
"""

import math

import numpy as np

from gpt2_cupy import backend, kernels
from gpt2_cupy.ops.arrays import (FLOAT32, WARP_SIZE, ceil_div, check, output, row_width, storage_c_type,
                                  storage_dtype)
from gpt2_cupy.ops.layernorm import add_column_sums

WARPS_PER_BLOCK = 8      # the first layout, and the register layout with a warp per row: eight rows per block
STRIPES = 8              # rmsnorm_weight_gradient: blocks of (32, 8) threads (kernels/rmsnorm.cu's STRIPES)
FLOATS_PER_THREAD = 16   # of a row, held in registers: K WIDTH <= 16
WARPS_PER_ROW = (1, 2, 4, 8, 16, 32)
# rmsnorm_backward_registers: a fixed number of rows per block (not sized by the GPU, so that dweight's sums are
# added in the same order everywhere): at B T = 4096 rows, 256 blocks and 256 rows of partial sums, 4 % of the
# backward's bytes at C = 4096 (bench/llama.py times 8, 16 and 32).
BACKWARD_ROWS_PER_BLOCK = 16


def row_layout(operation, columns, arrays):
    """(WIDTH, K, WARPS_PER_ROW) for rows of `columns` floats: the fewest warps whose threads hold the row in
    K groups of WIDTH floats each, K WIDTH <= FLOATS_PER_THREAD; WIDTH = 4 when rows and arrays allow float4."""
    width = row_width(columns, *arrays)
    for warps in WARPS_PER_ROW:
        k = ceil_div(columns, warps * WARP_SIZE * width)
        if k * width <= FLOATS_PER_THREAD:
            return width, max(k, 1), warps
    most = WARPS_PER_ROW[-1] * WARP_SIZE * FLOATS_PER_THREAD
    raise ValueError(f"{operation}: rows of C = {columns} are longer than the kernels hold in registers (at most "
                     f"{most}, or {most // 4} when C is not a multiple of 4)")


def _kernel(name, layout, storage_types=()):
    """name<WIDTH, K, WARPS_PER_ROW[, floatX, weightT]>: the storage types only where one is bf16."""
    template_arguments = [str(n) for n in layout]
    if any(dtype != FLOAT32 for dtype in storage_types):
        template_arguments += [storage_c_type(dtype) for dtype in storage_types]
    full_name = f"{name}<{', '.join(template_arguments)}>"
    return kernels.function("rmsnorm", full_name, name_expressions=(full_name,))


def rmsnorm_forward(x, weight, *, eps=1e-6, out=None):
    """y = x / sqrt(mean(x^2) + eps) * weight over the last axis; returns (y, rstd). x float32 or bf16 (y in
    x's dtype), weight float32 or bf16 (a model converted for generation); rstd float32."""
    x_dtype = storage_dtype("rmsnorm_forward", "x", x)
    weight_dtype = storage_dtype("rmsnorm_forward", "weight", weight)
    sizes = check("rmsnorm_forward", x=(x, ("...", "C"), x_dtype), weight=(weight, ("C",), weight_dtype))
    out = output("rmsnorm_forward", out, x.shape, dtype=x_dtype)
    rows, columns = math.prod(sizes["..."]), sizes["C"]
    rstd = backend.xp.empty(sizes["..."], dtype=np.float32)
    if rows and columns:
        layout = row_layout("rmsnorm_forward", columns, (x, out, weight))
        warps = layout[2]
        blocks, threads = (ceil_div(rows, WARPS_PER_BLOCK), WARPS_PER_BLOCK * WARP_SIZE) if warps == 1 else \
            (rows, warps * WARP_SIZE)
        backend.launch_dependent(_kernel("rmsnorm_forward_registers", layout, (x_dtype, weight_dtype)),
                                 (blocks,), (threads,),
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
        layout = row_layout("rmsnorm_backward", columns, (dout, x, out, weight))
        _backward(layout, out, dweight, dout, x, weight, rstd, rows, columns)
    return out


def _backward(layout, out, dweight, dout, x, weight, rstd, rows, columns, rows_per_block=BACKWARD_ROWS_PER_BLOCK):
    blocks = ceil_div(rows, rows_per_block)
    partials = backend.xp.empty((1, blocks, columns), dtype=np.float32)  # a row of dweight's terms per block
    _kernel("rmsnorm_backward_registers", layout)(
        (blocks,), (layout[2] * WARP_SIZE,),
        (out, partials, dout, x, weight, rstd, np.int32(rows), np.int32(columns), np.int32(rows_per_block)))
    add_column_sums((dweight,), partials)


# ---- chapter 17a's first layout, for bench/llama.py ---------------------------------------------------------

def first_layout_forward(out, rstd, x, weight, eps=1e-6):
    """rmsnorm_forward, a warp per row, into out and rstd (arrays as rmsnorm_forward's, not checked again)."""
    rows, columns = rstd.size, x.shape[-1]
    kernels.function("rmsnorm", "rmsnorm_forward")(
        (ceil_div(rows, WARPS_PER_BLOCK),), (WARPS_PER_BLOCK * WARP_SIZE,),
        (out, rstd, x, weight, np.int32(rows), np.int32(columns), np.float32(eps)))


def first_layout_backward(out, dweight, dout, x, weight, rstd):
    """rmsnorm_backward and rmsnorm_weight_gradient: dx into out, dweight added into."""
    rows, columns = rstd.size, x.shape[-1]
    kernels.function("rmsnorm", "rmsnorm_backward")(
        (ceil_div(rows, WARPS_PER_BLOCK),), (WARPS_PER_BLOCK * WARP_SIZE,),
        (out, dout, x, weight, rstd, np.int32(rows), np.int32(columns)))
    kernels.function("rmsnorm", "rmsnorm_weight_gradient")(
        (ceil_div(columns, WARP_SIZE),), (WARP_SIZE, STRIPES),
        (dweight, dout, x, rstd, np.int32(rows), np.int32(columns)))
