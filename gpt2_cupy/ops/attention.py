"""Causal self-attention on float32 heads, forward and backward (chapter 08).

    out, lse = attention_forward(q, k, v, causal=True, variant="softmax")
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, causal=True, variant="softmax", deterministic=True)
    out, lse = attention_forward(q, k, v, causal=False, scale=0.1, attn_mask=mask, dropout_p=0.1, rng_state=state)
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, causal=False, scale=0.1, attn_mask=mask,
                                    dropout_p=0.1, rng_state=state)

q: (..., H, T, d), any leading axes (GPT-2: (B, H, T, d)), or (T, d) for one head; k, v: the same shape, or,
for grouped-query attention, (..., H_kv, T, d) with H_kv dividing H: query head h reads key and value head
h // (H / H_kv), with no copy per query head, and dk, dv sum over the H / H_kv query heads of each group.
q, k, v, dout and out may be views of any layout whose rows (the last axis) are contiguous: the kernels read
and write heads where they lie (kernels/include/head_layout.cuh), so q, k, v cut by split and transpose from
one (B, T, 3 H d) product's output need no copy. out is made as a (..., T, H, d) array seen as (..., H, T, d):
its heads side by side, as the next product reads them. dq, dk, dv are laid out as q, k, v are
(arrays.empty_like_views): split from one array, their gradients make one array too. Where d is a multiple of
4 the kernels move float4s, and a view whose rows do not all start on 16 bytes is copied first.
d: any head size from 1 to 256 (HEAD_SIZES). The scores are S = q kᵀ / √d; causal=True lets query t see
keys 0..t.
    variant="softmax":  out = softmax(S) v; lse, the log-sum-exp of each row of S, (..., H, T), is saved for
                        the backward.
    variant="relu":     out = ReLU(S) v on the visible keys, no normalisation; lse is None.

PyTorch's scaled_dot_product_attention options (softmax only), which run the kernels' _general versions:
    scale:      S = scale q kᵀ, any float (None: 1/√d);
    attn_mask:  a bool array (True: the key takes part) or a float32 one added to S, broadcastable to the
                scores (..., H, T, T): read in place through strides, 0 along the axes it broadcasts over.
                A row with every key masked gives 0 (out and gradients), as PyTorch's math backend does;
    dropout_p:  each weight P_ij dropped with probability p, the others scaled by 1/(1-p), from the Philox
                number of element (..., h, i, j) of the scores, flattened, of the stream rng_state = (seed,
                offset) (ops.dropout, chapter 07), plus dropout_start: 0 for a whole batch, the flat index of
                a rank's first weight in the global batch under data parallelism. The backward regenerates the
                mask from the same rng_state and dropout_start; the caller advances rng_state
                (advance_rng_state) after the forward.

These are the fused kernels (kernels/attention.cu): S and P = softmax(S) are never written to memory, so
the only memory beyond the inputs and outputs is lse and the backward's row sums, O(T) per head. The
backward recomputes P from lse. deterministic=True (the default): dk and dv come from one kernel, dq from a
second, each element summed by one thread in a fixed order (no atomics): the same bits on every run.
deterministic=False: one pass, the dk, dv kernel also adds each tile's share of dq with atomicAdd: fewer
products (5 instead of 7), but dq's last bits vary from run to run (at d > 128 its tiles do not fit in a
block's shared memory, and the two passes run instead). Each kernel takes 32, 64 or 128 rows (queries, or
keys for dk, dv) per block, a template parameter; FORWARD_ROWS, BACKWARD_DK_DV_ROWS and BACKWARD_DQ_ROWS
say which the op launches, and bench/attention.py times the candidates.

The kernels are built for tiles of D = 32, 64, 128 or 256 floats (TILE_WIDTHS); a head of d floats runs in
the narrowest tile that holds it, its columns d..D-1 zeros inside the kernel (d = 80 runs as 128).

attention_forward_naive / attention_backward_naive compute the same thing from chapter 01's batched
matmul and chapter 04's softmax, writing the (..., T, T) scores and probabilities: the version the fused
one is measured against, and a second, independent check of it (one key head per query head).
"""

import math

import numpy as np

