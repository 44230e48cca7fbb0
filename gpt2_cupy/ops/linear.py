"""The linear layer y = x Wᵀ + b (GPT-2's c_attn, c_proj and c_fc), forward and backward, in float32.

    linear_forward(x, weight, bias=None, out=None) -> y
    linear_backward(dy, x, weight, dweight, dbias=None, dx=None) -> dx
    add_bias(y, bias)              y += bias along the last axis, in place
    bias_backward(dy, dbias)       dbias += dy summed over all axes but the last

Shapes: x (..., C_in), usually (B, T, C_in); weight (C_out, C_in), as in PyTorch's nn.Linear;
bias (C_out,) or None; y and dy (..., C_out). The leading axes are flattened to N = B*T rows.

Backward sets the activation gradient dx (a new array, or written into `dx`) and ADDS into the parameter
gradients dweight and dbias: a parameter's gradient is summed over all its uses (tied weights,
micro-batches), so those buffers are zeroed once per optimizer step, not by this function.

The products are chapter 01's matmul (kernels/matmul.cu); the bias add and the bias gradient are
chapter 02's kernels (kernels/bias_add.cu, kernels/bias_backward.cu, kernels/bias_column_sum.cu).
Arrays are the backend's (cupy on a GPU, numpy on the CPU), float32 and C-contiguous.
"""

import math
from functools import lru_cache

import numpy

from gpt2_cupy import backend, kernels
from gpt2_cupy.ops.arrays import address, check_float32
from gpt2_cupy.ops.matmul import matmul

THREADS = 256
ROWS_PER_BLOCK = 512  # rows of dy summed by one block of column_partial_sums (512 to 1024 measured best)
_MAX_INT32 = 2**31 - 1


@lru_cache(maxsize=None)
def _column_partial_sums(width):
    return kernels.function("bias_backward", f"column_partial_sums<{width}>",
                            name_expressions=("column_partial_sums<4>", "column_partial_sums<1>"))


@lru_cache(maxsize=None)
def _column_sum_accumulate():
    return kernels.function("bias_column_sum", "column_sum_accumulate")


@lru_cache(maxsize=None)
def _add_bias():
    return kernels.function("bias_add", "add_bias")


def _check_array(function, name, array, ndim=None):
    """A float32, C-contiguous array; ndim: a number of axes, or "2+" for (..., features)."""
    check_float32(function, name, array)
    if ndim == "2+" and array.ndim < 2:
        raise ValueError(f"{function}: {name} must have shape (..., features) with at least 2 axes, "
                         f"got {array.shape}")
    if isinstance(ndim, int) and array.ndim != ndim:
        raise ValueError(f"{function}: {name} must have {ndim} axes, got shape {array.shape}")


def _rows(array):
    """The (N, features) view of a C-contiguous (..., features) array: no copy."""
    return array.reshape(math.prod(array.shape[:-1]), array.shape[-1])  # -1 fails when a size is 0


