"""Embedding tables: rows looked up by token id (forward), gradients scattered back into them (backward).

    out = embedding_forward(ids, weight)                    weight[ids]: (..., C) from ids (...) int32
    embedding_backward(dout, ids, dweight=dweight)          dweight[ids[n]] += dout[n], deterministic
    out = token_position_embedding_forward(ids, wte, wpe)   GPT-2's input, wte[ids[b, t]] + wpe[t], fused
    token_position_embedding_backward(dout, ids, dwte=dwte, dwpe=dwpe)

weight: (V, C) float32, V rows (the vocabulary, or the positions). Ids outside [0, V) are refused with a
ValueError before any kernel runs. That check reads the smallest and largest id back to the host: one
synchronisation per call on a GPU. The ids come from the data loader, and a wrong id otherwise shows up
much later as a wrong loss, so the check is on by default; check_ids=False skips it (for a step that must
not synchronise, such as one captured in a CUDA graph), and then the kernels still never read or write
outside the table: the forward writes a row of NaN for a bad id, which the loss turns into NaN, and the
backward skips it.

The backward adds into dweight (parameter gradients accumulate, the op contract), in the same order on
every run: a counting sort groups the positions by id, in order of position (group_positions), then warps
sum chunks of 16 grouped positions, and the pieces of groups longer than a chunk are added chunk after
chunk. A padding_idx, when given, receives no gradient. Each call allocates its scratch arrays from the
memory pool: 2 (V + 1) + 2 N int32 for the grouping and 2 ⌈N / 16⌉ rows of C floats for the pieces.

A model trained in bf16 (gpt2_cupy.amp) keeps its tables in float32: embedding_forward(..., dtype=bfloat16)
rounds the rows it looks up once, and embedding_backward takes a bf16 dout, summed in float32 into the
float32 dweight.

The kernels are kernels/embedding.cu, taught in chapters/06_embedding.ipynb.
"""

import numpy as np

from gpt2_cupy import backend, kernels
from gpt2_cupy.graphs import is_current_stream_capturing
from gpt2_cupy.ops.arrays import (FLOAT32, LARGEST_INT, STORAGE_DTYPES, THREADS_PER_BLOCK, WARP_SIZE, ceil_div, check,
                                  output, row_width, storage_c_type, storage_dtype)

COLUMNS_PER_WARP = 128     # the backward's warps each cover 128 columns (kernels/embedding.cu)
POSITIONS_PER_CHUNK = 16   # and 16 grouped positions
SCAN_THREADS = 1024        # the one block of embedding_group_starts
NO_PADDING = -1
# The templates' instances, float32 and bf16, all in the module with the file's extern "C" kernels.
_NAMES = tuple(f"{kernel}<{c_type}>" for kernel in ("embedding_forward", "embedding_backward_chunks")
               for c_type in ("float", "__nv_bfloat16"))


def _kernel(name):
    """A kernel of kernels/embedding.cu (one module for all of them)."""
    return kernels.function("embedding", name, name_expressions=_NAMES)


def embedding_forward(ids, weight, *, out=None, check_ids=True, dtype=FLOAT32):
    """weight[ids]: ids int32 of any shape (...), weight (V, C) float32; returns (..., C) of dtype: float32,
    or bfloat16 (each value rounded once)."""
    if np.dtype(dtype) not in STORAGE_DTYPES:
        raise TypeError(f"embedding_forward: dtype {dtype} is not supported; use float32 or bfloat16")
    sizes = check("embedding_forward", ids=(ids, ("...",), np.int32), weight=(weight, ("V", "C")))
    out = _output("embedding_forward", out, sizes, np.dtype(dtype))
    if check_ids:
        _check_ids("embedding_forward", ids, sizes["V"])
    _lookup(out, ids, weight, None, 1, sizes["V"], sizes["C"])
    return out