from gpt2_cupy import backend, kernels
from gpt2_cupy.elementwise import copy
from gpt2_cupy.ops.arrays import (LARGEST_GRID_Y, THREADS_PER_BLOCK, ceil_div, check, check_views,
                                  empty_heads_side_by_side, empty_like_views, head_layout, heads_readable, output,
                                  storage_of)
from gpt2_cupy.ops.matmul import batched_matmul
from gpt2_cupy.ops.softmax import softmax_backward, softmax_forward

TILE = 64                  # keys (or queries) per tile of columns: kernels/attention.cu's COLUMNS
ROW_CHOICES = (64, 128)    # rows per block, a template parameter of every kernel (ROWS), timed at d = 64
# The rows per block that each kernel uses, chosen by timing bench/attention.py's candidates on an H100:
FORWARD_ROWS = 64
BACKWARD_DK_DV_ROWS = 64
BACKWARD_DQ_ROWS = 64
NARROW_ROWS = 32           # rows per block where a kernel's tiles at ROWS = 64 do not fit (the backward at D = 256)
PAD = 4                    # floats of padding after each row of a q, k, v or dout tile in shared memory
WEIGHTS_PAD = 8            # and after each row of a P or dS tile
FLOAT = 4                  # bytes
FLOAT4 = 16                # bytes: where d is a multiple of 4, every row must start on a multiple of this
TILE_WIDTHS = (32, 64, 128, 256)                   # D, a template parameter of the kernels
HEAD_SIZES = range(1, TILE_WIDTHS[-1] + 1)         # d: any head size that fits in a tile
SHARED_BYTES_PER_BLOCK = 227 * 1024                # the most shared memory one block may have (H100, H200)
VARIANTS = ("softmax", "relu")
ROWDOT_ROWS_PER_BLOCK = 16      # a half-warp per row: 256 threads


def threads(rows):
    """Threads per block for `rows` rows: rows / 4 row groups x 8 column groups (THREADS_FOR in attention.cu)."""
    return rows // 4 * 8


def tile_width(d):
    """D, the narrowest tile that holds a head of d floats."""
    return next(width for width in TILE_WIDTHS if width >= d)


# The tiles each kernel keeps in shared memory, in rows of D + PAD floats (its ROWS-row tiles, its 64-row
# tiles) and in rows of TILE + WEIGHTS_PAD floats (its ROWS-row tiles of P or dS).
_TILES = {"attention_forward": (1, 2, 1), "attention_backward_dk_dv": (2, 2, 1), "attention_backward_dq": (2, 2, 1)}


def _shared_bytes(name, width, rows, dq_atomic=False):
    row_tiles, column_tiles, weight_tiles = _TILES[name]
    transposed = TILE * (rows + PAD) if dq_atomic else 0  # the one-pass backward's dS tile, rows = queries
    return ((row_tiles * rows + column_tiles * TILE) * (width + PAD) + weight_tiles * rows * (TILE + WEIGHTS_PAD)
            + transposed) * FLOAT


def _fits(name, width, rows, dq_atomic=False):
    return _shared_bytes(name, width, rows, dq_atomic) <= SHARED_BYTES_PER_BLOCK


def _rows(name, width, rows):
    """`rows` where the kernel's tiles fit in a block's shared memory with them, else NARROW_ROWS."""
    return rows if _fits(name, width, rows) else NARROW_ROWS


def _kernel(name, width, variant, rows, dq_atomic=None, options=None):
    """(kernel, bytes of shared memory it needs): one module per instantiation, so that a run compiles
    only the versions it uses. dq_atomic: the dk, dv kernel's fourth template parameter. options (a
    ScoreOptions): the kernel's _general version, its mask type and dropout flag as template parameters."""
    atomic = "" if dq_atomic is None else f", {'true' if dq_atomic else 'false'}"
    if options is None:
        full_name = f"{name}<{width}, {'true' if variant == 'relu' else 'false'}, {rows}{atomic}>"
    else:
        full_name = f"{name}_general<{width}, {rows}{atomic}, {options.template_arguments}>"
    kernel = kernels.function("attention", full_name, name_expressions=(full_name,))
    shared = _shared_bytes(name, width, rows, bool(dq_atomic))
    if kernel.max_dynamic_shared_size_bytes < shared:
        # Beyond 48 KB a kernel must ask for its dynamic shared memory before its first launch.
        kernel.max_dynamic_shared_size_bytes = shared
    return kernel, shared


