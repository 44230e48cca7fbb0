"""Generated reduction kernels: sum, max and min (with the index where the extreme is) over any axes.

    values = reduce("sum", "sum", x, dims=(1,), keepdim=False)             x (4, 5, 6): values (4, 6)
    values, indices = reduce("max", "max", x, dims=(-1,), keepdim=True)    (4, 5, 1) each; indices int64

Every reduction is one of two layouts of a C-contiguous array, seen as (outer, reduced, inner):

- inner = 1, the reduced axes are the last ones: each output is a row of `reduced` neighbouring
  elements. Rows of up to 8192 elements, when there are enough of them to fill the GPU, take a warp
  each (8 rows per block of 256 threads): its lanes read the row in 16-byte vectors (4 floats), 4 vectors
  loaded before any is added so that they are in flight together, and combine their partials in five
  shuffles (warp.cuh's butterfly), with no shared memory and no barrier. Longer rows take a block each:
  the same loop over the row, then shuffles within each warp and shared memory across warps.
- inner > 1, middle axes: each output is a column, its elements `inner` apart. A block of (32, 8) threads
  takes 32 vectors of neighbouring columns (a warp reads 32 x 16 neighbouring bytes of one row:
  coalesced), and its 8 rows of threads split the reduced axis between them; the 8 partials of a column
  are combined in shared memory. When there are too few columns to fill the GPU (a sum over the first
  axis of a matrix has one row of them), the reduced axis is also split between blocks: each writes its
  partial results, and a second launch of the same kernel combines them, in split order.

Any other case (reduced axes that are not neighbours, a transposed input) is first copied by the
generated elementwise kernel into the order (kept axes, reduced axes), which is the first layout.

The order in which partial results are combined is fixed by the code, never by timing (no atomics),
so a reduction gives the same bits on every run, split or not. max and min keep the earliest index among
equal values and let NaN win, as PyTorch's do.

A bf16 input is read into float32 partials (a bf16 running sum would lose its small addends once it is
large) and its result, bf16 as in PyTorch, is rounded once when it is stored.
"""

import math

import numpy

from gpt2_cupy import backend
from gpt2_cupy.elementwise import (VECTOR_TYPE, c_type, copy, is_aligned, resident_blocks, storage_include,
                                   vector_width)
from gpt2_cupy.ops.arrays import BFLOAT16, FLOAT32, LARGEST_INT, WARP_SIZE, ceil_div

COLUMNS_PER_BLOCK = 32   # the strided kernel: one warp's width of columns (vectors of them)...
ROWS_PER_BLOCK = 8       # ...and 8 rows of threads splitting the reduced axis
FEWEST_ROWS_PER_SPLIT = 64   # a split of the reduced axis: at least 8 rows for each row of threads
WARPS_PER_BLOCK = 8      # the warp-per-row kernel: 8 rows per block of 256 threads
LONGEST_WARP_ROW = 8192  # longer rows take a whole block each
UNROLL = 4               # vector loads each thread issues before it combines any of them

# How a partial result takes in another (value, index): sum ignores the index; max and min keep the better
# value, the earlier index on a tie, and NaN over any number (x != x only for NaN). index < 0: no value yet.
COMBINE = {
    "sum": "value += other;",
    "max": "if (other_index >= 0 && (index < 0 || other > value || (other != other && value == value)\n"
           "        || ((other == value || (other != other && value != value)) && other_index < index))) {\n"
           "        value = other; index = other_index;\n    }",
    "min": "if (other_index >= 0 && (index < 0 || other < value || (other != other && value == value)\n"
           "        || ((other == value || (other != other && value != value)) && other_index < index))) {\n"
           "        value = other; index = other_index;\n    }",
}

