"""Attention of the newest positions over a KV cache, for generation (flash-decoding), forward only.

    out = decode_attention_forward(q, keys, values, length)
    decode_attention_store(keys, values, k, v, length)      the new positions' k and v into the cache

q: (B, H, n, d), the queries of the n newest positions, which sit at positions length - n .. length - 1;
keys, values: (B, H_kv, capacity, d), a KV cache whose first `length` positions are filled (the n new ones
included); H_kv divides H, and query head h reads key-value head h // (H / H_kv), with no copy per query head;
length: an int, or an int32 device array of one element, read by the kernel (what a captured CUDA graph
replays while the cache grows). d: any head size from 1 to 256. New position i sees keys 0 .. length - n + i:
out = softmax(q kᵀ / √d) v over those keys, (B, H, n, d). q, keys, values and out are float32, or all bf16
(a model generating in bf16): scores, softmax and sums are float32 either way, out rounded once.

Kernels (kernels/decode_attention.cu): decode_attention_partial cuts the keys into chunks, one block per
(key-value head, chunk), each writing its rows' partial maximum, sum and unnormalised output;
decode_attention_combine merges the chunks by their log-sum-exp, a block per output row. The chunks are sized so that about
BLOCKS_PER_MULTIPROCESSOR blocks per multiprocessor run: at batch 1 there are only H_kv heads to spread.
With a device length the chunks cover the whole capacity (blocks past the end do nothing), so that the grid
does not change from step to step.
"""

import numpy as np

from gpt2_cupy import backend, kernels
from gpt2_cupy.ops.arrays import (FLOAT32, LARGEST_GRID_Y, THREADS_PER_BLOCK, WARP_SIZE, ceil_div, check, output,
                                  storage_c_type, storage_dtype)
from gpt2_cupy.ops.attention import HEAD_SIZES, tile_width  # the fused attention's tiles: D = 32, 64, 128, 256

ROW_CHOICES = (1, 2, 4, 8)         # rows (query heads of a group x new positions) per block, a template parameter
WARPS = 4                          # per block (kernels/decode_attention.cu's WARPS)
COMBINE_THREADS = 128             # per block of the combining kernel (kernels/decode_attention.cu)
KEYS_PER_STEP = 4 * WARPS          # keys a block takes at once: KEYS_AT_ONCE per warp
SMALLEST_CHUNK = 2 * KEYS_PER_STEP
BLOCKS_PER_MULTIPROCESSOR = 8       # measured on an H200 with the caches cold in L2, as in generation


def rows_per_block(rows):
    """The smallest template choice that holds `rows` rows; more rows take several blocks of the largest."""
    return next((r for r in ROW_CHOICES if r >= rows), ROW_CHOICES[-1])


def key_chunks(keys_bound, blocks_per_chunk):
    """(splits, chunk): `splits` chunks of `chunk` keys (a multiple of KEYS_PER_STEP) covering keys_bound keys,
    as many as make about BLOCKS_PER_MULTIPROCESSOR blocks per multiprocessor, none shorter than SMALLEST_CHUNK."""
    wanted = ceil_div(BLOCKS_PER_MULTIPROCESSOR * backend.multiprocessor_count(), blocks_per_chunk)
    splits = max(1, min(wanted, ceil_div(keys_bound, SMALLEST_CHUNK), LARGEST_GRID_Y))
    chunk = ceil_div(ceil_div(keys_bound, splits), KEYS_PER_STEP) * KEYS_PER_STEP
    return ceil_div(keys_bound, chunk), chunk