def _check_variant(operation, variant):
    if variant not in VARIANTS:
        raise ValueError(f"{operation}: variant must be one of {VARIANTS}, got {variant!r}")


def _check_sizes(operation, q, k, v, like_q=None, per_row=None):
    """The sizes of q (..., H, T, d) and of k, v (..., H_kv, T, d) (or all (T, d)), checked: the same leading
    axes, T and d, H_kv dividing H, d in HEAD_SIZES. like_q: {name: array} of q's shape (the backward's dout,
    out); per_row: {name: array} of one value per row of q (lse)."""
    if q.ndim >= 3:
        queries, keys = ("...", "H", "T", "d"), ("...", "H_kv", "T", "d")
    else:
        queries = keys = ("T", "d")
    rows = {name: (array, queries[:-1]) for name, array in (per_row or {}).items()}
    check(operation, **rows)  # C-contiguous
    sizes = check_views(operation, q=(q, queries), k=(k, keys), v=(v, keys),
                        **{name: (array, queries) for name, array in (like_q or {}).items()}, **rows)
    sizes.setdefault("...", ())
    heads, key_heads = sizes.setdefault("H", 1), sizes.setdefault("H_kv", 1)
    if heads % key_heads:
        raise ValueError(f"{operation}: k and v have {key_heads} heads (shape {tuple(k.shape)}), which does not "
                         f"divide q's {heads} (shape {tuple(q.shape)}): in grouped-query attention each key and "
                         "value head serves the same number of query heads")
    if sizes["d"] not in HEAD_SIZES:
        raise ValueError(f"{operation}: the head size d (the last axis of q, k, v) must be from 1 to "
                         f"{HEAD_SIZES[-1]}, got {sizes['d']}")
    fewest_rows = NARROW_ROWS if tile_width(sizes["d"]) == TILE_WIDTHS[-1] else TILE  # per block, in any kernel
    if ceil_div(sizes["T"], fewest_rows) > LARGEST_GRID_Y:
        raise ValueError(f"{operation}: T = {sizes['T']} is too long for one launch (at most "
                         f"{LARGEST_GRID_Y * fewest_rows} at d = {sizes['d']})")
    return sizes


class ScoreOptions:
    """What the general kernels take beyond the plain ones (kernels/attention.cu's ScoreOptions): the scale, the
    mask and its strides, dropout's p and rng_state. ScoreOptions.of(...) is None where there is nothing."""

    @classmethod
    def of(cls, operation, sizes, variant, scale, attn_mask, dropout_p, rng_state, dropout_start=0):
        if scale is None and attn_mask is None and dropout_p == 0.0:
            return None
        if variant != "softmax":
            raise ValueError(f"{operation}: scale, attn_mask and dropout_p are for the softmax variant, got "
                             f"variant={variant!r}")
        return cls(operation, sizes, scale, attn_mask, dropout_p, rng_state, dropout_start)

    def __init__(self, operation, sizes, scale, attn_mask, dropout_p, rng_state, dropout_start=0):
        d = sizes["d"]
        if scale is None:
            scale = 1.0 / math.sqrt(d)
        if isinstance(scale, bool) or not isinstance(scale, (int, float, np.integer, np.floating)):
            raise TypeError(f"{operation}: scale must be a float or None, got {scale!r}")
        if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float, np.integer, np.floating)) \
                or not 0.0 <= dropout_p <= 1.0:
            raise ValueError(f"{operation}: dropout_p must be a probability in [0, 1], got {dropout_p!r}")
        self.dropout = dropout_p > 0.0
        if self.dropout:
            if rng_state is None:
                raise ValueError(f"{operation}: dropout_p = {dropout_p} needs an rng_state, the (seed, offset) "
                                 "device array of ops.dropout.new_rng_state")
            check(operation, rng_state=(rng_state, (2,), np.uint64))
        if isinstance(dropout_start, bool) or not isinstance(dropout_start, (int, np.integer)) \
                or not 0 <= dropout_start < 2**64:
            raise ValueError(f"{operation}: dropout_start must be an int in [0, 2**64), got {dropout_start!r}")
        self.mask, strides = _mask_and_strides(operation, attn_mask, sizes)
        mask_type = "void" if self.mask is None else "bool" if self.mask.dtype == np.bool_ else "float"
        self.template_arguments = f"{mask_type}, {'true' if self.dropout else 'false'}"
        self.arguments = (np.float32(scale), 0 if self.mask is None else self.mask, *(np.int64(s) for s in strides),
                          rng_state if self.dropout else 0, np.float32(dropout_p), np.uint64(dropout_start))


