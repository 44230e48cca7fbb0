"""Rotary position embedding (RoPE) of queries and keys, forward and backward, on float32 arrays (chapter 17a);
the forward also on bf16 arrays and from a first position held in device memory (generation).

    y = rope_forward(x, theta=10000.0, start=0, interleaved=False)
    dx = rope_backward(dout, theta=10000.0, start=0, interleaved=False)
    q_heads = rope_store_new_positions(qkv, keys, values, n_heads, theta=10000.0, start=0, interleaved=False)

x, y, dout, dx: (B, T, H, D), the heads of q or k before they are transposed to (B, H, T, D); D even. The
token at sequence index t sits at position start + t (start > 0 for new tokens after a KV cache's). Each
pair of channels that shares frequency i is turned by the angle position * theta^(-2i/D):
    interleaved=False  pairs channel i with i + D/2: Hugging Face's rotate_half, the layout of every
                       transformers Llama checkpoint (its conversion script permutes Meta's q and k rows);
    interleaved=True   pairs channel 2i with 2i + 1: Meta's released llama/model.py (view_as_complex of
                       adjacent channels), llama2.c and the RoFormer paper.
The same weights give different models under the two pairings; permute_for_interleaved converts q_proj
and k_proj weights from one layout to the other.

The backward is the rotation by minus the angle (a rotation's inverse is its transpose), so it needs no
saved tensor. `out=x` rotates in place. The inverse frequencies are computed once per (D, theta) in float32,
as transformers computes them; the angle is their float32 product with the position, in the kernel.
"""

from functools import lru_cache

import numpy as np

from gpt2_cupy import backend, kernels
from gpt2_cupy.elementwise import contiguous, copy
from gpt2_cupy.ops.arrays import (FLOAT32, THREADS_PER_BLOCK, ceil_div, check, check_views, element_offset, output,
                                  rows_apart, storage_c_type, storage_dtype, storage_of)


