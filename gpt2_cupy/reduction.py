"""Generated reduction kernels: sum, max and min (with the index where the extreme is) over any axes.

    values = reduce("sum", "sum", x, dims=(1,), keepdim=False)             x (4, 5, 6): values (4, 6)
    values, indices = reduce("max", "max", x, dims=(-1,), keepdim=True)    (4, 5, 1) each; indices int64

Every reduction is one of two layouts of a C-contiguous array, seen as (outer, reduced, inner):

- inner = 1, the reduced axes are the last ones: each output is a row of `reduced` neighbouring
  elements. One block per row: its threads step through the row together (neighbouring threads read
  neighbouring elements), each keeps a partial result, and the partials are combined by warp shuffles
  (warp.cuh's butterfly), then across the block's warps through shared memory.
- inner > 1, middle axes: each output is a column, its elements `inner` apart. A block takes 32
  neighbouring columns (a warp reads 32 neighbouring elements of one row: coalesced) and its 8 rows of
  threads split the reduced axis between them; the 8 partials of a column are combined in shared memory.

Any other case (reduced axes that are not neighbours, a transposed input) is first copied by the
generated elementwise kernel into the order (kept axes, reduced axes), which is the first layout.

The order in which partial results are combined is fixed by the code, never by timing (no atomics),
so a reduction gives the same bits on every run. max and min keep the earliest index among equal values
and let NaN win, as PyTorch's do.
"""

import math

import numpy

from gpt2_cupy import backend
from gpt2_cupy.elementwise import c_type, copy
from gpt2_cupy.ops.arrays import LARGEST_INT, WARP_SIZE, ceil_div

COLUMNS_PER_BLOCK = 32   # the strided kernel: one warp's width of columns...
ROWS_PER_BLOCK = 8       # ...and 8 rows of threads splitting the reduced axis

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
"""

_ROWS = """
// One block per row of `columns` neighbouring elements.
extern "C" __global__ void NAME(OUT* out, long long* indices, const IN* x, int columns, ACC scale)
{
    const IN* row = x + blockIdx.x * columns;
    ACC value = 0;
    int index = -1;
    for (int column = threadIdx.x; column < columns; column += blockDim.x) {
        combine(value, index, (ACC)row[column], column);
    }
    // the block's partials: first within each warp (a butterfly of shuffles), then across warps
    for (int offset = WARP_SIZE / 2; offset > 0; offset /= 2) {
        ACC other = __shfl_xor_sync(FULL_MASK, value, offset);
        int other_index = __shfl_xor_sync(FULL_MASK, index, offset);
        combine(value, index, other, other_index);
    }
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
        for (int offset = WARP_SIZE / 2; offset > 0; offset /= 2) {
            ACC other = __shfl_xor_sync(FULL_MASK, value, offset);
            int other_index = __shfl_xor_sync(FULL_MASK, index, offset);
            combine(value, index, other, other_index);
        }
        if (lane == 0) {
            store(out, indices, blockIdx.x, value, index, scale);
        }
    }
}
"""

_STRIDED = """
// x seen as (outer, reduced, inner): a block of (32, 8) threads reduces 32 neighbouring columns of one
// outer slice, each of its 8 rows of threads every 8th element of the reduced axis.
extern "C" __global__ void NAME(OUT* out, long long* indices, const IN* x, int reduced, int inner,
                                int column_blocks, ACC scale)
{
    int outer_index = blockIdx.x / column_blocks;
    int column = (blockIdx.x % column_blocks) * blockDim.x + threadIdx.x;
    ACC value = 0;
    int index = -1;
    if (column < inner) {
        const IN* slice = x + outer_index * reduced * inner + column;
        for (int r = threadIdx.y; r < reduced; r += blockDim.y) {
            combine(value, index, (ACC)slice[r * inner], r);
        }
    }
    __shared__ ACC partial_values[ROWS][COLUMNS];
    __shared__ int partial_indices[ROWS][COLUMNS];
    partial_values[threadIdx.y][threadIdx.x] = value;
    partial_indices[threadIdx.y][threadIdx.x] = index;
    __syncthreads();
    if (threadIdx.y == 0 && column < inner) {
        for (int row = 1; row < blockDim.y; row++) {
            combine(value, index, partial_values[row][threadIdx.x], partial_indices[row][threadIdx.x]);
        }
        store(out, indices, outer_index * inner + column, value, index, scale);
    }
}
"""


def accumulator_dtype(kind, dtype):
    """What a partial result is kept in: sums of integers and bools in int64 (PyTorch's sum type), floats
    in their own type; max and min in the input's type (bool as int: there is no shuffle of a bool)."""
    dtype = numpy.dtype(dtype)
    if dtype.kind in "biu":
        return numpy.dtype(numpy.int64) if kind == "sum" else numpy.dtype(numpy.int32 if dtype.kind == "b" else dtype)
    return dtype


def result_dtype(kind, dtype):
    dtype = numpy.dtype(dtype)
    return numpy.dtype(numpy.int64) if kind == "sum" and dtype.kind in "biu" else dtype


_kernels = {}


def _kernel(kind, layout, in_dtype, out_dtype):
    key = (kind, layout, numpy.dtype(in_dtype), numpy.dtype(out_dtype))
    if key not in _kernels:
        name = f"{kind}_{layout}"
        source = (_HEADER + (_ROWS if layout == "rows" else _STRIDED)).replace("COMBINE", COMBINE[kind])
        source = (source.replace("NAME", name).replace("ROWS]", f"{ROWS_PER_BLOCK}]")
                  .replace("COLUMNS]", f"{COLUMNS_PER_BLOCK}]"))
        types = {"ACC": c_type(accumulator_dtype(kind, in_dtype)), "OUT": c_type(out_dtype), "IN": c_type(in_dtype)}
        source = "\n".join(f"typedef {ctype} {alias};" for alias, ctype in types.items()) + "\n" + source
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
        threads = min(256, max(WARP_SIZE, ceil_div(reduced, WARP_SIZE) * WARP_SIZE))
        kernel = _kernel(kind, "rows", x.dtype, out.dtype)
        kernel((outer,), (threads,), (out, no_indices, x, numpy.int32(reduced), accumulate))
    else:
        column_blocks = ceil_div(inner, COLUMNS_PER_BLOCK)
        kernel = _kernel(kind, "strided", x.dtype, out.dtype)
        kernel((outer * column_blocks,), (COLUMNS_PER_BLOCK, ROWS_PER_BLOCK),
               (out, no_indices, x, numpy.int32(reduced), numpy.int32(inner), numpy.int32(column_blocks), accumulate))
