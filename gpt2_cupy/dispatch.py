"""Which kernel computes a product or an attention: every choice of the package, in one place.

The ops (gpt2_cupy.ops.X) each launch their own chapter's kernels; this module picks among them. The layers
(F.linear, Tensor's @, F.scaled_dot_product_attention, generation) call it. A row's condition is tested in
order, the first that holds wins; the threshold it names is a constant below, and the benchmark file holds
the measurement that chose it.

Products, out = op(a) @ op(b) (+ bias): product(), matmul(), batched_matmul(), linear_forward/backward(), and
tensor_core_matmul() (the float32 rows at its precision argument, "highest" then 3xTF32 on either kernel)

    operands              condition                                   kernel (chapter)                  bench/*.json
    bf16 weight (Linear)  at most GEMV_ROWS rows of x                 GEMV, ops.gemv (17b)              llama_generation
    bf16 a, b             fewer than SMALL_PRODUCT multiply-adds      float32 tiled, widened (01)       tensor_cores
    bf16 a, b             2-D, backend.runs_wgmma(), 16-byte rows     bf16 wgmma (15b)                  tensor_cores
    bf16 a, b             otherwise                                   bf16 mma.sync (15a)               tensor_cores
    float32, "highest"    tensor cores not emulated, 2-D, wgmma runs, 3xTF32 wgmma (15b)                tensor_cores
                          >= SMALL_PRODUCT, M, N >= MIN_COPIED_EXTENT
    float32, "highest"    otherwise                                   float32 tiled, ops.matmul (01)    matmul
    float32, "high",      2-D, wgmma runs, >= SMALL_PRODUCT, and x Wᵀ "high": TF32 wgmma; "medium":     tensor_cores
      "medium"            or M, N >= MIN_COPIED_EXTENT                bf16 copies, bf16 wgmma (15b)
    float32, "medium"     otherwise                                   bf16 mma.sync on bf16 copies (15a) tensor_cores
    float32, "high"       otherwise                                   TF32 mma.sync (15a)               tensor_cores

"highest", "high", "medium": gpt2_cupy.set_float32_matmul_precision. An empty product (M, N or K = 0) fills
out with zeros (or keeps it, with accumulate) whatever the row. A bias is added in the product's store where the
kernel takes one (wgmma's and the bf16 kernels), else by chapter 02's bias_add after it.

Attention, softmax(q kᵀ · scale + mask) v: attention()

    inputs                condition                                   kernels (chapter)                 bench/*.json
    bf16 q, k, v; float32 no mask, no dropout, T = S, d in            tensor cores,                     tensor_core_
      at "high"/"medium"  TENSOR_CORE_HEAD_SIZES, at least            ops.tensor_core_attention (16b)   attention
                          TENSOR_CORE_ATTENTION multiply-adds
    other bf16            any                                         the rows below, in float32
    float32               T = S, d in FUSED_HEAD_SIZES, a bool or     fused float32, ops.attention (08) attention
                          float32 mask that needs no gradient
    float32               causal, no mask, no dropout, default scale, batched products (the table
                          one key head per query head                 above) and ops.softmax (04)
    float32               otherwise                                   Tensor operations (11b)

Generation's new positions against a KV cache (B, H, n, d) run the decode kernel, ops.decode_attention
(chapter 17b, bench/decode_attention.json), as decode_attention() here.
"""

import math

import numpy

from gpt2_cupy import backend
from gpt2_cupy.elementwise import converted, elementwise
from gpt2_cupy.ops.arrays import BFLOAT16, FLOAT32, rows
from gpt2_cupy.ops.attention import HEAD_SIZES as FUSED_HEAD_SIZES
from gpt2_cupy.ops.decode_attention import decode_attention_forward
from gpt2_cupy.ops.gemv import gemv_forward
from gpt2_cupy.ops.linear import (ROWS_PER_BLOCK, add_residual, backward_output, bias_sums, forward_output,
                                  launch_bias_add)
