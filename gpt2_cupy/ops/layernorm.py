"""LayerNorm over the last axis, forward and backward, on float32 or bf16 arrays (chapter 05).

    y, mean, rstd = layernorm_forward(x, weight, bias, eps=1e-5)
    dx = layernorm_backward(dout, x, weight, mean, rstd, dweight=dweight, dbias=dbias)

Shapes: x, y, dout, dx (..., C), in GPT-2 (B, T, C); weight and bias (C,), bias may be None; mean and rstd
(...,), one per row, saved by the forward for the backward (rstd = 1 / sqrt(variance + eps)). The backward
returns dx and ADDS the parameter gradients into dweight and dbias (dbias may be None), deterministically:
the same sums, bit for bit, on every run.

x, y, dout and dx are float32, or all bf16 (a model trained in bf16, gpt2_cupy.amp); weight, bias, mean,
rstd, dweight and dbias are float32 in both cases: the kernels read a bf16 row into floats, keep every
statistic and sum in float32, and round y and dx once.

Kernels (kernels/layernorm.cu): a warp per row, the row in registers. When C is a multiple of 4 (at most
2048) and the arrays are 16-byte aligned, lanes move four floats per load (layernorm_forward<4, K>);
otherwise one (layernorm_forward<1, K>, C at most 1024). The backward (layernorm_backward_shared) keeps its
running column sums in shared memory, a slice per warp, and its blocks write one row of partial sums each
for a fixed number of rows; column_sums_accumulate adds them into dweight and dbias in one launch, in a
fixed order.
"""

import math

import numpy as np

from gpt2_cupy import backend, kernels
from gpt2_cupy.ops.arrays import (FLOAT32, SHARED_BYTES_WITHOUT_OPT_IN, WARP_SIZE, ceil_div, check, output, row_width,
                                  storage_c_type, storage_dtype)

WARPS_PER_BLOCK = 8            # forward: 256 threads, eight rows at a time per block
GROUPS_PER_LANE = {4: (1, 2, 3, 4, 6, 8, 12, 16), 1: (1, 2, 4, 8, 16, 32)}   # K, by WIDTH
# layernorm_backward_shared: up to 8 warps per block, each with a slice of 2 C floats of shared memory, as many
# as fit in the 48 KB a block gets without asking; a fixed 64 rows per block (not sized by the GPU, so the
# sums are added in the same order everywhere): 128 blocks of 8 warps at 8192 rows, one per multiprocessor on an
# H100, and 128 rows of partial sums to finish (bench/layernorm.py times 32 to 128 rows per block).
SHARED_WARPS_PER_BLOCK = 8
ROWS_PER_BLOCK = 64
# column_sums_accumulate: blocks of (32, 8) threads, each thread adding every 8th partial row, 16 at 128 rows
# (bench/layernorm.py times 8, 16 and 32 rows of threads).
COLUMN_SUM_STRIPES = 8


def names(kernel):
    """`kernel`<WIDTH, K> for every layout row_layout may pick."""
    return tuple(f"{kernel}<{width}, {k}>" for width, ks in GROUPS_PER_LANE.items() for k in ks)


NAMES = names("layernorm_forward") + names("layernorm_backward_shared")


def row_layout(operation, columns, arrays):
    """(WIDTH, K) of the warp-per-row kernels for rows of `columns`: float4 groups when they fit and align."""
    for width in ((4, 1) if row_width(columns, *arrays) == 4 else (1,)):
        for k in GROUPS_PER_LANE[width]:
            if WARP_SIZE * k * width >= columns:
                return width, k
    raise ValueError(f"{operation}: rows of C = {columns} are longer than the kernels hold in registers "
                     f"(at most {WARP_SIZE * 4 * GROUPS_PER_LANE[4][-1]} when C is a multiple of 4, "
                     f"{WARP_SIZE * GROUPS_PER_LANE[1][-1]} otherwise)")


def require_gradient_buffers(operation, **buffers):
    """A TypeError naming the argument when a parameter gradient buffer, which the caller must own, is None."""
    for name, buffer in buffers.items():
        if buffer is None:
            raise TypeError(f"{operation}: {name} is None; pass the parameter's gradient buffer, into which the "
                            "gradient is added")


def _kernel(name, dtype=FLOAT32):
    """A kernel of kernels/layernorm.cu: one module holds the float32 versions; a bf16 version is a module
    of its own, so that a run compiles only the few it uses."""
    return kernels.function("layernorm", name, name_expressions=NAMES if dtype == FLOAT32 else (name,))


def _storage(dtype):
    """The template arguments' tail that picks the storage type: "" for float32, ", __nv_bfloat16"."""
    return "" if dtype == FLOAT32 else f", {storage_c_type(dtype)}"


