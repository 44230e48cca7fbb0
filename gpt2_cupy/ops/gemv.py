"""Products of a few rows with a Linear layer's weight, y = x Wᵀ (+ b), read at the memory's speed (generation).

    y = gemv_forward(x, weight, bias=None, out=None, residual=None, *, gated=False)

x (..., K) with at most MAX_ROWS rows in all (the leading axes flattened), float32 or bf16; weight (N, K),
float32 or bf16, either with either; bias (N,) float32 or None; y (..., N) in x's dtype (a bf16 y rounded once
from its float32 sum). residual (..., N) in x's dtype, or None: y = residual + (x Wᵀ + b), with the bits of the
product followed by an add (the product rounded to y's dtype, then the sum), one launch instead of two.
gated: the weight's rows are two matrices, gate (the first N / 2) and up (the rest), and y (..., N / 2) =
silu(x W_gateᵀ) * (x W_upᵀ), Llama's SwiGLU, with the bits of the two products then swiglu_forward.
Generating a token at batch 1 multiplies one row by every matrix of the model: the whole cost is reading the
weights once, which this kernel does with 16-byte loads (evict-first from L2: read once, they leave it to what
is read again) and enough of them in flight to keep the memory busy (kernels/gemv.cu). gpt2_cupy.dispatch
routes few-row products with a bf16 weight here.

    y, normed = gemv_rmsnorm_forward(x, weight, norm_weight, bias=None, residual=None, *, eps=1e-6)

The same product, and normed = RMSNorm(y) * norm_weight over y's last axis (norm_weight (N,), float32 or bf16;
normed in y's dtype) by the launch's last block, with the bits of rmsnorm_forward(y, norm_weight, eps=eps): in
generation the norm after each residual product (o_proj then post_attention_layernorm, down_proj then the next
layer's input_layernorm) without a launch of its own. Rows too long for one block's warps (more than
NORM_MOST_COLUMNS) take rmsnorm_forward after the product instead, the same bits.

    q_heads = gemv_rope_store(x, weight, keys, values, n_heads, *, theta=10000.0, start=0, interleaved=False)

Generation's q, k, v product, then rope_store_new_positions (gpt2_cupy.ops.rope) of its output, in one launch:
x (B, n, K), weight the q, k and v weights' rows (H + 2 H_kv) D side by side; q returned as (B, H, n, D), k and v
written into the cache at start .. start + n - 1. Each block computes pairs of channels that RoPE turns together
and stores them itself: the bits of gemv_forward followed by rope_store_new_positions. A block holds at most 4
warps an output; where gemv_forward would take 8 (N < 4 WARPS_PER_MULTIPROCESSOR multiprocessors, no Llama's
q, k, v), the two kernels run.
"""

import math

import numpy as np

from gpt2_cupy import backend, kernels
from gpt2_cupy.elementwise import elementwise
from gpt2_cupy.ops.arrays import (BFLOAT16, WARP_SIZE, ceil_div, check, counters, float4_aligned, output,
                                  storage_c_type, storage_dtype)
from gpt2_cupy.ops.rmsnorm import FLOATS_PER_THREAD, rmsnorm_forward, row_layout
from gpt2_cupy.ops.rope import inverse_frequencies, new_positions_arguments, rope_store_new_positions

MAX_ROWS = 8                      # the kernel's limit: its ROWS template instances
ROW_CHOICES = (1, 2, 4, 8)        # the kernel's ROWS template instances: the smallest that holds the rows
WARPS_PER_BLOCK = 8               # kernels/gemv.cu's GEMV_WARPS
WARPS_PER_OUTPUT = (1, 2, 4, 8)
# Several warps share each output row when there are fewer outputs than WARPS_PER_MULTIPROCESSOR warps per
# multiprocessor, or when a row is longer than WARP_ROW_BYTES: more warps per row than that only add blocks and
# partial sums (bench/design_choices.json; bench/llama_generation.py --gemv and --settings measure them).
WARPS_PER_MULTIPROCESSOR = 16
WARP_ROW_BYTES = 8192
# gemv_rmsnorm_forward: the last block's 8 warps hold a row of at most this many columns in registers, 16 a
# thread (rmsnorm's row layout): Llama 3.2 1B's 2048 channels take 4 warps, Llama 2 7B's 4096 all 8.
NORM_MOST_COLUMNS = WARPS_PER_BLOCK * WARP_SIZE * FLOATS_PER_THREAD