def _mask_and_strides(operation, mask, sizes):
    """(mask, its strides in elements along (batch, H, T, T)): mask C-contiguous in its own shape, broadcastable
    to the scores (..., H, T, T); a stride is 0 along an axis the mask broadcasts over. Leading axes of the
    mask that are neither all 1 nor all q's (partial broadcasting over several batch axes) are copied out."""
    if mask is None:
        return None, (0, 0, 0, 0)
    if mask.dtype != np.bool_ and mask.dtype != np.float32:
        raise TypeError(f"{operation}: attn_mask must be bool (True: take part) or float32 (added to the "
                        f"scores), got {mask.dtype}")
    T = sizes["T"]
    scores = (*sizes["..."], sizes["H"], T, T)     # _check_sizes gives (T, d) heads H = 1 and no leading axes
    if mask.ndim > len(scores) or any(m not in (1, n) for m, n in zip(mask.shape[::-1], scores[::-1])):
        raise ValueError(f"{operation}: attn_mask of shape {tuple(mask.shape)} does not broadcast to the "
                         f"scores' shape {scores} (queries, keys last)")
    mask = backend.xp.ascontiguousarray(mask).reshape((1,) * (len(scores) - mask.ndim) + tuple(mask.shape))
    if len(scores) == 3:                                                    # (H, T, T): one batch
        mask, scores = mask[None], (1, *scores)
    leading, mask_leading = scores[:-3], mask.shape[:-3]
    if any(m != 1 for m in mask_leading) and mask_leading != leading:
        mask = backend.xp.ascontiguousarray(backend.xp.broadcast_to(mask, (*leading, *mask.shape[-3:])))
    element_strides = [stride // mask.itemsize for stride in mask.strides]
    batch = element_strides[-4] if any(m != 1 for m in mask.shape[:-3]) else 0
    strides = (batch, *(stride if size != 1 else 0 for stride, size in zip(element_strides[-3:], mask.shape[-3:])))
    return mask, strides


class LaunchShape:
    """What every launch needs: query heads (all leading axes and H), T, d, and query heads per key head.
    LaunchShape.of(q, k, v) for the kernels launched directly (bench/attention.py, the tests)."""

    @classmethod
    def of(cls, q, k, v):
        return cls(_check_sizes("attention", q, k, v))

    def __init__(self, sizes):
        self.heads = math.prod(sizes["..."]) * sizes["H"]
        self.heads_per_batch = sizes["H"]
        self.T, self.d = sizes["T"], sizes["d"]
        self.group = sizes["H"] // sizes["H_kv"]
        self.key_heads = self.heads // self.group
        self.width = tile_width(self.d)

    def arguments(self, causal):
        """The kernels' arguments after the arrays: T, causal, d, group, heads (H, per batch element)."""
        return (np.int32(self.T), np.int32(bool(causal)), np.int32(self.d), np.int32(self.group),
                np.int32(self.heads_per_batch))


def _heads(array):
    """array as (B, heads, T, d), the kernels' four axes: a (T, d) or (H, T, d) array as a view with axes of 1
    in front; more than one leading axis merged into one (a view where they merge, else a copy)."""
    if array.ndim <= 4:
        return array[(None,) * (4 - array.ndim)]
    return array.reshape(-1, *array.shape[-3:])


def _readable(array):
    """(B, heads, T, d) `array` itself where the kernels read it in place, else a C-contiguous copy."""
    return array if heads_readable(array, FLOAT4 if array.shape[-1] % 4 == 0 else FLOAT) else copy(
        "attention_input", array)


def _placed(*arrays):
    """([the array holding each], [each one's HeadLayout]) for arrays the kernels can read, as they take them."""
    pairs = [head_layout(_heads(array)) for array in arrays]
    return [storage for storage, _ in pairs], [layout for _, layout in pairs]


def attention_forward(q, k, v, *, causal=True, variant="softmax", scale=None, attn_mask=None, dropout_p=0.0,
                      rng_state=None, dropout_start=0, out=None):
    """(out, lse): attention of queries q (..., H, T, d) over keys k and values v (..., H_kv, T, d);
    lse is None for "relu". scale, attn_mask, dropout_p, rng_state and dropout_start: see the module's docstring."""
    name = "attention_forward"
    _check_variant(name, variant)
    sizes = _check_sizes(name, q, k, v)
    options = ScoreOptions.of(name, sizes, variant, scale, attn_mask, dropout_p, rng_state, dropout_start)
    shape = LaunchShape(sizes)
    out = empty_heads_side_by_side(q.shape, np.float32) if out is None else output(name, out, q.shape)
    lse = backend.xp.empty(q.shape[:-1], dtype=np.float32) if variant == "softmax" else None
    # out's leading axes merge into one without a copy: made here side by side, or C-contiguous if given
    _forward(_heads(out), lse, *(_readable(_heads(x)) for x in (q, k, v)), shape, causal, variant, options=options)
    return out, lse


def _forward(out, lse, q, k, v, shape, causal, variant, rows=FORWARD_ROWS, options=None):
    if shape.heads * shape.T == 0:
        return
    # The ReLU variant has no lse: the kernel never touches that pointer, so out stands in for it.
    rows = _rows("attention_forward", shape.width, rows)
    kernel, shared = _kernel("attention_forward", shape.width, variant, rows, options=options)
    general = () if options is None else options.arguments
    (out, q, k, v), layouts = _placed(out, q, k, v)
    kernel((shape.heads, ceil_div(shape.T, rows)), (threads(rows),),
           (out, lse if lse is not None else out, q, k, v, *shape.arguments(causal), *layouts, *general),
           shared_mem=shared)


def attention_backward(dout, q, k, v, out, lse, *, causal=True, variant="softmax", scale=None, attn_mask=None,
                       dropout_p=0.0, rng_state=None, dropout_start=0, deterministic=True):
    """(dq, dk, dv): the gradients of q, k, v, given dout = dL/dout and the forward's out and lse; scale,
    attn_mask, dropout_p, rng_state and dropout_start as the forward had them (rng_state before it was
    advanced).

    deterministic=False takes the one-pass backward (dq added with atomics): faster, not bit-reproducible."""
    name = "attention_backward"
    _check_variant(name, variant)
    sizes = _check_sizes(name, q, k, v, like_q=dict(dout=dout, out=out), per_row=dict(lse=lse))
    options = ScoreOptions.of(name, sizes, variant, scale, attn_mask, dropout_p, rng_state, dropout_start)
    shape = LaunchShape(sizes)
    if variant == "softmax" and lse is None:
        raise ValueError(f"{name}: the softmax variant needs the lse that attention_forward returned")
    heads = [_heads(x) for x in (q, k, v)]
    readable = [_readable(x) for x in heads]
    if all(r is h for r, h in zip(readable, heads)):  # all read where they lie: gradients laid out alike
        gradients = empty_like_views(*heads)
    else:
        gradients = [backend.xp.empty(x.shape, dtype=np.float32) for x in heads]
    rowdot = backend.xp.empty(q.shape[:-1], dtype=np.float32) if variant == "softmax" else None
    _backward(*gradients, rowdot, _readable(_heads(dout)), *readable, _readable(_heads(out)), lse, shape, causal,
              variant, deterministic, options)
    return tuple(g if g.shape == x.shape else g.reshape(x.shape) for g, x in zip(gradients, (q, k, v)))


def one_pass_fits(width):
    """Whether the one-pass backward's tiles fit in a block's shared memory at tile width D."""
    return _fits("attention_backward_dk_dv", width, TILE, dq_atomic=True)


def _backward(dq, dk, dv, rowdot, dout, q, k, v, out, lse, shape, causal, variant, deterministic=True, options=None):
    if shape.heads * shape.T == 0:
        return
    if variant == "softmax":
        _rowdot(rowdot, dout, out, shape)
    else:  # the ReLU kernels never read lse or rowdot: dout stands in for both pointers
        lse = rowdot = storage_of(dout)
    if deterministic or not one_pass_fits(shape.width):
        _dk_dv(dk, dv, dout, q, k, v, lse, rowdot, shape, causal, variant, options=options)
        _dq(dq, dout, q, k, v, lse, rowdot, shape, causal, variant, options=options)
    else:
        # The one-pass kernel adds into dq, which starts from zeros. They are written after rowdot, just
        # before that kernel: the zeros then wait in the L2 for its atomics, where written before rowdot they
        # are pushed out to memory while rowdot reads dout and out.
        backend.fill_zero(dq)
        _dk_dv(dk, dv, dout, q, k, v, lse, rowdot, shape, causal, variant, rows=TILE, dq=dq, options=options)


# The backward's three launches, each its own function so that bench/attention.py can time them apart
# (and each kernel with either number of rows per block).

def _rowdot(rowdot, dout, out, shape):
    rows = shape.heads * shape.T
    (dout, out), layouts = _placed(dout, out)
    kernels.function("attention", "attention_backward_rowdot")(
        (ceil_div(rows, ROWDOT_ROWS_PER_BLOCK),), (ROWDOT_ROWS_PER_BLOCK * 16,),
        (rowdot, dout, out, np.int32(rows), np.int32(shape.d), np.int32(shape.T), np.int32(shape.heads_per_batch),
         *layouts))


def _dk_dv(dk, dv, dout, q, k, v, lse, rowdot, shape, causal, variant, rows=BACKWARD_DK_DV_ROWS, dq=None,
           options=None):
    """dk, dv; given dq (zeros, and rows = TILE), also dq, added into it with atomics (the one-pass backward)."""
    if dq is None:
        rows = _rows("attention_backward_dk_dv", shape.width, rows)
    kernel, shared = _kernel("attention_backward_dk_dv", shape.width, variant, rows, dq_atomic=dq is not None,
                             options=options)
    general = () if options is None else options.arguments
    (dk, dv, dq, dout, q, k, v), layouts = _placed(dk, dv, dk if dq is None else dq, dout, q, k, v)
    kernel((shape.key_heads, ceil_div(shape.T, rows)), (threads(rows),),
           (dk, dv, dq, dout, q, k, v, lse, rowdot, *shape.arguments(causal), *layouts, *general), shared_mem=shared)


def _dq(dq, dout, q, k, v, lse, rowdot, shape, causal, variant, rows=BACKWARD_DQ_ROWS, options=None):
    rows = _rows("attention_backward_dq", shape.width, rows)
    kernel, shared = _kernel("attention_backward_dq", shape.width, variant, rows, options=options)
    general = () if options is None else options.arguments
    (dq, dout, q, k, v), layouts = _placed(dq, dout, q, k, v)
    kernel((shape.heads, ceil_div(shape.T, rows)), (threads(rows),),
           (dq, dout, q, k, v, lse, rowdot, *shape.arguments(causal), *layouts, *general), shared_mem=shared)


# ---- The naive version: scores and probabilities written out, (..., T, T) each ----

def _three_axes(array):
    """The (heads, rows, columns) view of a (..., rows, columns) array, for batched_matmul."""
    return array.reshape(-1, *array.shape[-2:])


def attention_forward_naive(q, k, v, *, causal=True, variant="softmax"):
    """(out, p): the same result as attention_forward, and the probabilities P, (..., T, T), it wrote."""
    name = "attention_forward_naive"
    sizes = check(name, q=(q, ("...", "T", "d")), k=(k, ("...", "T", "d")), v=(v, ("...", "T", "d")))
    _check_variant(name, variant)
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
    _check_variant(name, variant)
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
