"""Causal self-attention on float32 heads, forward and backward (chapter 08).

    out, lse = attention_forward(q, k, v, causal=True, variant="softmax")
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, causal=True, variant="softmax", deterministic=True)

q, k, v: (..., T, d), any leading axes (GPT-2: (B, H, T, d)), d = 32 or 64. The scores are S = q kᵀ / √d;
causal=True lets query t see keys 0..t.
    variant="softmax":  out = softmax(S) v; lse, the log-sum-exp of each row of S, (..., T), is saved for
                        the backward.
    variant="relu":     out = ReLU(S) v on the visible keys, no normalisation; lse is None.

These are the fused kernels (kernels/attention.cu): S and P = softmax(S) are never written to memory, so
the only memory beyond the inputs and outputs is lse and the backward's row sums, O(T) per head. The
backward recomputes P from lse. deterministic=True (the default): dk and dv come from one kernel, dq from a
second, each element summed by one thread in a fixed order (no atomics): the same bits on every run.
deterministic=False: one pass, the dk, dv kernel also adds each tile's share of dq with atomicAdd: fewer
products (5 instead of 7), but dq's last bits vary from run to run. Each kernel takes 64 or 128 rows
(queries, or keys for dk, dv) per block, a template parameter; FORWARD_ROWS, BACKWARD_DK_DV_ROWS and
BACKWARD_DQ_ROWS say which the op launches, and bench/attention.py times both.

attention_forward_naive / attention_backward_naive compute the same thing from chapter 01's batched
matmul and chapter 04's softmax, writing the (..., T, T) scores and probabilities: the version the fused
one is measured against, and a second, independent check of it.
"""

import math

import numpy as np

from gpt2_cupy import backend, kernels
from gpt2_cupy.ops.arrays import LARGEST_GRID_Y, THREADS_PER_BLOCK, ceil_div, check, output
from gpt2_cupy.ops.matmul import batched_matmul
from gpt2_cupy.ops.softmax import softmax_backward, softmax_forward

TILE = 64                  # keys (or queries) per tile of columns: kernels/attention.cu's COLUMNS
ROW_CHOICES = (64, 128)    # rows per block, a template parameter of every kernel (ROWS)
# The rows per block that each kernel uses, chosen by timing bench/attention.py's candidates on an H100:
FORWARD_ROWS = 64
BACKWARD_DK_DV_ROWS = 64
BACKWARD_DQ_ROWS = 64
PAD = 4                    # floats of padding after each row of a q, k, v or dout tile in shared memory
WEIGHTS_PAD = 8            # and after each row of a P or dS tile
FLOAT = 4                  # bytes
HEAD_SIZES = (32, 64)      # d, a template parameter of the kernels
VARIANTS = ("softmax", "relu")
ROWDOT_ROWS_PER_BLOCK = 16      # a half-warp per row: 256 threads


def threads(rows):
    """Threads per block for `rows` rows: rows / 4 row groups x 8 column groups (THREADS_FOR in attention.cu)."""
    return rows // 4 * 8


# The tiles each kernel keeps in shared memory, in rows of d + PAD floats (its ROWS-row tiles, its 64-row
# tiles) and in rows of TILE + WEIGHTS_PAD floats (its ROWS-row tiles of P or dS).
_TILES = {"attention_forward": (1, 2, 1), "attention_backward_dk_dv": (2, 2, 1), "attention_backward_dq": (2, 2, 1)}


def _shared_bytes(name, d, rows, dq_atomic=False):
    row_tiles, column_tiles, weight_tiles = _TILES[name]
    transposed = TILE * (rows + PAD) if dq_atomic else 0  # the one-pass backward's dS tile, rows = queries
    return ((row_tiles * rows + column_tiles * TILE) * (d + PAD) + weight_tiles * rows * (TILE + WEIGHTS_PAD)
            + transposed) * FLOAT


def _kernel(name, d, variant, rows, dq_atomic=None):
    """(kernel, bytes of shared memory it needs): one module per instantiation, so that a run compiles
    only the versions it uses. dq_atomic: the dk, dv kernel's fourth template parameter."""
    full_name = f"{name}<{d}, {'true' if variant == 'relu' else 'false'}, {rows}"
    full_name += ">" if dq_atomic is None else f", {'true' if dq_atomic else 'false'}>"
    kernel = kernels.function("attention", full_name, name_expressions=(full_name,))
    shared = _shared_bytes(name, d, rows, bool(dq_atomic))
    if kernel.max_dynamic_shared_size_bytes < shared:
        # Beyond 48 KB a kernel must ask for its dynamic shared memory before its first launch.
        kernel.max_dynamic_shared_size_bytes = shared
    return kernel, shared


