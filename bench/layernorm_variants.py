"""Chapter 05's LayerNorm and DyT backward kernels launched as the ops do not launch them: with other launch
sizes, and the chapter's first kernels, so that bench/layernorm.py can time them against the ops' own, and
tests/test_layernorm.py can check that every one gives the same gradients.

    layernorm_backward_shared(layout, ..., rows_per_block)    the op's kernel, another number of rows per block
    layernorm_backward_registers(layout, ...)                 the first kernel: column sums in registers
    add_column_sums(sums, partials, stripes)                  the finishing launch with other rows of threads
    dyt_backward_columns(width, ..., rows_per_block=, row_slots=, rows_at_once=, kernel=)
                                                              the op's kernel, other instances or a copy of it
    dyt_backward_rows(layout, ...)                            the first kernel: a warp per row, as LayerNorm's

layout is gpt2_cupy.ops.layernorm.row_layout's (WIDTH, K), width its WIDTH; "..." stands for the arrays, outputs
and gradient buffers first, then the inputs, then rows and columns, in the order of the ops' internal launches
(layernorm_ops._backward, dyt_ops.launch_backward_columns).
"""

import numpy as np

from gpt2_cupy import backend, kernels
from gpt2_cupy.ops import dyt as dyt_ops
from gpt2_cupy.ops import layernorm as layernorm_ops
from gpt2_cupy.ops.arrays import WARP_SIZE, ceil_div

# The first backward kernels, layernorm_backward and dyt_backward, hold five arrays of 4K floats per lane in
# registers (about 170 registers per thread at C = 768): blocks of 4 warps, 3 of them resident per
# multiprocessor, one wave of blocks that each write a row of partial sums (more blocks would mean more
# partial sums to add up).
FIRST_WARPS_PER_BLOCK = 4
FIRST_BLOCKS_PER_MULTIPROCESSOR = 3
LAYERNORM_FIRST_NAMES = layernorm_ops.names("layernorm_backward")
DYT_FIRST_NAMES = tuple(f"dyt_backward<{width}, {k}>" for width, ks in layernorm_ops.GROUPS_PER_LANE.items()
                        for k in ks)
# The float4 instances of dyt_backward_columns that bench/layernorm.py times, (ROW_SLOTS, ROWS_AT_ONCE).
DYT_CANDIDATES = tuple((slots, rows) for slots in (4, 8, 16) for rows in (1, 2, 4, 8))
DYT_CANDIDATE_NAMES = tuple(f"dyt_backward_columns<4, {slots}, {rows}>" for slots, rows in DYT_CANDIDATES)


def compiled_kernel(file_name, name):
    """The kernel `name` of kernels/<file_name>.cu: from the op's module when the op runs it, else from a module
    of the instances above that hold it (each compiled when first asked for)."""
    groups = {"layernorm": (layernorm_ops.NAMES, LAYERNORM_FIRST_NAMES),
              "dyt": (dyt_ops.NAMES, DYT_FIRST_NAMES, DYT_CANDIDATE_NAMES)}[file_name]
    names = next((names for names in groups if name in names), groups[0])
    return kernels.function(file_name, name, name_expressions=names)


def first_kernel_blocks(rows):
    """(blocks, rows per block) of the first kernels: enough blocks to fill the GPU, each a row of partial sums."""
    blocks = min(ceil_div(rows, FIRST_WARPS_PER_BLOCK),
                 FIRST_BLOCKS_PER_MULTIPROCESSOR * backend.multiprocessor_count())
    rows_per_block = ceil_div(rows, blocks)
    return ceil_div(rows, rows_per_block), rows_per_block


def layernorm_backward_shared(layout, out, dweight, dbias, dout, x, weight, mean, rstd, rows, columns,
                              rows_per_block):
    """The op's backward, layernorm_backward_shared, over blocks of rows_per_block rows."""
    width, k = layout
    warps = layernorm_ops.shared_warps(columns)
    layernorm_ops.launch_backward(compiled_kernel("layernorm", f"layernorm_backward_shared<{width}, {k}>"),
                                  warps * WARP_SIZE, 2 * warps * columns * 4, rows_per_block,
                                  out, dweight, dbias, dout, x, weight, mean, rstd, rows, columns)


def layernorm_backward_registers(layout, out, dweight, dbias, dout, x, weight, mean, rstd, rows, columns):
    """The first backward, layernorm_backward: column sums in registers, a wave of blocks of 4 warps."""
    width, k = layout
    _, rows_per_block = first_kernel_blocks(rows)
    layernorm_ops.launch_backward(compiled_kernel("layernorm", f"layernorm_backward<{width}, {k}>"),
                                  FIRST_WARPS_PER_BLOCK * WARP_SIZE, 2 * columns * 4, rows_per_block,
                                  out, dweight, dbias, dout, x, weight, mean, rstd, rows, columns)


def add_column_sums(sums, partials, stripes):
    """layernorm_ops.add_column_sums in blocks of `stripes` rows of threads (at most 32), each adding every
    stripes-th part."""
    _, parts, columns = partials.shape
    compiled_kernel("layernorm", "column_sums_accumulate")(
        (ceil_div(columns, WARP_SIZE), len(sums)), (WARP_SIZE, stripes),
        (sums[0], sums[-1], partials, np.int32(parts), np.int32(columns)))


def dyt_backward_columns(width, out, dalpha, dweight, dbias, dout, x, alpha, weight, rows, columns, *,
                         rows_per_block=dyt_ops.ROWS_PER_BLOCK, row_slots=dyt_ops.ROW_SLOTS,
                         rows_at_once=dyt_ops.ROWS_AT_ONCE, kernel=None):
    """dyt_backward_columns<width, row_slots, rows_at_once> over blocks of rows_per_block rows (the op's
    instance and rows per block unless asked), or `kernel`, a compiled kernel with its parameters (a copy of it
    cut short)."""
    kernel = kernel or compiled_kernel("dyt", f"dyt_backward_columns<{width}, {row_slots}, {rows_at_once}>")
    dyt_ops.launch_backward_columns(kernel, width, row_slots, rows_per_block, out, dalpha, dweight, dbias, dout, x,
                                    alpha, weight, rows, columns)


def dyt_backward_rows(layout, out, dalpha, dweight, dbias, dout, x, alpha, weight, rows, columns):
    """The first DyT backward, dyt_backward<WIDTH, K>: LayerNorm's first layout, a warp per row with the column
    sums in registers, then two column_sums_accumulate launches (dweight and dbias, then dalpha)."""
    width, k = layout
    blocks, rows_per_block = first_kernel_blocks(rows)
    partials = backend.xp.empty((2 * blocks * columns + blocks,), dtype=np.float32)
    weight_and_bias_partials = partials[:2 * blocks * columns].reshape(2, blocks, columns)
    weight_partials, bias_partials = weight_and_bias_partials
    alpha_partials = partials[2 * blocks * columns:].reshape(1, blocks, 1)
    compiled_kernel("dyt", f"dyt_backward<{width}, {k}>")(
        (blocks,), (FIRST_WARPS_PER_BLOCK * WARP_SIZE,),
        (out, weight_partials, bias_partials, alpha_partials, dout, x, alpha, weight, np.int32(rows),
         np.int32(columns), np.int32(rows_per_block)), shared_mem=2 * columns * 4)
    layernorm_ops.add_column_sums((dweight,) if dbias is None else (dweight, dbias), weight_and_bias_partials)
    layernorm_ops.add_column_sums((dalpha,), alpha_partials)
