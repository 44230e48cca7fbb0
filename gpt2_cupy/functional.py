"""PyTorch's torch.nn.functional names, each a small Function around one op pair of gpt2_cupy.ops.

    F.linear(x, weight, bias=None)                     F.gelu(x, approximate="tanh")
    F.layer_norm(x, (C,), weight, bias, eps=1e-5)      F.dyt(x, alpha, weight, bias)
    F.embedding(idx, weight)                           F.dropout(x, p=0.5, training=True)
    F.softmax(x, dim=-1)                               F.cross_entropy(logits, targets, ignore_index=-100)
    F.scaled_dot_product_attention(q, k, v, is_causal=True)     F.relu_attention(q, k, v, is_causal=True)
    add(a, b), reshape(x, shape), transpose(x, dim0, dim1), split(x, size, dim): Tensor's +, .reshape, ...

Each forward calls the op's X_forward and saves what X_backward needs; each backward calls X_backward
with the upstream gradient and hands the op the parameters' own gradient buffers (ctx.grad_buffer),
so that parameter gradients are added in place and only activation gradients come back to the tape.

reshape, transpose and split move data and do no arithmetic: they use the array module's own
operations (a reshape of a C-contiguous array is free; transpose and split copy into a C-contiguous
array, because every kernel reads its arguments as one flat C-contiguous block).
"""

import numpy

from gpt2_cupy import backend
from gpt2_cupy.autograd import Function, Tensor, dropout_rng_state
from gpt2_cupy.ops.attention import attention_backward, attention_forward
from gpt2_cupy.ops.cross_entropy import cross_entropy_backward, cross_entropy_forward
from gpt2_cupy.ops.dropout import advance_rng_state, dropout_backward, dropout_forward
from gpt2_cupy.ops.dyt import dyt_backward, dyt_forward
from gpt2_cupy.ops.embedding import embedding_backward, embedding_forward
from gpt2_cupy.ops.gelu import gelu_backward, gelu_forward
from gpt2_cupy.ops.layernorm import layernorm_backward, layernorm_forward
from gpt2_cupy.ops.linear import linear_backward, linear_forward
from gpt2_cupy.ops.residual import residual_forward
from gpt2_cupy.ops.softmax import softmax_backward, softmax_forward


# ---- arithmetic ------------------------------------------------------------------------------------------

class Linear(Function):
    @staticmethod
    def forward(ctx, x, weight, bias=None):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return linear_forward(x, weight, bias)

    @staticmethod
    def backward(ctx, dout):
        x, weight = ctx.saved_tensors
        dbias = ctx.grad_buffer(2) if ctx.has_bias else None
        dx = linear_backward(dout, x, weight, dweight=ctx.grad_buffer(1), dbias=dbias)
        return dx, None, None


def linear(x, weight, bias=None):
    """y = x Wᵀ + b; x (..., C_in), weight (C_out, C_in), bias (C_out,) or None."""
    return Linear.apply(x, weight, bias)


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


def gelu(x, approximate="tanh"):
    """GELU(x) elementwise: "tanh" (GPT-2's approximation) or "none" (the exact erf form)."""
    return GELU.apply(x, approximate)


class Add(Function):
    @staticmethod
    def forward(ctx, a, b):
        if a.shape != b.shape:
            raise ValueError(f"add: shapes {a.shape} and {b.shape} differ; this + does not broadcast")
        return residual_forward(a, b)

    @staticmethod
    def backward(ctx, dout):
        return dout, dout  # the add node hands its gradient unchanged to both inputs (chapter 03)


def add(a, b):
    """a + b, elementwise, for two tensors of one shape (the residual connection)."""
    return Add.apply(a, b)


class LayerNorm(Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
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
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids)
        return embedding_forward(ids, weight)

    @staticmethod
    def backward(ctx, dout):
        (ids,) = ctx.saved_tensors
        # The forward checked these ids already; checking again would cost a second wait for the GPU.
        embedding_backward(dout, ids, dweight=ctx.grad_buffer(1), check_ids=False)
        return None, None


def embedding(idx, weight):
    """The rows weight[idx]; idx an integer backend array (any shape), converted to int32 if needed."""
    return Embedding.apply(_int32(idx, "embedding", "idx"), weight)


