"""Softmax over the last axis, forward and backward, on float32 arrays (chapter 04).

    y = softmax_forward(x, scale=1.0, causal=False)    softmax(scale * x) along the last axis
    dx = softmax_backward(dout, y, scale=1.0)           dout's gradient pushed back through it

Any shape (..., C) works: in GPT-2, attention scores (B, H, T, T) with scale 1/sqrt(head size), and the
logits (B, T, V). causal=True takes x of shape (..., T, T) and lets row t see columns 0..t only: the
kernels skip the masked upper triangle instead of reading it, and write 0 there. The backward needs no
causal flag: y is 0 in the masked triangle, and so is dx.

Rows of at most 1024 elements go to a warp per row, the row held in registers (kernels/softmax.cu,
softmax_forward_warp<WIDTH, K>): when the row length is a multiple of 4 and the arrays start on 16 bytes,
each lane moves K float4s (WIDTH = 4, K = 1, 2, 4 or 8); otherwise K single floats (WIDTH = 1, K = 1, 2, 4,
..., 32). Longer rows go to a block of 1024 threads per row with the row kept in shared memory
(softmax_forward_shared, softmax_backward_shared): read from global memory once. When the row does not fit
in a block's shared memory (past about 58 000 floats on an H100), or an array does not start on 16 bytes
(the shared-memory kernels move float4s), they go to the two-pass kernels softmax_forward_block and
softmax_backward_block, which read the row twice (a grid of one block per multiprocessor, each looping over
rows). `out=` writes into an existing array, which may be the input itself.
"""

from functools import lru_cache

import numpy as np

from gpt2_cupy import backend, kernels
from gpt2_cupy.ops.arrays import WARP_SIZE, ceil_div, check, float4_aligned, output, row_width

WARPS_PER_BLOCK = 8             # rows per block for the warp kernels: 256 threads (WARP_ROW_THREADS, the most)
# The warp kernels' groups per lane, K, by WIDTH (floats per load): the op takes the smallest K that covers
# the row, 32 K WIDTH >= columns. WIDTH = 4 needs columns % 4 == 0 and arrays that start on 16 bytes.
GROUPS_PER_LANE = {4: (1, 2, 4, 8), 1: (1, 2, 4, 8, 16, 32)}
LONGEST_WARP_ROW = WARP_SIZE * GROUPS_PER_LANE[1][-1]   # 1024: longer rows take a block each
THREADS_PER_LONG_ROW = 1024   # LONG_ROW_THREADS in kernels/softmax.cu: the shared-memory kernels' launch bounds
# The two-pass kernels for long rows: a grid of this many blocks per multiprocessor, each looping over rows,
# rather than one block per row. Fewer rows in flight (132 rows of 50257 floats are 27 MB) let the output
# pass find its row still in the L2 cache (50 MB on an H100); bench/softmax.py measures 1, 2 and one block
# per row. The shared-memory kernels get one block per row: only one such block fits on a multiprocessor
# anyway, and the GPU hands the next row to whichever multiprocessor finishes first (bench/softmax.py also
# measures one block per multiprocessor looping over rows).
LONG_ROW_BLOCKS_PER_MULTIPROCESSOR = 1
# Room for the shared-memory kernels' own __shared__ arrays besides the row: the block reduction's 32 maxima,
# 32 sums and its result, 272 bytes once the compiler has aligned them (the backward's block_sum needs less).
REDUCTION_SHARED_BYTES = 512

NAMES = tuple(f"softmax_{direction}_warp<{width}, {k}>" for direction in ("forward", "backward")
              for width, ks in GROUPS_PER_LANE.items() for k in ks)


def softmax_forward(x, *, scale=1.0, causal=False, out=None):
    """softmax(scale * x) along the last axis; causal: x is (..., T, T) and row t keeps columns <= t."""
    sizes = check("softmax_forward", x=(x, ("...", "C")))
    if causal and (x.ndim < 2 or x.shape[-2] != x.shape[-1]):
        raise ValueError(f"softmax_forward: causal=True needs x of shape (..., T, T), got {x.shape}")
    out = output("softmax_forward", out, x.shape)
    rows, columns = x.size // max(sizes["C"], 1), sizes["C"]
    _forward(out, x, rows, columns, np.float32(scale), np.int32(bool(causal)))
    return out