from gpt2_cupy.ops.matmul import check_product, launch_float32_matmul
from gpt2_cupy.ops.tensor_core_attention import HEAD_SIZES as TENSOR_CORE_HEAD_SIZES
from gpt2_cupy.ops.tensor_core_matmul import (TF32_PRODUCTS, bf16_rows, check_tensor_core_product, launch_bf16_matmul,
                                              launch_tf32_mma_sync, to_bf16)
from gpt2_cupy.ops.wgmma_matmul import launch_tf32_wgmma_product, launch_wgmma_matmul, wgmma_fits
from gpt2_cupy.precision import get_float32_matmul_precision

# ---- the thresholds ----------------------------------------------------------------------------------------

# Rows of x at most for the GEMV: one row reads a bf16 weight several times faster than the tiled product, four
# rows still faster at Llama's widths, eight slower (bench/llama_generation.py --gemv).
GEMV_ROWS = 4
# Multiply-adds below which a bf16 product runs on the float32 kernel, and at or above which a 2-D product may
# take the wgmma: 2^27 take a few µs on an H100's float32 units, close to a launch, so tensor cores gain little
# there; the CPU executor, which emulates the tensor cores lane by lane, runs such a product much faster on the
# float32 kernel (bench/tensor_cores.json).
SMALL_PRODUCT = 1 << 27
# M and N at least this for a float32 product on wgmma when an operand is copied first (TF32's layouts other
# than x Wᵀ, 3xTF32's parts): the copy moves 8 bytes per element, the wgmma saves about 2 N flops per element of
# A over mma.sync (about 3 times faster), which pays once N is a few hundred (bench/tensor_cores.json).
MIN_COPIED_EXTENT = 256
# Multiply-adds (B H T² d) below which attention stays on chapter 08's float32 kernels: that small, it is bound
# by its launches on a GPU, and the CPU executor runs it faster (bench/tensor_core_attention.json).
TENSOR_CORE_ATTENTION = 1 << 24


# ---- products --------------------------------------------------------------------------------------------

def product(a, b, out, transpose_a=False, transpose_b=False, accumulate=False, bias=None):
    """out = op(a) @ op(b) (+ bias), or out += ... with accumulate; 2-D or batched 3-D, on the kernel the table
    above picks. Unchecked: a, b, out C-contiguous of matching shapes (check_product), out apart from both;
    bias None, or out's N columns of float32 for a 2-D out."""
    if a.dtype == BFLOAT16:
        return bf16_product(a, b, out, transpose_a, transpose_b, accumulate, bias)
    K = a.shape[-2] if transpose_a else a.shape[-1]
    precision = get_float32_matmul_precision()
    if out.size and K and (precision != "highest" or highest_on_tensor_cores(out, K)):
        return _tensor_core_product(a, b, out, transpose_a, transpose_b, accumulate, precision, bias)
    # (an empty product: the float32 op fills out with zeros, or keeps it with accumulate)
    return _add_bias(launch_float32_matmul(a, b, out, transpose_a, transpose_b, accumulate), bias)


def bf16_product(a, b, out, transpose_a=False, transpose_b=False, accumulate=False, bias=None):
    """product() for bf16 a and b (out float32, or bf16 rounded once after the float32 sum and bias)."""
    K = a.shape[-2] if transpose_a else a.shape[-1]
    if out.size == 0:
        return out
    if K == 0:  # an empty sum: 0 (+ bias) into out, or out kept (+ bias)
        if not accumulate:
            backend.fill_zero(out)   # a kernel, so that a CUDA graph records it (on the CPU too)
        if bias is not None:
            elementwise("bias_add", "a + b", [out, bias], compute_dtype=out.dtype, out=out)
        return out
    batch = out.shape[0] if out.ndim == 3 else 1
    if batch * out.shape[-2] * out.shape[-1] * K < SMALL_PRODUCT:
        return _small_bf16_product(a, b, out, transpose_a, transpose_b, accumulate, bias)
    if out.ndim == 2 and backend.runs_wgmma() and wgmma_fits(a, b):
        # Hopper's wgmma reads each operand as it lies in memory, k-contiguous or not (its transpose operands):
        # the Linear forward x Wᵀ, its input gradient dy W and its weight gradient dyᵀ x, none copied.
        return launch_wgmma_matmul(a, b, out, bias, accumulate, transpose_a, transpose_b)
    return launch_bf16_matmul(bf16_rows(a), bf16_rows(b), out, K, transpose_a, transpose_b, accumulate, bias)