def embedding_backward(dout, ids, *, dweight, padding_idx=None, check_ids=True):
    """dweight[ids[n]] += dout[n] for every position n (rows of padding_idx excepted); returns None.
    dout float32 or bf16; dweight float32."""
    sizes = check("embedding_backward", dout=(dout, ("...", "C"), storage_dtype("embedding_backward", "dout", dout)),
                  ids=(ids, ("...",), np.int32), dweight=(dweight, ("V", "C")))
    padding = _padding("embedding_backward", padding_idx, sizes["V"])
    if check_ids:
        _check_ids("embedding_backward", ids, sizes["V"])
    _scatter_grouped(dweight, dout, ids, sizes["V"], sizes["C"], padding)


def token_position_embedding_forward(ids, wte, wpe, *, out=None, check_ids=True):
    """out[b, t] = wte[ids[b, t]] + wpe[t]: ids (B, T) int32, wte (V, C), wpe (at least T rows, C)."""
    sizes = check("token_position_embedding_forward", ids=(ids, ("B", "T"), np.int32), wte=(wte, ("V", "C")),
                  wpe=(wpe, ("positions", "C")))
    _check_positions("token_position_embedding_forward", sizes)
    out = _output("token_position_embedding_forward", out, {**sizes, "...": ids.shape})
    if check_ids:
        _check_ids("token_position_embedding_forward", ids, sizes["V"])
    _lookup(out, ids, wte, wpe, sizes["T"], sizes["V"], sizes["C"])
    return out


def token_position_embedding_backward(dout, ids, *, dwte, dwpe, padding_idx=None, check_ids=True):
    """dwte[ids[b, t]] += dout[b, t] and dwpe[t] += sum over b of dout[b, t]; returns None."""
    operation = "token_position_embedding_backward"
    sizes = check(operation, dout=(dout, ("B", "T", "C")), ids=(ids, ("B", "T"), np.int32),
                  dwte=(dwte, ("V", "C")), dwpe=(dwpe, ("positions", "C")))
    _check_positions(operation, sizes)
    padding = _padding(operation, padding_idx, sizes["V"])
    if check_ids:
        _check_ids(operation, ids, sizes["V"])
    _scatter_grouped(dwte, dout, ids, sizes["V"], sizes["C"], padding)
    B, T, C = sizes["B"], sizes["T"], sizes["C"]
    if B * T * C:
        _kernel("position_embedding_backward")(
            (ceil_div(T * C, THREADS_PER_BLOCK),), (THREADS_PER_BLOCK,),
            (dwpe, dout, np.int32(B), np.int32(T), np.int32(C)))


# ---- unchecked internals ----

def _output(operation, out, sizes, dtype=FLOAT32):
    shape = tuple(sizes["..."]) + (sizes["C"],)
    if int(np.prod(shape)) > LARGEST_INT:
        raise ValueError(f"{operation}: the output would have shape {shape}, more than {LARGEST_INT} elements")
    return output(operation, out, shape, dtype=dtype)


def _check_ids(operation, ids, V):
    """ValueError unless every id is in [0, V). On a GPU this waits for the ids and reads two numbers back,
    which a CUDA graph's capture cannot do: skipped then (the kernels still never leave the table)."""
    if ids.size == 0 or is_current_stream_capturing():
        return
    smallest, largest = int(ids.min()), int(ids.max())
    if smallest >= 0 and largest < V:
        return
    bad = smallest if smallest < 0 else largest
    where = tuple(int(i) for i in np.argwhere(backend.asnumpy(ids) == bad)[0])
    raise ValueError(f"{operation}: ids must be in [0, {V}) (the rows of the table), but ids{list(where)} = {bad}")


def _check_positions(operation, sizes):
    if sizes["T"] > sizes["positions"]:
        raise ValueError(f"{operation}: T = {sizes['T']} positions, but the position table has only "
                         f"{sizes['positions']} rows")


def _padding(operation, padding_idx, V):
    if padding_idx is None:
        return NO_PADDING
    if isinstance(padding_idx, bool) or not isinstance(padding_idx, (int, np.integer)) or not 0 <= padding_idx < V:
        raise ValueError(f"{operation}: padding_idx must be None or an int in [0, {V}), got {padding_idx!r}")
    return int(padding_idx)