def softmax_backward(dout, y, *, scale=1.0, out=None):
    """dx = scale * y * (dout - sum(dout * y)) along the last axis; y is the forward's output."""
    sizes = check("softmax_backward", dout=(dout, ("...", "C")), y=(y, ("...", "C")))
    out = output("softmax_backward", out, y.shape)
    rows, columns = y.size // max(sizes["C"], 1), sizes["C"]
    _backward(out, dout, y, rows, columns, np.float32(scale))
    return out


def warp_kernel_name(direction, columns, width):
    """softmax_{direction}_warp<width, K>, K the fewest groups per lane that cover a row of `columns`."""
    k = next(k for k in GROUPS_PER_LANE[width] if WARP_SIZE * k * width >= columns)
    return f"softmax_{direction}_warp<{width}, {k}>"


def warp_kernel(direction, columns, width):
    """The warp-per-row kernel for rows of `columns` floats (at most LONGEST_WARP_ROW), `width` per load."""
    return kernels.function("softmax", warp_kernel_name(direction, columns, width), name_expressions=NAMES)


def cached_row_bytes(columns):
    """The shared-memory kernels' dynamic shared memory for a row of `columns` floats."""
    return 4 * (columns + 3)  # the kernels shift the row by up to 3 floats to put its float4s on 16 bytes


def row_fits_in_shared_memory(columns):
    """Whether a row of `columns` floats fits in one block's shared memory, next to the reduction's arrays."""
    return cached_row_bytes(columns) + REDUCTION_SHARED_BYTES <= backend.shared_memory_per_block()


def shared_memory_kernels_run(columns, *arrays):
    """Whether the shared-memory kernels can take rows of `columns` floats in these arrays: the row fits, and
    every array starts on 16 bytes (the kernels move float4s)."""
    return row_fits_in_shared_memory(columns) and float4_aligned(*arrays)


@lru_cache(maxsize=None)
def shared_kernel(direction):
    """softmax_{direction}_shared, allowed all the dynamic shared memory a block may have."""
    kernel = kernels.function("softmax", f"softmax_{direction}_shared", name_expressions=NAMES)
    # Past 48 KB of dynamic shared memory a kernel must opt in before its first launch.
    kernel.max_dynamic_shared_size_bytes = backend.shared_memory_per_block() - REDUCTION_SHARED_BYTES
    return kernel


def two_pass_kernel(direction):
    """softmax_{direction}_block, which reads the row twice: any row length, any alignment."""
    return kernels.function("softmax", f"softmax_{direction}_block", name_expressions=NAMES)


def two_pass_blocks(rows):
    """The two-pass kernels' grid: LONG_ROW_BLOCKS_PER_MULTIPROCESSOR blocks per multiprocessor, at most one
    per row."""
    return min(rows, LONG_ROW_BLOCKS_PER_MULTIPROCESSOR * backend.multiprocessor_count())


def _forward(out, x, rows, columns, scale, causal):
    _launch("forward", rows, columns, (out, x, np.int32(rows), np.int32(columns), scale, causal), (out, x))


def _backward(out, dout, y, rows, columns, scale):
    _launch("backward", rows, columns, (out, dout, y, np.int32(rows), np.int32(columns), scale), (out, dout, y))


def _launch(direction, rows, columns, arguments, arrays):
    """Launches the kernel that rows of `columns` floats in `arrays` take (see the module's docstring) with
    `arguments`, the kernel's own, outputs first."""
    if rows == 0 or columns == 0:
        return
    if columns <= LONGEST_WARP_ROW:
        warp_kernel(direction, columns, row_width(columns, *arrays))(
            (ceil_div(rows, WARPS_PER_BLOCK),), (WARPS_PER_BLOCK * WARP_SIZE,), arguments)
    elif shared_memory_kernels_run(columns, *arrays):
        shared_kernel(direction)((rows,), (THREADS_PER_LONG_ROW,), arguments, shared_mem=cached_row_bytes(columns))
    else:
        two_pass_kernel(direction)((two_pass_blocks(rows),), (THREADS_PER_LONG_ROW,), arguments)
