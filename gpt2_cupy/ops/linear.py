"""The linear layer y = x Wᵀ + b (GPT-2's c_attn, c_proj and c_fc), forward and backward, in float32.

    linear_forward(x, weight, bias=None, out=None, residual=None) -> y   (residual + x Wᵀ + b when given)
    linear_backward(dout, x, weight, *, dweight, dbias=None, out=None) -> dx
    bias_add(y, bias)              y += bias along the last axis, in place
    bias_backward(dout, dbias)     dbias += dout summed over all axes but the last

Shapes: x (..., C_in), usually (B, T, C_in); weight (C_out, C_in), as in PyTorch's nn.Linear;
bias (C_out,) or None; y and dout (..., C_out). The leading axes are flattened to N = B*T rows.

The backward returns the activation gradient dx (a new array, or written into `out`) and ADDS into the
parameter gradients dweight and dbias: a parameter's gradient is summed over all its uses (tied weights,
micro-batches), so those buffers are zeroed once per optimizer step, not by this function.

The products are chapter 01's matmul (kernels/matmul.cu); the bias add and the bias gradient are
chapter 02's kernels (kernels/bias_add.cu, kernels/bias_partial_sums.cu, kernels/bias_column_sum.cu).
Arrays are the backend's (cupy on a GPU, numpy on the CPU), float32 and C-contiguous.

This op is chapters 01 and 02's kernels and nothing else. The package's Linear layers go through
gpt2_cupy.dispatch.linear_forward and linear_backward, which check their arguments with forward_output and
backward_output below and choose each product's kernel: bf16 (a model trained in bf16, gpt2_cupy.amp: x,
weight and dout bf16; bias, dweight and dbias float32) on tensor cores with float32 sums, a few rows times a
bf16 weight on the GEMV, float32 by gpt2_cupy.set_float32_matmul_precision.
"""

import numpy

from gpt2_cupy import backend, kernels
from gpt2_cupy.elementwise import elementwise
from gpt2_cupy.ops.arrays import (FLOAT32, LARGEST_GRID_Y, THREADS_PER_BLOCK, ceil_div, check, output,
                                  row_width, rows, storage_c_type, storage_dtype)
from gpt2_cupy.ops.matmul import launch_float32_matmul

ROWS_PER_BLOCK = 512  # rows of dout summed by one block of bias_partial_sums (512 to 1024 measured best)


def bias_add(y, bias):
    """y += bias, broadcast over all axes of y but the last, in place. y: (..., C), bias: (C,). Returns y."""
    check("bias_add", y=(y, ("...", "C")), bias=(bias, ("C",)))
    launch_bias_add(rows(y), bias)
    return y


def bias_backward(dout, dbias, rows_per_block=ROWS_PER_BLOCK):
    """dbias += dout summed over all axes but the last (deterministic). dout: (..., C), dbias: (C,). Returns dbias.

    Two launches: bias_partial_sums sums strips of 32 columns over `rows_per_block` rows per block,
    bias_column_sum adds those partial sums into dbias.
    """
    check("bias_backward", dout=(dout, ("...", "C"), storage_dtype("bias_backward", "dout", dout)),
          dbias=(dbias, ("C",)))
    if not isinstance(rows_per_block, (int, numpy.integer)) or rows_per_block < 1:
        raise ValueError(f"bias_backward: rows_per_block must be a positive int, got {rows_per_block!r}")
    bias_sums(rows(dout), dbias, rows_per_block)
    return dbias


def linear_forward(x, weight, bias=None, out=None, residual=None):
    """y = x Wᵀ + b. x: (..., C_in), weight: (C_out, C_in), bias: (C_out,) or None; float32. Returns y: (..., C_out).

    out: an optional C-contiguous float32 array of shape (..., C_out), to write y into.
    residual: None, or an array of y's shape added to it, y = residual + (x Wᵀ + b) (a transformer block's
    x + f(x)).
    """
    out = forward_output(x, weight, bias, out, residual, bf16=False)
    launch_float32_matmul(rows(x), weight, rows(out), transpose_b=True)            # y = x Wᵀ
    if bias is not None:
        launch_bias_add(rows(out), bias)                                          # y += b
    return add_residual(out, residual)


def linear_backward(dout, x, weight, *, dweight, dbias=None, out=None):
    """Gradients of y = x Wᵀ + b, given dout = dL/dy. Returns dx = dout W; adds doutᵀ x into dweight, Σ dout into dbias.

    dout: (..., C_out), x: (..., C_in) as in the forward, weight: (C_out, C_in), all float32.
    dweight: (C_out, C_in), added into. dbias: (C_out,), added into, or None for a layer without bias.
    out: an optional array of x's shape to write dx into (its old contents are overwritten).
    """
    out = backward_output(dout, x, weight, dweight, dbias, out, bf16=False)
    dout_rows = rows(dout)
    launch_float32_matmul(dout_rows, weight, rows(out))                                    # dx = dout W    (set)
    launch_float32_matmul(dout_rows, rows(x), dweight, transpose_a=True, accumulate=True)  # dW += doutᵀ x  (add)
    if dbias is not None:
        bias_sums(dout_rows, dbias, ROWS_PER_BLOCK)                                        # db += Σ dout   (add)
    return out


