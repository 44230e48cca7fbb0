"""Attention on tensor cores in bf16, TF32 or 3xTF32, forward and backward, with grouped-query attention.

    out, lse = tensor_core_attention_forward(q, k, v, causal=True, scale=None, out=None, precision=None)
    dq, dk, dv = tensor_core_attention_backward(dout, q, k, v, out, lse, causal=True, scale=None, precision=None)

q, out, dout, dq: (B, H, T, d); k, v, dk, dv: (B, H_kv, T, d), with H a multiple of H_kv: query head h
reads key/value head h // (H // H_kv) (grouped-query attention; H_kv = H is multi-head attention, H_kv = 1
multi-query), and no copy of K and V is made per query head. All of them one dtype, ml_dtypes.bfloat16 or
float32, backend arrays of any strides whose rows (the last axis) are contiguous: the kernels read and
write them where they lie, as PyTorch's flash attention does. So q, k, v can be the (B, H, T, d) views of
one (B, T, 3 H d) product's output, and out is made as a (B, T, H d) array seen as (B, H, T, d): heads side
by side again, as the next product reads them. dq, dk, dv are laid out as q, k, v are
(arrays.empty_like_views). lse: (B, H, T) float32, C-contiguous, the log-sum-exp of each row of the scaled
scores, which the backward needs. d = 32, 64 or 128. S = scale q kᵀ with scale = 1/√d unless given
(PyTorch's scaled_dot_product_attention's default); causal=True lets query t see keys 0..t; out = softmax(S) v.

What is rounded (kernels/tensor_core_attention.cu, FlashAttention-2's scheme): the products run on tensor
cores with float32 sums, the softmax in float32. precision says how float32 inputs are multiplied, with
gpt2_cupy.set_float32_matmul_precision's names (the op does not read that setting: None is "high"):
  - bf16 inputs, whatever the precision: P, and dS in the backward, are rounded to bf16 as the next
    product's input; every output is rounded to bf16 once, at the end.
  - float32, precision "high" or None (TF32): the tensor cores read q, k, v and dout as TF32 (a float's upper
    19 bits, rounded toward zero); P and dS are rounded to TF32 to nearest; the outputs are float32.
  - float32, precision "highest" (3xTF32): every operand of every product, P and dS included, is split into
    big = x rounded to TF32 and small = the rest rounded to TF32, and each product is small·big + big·small
    + big·big, each 16-wide step's products summed from zero and added to the running sum in float32. The
    outputs are float32, as accurate as chapter 08's float32 kernels make them, for three times TF32's tensor
    work (bench/design_choices.json: 'precision: "highest" attention keeps chapter 08's kernels').
  - float32, precision "medium" is a ValueError: bf16 products take bf16 inputs (F.scaled_dot_product_attention
    converts float32 ones at set_float32_matmul_precision("medium")).
dk and dv of a key/value head are summed over the query heads of its group in float32 before they are stored.

The backward is deterministic, as gpt2_cupy.ops.attention's default: a small kernel forms
row_dot = rowsum(dout ⊙ out); then one pass computes dk, dv (a block per tile of keys, looping over the
queries of every head of the group) and another dq (a block per tile of queries, looping over keys). No
atomics: the same bits on every run.

Each kernel takes its format and shape as template parameters: warps per block, the tile of the other axis
a block takes at a time, and strips per warp: a warp owns 16 rows (queries, or keys in the dk, dv pass) per
strip, and each fragment of the other axis it reads from shared memory serves all its strips, so two strips
read half the shared memory per multiply, for twice the registers. FORWARD_TILES, DK_DV_TILES and DQ_TILES
say what the op launches for each format and d; bench/tensor_core_attention.py times other candidates
through the same launchers.
"""

import math

import numpy
from ml_dtypes import bfloat16

from gpt2_cupy import backend, kernels
from gpt2_cupy.elementwise import copy
from gpt2_cupy.ops.arrays import (LARGEST_GRID_Y, ceil_div, check, check_views, empty_heads_side_by_side,
                                  empty_like_views, float4_aligned, head_layout, heads_readable)