_HEADER = """#include "warp.cuh"

// Fold (other, other_index) into the partial result (value, index).
__device__ __forceinline__ void combine(ACC& value, int& index, ACC other, int other_index)
{
    COMBINE
}

// Write one result: the value (times scale: 1/count for a mean) and, for max and min, its index.
__device__ __forceinline__ void store(OUT* out, long long* indices, int at, ACC value, int index, ACC scale)
{
    out[at] = (OUT)(value * scale);
    if (indices != 0) {
        indices[at] = index;
    }
}

// Combine the 32 lanes' partials: a butterfly of shuffles; afterwards every lane holds the warp's result.
__device__ __forceinline__ void warp_combine(ACC& value, int& index)
{
    for (int offset = WARP_SIZE / 2; offset > 0; offset /= 2) {
        ACC other = __shfl_xor_sync(FULL_MASK, value, offset);
        int other_index = __shfl_xor_sync(FULL_MASK, index, offset);
        combine(value, index, other, other_index);
    }
}
"""

_ROW_PARTIAL = """
// One thread's partial over a row of `groups` vectors of W elements: vectors first, first + step, ...
// UNROLL of them are loaded before any is combined, so that each thread has UNROLL 16-byte loads in
// flight; a thread meets its elements in increasing order, so the earliest index wins a tie.
__device__ __forceinline__ void row_partial(const IN* row, int groups, int first, int step, ACC& value, int& index)
{
    const Vector<IN, W>* vectors = reinterpret_cast<const Vector<IN, W>*>(row);
    int group = first;
    for (; group < groups - (UNROLL - 1) * step; group += UNROLL * step) {
        Vector<IN, W> loaded[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            loaded[u] = vectors[group + u * step];
        }
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
#pragma unroll
            for (int k = 0; k < W; k++) {
                combine(value, index, (ACC)loaded[u].item[k], (group + u * step) * W + k);
            }
        }
    }
    for (; group < groups; group += step) {  // the last vectors, fewer than UNROLL * step
        Vector<IN, W> loaded = vectors[group];
#pragma unroll
        for (int k = 0; k < W; k++) {
            combine(value, index, (ACC)loaded.item[k], group * W + k);
        }
    }
}
"""

_ROWS_WARP = """
// A warp per row (rows of up to a few thousand elements): block (32, WARPS) holds WARPS rows. No shared
// memory and no barrier: the lanes' partials meet in five shuffles.
extern "C" __global__ void NAME(OUT* out, long long* indices, const IN* x, int rows, int columns, ACC scale)
{
    int row = blockIdx.x * blockDim.y + threadIdx.y;
    if (row >= rows) {
        return;  // the whole warp: the shuffles below still see all 32 lanes
    }
    ACC value = 0;
    int index = -1;
    row_partial(x + row * columns, columns / W, threadIdx.x, WARP_SIZE, value, index);
    warp_combine(value, index);
    if (threadIdx.x == 0) {
        store(out, indices, row, value, index, scale);
    }
}
"""

_ROWS_BLOCK = """
// A block per row (long rows): its threads step through the row together, then the partials are
// combined within each warp by shuffles and across the warps through shared memory.
extern "C" __global__ void NAME(OUT* out, long long* indices, const IN* x, int rows, int columns, ACC scale)
{
    ACC value = 0;
    int index = -1;
    row_partial(x + blockIdx.x * columns, columns / W, threadIdx.x, blockDim.x, value, index);
    warp_combine(value, index);
    __shared__ ACC warp_values[WARP_SIZE];
    __shared__ int warp_indices[WARP_SIZE];
    int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE, warps = blockDim.x / WARP_SIZE;
    if (lane == 0) {
        warp_values[warp] = value;
        warp_indices[warp] = index;
    }
    __syncthreads();
    if (warp == 0) {
        value = lane < warps ? warp_values[lane] : (ACC)0;
        index = lane < warps ? warp_indices[lane] : -1;
        warp_combine(value, index);
        if (lane == 0) {
            store(out, indices, blockIdx.x, value, index, scale);
        }
    }
}
"""

