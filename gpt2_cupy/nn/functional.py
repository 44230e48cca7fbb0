"""PyTorch's torch.nn.functional names, each a small Function around one op pair of gpt2_cupy.ops.

    F.linear(x, weight, bias=None)                     F.gelu(x, approximate="none")     F.relu(x)   F.silu(x)
    F.sigmoid(x)   F.tanh(x)
    F.layer_norm(x, (C,), weight, bias, eps=1e-5)      F.dyt(x, alpha, weight, bias)
    F.embedding(idx, weight)                           F.dropout(x, p=0.5, training=True)
    F.softmax(x, dim=-1)   F.log_softmax(x, dim=-1)    F.cross_entropy(logits, targets, ignore_index=-100,
                                                                       reduction="mean")
    F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None)
    F.relu_attention(q, k, v, is_causal=True)
    split(x, size, dim): Tensor's .split
    F.batch_norm(x, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1, eps=1e-5)

Each forward calls the op's X_forward and saves what X_backward needs; each backward calls X_backward
with the upstream gradient and hands the op the parameters' own gradient buffers (ctx.grad_buffer),
so that parameter gradients are added in place and only activation gradients come back to the tape.

relu, silu, sigmoid, tanh and log_softmax are generated kernels (gpt2_cupy.tensor_ops), as are Tensor's
operators; the others are the course's own fused kernels, which read their arguments as flat C-contiguous
blocks (autograd.Function hands them contiguous copies of views). split copies its pieces.

bf16: every op here takes bf16 activations and returns bf16 (parameters stay float32; LayerNorm's statistics
and cross-entropy's loss are float32). Inside gpt2_cupy.autocast, linear takes its input and weight in
bf16 and embedding returns bf16 rows (gpt2_cupy.amp). softmax, and scaled_dot_product_attention where its
tensor-core kernels do not take the shape, run bf16 inputs through their float32 kernels, converted on the
way in and rounded once on the way out.

float32 attention follows gpt2_cupy.set_float32_matmul_precision as the products do: at "high" it runs on the
tensor-core kernels in TF32, at "medium" on them in bf16 (q, k, v rounded to bf16, out rounded once, widened
back to float32), where they take the shape; at "highest", and elsewhere, on chapter 08's float32 kernels.
"""

import math

import numpy

from gpt2_cupy import amp, backend, device_checks, dispatch, tensor_ops
from gpt2_cupy.autograd import Function, Tensor, storage_version
from gpt2_cupy.random import dropout_draw, dropout_rng_state
from gpt2_cupy.elementwise import contiguous, converted, elementwise
from gpt2_cupy.ops.arrays import BFLOAT16, FLOAT32, same_place, storage_of
from gpt2_cupy.reduction import normalize_dims
from gpt2_cupy.ops.attention import attention_backward, attention_forward
from gpt2_cupy.ops.tensor_core_attention import tensor_core_attention_backward, tensor_core_attention_forward
from gpt2_cupy.ops.cross_entropy import cross_entropy_backward, cross_entropy_forward
from gpt2_cupy.ops.dropout import advance_rng_state, dropout_backward, dropout_forward
from gpt2_cupy.ops.dyt import dyt_backward, dyt_forward
from gpt2_cupy.ops.embedding import embedding_backward, embedding_forward
from gpt2_cupy.ops.gelu import gelu_backward, gelu_forward
from gpt2_cupy.ops.layernorm import layernorm_backward, layernorm_forward
from gpt2_cupy.dispatch import linear_backward, linear_forward
from gpt2_cupy.ops.softmax import softmax_backward, softmax_forward


# ---- arithmetic ------------------------------------------------------------------------------------------

class Linear(Function):
    @staticmethod
    def forward(ctx, x, weight, bias=None, weight_bf16=None):
        # weight_bf16: autocast's bf16 copy of the weight; then x is multiplied in bf16 too, and the
        # gradients keep x's and weight's own dtypes (weight's float32, summed so on the tensor cores)
        ctx.x_dtype = x.dtype
        if weight_bf16 is not None:
            x, weight = amp.as_bf16(x), weight_bf16
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return linear_forward(x, weight, None if bias is None else _float32(bias))

    @staticmethod
    def backward(ctx, dout):
        x, weight = ctx.saved_tensors
        dbias = ctx.grad_buffer(2) if ctx.has_bias else None
        dx = backend.xp.empty(x.shape, dtype=ctx.x_dtype)  # a float32 input's gradient: float32 sums, unrounded
        linear_backward(dout, x, weight, dweight=ctx.grad_buffer(1), dbias=dbias, out=dx)
        return dx, None, None, None


