"""Attention on tensor cores in bf16, forward and backward, with grouped-query attention.

    out, lse = tensor_core_attention_forward(q, k, v, causal=True, scale=None, out=None)
    dq, dk, dv = tensor_core_attention_backward(dout, q, k, v, out, lse, causal=True, scale=None)

q, out, dout, dq: (B, H, T, d); k, v, dk, dv: (B, H_kv, T, d), with H a multiple of H_kv: query head h
reads key/value head h // (H // H_kv) (grouped-query attention; H_kv = H is multi-head attention, H_kv = 1
multi-query), and no copy of K and V is made per query head. All of them ml_dtypes.bfloat16, C-contiguous
backend arrays; lse: (B, H, T) float32, the log-sum-exp of each row of the scaled scores, which the
backward needs. d = 32, 64 or 128. S = scale q kᵀ with scale = 1/√d unless given (PyTorch's
scaled_dot_product_attention's default); causal=True lets query t see keys 0..t; out = softmax(S) v.

What is rounded (kernels/tensor_core_attention.cu, FlashAttention-2's scheme): the products run on tensor
cores with bf16 inputs and float32 sums, the softmax in float32; P, and dS in the backward, are rounded
to bf16 as the next product's input; every output is rounded to bf16 once, at the end. dk and dv of a
key/value head are summed over the query heads of its group in float32 before that rounding.

The backward is deterministic, as gpt2_cupy.ops.attention's default: a small kernel forms
row_dot = rowsum(dout ⊙ out); then one pass computes dk, dv (a block per tile of keys, looping over the
queries of every head of the group) and another dq (a block per tile of queries, looping over keys). No
atomics: the same bits on every run.

Each kernel takes its shape as template parameters: warps per block (a warp owns 16 rows: queries, or
keys in the dk, dv pass) and the tile of the other axis a block takes at a time. FORWARD_TILES,
DK_DV_TILES and DQ_TILES say what the op launches for each d; bench/tensor_core_attention.py times other
candidates through the same launchers.
"""

import math

import numpy
from ml_dtypes import bfloat16

from gpt2_cupy import backend, kernels
from gpt2_cupy.ops.arrays import LARGEST_GRID_Y, ceil_div, check, float4_aligned, output

HEAD_SIZES = (32, 64, 128)
# Multiply-adds (B·H·T²·d) below which F.scaled_dot_product_attention keeps bf16 attention on chapter 08's
# float32 kernels: that small, it is bound by its launches on a GPU, and the CPU executor runs it faster.
SMALL_ATTENTION = 1 << 24
ROW_PADDING = 8                 # bf16 after each row of a shared tile (ROW_PADDING in the kernel file)
BF16, FLOAT = 2, 4              # bytes
ROWS_PER_WARP = 16
ROW_DOT_WARPS = 8               # rows (a warp each) per block of the row_dot kernel
# (warps per block, keys per tile) of the forward and of the dq pass; (warps per block, queries per tile)
# of the dk, dv pass: the fastest of TILE_CANDIDATES measured by bench/tensor_core_attention.py on an H200
# at GPT-2's shape (d = 64) and Llama's (d = 128, grouped heads). The dk, dv pass holds two 16 x d sums, d
# registers per lane, besides the tile's two 16 x tile products (tile / 4 registers each), so dq takes
# half the tile at d = 128, to leave room for its fragments of Q and dO.
FORWARD_TILES = {32: (4, 64), 64: (4, 64), 128: (8, 128)}
DK_DV_TILES = {32: (4, 32), 64: (4, 32), 128: (4, 64)}
DQ_TILES = {32: (4, 64), 64: (4, 64), 128: (4, 32)}
# The shapes bench/tensor_core_attention.py times for each kernel (and tests check), the ones above among them.
TILE_CANDIDATES = {"forward": ((4, 64), (8, 64), (4, 128), (8, 128)),
                   "dk_dv": ((4, 32), (4, 64), (8, 32), (8, 64)),
                   "dq": ((4, 32), (4, 64), (8, 32), (8, 64))}