_STRIDED = """
// x seen as (outer, reduced, inner), each output a column of `reduced` elements `inner` apart. A block of
// (32, ROWS) threads takes 32 x W neighbouring columns of one outer slice: each thread W neighbouring
// columns (one vector; a warp reads 32 x W neighbours of one row: coalesced), its row of threads every
// ROWS-th row of the reduced rows [first_row, end_row) of this block's split (blockIdx.y). With one
// split, the block writes the results; with several, each split writes its partials to its own slice
// of `out` (split_stride apart) and a second launch combines them in a fixed order (x_indices: the
// partials' indices for max and min; 0 on a first pass, where the index is the row).
extern "C" __global__ void NAME(OUT* out, long long* indices, const IN* x, const long long* x_indices,
                                int reduced, int inner, int column_blocks, int rows_per_split, int split_stride,
                                ACC scale)
{
    int outer_index = blockIdx.x / column_blocks;
    int column = ((blockIdx.x % column_blocks) * blockDim.x + threadIdx.x) * W;
    int first_row = blockIdx.y * rows_per_split;
    int end_row = min(first_row + rows_per_split, reduced);
    ACC value[W];
    int index[W];
#pragma unroll
    for (int k = 0; k < W; k++) {
        value[k] = 0;
        index[k] = -1;
    }
    if (column < inner) {
        int slice = outer_index * reduced * inner + column;
        int r = first_row + threadIdx.y;
        // UNROLL rows loaded before any is combined: UNROLL loads in flight per thread
        for (; r < end_row - (UNROLL - 1) * ROWS; r += UNROLL * ROWS) {
            Vector<IN, W> loaded[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; u++) {
                loaded[u] = *reinterpret_cast<const Vector<IN, W>*>(x + slice + (r + u * ROWS) * inner);
            }
#pragma unroll
            for (int u = 0; u < UNROLL; u++) {
#pragma unroll
                for (int k = 0; k < W; k++) {
                    int at = slice + (r + u * ROWS) * inner + k;
                    combine(value[k], index[k], (ACC)loaded[u].item[k], x_indices ? (int)x_indices[at] : r + u * ROWS);
                }
            }
        }
        for (; r < end_row; r += ROWS) {  // the last rows, fewer than UNROLL * ROWS
            Vector<IN, W> loaded = *reinterpret_cast<const Vector<IN, W>*>(x + slice + r * inner);
#pragma unroll
            for (int k = 0; k < W; k++) {
                int at = slice + r * inner + k;
                combine(value[k], index[k], (ACC)loaded.item[k], x_indices ? (int)x_indices[at] : r);
            }
        }
    }
    // the ROWS partials of each column meet in shared memory, combined in row order by threadIdx.y == 0
    __shared__ ACC partial_values[ROWS][COLUMNS * W];
    __shared__ int partial_indices[ROWS][COLUMNS * W];
#pragma unroll
    for (int k = 0; k < W; k++) {
        partial_values[threadIdx.y][threadIdx.x * W + k] = value[k];
        partial_indices[threadIdx.y][threadIdx.x * W + k] = index[k];
    }
    __syncthreads();
    if (threadIdx.y == 0 && column < inner) {
        for (int row = 1; row < blockDim.y; row++) {
#pragma unroll
            for (int k = 0; k < W; k++) {
                combine(value[k], index[k], partial_values[row][threadIdx.x * W + k],
                        partial_indices[row][threadIdx.x * W + k]);
            }
        }
#pragma unroll
        for (int k = 0; k < W; k++) {
            store(out + blockIdx.y * split_stride, indices == 0 ? 0 : indices + blockIdx.y * split_stride,
                  outer_index * inner + column + k, value[k], index[k], scale);
        }
    }
}
"""

def accumulator_dtype(kind, dtype):
    """What a partial result is kept in: sums of integers and bools in int64 (PyTorch's sum type), floats
    in their own type, bf16 in float32 (a bf16 running sum would lose the small addends); max and min in
    the input's type (bool as int: there is no shuffle of a bool; bf16 as float32, which holds it exactly)."""
    dtype = numpy.dtype(dtype)
    if dtype == BFLOAT16:
        return FLOAT32
    if dtype.kind in "biu":
        return numpy.dtype(numpy.int64) if kind == "sum" else numpy.dtype(numpy.int32 if dtype.kind == "b" else dtype)
    return dtype


def result_dtype(kind, dtype):
    dtype = numpy.dtype(dtype)
    return numpy.dtype(numpy.int64) if kind == "sum" and dtype.kind in "biu" else dtype