def _check_options(operation, variant, d):
    if variant not in VARIANTS:
        raise ValueError(f"{operation}: variant must be one of {VARIANTS}, got {variant!r}")
    if d not in HEAD_SIZES:
        raise ValueError(f"{operation}: the head size d (the last axis of q, k, v) must be one of {HEAD_SIZES}, "
                         f"got {d}")


def _heads_and_tiles(operation, sizes):
    heads, T = math.prod(sizes["..."]), sizes["T"]
    if ceil_div(T, TILE) > LARGEST_GRID_Y:
        raise ValueError(f"{operation}: T = {T} is too long for one launch (at most {LARGEST_GRID_Y * TILE})")
    return heads, T


def attention_forward(q, k, v, *, causal=True, variant="softmax", out=None):
    """(out, lse): attention of queries q over keys k and values v, all (..., T, d); lse is None for "relu"."""
    name = "attention_forward"
    sizes = check(name, q=(q, ("...", "T", "d")), k=(k, ("...", "T", "d")), v=(v, ("...", "T", "d")))
    _check_options(name, variant, sizes["d"])
    heads, T = _heads_and_tiles(name, sizes)
    out = output(name, out, q.shape)
    lse = backend.xp.empty(q.shape[:-1], dtype=np.float32) if variant == "softmax" else None
    _forward(out, lse, q, k, v, heads, T, sizes["d"], causal, variant)
    return out, lse


def _forward(out, lse, q, k, v, heads, T, d, causal, variant, rows=FORWARD_ROWS):
    if heads * T == 0:
        return
    # The ReLU variant has no lse: the kernel never touches that pointer, so out stands in for it.
    kernel, shared = _kernel("attention_forward", d, variant, rows)
    kernel((heads, ceil_div(T, rows)), (threads(rows),),
           (out, lse if lse is not None else out, q, k, v, np.int32(T), np.int32(bool(causal))), shared_mem=shared)


def attention_backward(dout, q, k, v, out, lse, *, causal=True, variant="softmax", deterministic=True):
    """(dq, dk, dv): the gradients of q, k, v, given dout = dL/dout and the forward's out and lse.

    deterministic=False takes the one-pass backward (dq added with atomics): faster, not bit-reproducible."""
    name = "attention_backward"
    pattern = ("...", "T", "d")
    sizes = check(name, dout=(dout, pattern), q=(q, pattern), k=(k, pattern), v=(v, pattern), out=(out, pattern),
                  lse=(lse, ("...", "T")))
    _check_options(name, variant, sizes["d"])
    if variant == "softmax" and lse is None:
        raise ValueError(f"{name}: the softmax variant needs the lse that attention_forward returned")
    heads, T = _heads_and_tiles(name, sizes)
    dq, dk, dv = (backend.xp.empty(q.shape, dtype=np.float32) for _ in range(3))
    rowdot = backend.xp.empty(q.shape[:-1], dtype=np.float32) if variant == "softmax" else None
    _backward(dq, dk, dv, rowdot, dout, q, k, v, out, lse, heads, T, sizes["d"], causal, variant, deterministic)
    return dq, dk, dv


def _backward(dq, dk, dv, rowdot, dout, q, k, v, out, lse, heads, T, d, causal, variant, deterministic=True):
    if heads * T == 0:
        return
    if variant == "softmax":
        _rowdot(rowdot, dout, out, heads * T, d)
    else:  # the ReLU kernels never read lse or rowdot: dout stands in for both pointers
        lse = rowdot = dout
    if deterministic:
        _dk_dv(dk, dv, dout, q, k, v, lse, rowdot, heads, T, d, causal, variant)
        _dq(dq, dout, q, k, v, lse, rowdot, heads, T, d, causal, variant)
    else:
        # The one-pass kernel adds into dq, which starts from zeros. They are written after rowdot, just
        # before that kernel: the zeros then wait in the L2 for its atomics, where written before rowdot they
        # are pushed out to memory while rowdot reads dout and out.
        dq.fill(0)
        _dk_dv(dk, dv, dout, q, k, v, lse, rowdot, heads, T, d, causal, variant, rows=TILE, dq=dq)


# The backward's three launches, each its own function so that bench/attention.py can time them apart
# (and each kernel with either number of rows per block).