def inverse_frequencies_host(head_dim, theta):
    """theta^(-2i/D) for i < D/2 as numpy float32: transformers' 1 / theta ** (arange(0, D, 2) / D) in float32."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    return (np.float32(1.0) / np.power(np.float32(theta), exponents)).astype(np.float32)


@lru_cache(maxsize=None)
def inverse_frequencies(head_dim, theta):
    """inverse_frequencies_host on the device, made once per (D, theta)."""
    return backend.xp.asarray(inverse_frequencies_host(head_dim, float(theta)))


def rope_forward(x, *, theta=10000.0, start=0, interleaved=False, out=None):
    """x (B, T, H, D) with each pair of channels rotated by its position's angle; returns y (or out), C-contiguous.
    x float32 or bf16 (y in x's dtype, the angle and the rotation in float32). start: an int, or an int32
    device array of one element (generation in a CUDA graph: the position changes between replays). x may
    be a view whose (b, t) rows are evenly spaced, as q sliced from the q, k, v product's output is: the bf16
    kernel reads it where it lies; any other view is copied first."""
    if x.dtype == FLOAT32 and not isinstance(start, backend.xp.ndarray):
        return _rotate("rope_forward", contiguous(x), theta, start, interleaved, out)
    return _rotate_stored("rope_forward", x, theta, start, interleaved, out)


def rope_backward(dout, *, theta=10000.0, start=0, interleaved=False, out=None):
    """dx of rope_forward with the same options: dout rotated back by minus each angle."""
    return _rotate("rope_backward", dout, theta, start, interleaved, out)


def _rotate(operation, x, theta, start, interleaved, out):
    sizes = check(operation, x=(x, ("B", "T", "H", "D")))
    B, T, H, D = (sizes[name] for name in "BTHD")
    if D % 2:
        raise ValueError(f"{operation}: the head size D = {D} must be even: channels are rotated in pairs")
    if start < 0:
        raise ValueError(f"{operation}: start = {start}; positions start at 0 or later")
    if theta <= 0:
        raise ValueError(f"{operation}: theta = {theta}; the base of the frequencies must be positive")
    out = output(operation, out, x.shape)
    pairs = B * T * H * D // 2
    if pairs:
        kernels.function("rope", operation)(
            (ceil_div(pairs, THREADS_PER_BLOCK),), (THREADS_PER_BLOCK,),
            (out, x, inverse_frequencies(D, theta), np.int32(pairs), np.int32(T), np.int32(H),
             np.int32(D), np.int32(start), np.int32(bool(interleaved))))
    return out


def _rotate_stored(operation, x, theta, start, interleaved, out):
    """rope_forward_stored<floatX>: bf16 arrays, or a start in device memory."""
    dtype = storage_dtype(operation, "x", x)
    sizes = check_views(operation, x=(x, ("B", "T", "H", "D"), dtype))
    x_row = rows_apart(x, row_axes=2)
    if x_row is None:
        x = copy(operation, x)
        x_row = rows_apart(x, row_axes=2)
    B, T, H, D = (sizes[name] for name in "BTHD")
    if D % 2:
        raise ValueError(f"{operation}: the head size D = {D} must be even: channels are rotated in pairs")
    device_start, host_start = _start(operation, start)
    if theta <= 0:
        raise ValueError(f"{operation}: theta = {theta}; the base of the frequencies must be positive")
    out = output(operation, out, x.shape, dtype=dtype)
    pairs = B * T * H * D // 2
    if pairs:
        name = f"rope_forward_stored<{storage_c_type(dtype)}>"
        kernels.function("rope", name, name_expressions=(name,))(
            (ceil_div(pairs, THREADS_PER_BLOCK),), (THREADS_PER_BLOCK,),
            (out, storage_of(x), np.int64(element_offset(x)), np.int64(x_row), inverse_frequencies(D, theta),
             0 if device_start is None else device_start,
             np.int32(host_start), np.int32(pairs), np.int32(T), np.int32(H), np.int32(D),
             np.int32(bool(interleaved))))
    return out


def _start(operation, start):
    """(device array or None, int): the first position as the kernel takes it."""
    if isinstance(start, backend.xp.ndarray):
        check(operation, start=(start.reshape(-1), (1,), np.int32))
        return start, 0
    if start < 0:
        raise ValueError(f"{operation}: start = {start}; positions start at 0 or later")
    return None, int(start)


def rope_store_new_positions(qkv, keys, values, n_heads, *, theta=10000.0, start=0, interleaved=False):
    """Generation's step between the q, k, v product and the decode attention, in one launch. qkv (B, n,
    (H + 2 H_kv) D) holds the n new positions' q, k and v side by side (H = n_heads query heads, H_kv key-value
    heads), as one product with the three weights' rows gives them. q and k are rotated as rope_forward
    rotates them (the same bits); q is returned as (B, H, n, D); k and v are written into the cache keys,
    values (B, H_kv, capacity, D) at positions start .. start + n - 1, as decode_attention_store writes them.
    start: an int or an int32 device array of one element (a captured decode step)."""
    name = "rope_store_new_positions"
    dtype = storage_dtype(name, "qkv", qkv)
    sizes = check(name, qkv=(qkv, ("B", "n", "width"), dtype))
    B, n = sizes["B"], sizes["n"]
    H_kv, D, capacity, device_start = new_positions_arguments(name, B, n, sizes["width"], keys, values, n_heads,
                                                              theta, start, dtype)
    q_heads = backend.xp.empty((B, n_heads, n, D), dtype=dtype)
    pairs = B * n * sizes["width"] // 2
    if pairs:
        kernel_name = f"rope_store_new_positions<{storage_c_type(dtype)}>"
        backend.launch_dependent(
            kernels.function("rope", kernel_name, name_expressions=(kernel_name,)),
            (ceil_div(pairs, THREADS_PER_BLOCK),), (THREADS_PER_BLOCK,),
            (q_heads, keys, values, qkv, inverse_frequencies(D, theta), device_start, np.int32(B),
             np.int32(n), np.int32(n_heads), np.int32(H_kv), np.int32(D), np.int32(capacity),
             np.int32(bool(interleaved))))
    return q_heads


def new_positions_arguments(name, B, n, width, keys, values, n_heads, theta, start, dtype):
    """The checks of rope_store_new_positions (and of gemv_rope_store, which takes the same cache) for q, k, v of
    (B, n, width): (H_kv, D, capacity, device_start), the first position as an int32 device array."""
    sizes = check(name, keys=(keys, ("B", "H_kv", "capacity", "D"), dtype),
                  values=(values, ("B", "H_kv", "capacity", "D"), dtype))
    H_kv, D, capacity = sizes["H_kv"], sizes["D"], sizes["capacity"]
    if sizes["B"] != B:
        raise ValueError(f"{name}: the cache holds {sizes['B']} sequences; the new positions are of {B}")
    if width != (n_heads + 2 * H_kv) * D:
        raise ValueError(f"{name}: qkv's last axis is {width}; {n_heads} query heads and the cache's {H_kv} key "
                         f"and value heads of {D} need {(n_heads + 2 * H_kv) * D}")
    if D % 2:
        raise ValueError(f"{name}: the head size D = {D} must be even: channels are rotated in pairs")
    if theta <= 0:
        raise ValueError(f"{name}: theta = {theta}; the base of the frequencies must be positive")
    device_start, host_start = _start(name, start)
    if device_start is None:
        if host_start + n > capacity:
            raise ValueError(f"{name}: positions {host_start} .. {host_start + n - 1} do not fit a cache of "
                             f"{capacity} positions")
        device_start = backend.xp.asarray(np.array([host_start], dtype=np.int32))
    return H_kv, D, capacity, device_start


def permute_for_interleaved(weight, n_heads):
    """A q_proj or k_proj weight (n_heads * D, C) of the rotate_half layout, its output rows reordered so that
    the interleaved pairing gives the same model: row i of each head goes to 2i, row i + D/2 to 2i + 1.
    (Hugging Face's convert_llama_weights_to_hf.py does the inverse to Meta's weights.) Any array module."""
    rows, columns = weight.shape
    head_dim = rows // n_heads
    by_half = weight.reshape(n_heads, 2, head_dim // 2, columns)        # (heads, which half, i, C)
    return by_half.transpose(0, 2, 1, 3).reshape(rows, columns)         # (heads, i, which half, C)