def forward_shared_bytes(d, warps, keys):
    """The forward's dynamic shared memory: the query tile and two stages of K and of V."""
    return (ROWS_PER_WARP * warps + 4 * keys) * (d + ROW_PADDING) * BF16


def dk_dv_shared_bytes(d, warps, queries):
    """The dk, dv pass's: the K and V tiles, two stages of Q and dO, two of lse and of row_dot."""
    return (2 * ROWS_PER_WARP * warps + 4 * queries) * (d + ROW_PADDING) * BF16 + 4 * queries * FLOAT


def dq_shared_bytes(d, warps, keys):
    """The dq pass's: the Q and dO tiles and two stages of K and of V."""
    return (2 * ROWS_PER_WARP * warps + 4 * keys) * (d + ROW_PADDING) * BF16


def _kernel(name, d, warps, tile, shared):
    """One instantiation of a kernel template, its dynamic shared memory allowed (one module each, so that a
    run compiles only the versions it uses)."""
    full_name = f"{name}<{d}, {warps}, {tile}>"
    kernel = kernels.function("tensor_core_attention", full_name, name_expressions=(full_name,))
    if kernel.max_dynamic_shared_size_bytes < shared:
        # Beyond 48 KB a kernel must ask for its dynamic shared memory before its first launch.
        kernel.max_dynamic_shared_size_bytes = shared
    return kernel


def _sizes(operation, q, k, v, others=()):
    """(B, H, H_kv, T, d) after checking q, k, v and others ((name, array, pattern, dtype) each)."""
    pattern, kv_pattern = ("B", "H", "T", "d"), ("B", "H_kv", "T", "d")
    arrays = {"q": (q, pattern, bfloat16), "k": (k, kv_pattern, bfloat16), "v": (v, kv_pattern, bfloat16)}
    arrays.update({name: (array, shape, dtype) for name, array, shape, dtype in others})
    sizes = check(operation, **arrays)
    B, H, H_kv, T, d = (sizes[name] for name in ("B", "H", "H_kv", "T", "d"))
    if d not in HEAD_SIZES:
        raise ValueError(f"{operation}: the head size d (the last axis of q, k, v) must be one of {HEAD_SIZES}, "
                         f"got {d}")
    if (H_kv == 0 and H > 0) or (H_kv > 0 and H % H_kv != 0):
        raise ValueError(f"{operation}: q has H = {H} heads and k, v have H_kv = {H_kv}: H must be a multiple of "
                         "H_kv (each key/value head serves H // H_kv query heads)")
    if ceil_div(T, ROWS_PER_WARP) > LARGEST_GRID_Y:
        raise ValueError(f"{operation}: T = {T} is too long for one launch (at most {LARGEST_GRID_Y * ROWS_PER_WARP})")
    unaligned = [name for name, (array, _, _) in arrays.items() if array is not None and not float4_aligned(array)]
    if unaligned:
        raise ValueError(f"{operation}: {', '.join(unaligned)} must start on a 16-byte boundary (the kernels copy "
                         "16 bytes at a time); a view into the middle of an array may not: pass a fresh copy")
    return B, H, H_kv, T, d


def _scale(scale, d):
    return numpy.float32(1.0 / math.sqrt(d) if scale is None else scale)


def tensor_core_attention_forward(q, k, v, causal=True, scale=None, out=None):
    """(out, lse): attention of q (B, H, T, d) over k, v (B, H_kv, T, d), bf16; lse (B, H, T) float32."""
    name = "tensor_core_attention_forward"
    B, H, H_kv, T, d = _sizes(name, q, k, v)
    out = output(name, out, q.shape, dtype=bfloat16)
    lse = backend.xp.empty((B, H, T), dtype=numpy.float32)
    if q.size:
        _forward(out, lse, q, k, v, causal, _scale(scale, d), *FORWARD_TILES[d])
    return out, lse