def _rowdot(rowdot, dout, out, rows, d):
    kernels.function("attention", "attention_backward_rowdot")(
        (ceil_div(rows, ROWDOT_ROWS_PER_BLOCK),), (ROWDOT_ROWS_PER_BLOCK * 16,),
        (rowdot, dout, out, np.int32(rows), np.int32(d)))


def _dk_dv(dk, dv, dout, q, k, v, lse, rowdot, heads, T, d, causal, variant, rows=BACKWARD_DK_DV_ROWS, dq=None):
    """dk, dv; given dq (zeros, and rows = TILE), also dq, added into it with atomics (the one-pass backward)."""
    kernel, shared = _kernel("attention_backward_dk_dv", d, variant, rows, dq_atomic=dq is not None)
    kernel((heads, ceil_div(T, rows)), (threads(rows),),
           (dk, dv, dk if dq is None else dq, dout, q, k, v, lse, rowdot, np.int32(T),
            np.int32(bool(causal))), shared_mem=shared)


def _dq(dq, dout, q, k, v, lse, rowdot, heads, T, d, causal, variant, rows=BACKWARD_DQ_ROWS):
    kernel, shared = _kernel("attention_backward_dq", d, variant, rows)
    kernel((heads, ceil_div(T, rows)), (threads(rows),),
           (dq, dout, q, k, v, lse, rowdot, np.int32(T), np.int32(bool(causal))), shared_mem=shared)


# ---- The naive version: scores and probabilities written out, (..., T, T) each ----

def _three_axes(array):
    """The (heads, rows, columns) view of a (..., rows, columns) array, for batched_matmul."""
    return array.reshape(-1, *array.shape[-2:])


def attention_forward_naive(q, k, v, *, causal=True, variant="softmax"):
    """(out, p): the same result as attention_forward, and the probabilities P, (..., T, T), it wrote."""
    name = "attention_forward_naive"
    sizes = check(name, q=(q, ("...", "T", "d")), k=(k, ("...", "T", "d")), v=(v, ("...", "T", "d")))
    _check_options(name, variant, sizes["d"])
    T, scale = sizes["T"], 1.0 / math.sqrt(sizes["d"])
    scores = batched_matmul(_three_axes(q), _three_axes(k), transpose_b=True)    # q kᵀ, not yet scaled
    if variant == "softmax":
        p = softmax_forward(scores, scale=scale, causal=causal, out=scores)       # in place: S is not needed again
    else:
        p = scores
        n = p.size
        if n:
            kernels.function("steps/attention_relu_naive", "relu_scores_forward")(
                (ceil_div(n, THREADS_PER_BLOCK),), (THREADS_PER_BLOCK,),
                (p, scores, np.int32(n), np.int32(T), np.float32(scale), np.int32(bool(causal))))
    out = batched_matmul(p, _three_axes(v))
    return out.reshape(q.shape), p.reshape(*q.shape[:-1], T)


def attention_backward_naive(dout, q, k, v, p, *, variant="softmax"):
    """(dq, dk, dv) from the graph of the naive forward, given its probabilities p (masked ones are 0)."""
    name = "attention_backward_naive"
    pattern = ("...", "T", "d")
    sizes = check(name, dout=(dout, pattern), q=(q, pattern), k=(k, pattern), v=(v, pattern),
                  p=(p, ("...", "T", "T")))
    _check_options(name, variant, sizes["d"])
    scale = 1.0 / math.sqrt(sizes["d"])
    dout3, q3, k3, v3, p3 = (_three_axes(a) for a in (dout, q, k, v, p))
    dv = batched_matmul(p3, dout3, transpose_a=True)          # dV = Pᵀ dO
    dp = batched_matmul(dout3, v3, transpose_b=True)          # dP = dO Vᵀ, (..., T, T)
    if variant == "softmax":
        ds = softmax_backward(dp, p3, scale=scale, out=dp)    # dS = scale P ⊙ (dP - rowsum(dP ⊙ P)), in place
    else:
        ds, n = dp, dp.size
        if n:
            kernels.function("steps/attention_relu_naive", "relu_scores_backward")(
                (ceil_div(n, THREADS_PER_BLOCK),), (THREADS_PER_BLOCK,),
                (ds, dp, p3, np.int32(n), np.float32(scale)))
    dq = batched_matmul(ds, k3)                               # dQ = dS K   (the scale is already in dS)
    dk = batched_matmul(ds, q3, transpose_a=True)             # dK = dSᵀ Q
    return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)