def add_bias(y, bias):
    """y += bias, broadcast over all axes of y but the last, in place. y: (..., C), bias: (C,). Returns y."""
    _check_array("add_bias", "y", y, "2+")
    _check_array("add_bias", "bias", bias, 1)
    if bias.shape[0] != y.shape[-1]:
        raise ValueError(f"add_bias: bias has shape {bias.shape}, but y {y.shape} has {y.shape[-1]} features")
    rows, columns = _rows(y).shape
    if rows * columns == 0:
        return y
    if rows > _MAX_INT32 or columns > _MAX_INT32:
        raise ValueError(f"add_bias: y {y.shape} has too many rows or columns for 32-bit counts")
    blocks = -(-(rows * columns) // THREADS)
    _add_bias()((blocks,), (THREADS,), (y, bias, numpy.int32(rows), numpy.int32(columns)))
    return y


def bias_backward(dy, dbias, rows_per_block=ROWS_PER_BLOCK):
    """dbias += dy summed over all axes but the last (deterministic). dy: (..., C), dbias: (C,). Returns dbias.

    Two launches: column_partial_sums sums strips of 32 columns over `rows_per_block` rows per block,
    column_sum_accumulate adds those partial sums into dbias.
    """
    _check_array("bias_backward", "dy", dy, "2+")
    _check_array("bias_backward", "dbias", dbias, 1)
    if dbias.shape[0] != dy.shape[-1]:
        raise ValueError(f"bias_backward: dbias has shape {dbias.shape}, but dy {dy.shape} has "
                         f"{dy.shape[-1]} features")
    if not isinstance(rows_per_block, (int, numpy.integer)) or rows_per_block < 1:
        raise ValueError(f"bias_backward: rows_per_block must be a positive int, got {rows_per_block!r}")
    dy_rows = _rows(dy)
    rows, columns = dy_rows.shape
    if rows == 0 or columns == 0:
        return dbias
    if rows > _MAX_INT32 or columns > _MAX_INT32:
        raise ValueError(f"bias_backward: dy {dy.shape} has too many rows or columns for 32-bit counts")
    row_ranges = -(-rows // rows_per_block)
    if row_ranges > 65535:
        raise ValueError(f"bias_backward: {rows} rows need {row_ranges} blocks along y, more than 65535; "
                         "raise rows_per_block")
    # 16-byte loads need every row to start on a 16-byte boundary.
    width = 4 if columns % 4 == 0 and address(dy_rows) % 16 == 0 else 1
    partial_sums = backend.xp.empty((row_ranges, columns), dtype=numpy.float32)
    _column_partial_sums(width)((-(-columns // 32), row_ranges), (THREADS,),
                                (dy_rows, partial_sums, numpy.int32(rows), numpy.int32(columns),
                                 numpy.int32(rows_per_block)))
    _column_sum_accumulate()((-(-columns // THREADS),), (THREADS,),
                             (partial_sums, dbias, numpy.int32(row_ranges), numpy.int32(columns)))
    return dbias


def _check_linear_shapes(function, x, weight, bias):
    _check_array(function, "x", x, "2+")
    _check_array(function, "weight", weight, 2)
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(f"{function}: weight has shape {weight.shape} (C_out, C_in), but x {x.shape} has "
                         f"C_in = {x.shape[-1]} features")
    if bias is not None:
        _check_array(function, "bias", bias, 1)
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(f"{function}: bias has shape {bias.shape}, but weight {weight.shape} has "
                             f"C_out = {weight.shape[0]} rows")


def linear_forward(x, weight, bias=None, out=None):
    """y = x Wᵀ + b. x: (..., C_in), weight: (C_out, C_in), bias: (C_out,) or None. Returns y: (..., C_out).

    out: an optional C-contiguous float32 array of shape (..., C_out) to write y into.
    """
    _check_linear_shapes("linear_forward", x, weight, bias)
    out_shape = x.shape[:-1] + (weight.shape[0],)
    if out is None:
        out = backend.xp.empty(out_shape, dtype=numpy.float32)
    else:
        _check_array("linear_forward", "out", out)
        if out.shape != out_shape:
            raise ValueError(f"linear_forward: out has shape {out.shape}, but x {x.shape} and weight "
                             f"{weight.shape} give y of shape {out_shape}")
    matmul(_rows(x), weight, transpose_b=True, out=_rows(out))
    if bias is not None:
        add_bias(out, bias)
    return out


def linear_backward(dy, x, weight, dweight, dbias=None, dx=None):
    """Gradients of y = x Wᵀ + b, given dy = dL/dy. Returns dx = dy W; adds dyᵀ x into dweight, Σ dy into dbias.

    dy: (..., C_out), x: (..., C_in) as in the forward, weight: (C_out, C_in).
    dweight: (C_out, C_in), accumulated into. dbias: (C_out,), accumulated into, or None for a layer
    without bias. dx: an optional array of x's shape to write dx into (its old contents are overwritten).
    """
    _check_linear_shapes("linear_backward", x, weight, None)
    _check_array("linear_backward", "dy", dy, "2+")
    expected_dy = x.shape[:-1] + (weight.shape[0],)
    if dy.shape != expected_dy:
        raise ValueError(f"linear_backward: dy has shape {dy.shape}, but x {x.shape} and weight {weight.shape} "
                         f"give y of shape {expected_dy}")
    _check_array("linear_backward", "dweight", dweight, 2)
    if dweight.shape != weight.shape:
        raise ValueError(f"linear_backward: dweight has shape {dweight.shape}, weight has {weight.shape}")
    if dbias is not None:
        _check_array("linear_backward", "dbias", dbias, 1)
        if dbias.shape[0] != weight.shape[0]:
            raise ValueError(f"linear_backward: dbias has shape {dbias.shape}, but weight {weight.shape} has "
                             f"C_out = {weight.shape[0]} rows")
    if dx is None:
        dx = backend.xp.empty(x.shape, dtype=numpy.float32)
    else:
        _check_array("linear_backward", "dx", dx)
        if dx.shape != x.shape:
            raise ValueError(f"linear_backward: dx has shape {dx.shape}, x has {x.shape}")
    dy_rows, x_rows = _rows(dy), _rows(x)
    matmul(dy_rows, weight, out=_rows(dx))                                       # dx = dy W      (set)
    matmul(dy_rows, x_rows, transpose_a=True, out=dweight, accumulate=True)      # dW += dyᵀ x    (add)
    if dbias is not None:
        bias_backward(dy_rows, dbias)                                            # db += Σ_n dy   (add)
    return dx