def tensor_core_attention_backward(dout, q, k, v, out, lse, causal=True, scale=None):
    """(dq, dk, dv), bf16 in the shapes of q, k, v: the gradients given dout = dL/dout and the forward's out
    and lse, with the same causal and scale."""
    name = "tensor_core_attention_backward"
    pattern = ("B", "H", "T", "d")
    B, H, H_kv, T, d = _sizes(name, q, k, v, [("dout", dout, pattern, bfloat16), ("out", out, pattern, bfloat16),
                                             ("lse", lse, ("B", "H", "T"), numpy.float32)])
    xp = backend.xp
    dq, dk, dv = xp.empty(q.shape, dtype=bfloat16), xp.empty(k.shape, dtype=bfloat16), xp.empty(v.shape, dtype=bfloat16)
    if q.size:
        row_dot = xp.empty((B, H, T), dtype=numpy.float32)
        scale = _scale(scale, d)
        _row_dot(row_dot, dout, out)
        _dk_dv(dk, dv, dout, q, k, v, lse, row_dot, causal, scale, *DK_DV_TILES[d])
        _dq(dq, dout, q, k, v, lse, row_dot, causal, scale, *DQ_TILES[d])
    return dq, dk, dv


# ---- launchers: unchecked, each kernel with any shape, for the op above and for bench/tensor_core_attention.py ----

def _head_sizes(q, k):
    """(B H, H, H_kv, T, d) of checked (B, H, T, d) queries and (B, H_kv, T, d) keys."""
    B, H, T, d = q.shape
    return B * H, H, k.shape[1], T, d


def _forward(out, lse, q, k, v, causal, scale, warps, keys):
    heads, H, H_kv, T, d = _head_sizes(q, k)
    shared = forward_shared_bytes(d, warps, keys)
    kernel = _kernel("tensor_core_attention_forward", d, warps, keys, shared)
    kernel((heads, ceil_div(T, ROWS_PER_WARP * warps)), (32 * warps,),
           (out, lse, q, k, v, numpy.int32(T), numpy.int32(H), numpy.int32(H_kv), numpy.float32(scale),
            numpy.int32(bool(causal))), shared_mem=shared)


def _row_dot(row_dot, dout, out):
    rows, d = row_dot.size, dout.shape[-1]
    kernels.function("tensor_core_attention", "tensor_core_attention_row_dot")(
        (ceil_div(rows, ROW_DOT_WARPS),), (32 * ROW_DOT_WARPS,),
        (row_dot, dout, out, numpy.int32(rows), numpy.int32(d)))


def _dk_dv(dk, dv, dout, q, k, v, lse, row_dot, causal, scale, warps, queries):
    heads, H, H_kv, T, d = _head_sizes(q, k)
    shared = dk_dv_shared_bytes(d, warps, queries)
    kernel = _kernel("tensor_core_attention_backward_dk_dv", d, warps, queries, shared)
    kernel((heads // H * H_kv, ceil_div(T, ROWS_PER_WARP * warps)), (32 * warps,),
           (dk, dv, dout, q, k, v, lse, row_dot, numpy.int32(T), numpy.int32(H), numpy.int32(H_kv),
            numpy.float32(scale), numpy.int32(bool(causal))), shared_mem=shared)


def _dq(dq, dout, q, k, v, lse, row_dot, causal, scale, warps, keys):
    heads, H, H_kv, T, d = _head_sizes(q, k)
    shared = dq_shared_bytes(d, warps, keys)
    kernel = _kernel("tensor_core_attention_backward_dq", d, warps, keys, shared)
    kernel((heads, ceil_div(T, ROWS_PER_WARP * warps)), (32 * warps,),
           (dq, dout, q, k, v, lse, row_dot, numpy.int32(T), numpy.int32(H), numpy.int32(H_kv),
            numpy.float32(scale), numpy.int32(bool(causal))), shared_mem=shared)