def _small_bf16_product(a, b, out, transpose_a, transpose_b, accumulate, bias):
    """A small bf16 product on the float32 kernels: the bf16 values widened (exactly), their products exact in
    float32 as on a tensor core, sums in float32, the bias added, then out rounded once."""
    if out.dtype == numpy.float32:
        result = out
    else:
        result = converted(out, numpy.float32) if accumulate else backend.xp.empty(out.shape, dtype=numpy.float32)
    product(converted(a, numpy.float32), converted(b, numpy.float32), result, transpose_a, transpose_b, accumulate)
    if result is out:
        _add_bias(result, bias)
    elif bias is not None:   # the float32 sum, rounded once to bf16 as it is stored: one pass for both
        elementwise("bias_add_to_bf16", "a + b", [result, bias], compute_dtype=numpy.float32, out_dtype=out.dtype,
                    out=out)
    else:
        elementwise("float_to_bf16", "a", [result], compute_dtype=numpy.float32, out_dtype=out.dtype, out=out)
    return out


def _large_on_wgmma(out, K):
    """A 2-D product of at least SMALL_PRODUCT multiply-adds, on a backend that runs wgmma."""
    M, N = out.shape[-2:]
    return out.ndim == 2 and backend.runs_wgmma() and M * N * K >= SMALL_PRODUCT


def _copy_pays(out):
    """Copying an operand K-major first costs less than the wgmma saves: M and N at least MIN_COPIED_EXTENT."""
    return min(out.shape[-2:]) >= MIN_COPIED_EXTENT


def highest_on_tensor_cores(out, K):
    """A float32 product at "highest" as 3xTF32 on the wgmma (as accurate as float32, gpt2_cupy.precision, and
    faster there), where the tensor cores are the GPU's own: the executor's emulation runs three products at many
    times the float32 kernel's time."""
    return not backend.TENSOR_CORES_EMULATED and _large_on_wgmma(out, K) and _copy_pays(out)


def _tensor_core_product(a, b, out, transpose_a, transpose_b, accumulate, precision, bias):
    """A float32 product (K at least 1) on tensor cores at precision: wgmma where large, else mma.sync."""
    K = a.shape[-2] if transpose_a else a.shape[-1]
    if _large_on_wgmma(out, K):
        if precision == "medium":   # bf16 copies (as for mma.sync), then the bf16 wgmma (bf16_product picks it)
            return bf16_product(converted(a, BFLOAT16), converted(b, BFLOAT16), out, transpose_a, transpose_b,
                                accumulate, bias)
        # TF32 reads x Wᵀ as it lies; other layouts, and 3xTF32's parts, take a K-major copy first.
        copied = transpose_a or not transpose_b or precision == "highest"
        if not copied or _copy_pays(out):
            return launch_tf32_wgmma_product(a, b, out, transpose_a, transpose_b, accumulate, TF32_PRODUCTS[precision],
                                             bias)
    if precision == "medium":
        return launch_bf16_matmul(to_bf16(a)[0], to_bf16(b)[0], out, K, transpose_a, transpose_b, accumulate, bias)
    return _add_bias(launch_tf32_mma_sync(a, b, out, transpose_a, transpose_b, accumulate, TF32_PRODUCTS[precision]),
                     bias)


def _add_bias(out, bias):
    """out += bias along every row on chapter 02's kernel, for the products whose kernel takes no bias."""
    if bias is not None:
        launch_bias_add(out, bias)
    return out