# ---- the checks, which gpt2_cupy.dispatch's Linear shares --------------------------------------------------

def forward_output(x, weight, bias, out, residual, bf16=True):
    """linear_forward's checks; returns out, made if None. bf16: whether bf16 x and weight pass too (y bf16)."""
    dtype = storage_dtype("linear_forward", "x", x) if bf16 else FLOAT32
    sizes = check("linear_forward", x=(x, ("...", "C_in"), dtype), weight=(weight, ("C_out", "C_in"), dtype),
                  bias=(bias, ("C_out",)), residual=(residual, ("...", "C_out"), dtype))
    return output("linear_forward", out, sizes["..."] + (sizes["C_out"],), dtype=dtype)


def backward_output(dout, x, weight, dweight, dbias, out, bf16=True):
    """linear_backward's checks; returns out (dx), made if None. bf16: whether bf16 dout, x and weight pass too
    (dx bf16, or float32 if out is a float32 array: the tensor cores' sums unrounded)."""
    dtype = storage_dtype("linear_backward", "dout", dout) if bf16 else FLOAT32
    sizes = check("linear_backward", dout=(dout, ("...", "C_out"), dtype), x=(x, ("...", "C_in"), dtype),
                  weight=(weight, ("C_out", "C_in"), dtype), dweight=(dweight, ("C_out", "C_in")),
                  dbias=(dbias, ("C_out",)))
    dx_dtype = FLOAT32 if out is not None and out.dtype == FLOAT32 else dtype
    out = output("linear_backward", out, sizes["..."] + (sizes["C_in"],), dtype=dx_dtype)
    for name, array in (("x", x), ("dout", dout), ("weight", weight)):
        if backend.xp.may_share_memory(dweight, array):
            raise ValueError(f"linear_backward: dweight overlaps {name}; it is added into while {name} is read")
    return out


def add_residual(out, residual):
    """out = residual + out (None: out as it is), the product's bits then an add. Returns out."""
    if residual is not None:
        elementwise("residual_add", "a + b", [residual, out], compute_dtype=out.dtype, out=out)
    return out


# ---- unchecked launches: the public functions above have checked their arguments ----------------------------

def launch_bias_add(y_rows, bias):
    """y_rows (rows, C) float32 += bias (C,) on chapter 02's kernel."""
    count = y_rows.size
    if count == 0:
        return
    kernel = kernels.function("bias_add")
    kernel((ceil_div(count, THREADS_PER_BLOCK),), (THREADS_PER_BLOCK,),
           (y_rows, bias, numpy.int32(y_rows.shape[0]), numpy.int32(y_rows.shape[1])))


def _partial_sums_kernel(width, dtype):
    """bias_partial_sums<width> for float32 rows (chapter 02's names), <width, __nv_bfloat16> for bf16 rows;
    one module per dtype, so a float32 run compiles only the float32 versions."""
    if dtype == FLOAT32:
        names = ("bias_partial_sums<4>", "bias_partial_sums<1>")
    else:
        names = tuple(f"bias_partial_sums<{w}, {storage_c_type(dtype)}>" for w in (4, 1))
    return kernels.function("bias_partial_sums", names[0 if width == 4 else 1], name_expressions=names)


def bias_sums(dout_rows, dbias, rows_per_block):
    """dbias += dout_rows (rows, C) summed over its rows, in two launches (bias_backward, unchecked)."""
    row_count, columns = dout_rows.shape
    if row_count == 0 or columns == 0:
        return
    # 16-byte loads need every row to start on a 16-byte boundary.
    width = row_width(columns, dout_rows)
    row_ranges = ceil_div(row_count, rows_per_block)
    if row_ranges > LARGEST_GRID_Y:  # a launch limit, not an argument check: linear_backward can reach it too
        raise ValueError(f"bias_backward: {row_count} rows need more than {LARGEST_GRID_Y} blocks of "
                         f"{rows_per_block} rows along y; raise rows_per_block")
    partial_sums = backend.xp.empty((row_ranges, columns), dtype=numpy.float32)
    partial_kernel = _partial_sums_kernel(width, dout_rows.dtype)
    partial_kernel((ceil_div(columns, 32), row_ranges), (THREADS_PER_BLOCK,),
                   (partial_sums, dout_rows, numpy.int32(row_count), numpy.int32(columns), numpy.int32(rows_per_block)))
    kernels.function("bias_column_sum")((ceil_div(columns, THREADS_PER_BLOCK),), (THREADS_PER_BLOCK,),
                                        (dbias, partial_sums, numpy.int32(row_ranges), numpy.int32(columns)))