_kernels = {}
_LAYOUTS = {"rows_warp": _ROW_PARTIAL + _ROWS_WARP, "rows_block": _ROW_PARTIAL + _ROWS_BLOCK, "strided": _STRIDED}


def _kernel(kind, layout, in_dtype, out_dtype, width=4):
    """The kernel for kind and layout, compiled once per (input, output) dtype and vector width.
    layout "rows" is the block-per-row kernel (rows_block)."""
    layout = "rows_block" if layout == "rows" else layout
    key = (kind, layout, numpy.dtype(in_dtype), numpy.dtype(out_dtype), width)
    if key not in _kernels:
        name = f"{kind}_{layout}{width}"
        source = (_HEADER + _LAYOUTS[layout]).replace("COMBINE", COMBINE[kind]).replace("NAME", name)
        types = {"ACC": c_type(accumulator_dtype(kind, in_dtype)), "OUT": c_type(out_dtype), "IN": c_type(in_dtype)}
        source = ("\n".join(storage_include(types.values())) +   # a bf16 is read and written by C casts
                  "\n".join(f"typedef {ctype} {alias};" for alias, ctype in types.items()) + "\n" +
                  f"#define W {width}          // elements per vector load (16 bytes for 4 floats)\n"
                  f"#define UNROLL {UNROLL}     // vector loads in flight per thread\n"
                  f"#define ROWS {ROWS_PER_BLOCK}       // strided: rows of threads splitting the reduced axis\n"
                  f"#define COLUMNS {COLUMNS_PER_BLOCK}   // strided: threads along the columns\n" +
                  VECTOR_TYPE + source)
        _kernels[key] = backend.RawKernel(source, name)
    return _kernels[key]


def normalize_dims(operation, dims, ndim):
    """dims as sorted non-negative axes; None or () means every axis. PyTorch's error for one out of range."""
    if dims is None:
        return tuple(range(ndim))
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    low, high = (-ndim, ndim - 1) if ndim else (-1, 0)
    normalized = []
    for dim in dims:
        if not low <= dim <= high:
            raise IndexError(f"{operation}: Dimension out of range (expected to be in range of [{low}, {high}], "
                             f"but got {dim})")
        normalized.append(dim % max(ndim, 1))
    if len(set(normalized)) != len(normalized):
        raise RuntimeError(f"{operation}: dim {dims} appears multiple times in the list of dims")
    return tuple(sorted(normalized)) if ndim else ()


def reduce(operation, kind, x, dims=None, keepdim=False, scale=1.0):
    """Reduce x over dims with kind "sum", "max" or "min"; values, or (values, indices) for max and min.

    scale multiplies each result (1/count turns sum into mean). Results are new C-contiguous arrays.
    """
    dims = normalize_dims(operation, dims, x.ndim)
    kept = [axis for axis in range(x.ndim) if axis not in dims]
    out_shape = tuple(1 if axis in dims else size for axis, size in enumerate(x.shape)) if keepdim else \
        tuple(x.shape[axis] for axis in kept)
    reduced = math.prod(x.shape[axis] for axis in dims)
    with_index = kind != "sum"
    if with_index and reduced == 0:
        raise IndexError(f"{operation}(): Expected reduction dim {dims[0] if dims else 0} to have non-zero size.")
    out_dtype = result_dtype(kind, x.dtype)
    out = backend.xp.empty(out_shape, dtype=out_dtype)
    indices = backend.xp.empty(out_shape, dtype=numpy.int64) if with_index else None
    if x.size > LARGEST_INT:
        raise ValueError(f"{operation}: the input has {x.size} elements; the generated kernels index with int, "
                         f"at most {LARGEST_INT}")
    if out.size > 0:
        _launch(kind, x, dims, kept, reduced, out, indices, scale)
    return (out, indices) if with_index else out


def _width(x, columns):
    """16-byte vectors when x starts at a multiple of the vector's size and every row (of `columns`
    elements) does too; else one element per load."""
    width = vector_width([x])
    return width if columns % width == 0 and is_aligned(x, width) else 1