def linear(x, weight, bias=None):
    """y = x Wᵀ + b; x (..., C_in), weight (C_out, C_in), bias (C_out,) or None. Inside gpt2_cupy.autocast,
    x and weight are multiplied in bf16 (the weight's copy cached for the block) and y is bf16."""
    weight_bf16 = amp.product_input(weight) if amp.autocast_dtype() is not None else None
    return Linear.apply(x, weight, bias, weight_bf16)


class GELU(Function):
    @staticmethod
    def forward(ctx, x, approximate):
        ctx.save_for_backward(x)
        ctx.approximate = approximate
        return gelu_forward(x, approximate=approximate)

    @staticmethod
    def backward(ctx, dout):
        (x,) = ctx.saved_tensors
        return gelu_backward(dout, x, approximate=ctx.approximate), None


def gelu(x, approximate="none"):
    """GELU(x) elementwise: "none" (the exact erf form, PyTorch's default) or "tanh" (GPT-2's approximation)."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu: approximate={approximate!r}; it must be 'none' or 'tanh'")
    return GELU.apply(x, approximate)


def relu(x):
    """max(x, 0) elementwise (a generated kernel, as every elementwise function of gpt2_cupy.tensor_ops)."""
    return tensor_ops.unary("relu", x)


def silu(x):
    """x · sigmoid(x) elementwise (Llama's MLP gate)."""
    return tensor_ops.unary("silu", x)


def sigmoid(x):
    return tensor_ops.unary("sigmoid", x)


def tanh(x):
    return tensor_ops.unary("tanh", x)


class LayerNorm(Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        weight, bias = _float32(weight), None if bias is None else _float32(bias)
        y, mean, rstd = layernorm_forward(x, weight, bias, eps=eps)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, dout):
        x, weight, mean, rstd = ctx.saved_tensors
        dbias = ctx.grad_buffer(2) if ctx.has_bias else None
        dx = layernorm_backward(dout, x, weight, mean, rstd, dweight=ctx.grad_buffer(1), dbias=dbias)
        return dx, None, None, None


def layer_norm(x, normalized_shape, weight, bias=None, eps=1e-5):
    """Normalise each row of x over its last axis, then scale by weight and shift by bias."""
    if tuple(normalized_shape) != (x.shape[-1],):
        raise ValueError(f"layer_norm: normalized_shape {tuple(normalized_shape)} must be the last axis of "
                         f"x, ({x.shape[-1]},): only the channels are normalised")
    return LayerNorm.apply(x, weight, bias, eps)


class DyT(Function):
    @staticmethod
    def forward(ctx, x, alpha, weight, bias):
        ctx.save_for_backward(x, alpha, weight)
        ctx.has_bias = bias is not None
        return dyt_forward(x, alpha, weight, bias)

    @staticmethod
    def backward(ctx, dout):
        x, alpha, weight = ctx.saved_tensors
        dbias = ctx.grad_buffer(3) if ctx.has_bias else None
        dx = dyt_backward(dout, x, alpha, weight, dalpha=ctx.grad_buffer(1), dweight=ctx.grad_buffer(2),
                          dbias=dbias)
        return dx, None, None, None


def dyt(x, alpha, weight, bias=None):
    """Dynamic tanh, weight * tanh(alpha x) + bias: LayerNorm's replacement without statistics."""
    return DyT.apply(x, alpha, weight, bias)


class Embedding(Function):
    @staticmethod
    def forward(ctx, ids, weight, dtype):
        ctx.save_for_backward(ids)
        # embedding() launched the ids' range check on the device; the kernels skip a bad id (a NaN row)
        return embedding_forward(ids, _float32(weight), dtype=dtype, check_ids=False)

    @staticmethod
    def backward(ctx, dout):
        (ids,) = ctx.saved_tensors
        embedding_backward(dout, ids, dweight=ctx.grad_buffer(1), check_ids=False)
        return None, None, None


def embedding(idx, weight):
    """The rows weight[idx]; idx an integer backend array (any shape), converted to int32 if needed. The rows
    have the table's dtype; inside gpt2_cupy.autocast they are bf16 (rounded once from a float32 table).

    An id outside [0, rows) raises IndexError at the next synchronisation (the check runs on the device,
    gpt2_cupy.device_checks: no wait here, and it works inside a CUDA graph's capture)."""
    dtype = BFLOAT16 if amp.autocast_dtype() is not None or weight.dtype == BFLOAT16 else FLOAT32
    ids = _int32(idx, "embedding", "idx")
    rows, shape = weight.shape[0], tuple(ids.shape)

    def out_of_range(position, value):
        where = list(numpy.unravel_index(position, shape)) if shape else []
        return IndexError(f"embedding: index out of range in self: idx{[int(i) for i in where]} = {value}, but "
                          f"weight has {rows} rows (ids must be in [0, {rows}))")

    device_checks.check_range("embedding", ids, 0, rows, out_of_range)
    return Embedding.apply(ids, weight, dtype)


class Dropout(Function):
    @staticmethod
    def forward(ctx, x, p):
        rng_state = dropout_rng_state()
        ctx.rng_state = rng_state.copy()  # the backward regenerates the forward's mask from this state
        ctx.p = p
        ctx.start, advance = dropout_draw(x.size)  # x's place in the global batch (data parallelism)
        y = dropout_forward(x, p, ctx.rng_state, start=ctx.start)
        advance_rng_state(rng_state, advance)  # the next call draws fresh numbers
        return y

    @staticmethod
    def backward(ctx, dout):
        return dropout_backward(dout, ctx.p, ctx.rng_state, start=ctx.start), None


def dropout(x, p=0.5, training=True):
    """Zero each element with probability p and scale the rest by 1/(1-p); the identity when not training."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout: p = {p}; it must be in [0, 1)")
    if not training or p == 0.0:
        return x
    return Dropout.apply(x, float(p))


class Softmax(Function):
    @staticmethod
    def forward(ctx, x):
        y = softmax_forward(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, dout):
        (y,) = ctx.saved_tensors
        return softmax_backward(dout, y)


def softmax(x, dim=-1):
    """Softmax over dim: chapter 04's kernel, which reduces over the last axis; any other axis is moved
    there first (a transposed view, copied to contiguous rows as the kernel reads them) and back after.
    bf16 x goes through the float32 kernel (in_float32), its result rounded once."""
    if x.dtype == BFLOAT16:
        return in_float32(softmax, x, dim=dim)
    (dim,) = normalize_dims("softmax", (dim,), x.ndim) if x.ndim else (0,)
    if x.ndim == 0 or dim == x.ndim - 1:
        return Softmax.apply(x)
    return Softmax.apply(x.transpose(dim, -1)).transpose(dim, -1)


def log_softmax(x, dim=-1):
    """log(softmax(x)) over dim, as x - max - log Σ exp(x - max): generated kernels, stable for large x."""
    return tensor_ops.log_softmax(x, dim)


class Attention(Function):
    """Chapter 08's fused kernels. scale (None: 1/√d), attn_mask (an array, or None) and dropout_p take the
    kernels' general versions; dropout draws from dropout's generator as F.dropout does: the forward uses a copy
    of its (seed, offset), kept for the backward to regenerate the mask, and advances the offset on the device
    past the B·H·T·T weights (no host copy: it works inside a CUDA graph capture)."""
    accepts_strided = True   # the kernels read q, k, v and dout where they lie, and make out with heads side by side

    @staticmethod
    def forward(ctx, q, k, v, causal, variant, scale=None, attn_mask=None, dropout_p=0.0):
        ctx.rng_state, start, advance = None, 0, 0
        if dropout_p > 0.0:
            rng_state = dropout_rng_state()
            ctx.rng_state = rng_state.copy()
            start, advance = dropout_draw(q.size // q.shape[-1] * q.shape[-2])  # one number per weight, (..., H, T, T)
        options = dict(scale=scale, attn_mask=attn_mask, dropout_p=dropout_p, rng_state=ctx.rng_state,
                       dropout_start=start)
        out, lse = attention_forward(q, k, v, causal=causal, variant=variant, **options)
        if dropout_p > 0.0:
            advance_rng_state(rng_state, advance)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.variant, ctx.options = causal, variant, options
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = attention_backward(dout, q, k, v, out, lse, causal=ctx.causal, variant=ctx.variant,
                                        **ctx.options)
        return dq, dk, dv, None, None, None, None, None


class TensorCoreAttention(Function):
    """Attention on tensor cores (chapter 16b): q, k, v, out and gradients all bf16, or all float32 (TF32
    products), float32 softmax. The kernels read and write by strides: heads split from the q, k, v product's
    output are read where they lie, out is made with its heads side by side, and the gradients lie as q, k,
    v do."""
    accepts_strided = True

    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        out, lse = tensor_core_attention_forward(q, k, v, causal=causal, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale = causal, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = tensor_core_attention_backward(dout, q, k, v, out, lse, causal=ctx.causal, scale=ctx.scale)
        return dq, dk, dv, None, None


def scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """softmax(q kᵀ · scale + mask) v, q (B, H, T, d), k, v (B, H, S, d); is_causal: each query sees keys up to its
    own position. PyTorch's signature and defaults; dropout_p drops attention weights whenever it is above 0.
    enable_gqa: k and v may have H_kv heads, H_kv dividing H: query head h reads key and value head
    h // (H / H_kv) (grouped-query attention, as PyTorch 2.5's argument; without it, other head counts are its error).

    attn_mask: a bool tensor (True: take part) or a float one added to the scores, broadcastable to (B, H, T, S).
    A query whose every key is masked gets 0 (and zero gradients), as in PyTorch's math backend (_safe_softmax).

    bf16 q, k, v, and float32 ones at set_float32_matmul_precision("high") (TF32) or ("medium") (bf16), run on
    the tensor-core kernels of chapter 16b where they take the shape (gpt2_cupy.dispatch.attention has the table).
    The fused kernels of chapter 08 run head sizes ops.attention.HEAD_SIZES (1 to 256) with as many keys as
    queries: any scale, a bool or float32 mask (read in place, broadcast through strides), dropout (its mask
    regenerated in the backward from Philox, as F.dropout's), grouped heads read without a copy. Anything else
    (T != S, a mask that requires grad, other head sizes) runs PyTorch's "math" path, written with Tensor
    operations (chapter 11b). Both draw dropout's numbers for the same elements of (B, H, T, S) the same way.
    """
    path = dispatch.attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if path == dispatch.TENSOR_CORES_FROM_FLOAT32:   # "medium": bf16 inputs, out rounded once
        return TensorCoreAttention.apply(*(x.to(BFLOAT16) for x in (q, k, v)), bool(is_causal), scale).float()
    if path == dispatch.TENSOR_CORES:
        return TensorCoreAttention.apply(q, k, v, bool(is_causal), scale)
    if path == dispatch.IN_FLOAT32:  # other bf16 attention: the float32 kernels, converted around
        return in_float32(scaled_dot_product_attention, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    d = q.shape[-1]
    default_scale = scale is None or math.isclose(scale, 1 / math.sqrt(d), rel_tol=1e-6)
    if attn_mask is not None and is_causal:
        raise RuntimeError("_scaled_dot_product_attention: Explicit attn_mask should not be set when is_causal=True")
    heads, key_heads, value_heads = (x.shape[-3] if x.ndim >= 3 else 1 for x in (q, k, v))
    if enable_gqa and (heads % key_heads or heads % value_heads):
        raise RuntimeError("Number of heads in key and value must divide the number of heads in query: "
                           f"q has {heads}, k {key_heads}, v {value_heads}")
    for other in (key_heads, value_heads):
        if not enable_gqa and other not in (heads, 1):  # a single head broadcasts, as in PyTorch's matmul
            raise RuntimeError(f"The size of tensor a ({heads}) must match the size of tensor b ({other}) at "
                               f"non-singleton dimension {q.ndim - 3}: q has {heads} heads, k {key_heads} and v "
                               f"{value_heads} (enable_gqa=True: a key and value head serves several query heads)")
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"scaled_dot_product_attention: dropout_p = {dropout_p}; it must be in [0, 1]")
    if attn_mask is not None and not isinstance(attn_mask, Tensor):
        attn_mask = Tensor(attn_mask)
    if attn_mask is not None and attn_mask.dtype != numpy.bool_ and attn_mask.dtype.kind != "f":
        raise TypeError("scaled_dot_product_attention: Expected attn_mask dtype to be bool or float or to match query "
                        f"dtype, but got attn_mask.dtype: {attn_mask.dtype} and query.dtype: {q.dtype} instead.")
    if path == dispatch.FUSED:
        return Attention.apply(q, k, v, bool(is_causal), "softmax", None if default_scale else float(scale),
                               attn_mask, float(dropout_p))
    if path == dispatch.BATCHED_PRODUCTS:
        return MatmulAttention.apply(q, k, v)
    return _attention_from_operations(q, k, v, attn_mask, dropout_p, is_causal, 1 / math.sqrt(d) if scale is None else scale)


def _attention_from_operations(q, k, v, attn_mask, dropout_p, is_causal, scale):
    """The attention of the textbooks, one Tensor operation at a time: every launch reads and writes the
    (T, S) scores that the fused kernels keep on chip (chapter 11b counts the bytes). Grouped k and v heads are
    repeated first, head j as heads j·group .. j·group + group - 1 (PyTorch's repeat_interleave)."""
    T, S = q.shape[-2], k.shape[-2]
    repeated = []
    for x in (k, v):
        if x.ndim == q.ndim >= 3 and x.shape[-3] not in (1, q.shape[-3]):             # grouped: (B, H_kv, S, d)
            group = q.shape[-3] // x.shape[-3]
            x = x.unsqueeze(-3).expand(*x.shape[:-2], group, *x.shape[-2:]).reshape(*x.shape[:-3], q.shape[-3],
                                                                                   *x.shape[-2:])  # (B, H, S, d)
        repeated.append(x)
    k, v = repeated
    scores = (q @ k.transpose(-2, -1)) * scale                                     # (B, H, T, S)
    if is_causal:
        attn_mask = Tensor(backend.xp.tril(backend.xp.ones((T, S), dtype=numpy.bool_)))
    if attn_mask is not None:
        if attn_mask.dtype == numpy.bool_:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask
        # A row of -inf alone would give softmax NaN: such rows attend to nothing (PyTorch's _safe_softmax). They
        # are set to 0 before the softmax, so that its backward sees finite weights, and their weights to 0 after.
        nothing_visible = scores.max(dim=-1, keepdim=True)[0] == float("-inf")      # (B, H, T, 1)
        weights = softmax(scores.masked_fill(nothing_visible, 0.0), dim=-1).masked_fill(nothing_visible, 0.0)
    else:
        weights = softmax(scores, dim=-1)
    if dropout_p > 0.0:
        weights = dropout(weights, dropout_p)
    return weights @ v


def relu_attention(q, k, v, is_causal=True):
    """Attention with ReLU in place of softmax (chapter 08's variant); q, k, v (B, H, T, d)."""
    if BFLOAT16 in (q.dtype, k.dtype, v.dtype):
        return in_float32(relu_attention, q, k, v, is_causal)
    return Attention.apply(q, k, v, is_causal, "relu")


def in_float32(function, *arguments, **options):
    """function(*arguments) for an op whose kernels take float32 only: its bf16 tensors converted to float32
    (exactly), the result rounded once to bf16. The conversions are autograd's .to, so the gradients go
    back the same way: float32 through the op, bf16 for the bf16 inputs."""
    widened = [a.float() if isinstance(a, Tensor) and a.dtype == BFLOAT16 else a for a in arguments]
    return function(*widened, **options).to(BFLOAT16)


class CrossEntropy(Function):
    @staticmethod
    def forward(ctx, logits, targets, ignore_index, reduction):
        loss, lse = cross_entropy_forward(logits, targets, ignore_index=ignore_index)
        ctx.save_for_backward(logits, targets, lse)
        ctx.ignore_index, ctx.reduction = ignore_index, reduction
        if reduction == "mean":
            return loss
        # a target out of range (reported at the next synchronisation) gives its row a NaN loss, as the kernel
        xp = backend.xp
        bad = (targets != ignore_index) & ((targets < 0) | (targets >= logits.shape[1]))
        row_losses = xp.where(bad, numpy.float32(numpy.nan),
                              _row_losses(logits, xp.where(bad, 0, targets), lse, ignore_index))
        return row_losses if reduction == "none" else row_losses.sum()

    @staticmethod
    def backward(ctx, dout):
        logits, targets, lse = ctx.saved_tensors
        if ctx.reduction == "mean":
            dlogits = cross_entropy_backward(dout, logits, targets, lse, ignore_index=ctx.ignore_index)
            return dlogits, None, None, None
        # The kernel's gradient is that of the mean: (softmax - onehot) · dout / count. Handing it
        # dout = count leaves (softmax - onehot) for each counted row, which the sum's or each row's own
        # upstream gradient then scales.
        count = (targets != ctx.ignore_index).sum(dtype=numpy.float32)
        row_gradients = cross_entropy_backward(backend.xp.asarray(count, dtype=numpy.float32), logits, targets,
                                               lse, ignore_index=ctx.ignore_index)
        scale = dout if ctx.reduction == "sum" else dout[:, None]
        return elementwise("cross_entropy_scale", "a * b", [row_gradients, scale],
                           compute_dtype=logits.dtype), None, None, None


def _row_losses(logits, targets, lse, ignore_index):
    """Each row's lse - logits[row, target], 0 where the target is ignored: reduction="none"'s result."""
    xp = backend.xp
    counted = targets != ignore_index
    picked = xp.take_along_axis(logits, xp.where(counted, targets, 0)[:, None], axis=1)[:, 0]
    return xp.where(counted, lse - picked.astype(numpy.float32), 0).astype(numpy.float32)


REDUCTIONS = ("mean", "sum", "none")


def cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None, reduction="mean",
                  label_smoothing=0.0):
    """-log softmax(input)[target] for each row whose target is not ignore_index: input (N, C) logits,
    target (N,) class indices; reduced by reduction: "mean" over the counted rows, "sum", or "none" (N,).

    A target outside [0, C) other than ignore_index raises IndexError, as PyTorch's does, at the next
    synchronisation (.item(), float(), .numpy(), print, backend.synchronize()): the check runs on the device
    (gpt2_cupy.device_checks), so the call never waits for it, and inside a CUDA graph it runs at each
    replay. Until then the loss of a bad row is NaN. weight and label_smoothing are not supported yet.
    """
    if weight is not None or label_smoothing != 0.0:
        raise NotImplementedError("cross_entropy: weight and label_smoothing are not supported yet")
    if size_average is not None or reduce is not None:
        raise ValueError("cross_entropy: size_average and reduce are deprecated in PyTorch; use reduction")
    if reduction not in REDUCTIONS:
        raise ValueError(f"cross_entropy: reduction={reduction!r} is not a valid value; use one of {REDUCTIONS}")
    if isinstance(target, Tensor):
        target = target._data
    target = _int32(target, "cross_entropy", "target")
    if input.ndim != 2 or target.shape != input.shape[:1]:
        raise ValueError(f"cross_entropy: input must be (N, C) logits and target (N,) class indices; got input "
                         f"{input.shape} and target {tuple(target.shape)}")
    _check_targets(target, input.shape[1], ignore_index)
    return CrossEntropy.apply(input, target, ignore_index, reduction)


def _check_targets(target, classes, ignore_index):
    """Launch the targets' range check on the device; its error is raised at the next synchronisation."""
    def out_of_range(row, value):
        return IndexError(f"cross_entropy: Target {value} is out of bounds: target[{row}] = {value}, but input has "
                          f"{classes} classes (targets must be in [0, {classes}) or ignore_index = {ignore_index})")

    device_checks.check_range("cross_entropy", target, 0, classes, out_of_range, skip=ignore_index)


# ---- data movement ---------------------------------------------------------------------------------------

class Split(Function):
    """Views of consecutive pieces of x along dim, as PyTorch's split gives. Their gradients are joined into
    one of x's shape: by a copy, unless they already lie side by side in one array of that shape, as the
    tensor-core attention's dq, dk, dv of a split q, k, v do (ops.arrays.empty_like_views)."""
    accepts_strided = True

    @staticmethod
    def forward(ctx, x, keys):
        ctx.keys, ctx.shape = keys, x.shape
        ctx.is_view, ctx.view_version = True, storage_version(x)
        return tuple(x[key] for key in keys)

    @staticmethod
    def backward(ctx, *douts):
        whole = storage_of(douts[0])
        in_place = (whole.shape == ctx.shape and whole.flags.c_contiguous and all(
            storage_of(dout) is whole and same_place(dout, whole[key]) for dout, key in zip(douts, ctx.keys)))
        if in_place:
            return whole, None
        axis = len(ctx.keys[0]) - 1
        return backend.xp.concatenate(douts, axis=axis), None


def split(x, split_size, dim=-1):
    """Pieces of split_size along dim (the last one shorter when it does not divide): views of x, as in
    PyTorch. An in-place write into a piece writes into x, and x's place in the graph follows (CopySlices)."""
    (dim,) = normalize_dims("split", (dim,), x.ndim)
    keys = tuple((slice(None),) * dim + (slice(start, min(start + split_size, x.shape[dim])),)
                 for start in range(0, max(x.shape[dim], 1), split_size))
    pieces = Split.apply(x, keys)
    for piece, key in zip(pieces, keys):
        tensor_ops.remember_base(piece, x, lambda a, key=key: a[key], tensor_ops.scatter_into(x.shape, key))
    return pieces


def _float32(parameter):
    """A parameter array as the float32 the kernels read (a bf16 one converted; its gradient, float32 in the
    op's buffer, is converted back by autograd)."""
    return converted(parameter, FLOAT32)


def _int32(ids, operation, name):
    """ids as a C-contiguous int32 backend array (token ids fit easily in 32 bits)."""
    if isinstance(ids, Tensor):
        ids = ids._data
    if not isinstance(ids, backend.xp.ndarray):
        raise TypeError(f"{operation}: {name} must be a {backend.xp.__name__}.ndarray of integers, "
                        f"got {type(ids).__name__}")
    if ids.dtype.kind not in "iu":
        raise TypeError(f"{operation}: {name} has dtype {ids.dtype}; it must hold integers")
    return backend.xp.ascontiguousarray(ids, dtype=numpy.int32)



# ==== Llama (chapter 17a): RMSNorm, RoPE, SwiGLU, grouped-query attention ===================================
# This last section holds the Functions that gpt2_cupy.llama needs and GPT-2 does not.

from gpt2_cupy.dispatch import batched_matmul  # noqa: E402
from gpt2_cupy.ops.rmsnorm import rmsnorm_backward, rmsnorm_forward  # noqa: E402
from gpt2_cupy.ops.rope import rope_backward, rope_forward  # noqa: E402
from gpt2_cupy.ops.swiglu import swiglu_backward, swiglu_forward  # noqa: E402


class RMSNorm(Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = rmsnorm_forward(x, weight, eps=eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dout):
        x, weight, rstd = ctx.saved_tensors
        return rmsnorm_backward(dout, x, weight, rstd, dweight=ctx.grad_buffer(1)), None, None


def rms_norm(input, normalized_shape, weight=None, eps=None):
    """x / sqrt(mean(x²) + eps) over the last axis, times weight: PyTorch's F.rms_norm. eps=None is float32's
    machine epsilon, as PyTorch's default; Llama passes its config's rms_norm_eps."""
    if tuple(normalized_shape) != (input.shape[-1],):
        raise ValueError(f"rms_norm: normalized_shape {tuple(normalized_shape)} must be the last axis of the input, "
                         f"({input.shape[-1]},): only the channels are normalised")
    if weight is None:
        weight = backend.xp.ones(input.shape[-1], dtype=numpy.float32)
    eps = float(numpy.finfo(numpy.float32).eps) if eps is None else float(eps)
    return RMSNorm.apply(input, weight, eps)


class Rope(Function):
    """rope_forward reads q or k sliced from one product's output where they lie (accepts_strided)."""
    accepts_strided = True

    @staticmethod
    def forward(ctx, x, theta, start, interleaved):
        ctx.options = dict(theta=theta, start=start, interleaved=interleaved)
        return rope_forward(x, **ctx.options)

    @staticmethod
    def backward(ctx, dout):
        return rope_backward(contiguous(dout), **ctx.options), None, None, None  # the rotation back: nothing saved


def rope(x, theta=10000.0, start=0, interleaved=False):
    """Rotary position embedding of q or k heads x (B, T, H, D): the token at index t sits at position start + t.
    interleaved=False pairs channel i with i + D/2 (Hugging Face's rotate_half), True pairs 2i with 2i + 1
    (Meta's llama/model.py, llama2.c). Not a PyTorch function: transformers writes it as apply_rotary_pos_emb with cos and sin tables."""
    return Rope.apply(x, float(theta), int(start), bool(interleaved))


class SwiGLU(Function):
    """swiglu_forward reads gate and up sliced from one product's output where they lie (accepts_strided)."""
    accepts_strided = True

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return swiglu_forward(gate, up)

    @staticmethod
    def backward(ctx, dout):
        gate, up = ctx.saved_tensors
        return swiglu_backward(*(contiguous(x) for x in (dout, gate, up)))


def swiglu(gate, up):
    """silu(gate) * up, fused: Llama's MLP activation (PyTorch writes F.silu(gate) * up)."""
    return SwiGLU.apply(gate, up)


class RepeatKV(Function):
    @staticmethod
    def forward(ctx, x, n_rep):
        ctx.n_rep = n_rep
        return backend.xp.repeat(x, n_rep, axis=1)       # (B, Hkv, T, D) -> (B, Hkv·n_rep, T, D), head h from h // n_rep

    @staticmethod
    def backward(ctx, dout):
        B, H, T, D = dout.shape
        return dout.reshape(B, H // ctx.n_rep, ctx.n_rep, T, D).sum(axis=2, dtype=numpy.float32), None  # a fork


def repeat_kv(x, n_rep):
    """Grouped-query attention's keys or values (B, n_kv_heads, T, D), each head repeated n_rep times in place, so
    that query head h meets key head h // n_rep (transformers' repeat_kv). A copy: the fused attention kernels
    take one key head per query head."""
    return x if n_rep == 1 else RepeatKV.apply(x, int(n_rep))


class MatmulAttention(Function):
    """Causal softmax attention of any head size from chapter 01's batched matmul and chapter 04's softmax: the
    (B, H, T, T) probabilities are written to memory. The path for head sizes the fused kernels do not take."""

    @staticmethod
    def forward(ctx, q, k, v):
        B, H, T, D = q.shape
        scale = 1.0 / math.sqrt(D)
        scores = batched_matmul(q.reshape(B * H, T, D), k.reshape(B * H, T, D), transpose_b=True)  # (B·H, T, T)
        p = softmax_forward(scores, scale=scale, causal=True, out=scores)
        ctx.save_for_backward(q, k, v, p)
        return batched_matmul(p, v.reshape(B * H, T, D)).reshape(B, H, T, D)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, p = ctx.saved_tensors
        B, H, T, D = q.shape
        dout3, q3, k3, v3 = (a.reshape(B * H, T, D) for a in (dout, q, k, v))
        dv = batched_matmul(p, dout3, transpose_a=True)                     # dV = Pᵀ dO
        dp = batched_matmul(dout3, v3, transpose_b=True)                    # dP = dO Vᵀ
        ds = softmax_backward(dp, p, scale=1.0 / math.sqrt(D), out=dp)      # dS, the scale included
        dq, dk = batched_matmul(ds, k3), batched_matmul(ds, q3, transpose_a=True)
        return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)


def causal_attention(q, k, v):
    """softmax(q kᵀ / √D) v with the causal mask, q, k, v (B, H, T, D): chapter 08's fused kernels for the head
    sizes they take (ops.attention.HEAD_SIZES), the batched-matmul path otherwise (Llama's D = 128)."""
    return scaled_dot_product_attention(q, k, v, is_causal=True)


# ---- more of torch.nn.functional, from tensor operations (each a generated kernel with its gradient) ----------------

def one_hot(tensor, num_classes=-1):
    """int64 (..., num_classes): 1 where the last axis equals the id; num_classes -1 means max + 1."""
    ids = tensor._data
    if ids.dtype.kind not in "iu":
        raise RuntimeError("one_hot is only applicable to index tensor of type LongTensor.")
    if num_classes == -1:
        num_classes = int(backend.asnumpy(ids).max()) + 1 if ids.size else 0
    classes = backend.xp.arange(num_classes, dtype=numpy.int64)
    return Tensor(elementwise("one_hot", "a == b", [ids[..., None], classes], compute_dtype=numpy.int64,
                              out_dtype=numpy.int64))


def leaky_relu(input, negative_slope=0.01, inplace=False):
    return tensor_ops.where(input > 0, input, input * negative_slope)


def softplus(input, beta=1.0, threshold=20.0):
    scaled = input * beta
    return tensor_ops.where(scaled > threshold, input, (scaled.exp() + 1).log() / beta)


def mse_loss(input, target, size_average=None, reduce=None, reduction="mean"):
    return _reduced((input - target) ** 2, reduction)


def l1_loss(input, target, size_average=None, reduce=None, reduction="mean"):
    return _reduced((input - target).abs(), reduction)


def _reduced(losses, reduction):
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"{reduction} is not a valid value for reduction")
    return losses if reduction == "none" else losses.mean() if reduction == "mean" else losses.sum()


def normalize(input, p=2.0, dim=1, eps=1e-12):
    """input / max(‖input‖_p over dim, eps)."""
    return input / input.norm(p, dim, keepdim=True).clamp(min=eps)


def batch_norm(input, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1, eps=1e-5):
    """Each channel (axis 1) normalised over the batch and every axis after the channel's: by the batch's mean
    and biased variance when training (then running_mean and running_var, if given, move towards the batch's
    mean and unbiased variance by `momentum`), else by running_mean and running_var; then weight and bias."""
    channels = input.shape[1] if input.ndim > 1 else 0
    for name, statistic in (("running_mean", running_mean), ("running_var", running_var)):
        if statistic is not None and statistic.numel() != channels:
            raise RuntimeError(f"{name} should contain {channels} elements not {statistic.numel()}")
    dims = (0,) + tuple(range(2, input.ndim))
    shape = (1, channels) + (1,) * (input.ndim - 2)
    if training:
        count = input.numel() // max(channels, 1)
        if count <= 1:
            raise ValueError("Expected more than 1 value per channel when training, got input size "
                             f"torch.Size({list(input.shape)})")
        mean = input.mean(dims, keepdim=True)
        variance = input.var(dims, unbiased=False, keepdim=True)
        _move_towards(running_mean, mean, momentum)
        _move_towards(running_var, variance * (count / (count - 1)), momentum)
    elif running_mean is None or running_var is None:
        raise RuntimeError("running_mean and running_var must be defined in evaluation mode")
    else:
        mean, variance = running_mean.reshape(shape), running_var.reshape(shape)
    out = (input - mean) * (variance + eps).rsqrt()
    if weight is not None:
        out = out * weight.reshape(shape)
    out = out if bias is None else out + bias.reshape(shape)
    return out.to(input.dtype)  # a bf16 input with float32 weights stays bf16, as PyTorch's


def _move_towards(running, statistic, momentum):
    """running = (1 - momentum) running + momentum statistic, in place (the buffer stays the same tensor, so
    state_dict's entries see it) and outside every graph."""
    if running is not None:
        running.mul_(1 - momentum).add_(statistic.detach().reshape(running.shape), alpha=momentum)