def gemv_forward(x, weight, bias=None, out=None, residual=None, *, gated=False):
    """y = x Wᵀ + b (+ residual) for x of at most MAX_ROWS rows, SwiGLU of the two halves when gated. Returns y
    (..., N), or (..., N / 2) when gated; or out."""
    return _gemv("gemv_forward", x, weight, bias, out, residual, gated)


def gemv_rmsnorm_forward(x, weight, norm_weight, bias=None, residual=None, *, eps=1e-6, out=None, norm_out=None):
    """gemv_forward's y (gated=False) and normed = RMSNorm(y) * norm_weight over y's last axis, the bits of
    rmsnorm_forward(y, norm_weight, eps=eps)[0]: the norm in the product's last block. Returns (y, normed)."""
    return _gemv("gemv_rmsnorm_forward", x, weight, bias, out, residual, False,
                 norm=(norm_weight, float(eps), norm_out))


def _gemv(name, x, weight, bias, out, residual, gated, norm=None):
    """The checks and the launch of both; norm: None, or (norm_weight, eps, norm_out), then (y, normed)."""
    x_dtype, weight_dtype = storage_dtype(name, "x", x), storage_dtype(name, "weight", weight)
    sizes = check(name, x=(x, ("...", "K"), x_dtype), weight=(weight, ("N", "K"), weight_dtype),
                  bias=(bias, ("N",)))
    row_count, N, K = math.prod(sizes["..."]), sizes["N"], sizes["K"]
    if gated and (N % 2 or residual is not None):
        raise ValueError(f"{name}: gated=True takes a weight of an even number of rows, gate then up (got {N}), "
                         "and no residual")
    outputs = N // 2 if gated else N
    check(name, residual=(residual, sizes["..."] + (outputs,), x_dtype))
    _check_rows(name, row_count)
    out = output(name, out, sizes["..."] + (outputs,), dtype=x_dtype)
    normed = None
    if norm is not None:
        norm_weight, eps, norm_out = norm
        check(name, norm_weight=(norm_weight, (outputs,), storage_dtype(name, "norm_weight", norm_weight)))
        normed = output(name, norm_out, out.shape, dtype=x_dtype)
        if K == 0 or out.size == 0 or outputs > NORM_MOST_COLUMNS:   # the norm as a kernel of its own
            _gemv(name, x, weight, bias, out, residual, gated)
            if out.size:
                rmsnorm_forward(out, norm_weight, eps=eps, out=normed)
            return out, normed
    if out.size == 0:
        return out
    if K == 0:
        if gated:
            raise ValueError(f"{name}: K = 0 with gated=True: SwiGLU of empty products is not worth a launch")
        backend.fill_zero(out)   # an empty sum: the bias alone
        if bias is not None:
            elementwise("bias_add", "a + b", [out, bias], out_dtype=x_dtype, out=out)
        if residual is not None:
            elementwise("residual_add", "a + b", [out, residual], compute_dtype=x_dtype, out=out)
        return out
    # Gated blocks hold gate and up rows of the same outputs: at least two outputs per block.
    warps_per_output = min(_warps_per_output(N, K * weight.itemsize), WARPS_PER_BLOCK // 2 if gated else WARPS_PER_BLOCK)
    template = _load_template(row_count, K, x, weight) + ["true" if gated else "false"]
    norm_arguments = (0, 0, np.float32(0))
    if normed is not None:
        norm_width, norm_k, norm_warps = row_layout(name, outputs, (out, normed, norm_weight))
        template += [str(norm_warps), str(norm_width), str(norm_k), storage_c_type(norm_weight.dtype)]
        norm_arguments = (norm_weight, counters(1), np.float32(eps))
    kernel_name = f"gemv<{', '.join(template)}>"
    outputs_per_block = WARPS_PER_BLOCK // warps_per_output
    blocks = ceil_div(outputs, outputs_per_block // 2) if gated else ceil_div(N, outputs_per_block)
    norm_weight_argument, counters_argument, eps_argument = norm_arguments
    backend.launch_dependent(
        kernels.function("gemv", kernel_name, name_expressions=(kernel_name,)), (blocks,), (WARPS_PER_BLOCK * WARP_SIZE,),
        (out, 0 if normed is None else normed, x, weight, 0 if bias is None else bias,
         0 if residual is None else residual, norm_weight_argument, counters_argument, np.int32(row_count),
         np.int32(N), np.int32(K), np.int32(warps_per_output), eps_argument))
    return out if normed is None else (out, normed)


def gemv_rope_store(x, weight, keys, values, n_heads, *, theta=10000.0, start=0, interleaved=False):
    """The q, k, v product of the new positions x (B, n, K) and rope_store_new_positions of it, one launch; returns
    q (B, H, n, D). weight bf16 (or float32); x, keys and values of one storage dtype. start: an int or an int32
    device array of one element (a captured decode step)."""
    name = "gemv_rope_store"
    x_dtype, weight_dtype = storage_dtype(name, "x", x), storage_dtype(name, "weight", weight)
    sizes = check(name, x=(x, ("B", "n", "K"), x_dtype), weight=(weight, ("N", "K"), weight_dtype))
    B, n, N, K = sizes["B"], sizes["n"], sizes["N"], sizes["K"]
    H_kv, D, capacity, device_start = new_positions_arguments(name, B, n, N, keys, values, n_heads, theta, start,
                                                              x_dtype)
    _check_rows(name, B * n)
    # A block holds both channels of its pairs: at least two outputs per block, at most 4 warps an output. Where
    # gemv_forward would give an output 8 (its sums in another order), and for empty products, the two kernels.
    warps_per_output = _warps_per_output(N, K * weight.itemsize)
    if warps_per_output > WARPS_PER_BLOCK // 2 or B * n * N == 0 or K == 0:
        return rope_store_new_positions(gemv_forward(x, weight), keys, values, n_heads, theta=theta,
                                        start=device_start, interleaved=interleaved)
    q_heads = backend.xp.empty((B, n_heads, n, D), dtype=x_dtype)
    kernel_name = f"gemv_rope_store<{', '.join(_load_template(B * n, K, x, weight))}>"
    pairs_per_block = WARPS_PER_BLOCK // warps_per_output // 2
    backend.launch_dependent(
        kernels.function("gemv", kernel_name, name_expressions=(kernel_name,)), (ceil_div(N // 2, pairs_per_block),),
        (WARPS_PER_BLOCK * WARP_SIZE,),
        (q_heads, keys, values, x, weight, inverse_frequencies(D, theta), device_start, np.int32(B * n),
         np.int32(N), np.int32(K), np.int32(warps_per_output), np.int32(n), np.int32(n_heads), np.int32(H_kv),
         np.int32(D), np.int32(capacity), np.int32(bool(interleaved))))
    return q_heads


def _check_rows(name, rows):
    if rows > MAX_ROWS:
        raise ValueError(f"{name}: x has {rows} rows; the kernel takes at most {MAX_ROWS} (more rows are the tiled "
                         "matmul's work: gpt2_cupy.dispatch.linear_forward)")


def _load_template(rows, K, x, weight):
    """The template arguments every GEMV kernel starts with: its ROWS (the ROW_CHOICES instance for `rows`),
    elements per load, and the weight's and x's storage types."""
    rows_template = next(r for r in ROW_CHOICES if r >= rows)
    width = _elements_per_load(weight.dtype, K, x, weight)
    return [str(rows_template), str(width), storage_c_type(weight.dtype), storage_c_type(x.dtype)]


def _elements_per_load(weight_dtype, K, *arrays):
    """16 bytes of weight per load (8 bf16 or 4 floats) when every row of every array starts on 16 bytes
    (K a multiple of the group, arrays 16-byte aligned); one element otherwise."""
    wide = 8 if weight_dtype == BFLOAT16 else 4
    return wide if K % wide == 0 and float4_aligned(*arrays) else 1


def _warps_per_output(N, row_bytes):
    """The fewest warps per output row that give WARPS_PER_MULTIPROCESSOR warps per multiprocessor in all and
    at most WARP_ROW_BYTES of a weight row per warp."""
    wanted_warps = WARPS_PER_MULTIPROCESSOR * backend.multiprocessor_count()
    return next((w for w in WARPS_PER_OUTPUT if N * w >= wanted_warps and row_bytes <= w * WARP_ROW_BYTES),
                WARPS_PER_OUTPUT[-1])