class Dropout(Function):
    @staticmethod
    def forward(ctx, x, p):
        rng_state = dropout_rng_state()
        ctx.rng_state = rng_state.copy()  # the backward regenerates the forward's mask from this state
        ctx.p = p
        y = dropout_forward(x, p, ctx.rng_state)
        advance_rng_state(rng_state, x.size)  # the next call draws fresh numbers
        return y

    @staticmethod
    def backward(ctx, dout):
        return dropout_backward(dout, ctx.p, ctx.rng_state), None


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
    """Softmax over the last axis (the only one the kernel reduces over)."""
    if dim not in (-1, x.ndim - 1):
        raise ValueError(f"softmax: dim={dim}; only the last axis (dim=-1) is supported")
    return Softmax.apply(x)


class Attention(Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, variant):
        out, lse = attention_forward(q, k, v, causal=causal, variant=variant)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.variant = causal, variant
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = attention_backward(dout, q, k, v, out, lse, causal=ctx.causal, variant=ctx.variant)
        return dq, dk, dv, None, None


def scaled_dot_product_attention(q, k, v, is_causal=True):
    """softmax(q kᵀ / √d) v, each query seeing keys up to its own position; q, k, v (B, H, T, d)."""
    return Attention.apply(q, k, v, is_causal, "softmax")


def relu_attention(q, k, v, is_causal=True):
    """Attention with ReLU in place of softmax (chapter 08's variant); q, k, v (B, H, T, d)."""
    return Attention.apply(q, k, v, is_causal, "relu")


class CrossEntropy(Function):
    @staticmethod
    def forward(ctx, logits, targets, ignore_index):
        loss, lse = cross_entropy_forward(logits, targets, ignore_index=ignore_index)
        ctx.save_for_backward(logits, targets, lse)
        ctx.ignore_index = ignore_index
        return loss

    @staticmethod
    def backward(ctx, dout):
        logits, targets, lse = ctx.saved_tensors
        dlogits = cross_entropy_backward(dout, logits, targets, lse, ignore_index=ctx.ignore_index)
        return dlogits, None, None


def cross_entropy(logits, targets, ignore_index=-100):
    """The mean of -log softmax(logits)[target] over targets != ignore_index; logits (N, V), targets (N,)."""
    if isinstance(targets, Tensor):
        targets = targets.data
    return CrossEntropy.apply(logits, _int32(targets, "cross_entropy", "targets"), ignore_index)


# ---- data movement ---------------------------------------------------------------------------------------

class Reshape(Function):
    @staticmethod
    def forward(ctx, x, shape):
        ctx.input_shape = x.shape
        return x.reshape(shape)  # a view: x is C-contiguous

    @staticmethod
    def backward(ctx, dout):
        return dout.reshape(ctx.input_shape), None


def reshape(x, shape):
    return Reshape.apply(x, tuple(shape))


class Transpose(Function):
    @staticmethod
    def forward(ctx, x, dim0, dim1):
        ctx.dims = (dim0, dim1)
        return backend.xp.ascontiguousarray(backend.xp.swapaxes(x, dim0, dim1))  # a copy, C-contiguous

    @staticmethod
    def backward(ctx, dout):
        return backend.xp.ascontiguousarray(backend.xp.swapaxes(dout, *ctx.dims)), None, None


def transpose(x, dim0, dim1):
    return Transpose.apply(x, dim0, dim1)


class Split(Function):
    @staticmethod
    def forward(ctx, x, split_size, dim):
        ctx.dim = dim
        pieces = [backend.xp.ascontiguousarray(piece)  # copies: a slice along a later axis has gaps
                  for piece in backend.xp.split(x, range(split_size, x.shape[dim], split_size), axis=dim)]
        return tuple(pieces)

    @staticmethod
    def backward(ctx, *douts):
        return backend.xp.concatenate(douts, axis=ctx.dim), None, None


def split(x, split_size, dim=-1):
    """Pieces of split_size along dim (the last one shorter when it does not divide), each a copy."""
    return Split.apply(x, split_size, dim)


def _int32(ids, operation, name):
    """ids as a C-contiguous int32 backend array (token ids fit easily in 32 bits)."""
    if not isinstance(ids, backend.xp.ndarray):
        raise TypeError(f"{operation}: {name} must be a {backend.xp.__name__}.ndarray of integers, "
                        f"got {type(ids).__name__}")
    if ids.dtype.kind not in "iu":
        raise TypeError(f"{operation}: {name} has dtype {ids.dtype}; it must hold integers")
    return backend.xp.ascontiguousarray(ids, dtype=numpy.int32)