def matmul(a, b, transpose_a=False, transpose_b=False, out=None, accumulate=False):
    """op(a) @ op(b) for 2-D float32 or bf16 arrays, as gpt2_cupy.ops.matmul.matmul, on the kernel the table
    picks: a: (M, K), or (K, M) if transpose_a.  b: (K, N), or (N, K) if transpose_b.  Returns out: (M, N)."""
    a, b, transpose_a, transpose_b, out = check_product("matmul", a, b, transpose_a, transpose_b, out, accumulate,
                                                        batched=False, bf16=True)
    return product(a, b, out, transpose_a, transpose_b, accumulate)


def batched_matmul(a, b, transpose_a=False, transpose_b=False, out=None, accumulate=False):
    """matmul over a leading batch dimension: out[i] = op(a[i]) @ op(b[i]), (batch, M, N)."""
    a, b, transpose_a, transpose_b, out = check_product("batched_matmul", a, b, transpose_a, transpose_b, out,
                                                        accumulate, batched=True, bf16=True)
    return product(a, b, out, transpose_a, transpose_b, accumulate)


def tensor_core_matmul(a, b, transpose_a=False, transpose_b=False, out=None, accumulate=False, precision=None):
    """gpt2_cupy.ops.tensor_core_matmul.tensor_core_matmul's product on tensor cores at precision (None: the
    setting's; "highest" is 3xTF32 here), on the wgmma where the table's rows for large products say so, else
    on mma.sync. bf16 a and b are multiplied as they are."""
    a, b, transpose_a, transpose_b, out = check_tensor_core_product("tensor_core_matmul", a, b, transpose_a,
                                                                    transpose_b, out, accumulate, precision, False)
    return _on_tensor_cores(a, b, out, transpose_a, transpose_b, accumulate, precision)


def batched_tensor_core_matmul(a, b, transpose_a=False, transpose_b=False, out=None, accumulate=False,
                               precision=None):
    """tensor_core_matmul over a leading batch dimension: out[i] = op(a[i]) @ op(b[i])."""
    a, b, transpose_a, transpose_b, out = check_tensor_core_product("batched_tensor_core_matmul", a, b, transpose_a,
                                                                    transpose_b, out, accumulate, precision, True)
    return _on_tensor_cores(a, b, out, transpose_a, transpose_b, accumulate, precision)


def _on_tensor_cores(a, b, out, transpose_a, transpose_b, accumulate, precision):
    precision = get_float32_matmul_precision() if precision is None else precision
    K = a.shape[-2] if transpose_a else a.shape[-1]
    if a.dtype == BFLOAT16 or out.size == 0 or K == 0:   # bf16's rows, or nothing to multiply
        return product(a, b, out, transpose_a, transpose_b, accumulate)
    return _tensor_core_product(a, b, out, transpose_a, transpose_b, accumulate, precision, None)


# ---- the Linear layer -------------------------------------------------------------------------------------

def gemv_takes(x, weight):
    """Whether y = x Wᵀ is the GEMV's: a bf16 weight and at most GEMV_ROWS rows of x. float32 weights keep the
    tiled products at any row count, and with them the order of their sums."""
    return (isinstance(weight, backend.xp.ndarray) and weight.dtype == BFLOAT16 and x.ndim >= 1
            and math.prod(x.shape[:-1]) <= GEMV_ROWS)


def linear_forward(x, weight, bias=None, out=None, residual=None):
    """gpt2_cupy.ops.linear.linear_forward's y = (residual +) x Wᵀ + b, on the kernel the table picks: float32 or
    bf16 x and weight, and a float32 x with a bf16 weight where the GEMV takes it."""
    if gemv_takes(x, weight):
        return gemv_forward(x, weight, bias, out=out, residual=residual)      # the weight read once
    out = forward_output(x, weight, bias, out, residual)
    product(rows(x), weight, rows(out), transpose_b=True, bias=bias)          # y = x Wᵀ + b (rounded once)
    return add_residual(out, residual)