def _lookup(out, ids, table, positions, T, V, C):
    """out = table[ids] (+ positions[t] when positions is given), four columns per thread when it can (float32
    out); a bf16 out takes embedding_forward<__nv_bfloat16>, one element per thread."""
    N = ids.size
    if N * C == 0:
        return
    name = "embedding_forward" if positions is None else "token_position_embedding_forward"
    tables = (table,) if positions is None else (table, positions)
    sizes = (np.int32(N),) if positions is None else (np.int32(N), np.int32(T))
    if out.dtype == FLOAT32 and row_width(C, out, *tables) == 4:
        kernel, threads = _kernel(name + "_float4"), N * C // 4
    elif positions is None:
        kernel, threads = _kernel(f"{name}<{storage_c_type(out.dtype)}>"), N * C
    else:
        kernel, threads = _kernel(name), N * C
    kernel((ceil_div(threads, THREADS_PER_BLOCK),), (THREADS_PER_BLOCK,),
           (out, ids, *tables, *sizes, np.int32(V), np.int32(C)))


def group_positions(ids, V, padding=NO_PADDING):
    """The positions grouped by id: (starts, grouped), int32 arrays of V + 1 and N entries.

    The positions n with ids[n] = v are grouped[starts[v] : starts[v + 1]], in increasing order; ids outside
    [0, V) and the padding id are left out, so starts[V] positions are grouped and the rest of grouped is
    unused. A counting sort in four launches (kernels/embedding.cu), on the device, with no host copy.
    """
    xp = backend.xp
    N = ids.size
    counts_and_starts = xp.zeros(2 * (V + 1), dtype=xp.int32)  # one allocation, one memset
    counts, starts = counts_and_starts[:V + 1], counts_and_starts[V + 1:]
    unordered_and_grouped = xp.empty(2 * N, dtype=xp.int32)
    unordered, grouped = unordered_and_grouped[:N], unordered_and_grouped[N:]
    if N == 0:
        return starts, grouped  # no positions: every group empty
    per_position = ((ceil_div(N, THREADS_PER_BLOCK),), (THREADS_PER_BLOCK,))
    sizes = (np.int32(N), np.int32(V), np.int32(padding))
    _kernel("embedding_count_ids")(*per_position, (counts, ids, *sizes))
    _kernel("embedding_group_starts")((1,), (SCAN_THREADS,), (starts, counts, np.int32(V)))
    _kernel("embedding_place_positions")(*per_position, (unordered, counts, starts, ids, *sizes))
    _kernel("embedding_order_groups")(*per_position, (grouped, unordered, starts, ids, np.int32(V)))
    return starts, grouped


def sum_groups(dweight, dout, ids, starts, grouped, V, C):
    """dweight[v] += the rows of dout at grouped[starts[v] : starts[v + 1]], for N * C > 0.

    Warps sum chunks of POSITIONS_PER_CHUNK grouped positions in order; the pieces of a group longer than a
    chunk are then added chunk after chunk. The order of every addition depends on the ids alone.
    """
    N = ids.size
    warps_per_block = THREADS_PER_BLOCK // WARP_SIZE
    chunks = ceil_div(N, POSITIONS_PER_CHUNK)
    partials = backend.xp.empty((2 * chunks, C), dtype=np.float32)
    grid = (ceil_div(chunks, warps_per_block), ceil_div(C, COLUMNS_PER_WARP))
    _kernel(f"embedding_backward_chunks<{storage_c_type(dout.dtype)}>")(
        grid, (THREADS_PER_BLOCK,), (dweight, partials, dout, grouped, starts, ids, np.int32(V), np.int32(C)))
    _kernel("embedding_backward_long_groups")(
        grid, (THREADS_PER_BLOCK,), (dweight, partials, grouped, starts, ids, np.int32(V), np.int32(C)))


def _scatter_grouped(dweight, dout, ids, V, C, padding):
    if ids.size * C == 0:
        return
    starts, grouped = group_positions(ids, V, padding)
    sum_groups(dweight, dout, ids, starts, grouped, V, C)