from gpt2_cupy.precision import PRECISIONS

HEAD_SIZES = (32, 64, 128)
ELEMENT = {numpy.dtype(bfloat16): "bfloat16", numpy.dtype(numpy.float32): "float"}   # the kernels' Element
DTYPES = tuple(ELEMENT)
# The kernels' formats (their Format template argument) and the Element each stores: bf16; float32 as TF32
# ("float"), or as 3xTF32 ("Tf32x3"); and which of the float32 ones each precision runs.
FORMAT_ELEMENT = {"bfloat16": "bfloat16", "float": "float", "Tf32x3": "float"}
FLOAT32_FORMAT = {None: "float", "high": "float", "highest": "Tf32x3"}
ROW_PADDING = 8                 # elements after each row of a shared tile (Fragments<Element>::PADDING)
FLOAT = 4                       # bytes
ROWS_PER_STRIP = 16             # rows of a strip: one A fragment of mma.sync
ROW_DOT_THREADS = 256           # per block of the row_dot kernel
ROW_DOT_GROUP = 8               # elements of a row per row_dot lane: d / 8 lanes a row
ROW_ALIGNMENT_BYTES = 16        # every row of every tensor must start on 16 bytes (cp.async's copies)
# (warps per block, keys per tile, strips of 16 queries per warp) of the forward and of the dq pass; (warps
# per block, queries per tile, strips of 16 keys per warp) of the dk, dv pass, for each format and d: the
# fastest of TILE_CANDIDATES measured by bench/tensor_core_attention.py on an H100 at GPT-2's shape (d = 64,
# taken for d = 32 too) and Llama's (d = 128, grouped heads). Two strips pay where a pass reads the most
# shared memory per product: the dk, dv pass, whose four products all read Q or dO from shared memory. The
# forward keeps its queries in registers and runs faster with one strip: two take 244 registers a thread, so
# that an SM holds 8 warps instead of 12 to hide the latencies of the softmax between the products
# (bench/design_choices.json, "tensor_core_attention: strips per warp"). At d = 128
# the sums of two strips take more registers than a thread has (they spill), except in bf16's dq pass.
# TF32's fragments take twice the registers of bf16's, and its tiles twice the shared memory; 3xTF32 reads
# TF32's tiles and fragments and splits them in each step, and at d = 128 takes all 255 registers a thread
# has, whatever the shape.
FORWARD_TILES = {"bfloat16": {32: (4, 64, 1), 64: (4, 64, 1), 128: (4, 32, 1)},
                 "float": {32: (4, 32, 1), 64: (4, 32, 1), 128: (8, 64, 1)},
                 "Tf32x3": {32: (4, 32, 1), 64: (4, 32, 1), 128: (4, 32, 1)}}
DK_DV_TILES = {"bfloat16": {32: (4, 32, 2), 64: (4, 32, 2), 128: (4, 64, 1)},
               "float": {32: (4, 16, 2), 64: (4, 16, 2), 128: (8, 32, 1)},
               "Tf32x3": {32: (4, 16, 2), 64: (4, 16, 2), 128: (8, 32, 1)}}
DQ_TILES = {"bfloat16": {32: (4, 64, 1), 64: (4, 64, 1), 128: (4, 32, 2)},
            "float": {32: (4, 32, 2), 64: (4, 32, 2), 128: (8, 32, 1)},
            "Tf32x3": {32: (4, 32, 1), 64: (4, 32, 1), 128: (8, 32, 1)}}
# The shapes bench/tensor_core_attention.py times for each kernel (and tests check), the ones above among them.
TILE_CANDIDATES = {"forward": ((4, 32, 1), (4, 64, 1), (8, 64, 1), (8, 128, 1), (4, 32, 2), (4, 64, 2), (8, 64, 2)),
                   "dk_dv": ((4, 32, 1), (4, 64, 1), (8, 32, 1), (8, 64, 1), (4, 16, 2), (4, 32, 2), (8, 16, 2)),
                   "dq": ((4, 32, 1), (4, 64, 1), (8, 32, 1), (8, 64, 1), (4, 32, 2), (4, 64, 2), (8, 32, 2))}


