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
every run: positions are sorted by (id, position), and one warp sums each id's rows in that order. A
padding_idx, when given, receives no gradient. The sort allocates two arrays of N int64 per call.

The kernels are kernels/embedding.cu, taught in chapters/06_embedding.ipynb.
"""

import numpy as np

from gpt2_cupy import backend, kernels
from gpt2_cupy.ops.arrays import LARGEST_INT, THREADS_PER_BLOCK, ceil_div, check, output

WARP_SIZE = 32
COLUMNS_PER_WARP = 128  # the backward's warps each cover 128 columns (kernels/embedding.cu)
NO_PADDING = -1


def embedding_forward(ids, weight, *, out=None, check_ids=True):
    """weight[ids]: ids int32 of any shape (...), weight (V, C) float32; returns (..., C)."""
    sizes = check("embedding_forward", ids=(ids, ("...",), np.int32), weight=(weight, ("V", "C")))
    out = _output("embedding_forward", out, sizes)
    if check_ids:
        _check_ids("embedding_forward", ids, sizes["V"])
    _lookup(out, ids, weight, None, 1, sizes["V"], sizes["C"])
    return out


def embedding_backward(dout, ids, *, dweight, padding_idx=None, check_ids=True):
    """dweight[ids[n]] += dout[n] for every position n (rows of padding_idx excepted); returns None."""
    sizes = check("embedding_backward", dout=(dout, ("...", "C")), ids=(ids, ("...",), np.int32),
                  dweight=(dweight, ("V", "C")))
    padding = _padding("embedding_backward", padding_idx, sizes["V"])
    if check_ids:
        _check_ids("embedding_backward", ids, sizes["V"])
    _scatter_sorted(dweight, dout, ids, sizes["V"], sizes["C"], padding)


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
    _scatter_sorted(dwte, dout, ids, sizes["V"], sizes["C"], padding)
    B, T, C = sizes["B"], sizes["T"], sizes["C"]
    if B * T * C:
        kernels.function("embedding", "position_embedding_backward")(
            (ceil_div(T * C, THREADS_PER_BLOCK),), (THREADS_PER_BLOCK,),
            (dwpe, dout, np.int32(B), np.int32(T), np.int32(C)))


# ---- unchecked internals ----

def _output(operation, out, sizes):
    shape = tuple(sizes["..."]) + (sizes["C"],)
    if int(np.prod(shape)) > LARGEST_INT:
        raise ValueError(f"{operation}: the output would have shape {shape}, more than {LARGEST_INT} elements")
    return output(operation, out, shape)


def _check_ids(operation, ids, V):
    """ValueError unless every id is in [0, V). On a GPU this waits for the ids and reads two numbers back."""
    if ids.size == 0:
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


def _aligned(*arrays):
    return all(backend.address(array) % 16 == 0 for array in arrays)


def _lookup(out, ids, table, positions, T, V, C):
    """out = table[ids] (+ positions[t] when positions is given), four columns per thread when it can."""
    N = ids.size
    if N * C == 0:
        return
    name = "embedding_forward" if positions is None else "token_position_embedding_forward"
    tables = (table,) if positions is None else (table, positions)
    sizes = (np.int32(N),) if positions is None else (np.int32(N), np.int32(T))
    if C % 4 == 0 and _aligned(out, *tables):
        kernel, threads = kernels.function("embedding", name + "_float4"), N * C // 4
    else:
        kernel, threads = kernels.function("embedding", name), N * C
    kernel((ceil_div(threads, THREADS_PER_BLOCK),), (THREADS_PER_BLOCK,),
           (out, ids, *tables, *sizes, np.int32(V), np.int32(C)))


def sorted_position_keys(ids):
    """The keys id * N + position of every position, sorted: each id's positions next to each other, in order.

    The keys are all different, so any sort gives the same array (no stable sort needed).
    """
    xp = backend.xp
    N = ids.size
    keys = ids.reshape(-1).astype(xp.int64) * N + xp.arange(N, dtype=xp.int64)
    keys.sort()
    return keys


def _scatter_sorted(dweight, dout, ids, V, C, padding):
    N = ids.size
    if N * C == 0:
        return
    keys = sorted_position_keys(ids)
    warps_per_block = THREADS_PER_BLOCK // WARP_SIZE
    kernels.function("embedding", "embedding_backward_sorted")(
        (ceil_div(N, warps_per_block), ceil_div(C, COLUMNS_PER_WARP)), (THREADS_PER_BLOCK,),
        (dweight, dout, keys, np.int32(N), np.int32(V), np.int32(C), np.int32(padding)))