def linear_backward(dout, x, weight, *, dweight, dbias=None, out=None):
    """gpt2_cupy.ops.linear.linear_backward's dx = dout W, dW += doutᵀ x, db += Σ dout, the products on the
    kernels the table picks (float32 or bf16 dout, x, weight)."""
    out = backward_output(dout, x, weight, dweight, dbias, out)
    dout_rows = rows(dout)
    product(dout_rows, weight, rows(out))                                     # dx = dout W       (set)
    product(dout_rows, rows(x), dweight, transpose_a=True, accumulate=True)   # dW += doutᵀ x     (add)
    if dbias is not None:
        bias_sums(dout_rows, dbias, ROWS_PER_BLOCK)                           # db += Σ_n dout    (add)
    return out


# ---- attention --------------------------------------------------------------------------------------------

TENSOR_CORES, TENSOR_CORES_FROM_FLOAT32, IN_FLOAT32, FUSED, BATCHED_PRODUCTS, OPERATIONS = (
    "tensor cores", "tensor cores, bf16 copies", "in float32", "fused", "batched products", "operations")


def _tensor_core_format(q, k, v, attn_mask, dropout_p, enable_gqa):
    """"bf16", "tf32", or None where the tensor-core kernels do not take the inputs (the table's first row)."""
    if attn_mask is not None or dropout_p != 0.0 or not q.dtype == k.dtype == v.dtype:
        return None
    if q.dtype == BFLOAT16:
        fmt = "bf16"
    else:
        fmt = {"high": "tf32", "medium": "bf16"}.get(get_float32_matmul_precision()) if q.dtype == FLOAT32 else None
    if fmt is None:
        return None
    if q.ndim != 4 or k.shape != v.shape or k.ndim != 4 or k.shape[0] != q.shape[0] or k.shape[2:] != q.shape[2:]:
        return None
    B, H, T, d = q.shape
    H_kv = k.shape[1]
    grouped_fits = H_kv == H or (enable_gqa and H % H_kv == 0)
    fits = d in TENSOR_CORE_HEAD_SIZES and grouped_fits and B * H * T * T * d >= TENSOR_CORE_ATTENTION
    return fmt if fits else None


def attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """Which kernels F.scaled_dot_product_attention runs for its arguments (the table's rows): TENSOR_CORES,
    TENSOR_CORES_FROM_FLOAT32 (float32 q, k, v at "medium": bf16 copies, out rounded once), IN_FLOAT32 (other bf16
    inputs: the float32 rows, converted around), FUSED, BATCHED_PRODUCTS or OPERATIONS."""
    tensor_core_format = _tensor_core_format(q, k, v, attn_mask, dropout_p, enable_gqa)
    if tensor_core_format == "bf16" and q.dtype == FLOAT32:
        return TENSOR_CORES_FROM_FLOAT32
    if tensor_core_format is not None:
        return TENSOR_CORES
    if BFLOAT16 in (q.dtype, k.dtype, v.dtype):
        return IN_FLOAT32
    d = q.shape[-1]
    same_layout = (k.shape == v.shape and k.ndim == q.ndim and q.shape[:-3] == k.shape[:-3]
                   and q.shape[-2] == k.shape[-2])  # the fused kernels' (B, H or H_kv, T, d)
    mask_fits = attn_mask is None or (not getattr(attn_mask, "requires_grad", False)
                                      and getattr(attn_mask, "dtype", None) in (numpy.bool_, FLOAT32))
    if same_layout and mask_fits and d in FUSED_HEAD_SIZES:
        return FUSED
    heads, key_heads = (x.shape[-3] if x.ndim >= 3 else 1 for x in (q, k))
    default_scale = scale is None or math.isclose(scale, 1 / math.sqrt(d), rel_tol=1e-6)
    if attn_mask is None and dropout_p == 0.0 and default_scale and same_layout and is_causal and key_heads == heads:
        return BATCHED_PRODUCTS
    return OPERATIONS


def decode_attention(queries, keys, values, length):
    """New positions' queries (B, H, n, d) against a KV cache's keys and values (B, H_kv, max_length, d), of which
    the first `length` are filled: the decode kernel (the table's last line)."""
    return decode_attention_forward(queries, keys, values, length)