def _tile_bytes(d, element_bytes):
    """Bytes of one padded row of a shared tile."""
    return (d + ROW_PADDING) * element_bytes


def _block_rows(warps, strips):
    """Rows a block owns: queries (forward, dq) or keys (dk, dv)."""
    return ROWS_PER_STRIP * strips * warps


def forward_shared_bytes(d, warps, keys, strips, element_bytes=2):
    """The forward's dynamic shared memory: the query tile and two stages of K and of V."""
    return (_block_rows(warps, strips) + 4 * keys) * _tile_bytes(d, element_bytes)


def dk_dv_shared_bytes(d, warps, queries, strips, element_bytes=2):
    """The dk, dv pass's: the K and V tiles, two stages of Q and dO, two of lse and of row_dot."""
    return (2 * _block_rows(warps, strips) + 4 * queries) * _tile_bytes(d, element_bytes) + 4 * queries * FLOAT


def dq_shared_bytes(d, warps, keys, strips, element_bytes=2):
    """The dq pass's: the Q and dO tiles and two stages of K and of V."""
    return (2 * _block_rows(warps, strips) + 4 * keys) * _tile_bytes(d, element_bytes)


def _kernel(name, fmt, d, warps, tile, strips, shared):
    """One instantiation of a kernel template, its dynamic shared memory allowed (one module each, so that a
    run compiles only the versions it uses). fmt: a key of FORMAT_ELEMENT; the kernel's Format argument is
    left to its default, Element, where the two are the same."""
    element = FORMAT_ELEMENT[fmt]
    full_name = f"{name}<{element}, {d}, {warps}, {tile}, {strips}{'' if fmt == element else ', ' + fmt}>"
    kernel = kernels.function("tensor_core_attention", full_name, name_expressions=(full_name,))
    if kernel.max_dynamic_shared_size_bytes < shared:
        # Beyond 48 KB a kernel must ask for its dynamic shared memory before its first launch.
        kernel.max_dynamic_shared_size_bytes = shared
    return kernel


def _dtype(operation, q):
    """q's dtype, which every other tensor of the op shares: bf16 or float32."""
    dtype = getattr(q, "dtype", None)
    if dtype not in DTYPES:
        raise TypeError(f"{operation}: q has dtype {dtype}; it must be bfloat16 or float32 (k, v and the "
                        "gradients the same)")
    return numpy.dtype(dtype)


def _format(operation, dtype, precision):
    """The kernels' format for inputs of dtype at precision (see the module's doc)."""
    if precision is not None and precision not in PRECISIONS:
        raise ValueError(f"{operation}: precision must be one of {PRECISIONS} or None, got {precision!r}")
    if dtype == numpy.dtype(bfloat16):
        return "bfloat16"
    if precision == "medium":
        raise ValueError(f"{operation}: precision 'medium' multiplies in bf16, which takes bfloat16 inputs: convert "
                         "q, k, v to bfloat16 first (float32 ones run in TF32 at 'high', 3xTF32 at 'highest')")
    return FLOAT32_FORMAT[precision]


