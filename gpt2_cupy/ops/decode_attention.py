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
(key-value head, chunk), each writing its rows' partial maximum, sum and unnormalised output; then the chunks are
merged by their log-sum-exp, either by the last block of each head to finish, in the same launch (a counter per
head that the kernel leaves at zero: counters()), or by decode_attention_combine, a thread per output element, in
a second launch. At batch 1 the work is latency, not bandwidth, so a chunk is what the block's warps take in one
step each (every load of a warp in flight at once): each warp waits for memory once. Only a long cache, or many
heads, gives a warp several steps: the chunks grow so that there are at most MOST_SPLITS of them per head and
about BLOCKS_PER_MULTIPROCESSOR blocks per multiprocessor. One chunk writes out directly. With a device length the
chunks cover the whole capacity (blocks past the end do nothing), so that the grid does not change from step to
step.

Choices, timed by bench/decode_attention.py (the figures are in bench/design_choices.json, "decode_attention:
WIDE_WARPS blocks and the merge in the last block"):
- blocks of WIDE_WARPS warps where their grid fits one block per multiprocessor: fewer, fatter chunks, and a
  thread for each element of the merge; else blocks of WARPS;
- the merge in the last block only where it is one round trip to memory: an output element per thread and every
  chunk loaded at once (at most SPLITS_AT_ONCE); otherwise a block merging several elements per thread in turn
  is slower than the second launch.
"""

import numpy as np

from gpt2_cupy import backend, kernels
from gpt2_cupy.ops.arrays import (FLOAT32, LARGEST_GRID_Y, SHARED_BYTES_WITHOUT_OPT_IN, THREADS_PER_BLOCK, WARP_SIZE,
                                  ceil_div, check, counters, float4_aligned, output, storage_c_type, storage_dtype)
from gpt2_cupy.ops.attention import HEAD_SIZES, tile_width  # the fused attention's tiles: D = 32, 64, 128, 256

ROW_CHOICES = (1, 2, 4, 8)         # rows (query heads of a group x new positions) per block, a template parameter
WARPS = 4                          # per block of decode_attention_partial...
WIDE_WARPS = 8                     # ...or this many, where such blocks fit one per multiprocessor
MOST_WARPS = 8                     # kernels/decode_attention.cu's MOST_WARPS (its launch bounds)
COMBINE_THREADS = 128              # per block of decode_attention_combine (kernels/decode_attention.cu)
SPLITS_AT_ONCE = 16                # chunks the merge loads at once (kernels/decode_attention.cu)
MOST_SPLITS = 2 * SPLITS_AT_ONCE   # chunks per head
BLOCKS_PER_MULTIPROCESSOR = 4      # as many blocks of 4 warps as fit beside each other (128 to 168 registers)
MERGE_IN_LAST_BLOCK = True         # where it is one round trip (Launch); False: always decode_attention_combine


def rows_per_block(rows):
    """The smallest template choice that holds `rows` rows; more rows take several blocks of the largest."""
    return next((r for r in ROW_CHOICES if r >= rows), ROW_CHOICES[-1])


def keys_per_warp_step(width, block_rows, itemsize):
    """Keys a warp takes in one step: kernels/decode_attention.cu's KeyLayout<D, ROWS, floatX>::KEYS_PER_STEP.
    A lane loads 16 bytes of a row, so a row of `width` elements takes min(32, width * itemsize / 16) lanes; a
    step is 8, 4 or 2 such loads per lane for 1-2, 4 or 8 rows (half as many for float32 rows of 256)."""
    vector = 16 // itemsize
    lanes_per_key = min(WARP_SIZE, width // vector)
    pieces = width // (lanes_per_key * vector)
    loads = max(1, min(8, 16 // block_rows) // pieces)
    return loads * (WARP_SIZE // lanes_per_key)


def warps_per_block(width, block_rows, warps):
    """`warps`, or fewer where their merge space, warps x rows x (D + 2) floats, would pass
    SHARED_BYTES_WITHOUT_OPT_IN."""
    return max(1, min(warps, MOST_WARPS, SHARED_BYTES_WITHOUT_OPT_IN // (4 * block_rows * (width + 2))))


def key_chunks(keys_bound, block_keys, blocks_per_chunk):
    """(splits, chunk): `splits` chunks of `chunk` keys covering keys_bound keys. A chunk is a multiple of
    block_keys, the keys a block takes in one step of each warp: as short as that where there is room, longer
    where the chunks would pass MOST_SPLITS per head or about BLOCKS_PER_MULTIPROCESSOR blocks per
    multiprocessor (blocks_per_chunk blocks read each chunk: heads x blocks of rows)."""
    room = max(1, ceil_div(BLOCKS_PER_MULTIPROCESSOR * backend.multiprocessor_count(), blocks_per_chunk))
    splits = max(1, min(ceil_div(keys_bound, block_keys), MOST_SPLITS, room, LARGEST_GRID_Y))
    chunk = ceil_div(ceil_div(keys_bound, splits), block_keys) * block_keys
    return ceil_div(keys_bound, chunk), chunk


def merge_in_last_block(splits, block_rows, d, warps):
    """Whether the last block of each head merges the chunks (else decode_attention_combine, a second launch):
    where there are chunks to merge and the merge is one round trip to memory, an output element per thread
    (block_rows x d of them) and every chunk loaded at once (at most SPLITS_AT_ONCE)."""
    return MERGE_IN_LAST_BLOCK and 1 < splits <= SPLITS_AT_ONCE and block_rows * d <= warps * WARP_SIZE


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
    launch = Launch.of(q, keys, values, d, B * key_heads, H // key_heads * n, capacity, device_length, host_length)
    if launch.batches > LARGEST_GRID_Y:
        raise ValueError(f"{name}: {n} new positions are too many for one launch; the fused attention "
                         "(gpt2_cupy.ops.attention) is made for long runs of queries")
    partials = launch.partial_buffers()
    merge_counters = counters(launch.heads * launch.batches) if launch.merge_in_last_block else None
    _partial(launch, out, *partials, merge_counters, q, keys, values, device_length, host_length, n)
    if launch.splits > 1 and not launch.merge_in_last_block:
        _combine(launch, out, *partials)
    return out


class Launch:
    """The launch shape of one decode: heads (B x H_kv), rows per head, blocks of rows, warps, chunks, and who
    merges the chunks."""

    def __init__(self, dtype, d, heads, rows, keys_bound, vector_loads):
        self.dtype, self.d, self.heads, self.rows, self.vector_loads = dtype, d, heads, rows, vector_loads
        self.width = tile_width(d)
        self.block_rows = rows_per_block(rows)
        self.batches = ceil_div(rows, self.block_rows)
        warp_keys = keys_per_warp_step(self.width, self.block_rows, dtype.itemsize)
        for warps in (WIDE_WARPS, WARPS):  # wide blocks where their grid fits one block per multiprocessor
            self.warps = warps_per_block(self.width, self.block_rows, warps)
            self.splits, self.chunk = key_chunks(keys_bound, self.warps * warp_keys, heads * self.batches)
            if heads * self.batches * self.splits <= backend.multiprocessor_count():
                break
        self.merge_in_last_block = merge_in_last_block(self.splits, self.block_rows, d, self.warps)

    @classmethod
    def of(cls, q, keys, values, d, heads, rows, capacity, device_length, host_length):
        keys_bound = capacity if device_length is not None else host_length
        vector_loads = d == tile_width(d) and float4_aligned(q, keys, values)  # every row on 16 bytes
        return cls(q.dtype, d, heads, rows, keys_bound, vector_loads)

    def partial_buffers(self):
        """partial_out, partial_max, partial_sum for the chunks to merge (None with one chunk)."""
        if self.splits == 1:
            return None, None, None
        partial_out = backend.xp.empty((self.heads, self.splits, self.rows, self.d), dtype=np.float32)
        partial_max, partial_sum = (backend.xp.empty((self.heads, self.splits, self.rows), dtype=np.float32)
                                    for _ in range(2))
        return partial_out, partial_max, partial_sum


def _partial(launch, out, partial_out, partial_max, partial_sum, merge_counters, q, keys, values, device_length,
             host_length, new_positions):
    """decode_attention_partial: the chunks' partial results, merged in its last blocks where merge_counters is
    not None (else by _combine), or out itself with one chunk."""
    storage = "" if launch.dtype == FLOAT32 else f", {storage_c_type(launch.dtype)}"
    vector = "true" if launch.vector_loads else "false"
    kernel_name = f"decode_attention_partial<{launch.width}, {launch.block_rows}, {vector}{storage}>"
    capacity = keys.shape[2]
    backend.launch_dependent(
        kernels.function("decode_attention", kernel_name, name_expressions=(kernel_name,)),
        (launch.heads, launch.splits, launch.batches), (launch.warps * WARP_SIZE,),
        (out, _pointer(partial_out), _pointer(partial_max), _pointer(partial_sum), _pointer(merge_counters), q, keys,
         values, _pointer(device_length), np.int32(host_length), np.int32(launch.rows), np.int32(new_positions),
         np.int32(capacity), np.int32(launch.chunk), np.int32(launch.d)),
        shared_mem=4 * launch.warps * launch.block_rows * (launch.width + 2))


def _combine(launch, out, partial_out, partial_max, partial_sum):
    """decode_attention_combine: out from the chunks' partial results, a thread per element."""
    combine_name = f"decode_attention_combine<{storage_c_type(launch.dtype)}>"
    backend.launch_dependent(
        kernels.function("decode_attention", combine_name, name_expressions=(combine_name,)),
        (ceil_div(launch.heads * launch.rows * launch.d, COMBINE_THREADS),), (COMBINE_THREADS,),
        (out, partial_out, partial_max, partial_sum, np.int32(launch.heads), np.int32(launch.rows),
         np.int32(launch.splits), np.int32(launch.d)))


def _pointer(array):
    """An array as a kernel argument, or a null pointer for None."""
    return 0 if array is None else array


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