def decode_attention_forward(q, keys, values, length, *, out=None):
    """out (B, H, n, d): the n newest positions' queries over the first `length` positions of the cache."""
    name = "decode_attention_forward"
    dtype = storage_dtype(name, "q", q)
    sizes = check(name, q=(q, ("B", "H", "n", "d"), dtype), keys=(keys, ("B", "H_kv", "capacity", "d"), dtype),
                  values=(values, ("B", "H_kv", "capacity", "d"), dtype))
    B, H, n, d, key_heads, capacity = (sizes[k] for k in ("B", "H", "n", "d", "H_kv", "capacity"))
    if H % key_heads:
        raise ValueError(f"{name}: keys and values have {key_heads} heads, which does not divide q's {H}: in "
                         "grouped-query attention each key and value head serves the same number of query heads")
    if d not in HEAD_SIZES:
        raise ValueError(f"{name}: the head size d (the last axis of q, keys, values) must be from 1 to "
                         f"{HEAD_SIZES[-1]}, got {d}")
    device_length, host_length = _length(name, length, n, capacity)
    out = output(name, out, q.shape, dtype=dtype)
    if out.size == 0:
        return out
    rows = H // key_heads * n                         # a key-value head's queries: its group's heads x n positions
    width = tile_width(d)
    block_rows = rows_per_block(rows)
    heads, batches = B * key_heads, ceil_div(rows, block_rows)
    if batches > LARGEST_GRID_Y:
        raise ValueError(f"{name}: {n} new positions are too many for one launch; the fused attention "
                         "(gpt2_cupy.ops.attention) is made for long runs of queries")
    splits, chunk = key_chunks(capacity if device_length is not None else host_length, heads * batches)
    partial_out = backend.xp.empty((heads, splits, rows, d), dtype=np.float32)
    partial_max, partial_sum = (backend.xp.empty((heads, splits, rows), dtype=np.float32) for _ in range(2))
    storage = "" if dtype == FLOAT32 else f", {storage_c_type(dtype)}"
    kernel_name = f"decode_attention_partial<{width}, {block_rows}{storage}>"
    kernels.function("decode_attention", kernel_name, name_expressions=(kernel_name,))(
        (heads, splits, batches), (WARPS * WARP_SIZE,),
        (partial_out, partial_max, partial_sum, q, keys, values, 0 if device_length is None else device_length,
         np.int32(host_length), np.int32(rows), np.int32(n), np.int32(capacity), np.int32(chunk), np.int32(d)))
    combine_name = f"decode_attention_combine<{storage_c_type(dtype)}>"
    kernels.function("decode_attention", combine_name, name_expressions=(combine_name,))(
        (heads * rows,), (COMBINE_THREADS,),
        (out, partial_out, partial_max, partial_sum, np.int32(rows), np.int32(splits), np.int32(d)),
        shared_mem=4 * splits)
    return out


def decode_attention_store(keys, values, k, v, length):
    """Copy the n new positions' k and v (B, H_kv, n, d) into the cache keys, values (B, H_kv, capacity, d) at
    positions length - n .. length - 1; length an int or an int32 device array of one element (a CUDA graph
    replays the copy as the cache grows; a device length past the capacity writes nothing)."""
    name = "decode_attention_store"
    dtype = storage_dtype(name, "keys", keys)
    sizes = check(name, keys=(keys, ("B", "H_kv", "capacity", "d"), dtype),
                  values=(values, ("B", "H_kv", "capacity", "d"), dtype), k=(k, ("B", "H_kv", "n", "d"), dtype),
                  v=(v, ("B", "H_kv", "n", "d"), dtype))
    B, key_heads, n, capacity, d = (sizes[name] for name in ("B", "H_kv", "n", "capacity", "d"))
    device_length, host_length = _length(name, length, n, capacity)
    if device_length is None:
        device_length = backend.xp.asarray(np.array([host_length], dtype=np.int32))
    if k.size:
        kernel_name = f"decode_attention_store<{storage_c_type(dtype)}>"
        kernels.function("decode_attention", kernel_name, name_expressions=(kernel_name,))(
            (ceil_div(k.size, THREADS_PER_BLOCK),), (THREADS_PER_BLOCK,),
            (keys, values, k, v, device_length, np.int32(B * key_heads), np.int32(n), np.int32(capacity),
             np.int32(d)))


def _length(operation, length, new_positions, capacity):
    """(device array or None, int): the cache length as the kernel takes it."""
    if isinstance(length, backend.xp.ndarray):
        check(operation, length=(length.reshape(-1), (1,), np.int32))
        return length, 0
    if isinstance(length, (bool, np.bool_)) or not isinstance(length, (int, np.integer)):
        raise TypeError(f"{operation}: length must be an int or an int32 {backend.xp.__name__}.ndarray of one "
                        f"element, got {type(length).__name__}")
    if not new_positions <= length <= capacity:
        raise ValueError(f"{operation}: length = {length}, but the cache holds {capacity} positions and the "
                         f"{new_positions} new queries must be among the first `length`")
    return None, int(length)