def _sizes(operation, q, k, v, others=()):
    """(B, H, H_kv, T, d) after checking q, k, v and others ((name, array, pattern, dtype) each, dtype None
    for q's; lse and row_dot C-contiguous, the others of any layout)."""
    pattern, kv_pattern = ("B", "H", "T", "d"), ("B", "H_kv", "T", "d")
    dtype = _dtype(operation, q)
    arrays = {"q": (q, pattern, dtype), "k": (k, kv_pattern, dtype), "v": (v, kv_pattern, dtype)}
    arrays.update({name: (array, shape, dtype if kind is None else kind) for name, array, shape, kind in others})
    check(operation, **{name: arrays[name] for name, _, _, kind in others if kind is not None})  # contiguous
    sizes = check_views(operation, **arrays)
    B, H, H_kv, T, d = (sizes[name] for name in ("B", "H", "H_kv", "T", "d"))
    if d not in HEAD_SIZES:
        raise ValueError(f"{operation}: the head size d (the last axis of q, k, v) must be one of {HEAD_SIZES}, "
                         f"got {d}")
    if (H_kv == 0 and H > 0) or (H_kv > 0 and H % H_kv != 0):
        raise ValueError(f"{operation}: q has H = {H} heads and k, v have H_kv = {H_kv}: H must be a multiple of "
                         "H_kv (each key/value head serves H // H_kv query heads)")
    if ceil_div(T, ROWS_PER_STRIP) > LARGEST_GRID_Y:
        raise ValueError(f"{operation}: T = {T} is too long for one launch (at most {LARGEST_GRID_Y * ROWS_PER_STRIP})")
    unaligned = [name for name, (array, _, _) in arrays.items() if array is not None and not float4_aligned(array)]
    if unaligned:
        raise ValueError(f"{operation}: {', '.join(unaligned)} must start on a 16-byte boundary (the kernels copy "
                         "16 bytes at a time); a view into the middle of an array may not: pass a fresh copy")
    return B, H, H_kv, T, d


def _readable(array):
    """array itself when the kernels can read it where it lies (its rows contiguous, each starting on 16 bytes,
    in an array that is C-contiguous itself), else a C-contiguous copy."""
    return array if heads_readable(array, ROW_ALIGNMENT_BYTES) else copy("tensor_core_attention_input", array)


def _scale(scale, d):
    return numpy.float32(1.0 / math.sqrt(d) if scale is None else scale)


def tensor_core_attention_forward(q, k, v, causal=True, scale=None, out=None, precision=None):
    """(out, lse): attention of q (B, H, T, d) over k, v (B, H_kv, T, d), bf16 or float32, out of their dtype;
    lse (B, H, T) float32. out, when given, may be a view of any layout the kernels can write (rows contiguous
    and 16-byte aligned). precision, for float32 inputs: "high" or None (TF32 products) or "highest" (3xTF32);
    bf16 inputs ignore it."""
    name = "tensor_core_attention_forward"
    B, H, H_kv, T, d = _sizes(name, q, k, v, [("out", out, ("B", "H", "T", "d"), None)])
    fmt = _format(name, q.dtype, precision)
    q, k, v = (_readable(x) for x in (q, k, v))
    if out is None:
        out = empty_heads_side_by_side((B, H, T, d), q.dtype)
    elif _readable(out) is not out:
        raise ValueError(f"{name}: out (strides {out.strides}) must have contiguous rows that start on 16 bytes")
    lse = backend.xp.empty((B, H, T), dtype=numpy.float32)
    if q.size:
        _forward(out, lse, q, k, v, causal, _scale(scale, d), *FORWARD_TILES[fmt][d], fmt)
    return out, lse


def tensor_core_attention_backward(dout, q, k, v, out, lse, causal=True, scale=None, precision=None):
    """(dq, dk, dv) in the shapes and dtype of q, k, v: the gradients given dout = dL/dout and the forward's out
    and lse, with the same causal and scale; precision, for float32 inputs, as the forward's: "high" or None
    (TF32) or "highest" (3xTF32)."""
    name = "tensor_core_attention_backward"
    pattern = ("B", "H", "T", "d")
    B, H, H_kv, T, d = _sizes(name, q, k, v, [("dout", dout, pattern, None), ("out", out, pattern, None),
                                             ("lse", lse, ("B", "H", "T"), numpy.float32)])
    fmt = _format(name, q.dtype, precision)
    dout, q, k, v, out = (_readable(x) for x in (dout, q, k, v, out))
    dq, dk, dv = empty_like_views(q, k, v)
    if q.size:
        row_dot = backend.xp.empty((B, H, T), dtype=numpy.float32)
        scale = _scale(scale, d)
        _row_dot(row_dot, dout, out)
        _dk_dv(dk, dv, dout, q, k, v, lse, row_dot, causal, scale, *DK_DV_TILES[fmt][d], fmt)
        _dq(dq, dout, q, k, v, lse, row_dot, causal, scale, *DQ_TILES[fmt][d], fmt)
    return dq, dk, dv