def layernorm_forward(x, weight, bias, *, eps=1e-5, out=None):
    """y = (x - mean) * rstd * weight + bias over the last axis; returns (y, mean, rstd). y has x's dtype."""
    dtype = storage_dtype("layernorm_forward", "x", x)
    sizes = check("layernorm_forward", x=(x, ("...", "C"), dtype), weight=(weight, ("C",)), bias=(bias, ("C",)))
    out = output("layernorm_forward", out, x.shape, dtype=dtype)
    rows, columns = math.prod(sizes["..."]), sizes["C"]
    layout = row_layout("layernorm_forward", columns, (x, out, weight, bias))
    mean = backend.xp.empty(sizes["..."], dtype=np.float32)
    rstd = backend.xp.empty(sizes["..."], dtype=np.float32)
    if rows and columns:
        _forward(layout, out, mean, rstd, x, weight, bias, rows, columns, eps)
    return out, mean, rstd


def layernorm_backward(dout, x, weight, mean, rstd, *, dweight, dbias=None, out=None):
    """dx of LayerNorm; dweight += sum(dout * xhat), dbias += sum(dout) over all rows. Returns dx."""
    require_gradient_buffers("layernorm_backward", dweight=dweight)
    dtype = storage_dtype("layernorm_backward", "dout", dout)
    sizes = check("layernorm_backward", dout=(dout, ("...", "C"), dtype), x=(x, ("...", "C"), dtype),
                  weight=(weight, ("C",)), mean=(mean, ("...",)), rstd=(rstd, ("...",)), dweight=(dweight, ("C",)),
                  dbias=(dbias, ("C",)))
    out = output("layernorm_backward", out, x.shape, dtype=dtype)
    rows, columns = math.prod(sizes["..."]), sizes["C"]
    layout = row_layout("layernorm_backward", columns, (dout, x, out, weight))
    if rows and columns:
        _backward(layout, out, dweight, dbias, dout, x, weight, mean, rstd, rows, columns)
    return out


def _forward(layout, out, mean, rstd, x, weight, bias, rows, columns, eps):
    width, k = layout
    kernel = _kernel(f"layernorm_forward<{width}, {k}{_storage(x.dtype)}>", x.dtype)
    kernel((ceil_div(rows, WARPS_PER_BLOCK),), (WARPS_PER_BLOCK * WARP_SIZE,),
           (out, mean, rstd, x, weight, weight if bias is None else bias, np.int32(rows), np.int32(columns),
            np.float32(eps), np.int32(bias is not None)))


def add_column_sums(sums, partials):
    """sums[i] += partials[i] summed over its first axis, in a fixed order, in one launch (kernels/layernorm.cu).

    sums: a tuple of one or two (columns,) arrays; partials: (len(sums), parts, columns), contiguous.
    """
    _, parts, columns = partials.shape
    _kernel("column_sums_accumulate")((ceil_div(columns, WARP_SIZE), len(sums)), (WARP_SIZE, COLUMN_SUM_STRIPES),
                                      (sums[0], sums[-1], partials, np.int32(parts), np.int32(columns)))


def shared_warps(columns):
    """Warps per block of layernorm_backward_shared: 2 C floats of shared memory each, within 48 KB."""
    return max(1, min(SHARED_WARPS_PER_BLOCK, SHARED_BYTES_WITHOUT_OPT_IN // (2 * 4 * columns)))


def _backward(layout, out, dweight, dbias, dout, x, weight, mean, rstd, rows, columns):
    width, k = layout
    warps = shared_warps(columns)
    launch_backward(_kernel(f"layernorm_backward_shared<{width}, {k}{_storage(x.dtype)}>", x.dtype),
                    warps * WARP_SIZE, 2 * warps * columns * 4,
                    ROWS_PER_BLOCK, out, dweight, dbias, dout, x, weight, mean, rstd, rows, columns)


def launch_backward(kernel, threads, shared_mem, rows_per_block, out, dweight, dbias, dout, x, weight, mean, rstd,
                    rows, columns):
    """Launches `kernel`, a LayerNorm backward row kernel of kernels/layernorm.cu (dx, and a row of partial
    sums of dweight and dbias per block of rows_per_block rows), in blocks of `threads` threads with
    `shared_mem` bytes of dynamic shared memory, then adds the partial sums into dweight and dbias."""
    blocks = ceil_div(rows, rows_per_block)
    partials = backend.xp.empty((2, blocks, columns), dtype=np.float32)  # dweight's, then dbias's
    kernel((blocks,), (threads,),
           (out, partials[0], partials[1], dout, x, weight, mean, rstd, np.int32(rows), np.int32(columns),
            np.int32(rows_per_block)), shared_mem=shared_mem)
    add_column_sums((dweight,) if dbias is None else (dweight, dbias), partials)