def _launch(kind, x, dims, kept, reduced, out, indices, scale):
    consecutive = dims == tuple(range(dims[0], dims[0] + len(dims))) if dims else True
    if x.flags.c_contiguous and consecutive and dims:
        outer = math.prod(x.shape[:dims[0]])
        inner = math.prod(x.shape[dims[-1] + 1:])
    else:  # copy into the order (kept axes, reduced axes): the rows layout
        x = copy("contiguous", x.transpose(kept + list(dims)))
        outer, inner = math.prod(x.shape[axis] for axis in range(len(kept))), 1
    accumulate = accumulator_dtype(kind, x.dtype).type(scale)
    no_indices = indices if indices is not None else 0
    if inner == 1:
        width = _width(x, reduced)
        arguments = (out, no_indices, x, numpy.int32(outer), numpy.int32(reduced), accumulate)
        if reduced <= LONGEST_WARP_ROW and outer >= resident_blocks():
            # a warp per row: enough rows to keep every multiprocessor busy, short enough for one warp
            kernel = _kernel(kind, "rows_warp", x.dtype, out.dtype, width)
            kernel((ceil_div(outer, WARPS_PER_BLOCK),), (WARP_SIZE, WARPS_PER_BLOCK), arguments)
        else:
            threads = min(256, max(WARP_SIZE, ceil_div(reduced // width, WARP_SIZE) * WARP_SIZE))
            kernel = _kernel(kind, "rows_block", x.dtype, out.dtype, width)
            kernel((outer,), (threads,), arguments)
        return
    width = _width(x, inner)
    column_blocks = ceil_div(inner, COLUMNS_PER_BLOCK * width)
    blocks = outer * column_blocks
    splits = 1
    one_wave = resident_blocks() // 2  # 4 blocks per multiprocessor: about 40 registers a thread allow 6
    if blocks < one_wave and reduced >= 2 * FEWEST_ROWS_PER_SPLIT:
        # too few columns to fill the GPU: split the reduced axis between blocks, each writing partials
        splits = min(ceil_div(one_wave, blocks), reduced // FEWEST_ROWS_PER_SPLIT)
    rows_per_split = ceil_div(reduced, splits)
    splits = ceil_div(reduced, rows_per_split)
    if splits == 1:
        kernel = _kernel(kind, "strided", x.dtype, out.dtype, width)
        kernel((blocks,), (COLUMNS_PER_BLOCK, ROWS_PER_BLOCK),
               (out, no_indices, x, 0, numpy.int32(reduced), numpy.int32(inner), numpy.int32(column_blocks),
                numpy.int32(reduced), numpy.int32(0), accumulate))
        return
    # first pass: (splits, outer, inner) partials in the accumulator's type, unscaled
    accumulator = accumulator_dtype(kind, x.dtype)
    partials = backend.xp.empty((splits, outer * inner), dtype=accumulator)
    partial_indices = backend.xp.empty((splits, outer * inner), dtype=numpy.int64) if indices is not None else 0
    kernel = _kernel(kind, "strided", x.dtype, accumulator, width)
    kernel((blocks, splits), (COLUMNS_PER_BLOCK, ROWS_PER_BLOCK),
           (partials, partial_indices, x, 0, numpy.int32(reduced), numpy.int32(inner), numpy.int32(column_blocks),
            numpy.int32(rows_per_split), numpy.int32(outer * inner), accumulator.type(1)))
    # second pass: the partials as (1, splits, outer * inner), combined in split order: the same bits every run
    width = _width(partials, outer * inner)
    column_blocks = ceil_div(outer * inner, COLUMNS_PER_BLOCK * width)
    kernel = _kernel(kind, "strided", accumulator, out.dtype, width)
    kernel((column_blocks,), (COLUMNS_PER_BLOCK, ROWS_PER_BLOCK),
           (out, no_indices, partials, partial_indices, numpy.int32(splits), numpy.int32(outer * inner),
            numpy.int32(column_blocks), numpy.int32(splits), numpy.int32(0), accumulate))