# ---- launchers: unchecked, each kernel with any shape, for the op above and for bench/tensor_core_attention.py ----
# fmt: a key of FORMAT_ELEMENT that stores the arrays' dtype; None for the dtype's own (float32: TF32).

def _head_sizes(q, k):
    """(B H, H, H_kv, T, d) of checked (B, H, T, d) queries and (B, H_kv, T, d) keys."""
    B, H, T, d = q.shape
    return B * H, H, k.shape[1], T, d


def _forward(out, lse, q, k, v, causal, scale, warps, keys, strips, fmt=None):
    heads, H, H_kv, T, d = _head_sizes(q, k)
    shared = forward_shared_bytes(d, warps, keys, strips, q.itemsize)
    kernel = _kernel("tensor_core_attention_forward", fmt or ELEMENT[q.dtype], d, warps, keys, strips, shared)
    (out, out_at), (q, q_at), (k, k_at), (v, v_at) = (head_layout(x) for x in (out, q, k, v))
    kernel((heads, ceil_div(T, _block_rows(warps, strips))), (32 * warps,),
           (out, lse, q, k, v, numpy.int32(T), numpy.int32(H), numpy.int32(H_kv), numpy.float32(scale),
            numpy.int32(bool(causal)), out_at, q_at, k_at, v_at), shared_mem=shared)


def _row_dot(row_dot, dout, out):
    rows, (_, H, T, d) = row_dot.size, dout.shape
    name = f"tensor_core_attention_row_dot<{ELEMENT[dout.dtype]}>"
    (dout, dout_at), (out, out_at) = head_layout(dout), head_layout(out)
    kernels.function("tensor_core_attention", name, name_expressions=(name,))(
        (ceil_div(rows * (d // ROW_DOT_GROUP), ROW_DOT_THREADS),), (ROW_DOT_THREADS,),
        (row_dot, dout, out, numpy.int32(rows), numpy.int32(d), numpy.int32(T), numpy.int32(H), dout_at, out_at))


def _dk_dv(dk, dv, dout, q, k, v, lse, row_dot, causal, scale, warps, queries, strips, fmt=None):
    heads, H, H_kv, T, d = _head_sizes(q, k)
    shared = dk_dv_shared_bytes(d, warps, queries, strips, q.itemsize)
    kernel = _kernel("tensor_core_attention_backward_dk_dv", fmt or ELEMENT[q.dtype], d, warps, queries, strips,
                     shared)
    (dk, dk_at), (dv, dv_at), (dout, dout_at), (q, q_at), (k, k_at), (v, v_at) = (
        head_layout(x) for x in (dk, dv, dout, q, k, v))
    kernel((heads // H * H_kv, ceil_div(T, _block_rows(warps, strips))), (32 * warps,),
           (dk, dv, dout, q, k, v, lse, row_dot, numpy.int32(T), numpy.int32(H), numpy.int32(H_kv),
            numpy.float32(scale), numpy.int32(bool(causal)), dk_at, dv_at, dout_at, q_at, k_at, v_at),
           shared_mem=shared)


def _dq(dq, dout, q, k, v, lse, row_dot, causal, scale, warps, keys, strips, fmt=None):
    heads, H, H_kv, T, d = _head_sizes(q, k)
    shared = dq_shared_bytes(d, warps, keys, strips, q.itemsize)
    kernel = _kernel("tensor_core_attention_backward_dq", fmt or ELEMENT[q.dtype], d, warps, keys, strips, shared)
    (dq, dq_at), (dout, dout_at), (q, q_at), (k, k_at), (v, v_at) = (head_layout(x) for x in (dq, dout, q, k, v))
    kernel((heads, ceil_div(T, _block_rows(warps, strips))), (32 * warps,),
           (dq, dout, q, k, v, lse, row_dot, numpy.int32(T), numpy.int32(H), numpy.int32(H_kv),
            numpy.float32(scale), numpy.int32(bool(causal)), dq_at, dout_at, q_at, k_at, v_at), shared_mem=shared)
