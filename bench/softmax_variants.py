"""Chapter 04's softmax kernels launched with a choice the op makes for itself taken from the caller:

    forward(y, x, rows, columns, scale, causal, shared_memory=False)             long rows read twice
    backward(dx, dout, y, rows, columns, scale, width=1)                          one float per load
    forward(y, x, rows, columns, scale, causal, blocks_per_multiprocessor=2)      another grid

gpt2_cupy.ops.softmax picks each kernel and grid from the row length and the arrays' alignment; here any of
them may be asked for, so that bench/softmax.py can time the alternatives, tests/test_softmax.py can check
that each gives the softmax, and chapter 04 can show both. A choice left at None is the op's. scale and causal
are the kernels' own scalars (np.float32, np.int32).

    shared_memory          rows longer than LONGEST_WARP_ROW: True the shared-memory kernels (a ValueError
                           where the row does not fit or an array does not start on 16 bytes), False the
                           two-pass kernels
    blocks_per_multiprocessor  the long-row kernels' grid, each block looping over rows: that many blocks per
                           multiprocessor, or 0 for one block per row
    width                  rows of at most LONGEST_WARP_ROW: the warp kernels' floats per load (1 may always be
                           asked for, 4 only where arrays.row_width allows it)
"""

import numpy as np

from gpt2_cupy import backend, kernels
from gpt2_cupy.ops import softmax as softmax_ops
from gpt2_cupy.ops.arrays import WARP_SIZE, ceil_div


def forward(y, x, rows, columns, scale, causal, *, blocks_per_multiprocessor=None, shared_memory=None,
            width=None):
    """softmax_forward's kernels on (rows, columns) x into y, with the choices asked for."""
    _launch("forward", rows, columns, (y, x, np.int32(rows), np.int32(columns), scale, causal), (y, x),
            blocks_per_multiprocessor, shared_memory, width)


def backward(dx, dout, y, rows, columns, scale, *, blocks_per_multiprocessor=None, shared_memory=None,
             width=None):
    """softmax_backward's kernels on (rows, columns) arrays into dx, with the choices asked for."""
    _launch("backward", rows, columns, (dx, dout, y, np.int32(rows), np.int32(columns), scale), (dx, dout, y),
            blocks_per_multiprocessor, shared_memory, width)


def blocks(rows, blocks_per_multiprocessor):
    """A long-row grid: blocks_per_multiprocessor blocks per multiprocessor (at most one per row), 0: one per row."""
    if blocks_per_multiprocessor == 0:
        return rows
    return min(rows, blocks_per_multiprocessor * backend.multiprocessor_count())


def warp_kernel(direction, columns, width, options=()):
    """The warp-per-row kernel for rows of `columns` floats, `width` per load; with `options` (-D...), from a
    module of its own compiled with them."""
    if not options:
        return softmax_ops.warp_kernel(direction, columns, width)
    return kernels.function("softmax", softmax_ops.warp_kernel_name(direction, columns, width),
                            options=tuple(options), name_expressions=softmax_ops.NAMES)


def _launch(direction, rows, columns, arguments, arrays, blocks_per_multiprocessor, shared_memory, width):
    if rows == 0 or columns == 0:
        return
    if columns <= softmax_ops.LONGEST_WARP_ROW:
        if width is None:
            softmax_ops._launch(direction, rows, columns, arguments, arrays)
            return
        warp_kernel(direction, columns, width)(
            (ceil_div(rows, softmax_ops.WARPS_PER_BLOCK),), (softmax_ops.WARPS_PER_BLOCK * WARP_SIZE,), arguments)
        return
    possible = softmax_ops.shared_memory_kernels_run(columns, *arrays)
    if shared_memory and not possible:
        raise ValueError(f"softmax: the shared-memory kernels need rows of at most "
                         f"{(backend.shared_memory_per_block() - softmax_ops.REDUCTION_SHARED_BYTES) // 4 - 3} "
                         "floats and arrays that start on 16 bytes")
    if possible if shared_memory is None else shared_memory:
        grid = blocks(rows, 0 if blocks_per_multiprocessor is None else blocks_per_multiprocessor)
        softmax_ops.shared_kernel(direction)((grid,), (softmax_ops.THREADS_PER_LONG_ROW,), arguments,
                                             shared_mem=softmax_ops.cached_row_bytes(columns))
    else:
        grid = blocks(rows, softmax_ops.LONG_ROW_BLOCKS_PER_MULTIPROCESSOR if blocks_per_multiprocessor is None
                      else blocks_per_multiprocessor)
        softmax_ops.two_pass_kernel(direction)((grid,), (softmax_ops.THREADS_PER_LONG_ROW,), arguments)
