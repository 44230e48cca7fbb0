"""The decode kernel (gpt2_cupy.ops.decode_attention) against a float64 numpy reference written here, and generation
with the KV cache, which runs it at every step after the prompt, against generation that recomputes the whole
sequence at every step.

The reference repeats each key-value head for its group and masks, for new position i of n, the keys after
position length - n + i. Cases, in float32 and in bf16 (within one rounding of the output): head sizes on and
between the tile widths (1, 32, 37, 48, 64, 80, 128, 200, 256), grouped heads (3 or 4 query heads per key head, 1
key head for 8), several new positions at once, caches filled to less than their capacity, Llama 3.2 1B's and
Llama 2 7B's heads, lengths that split into several chunks of keys (and one that does not), the length given as a
device array and through a captured graph replayed as it grows, every way of cutting the keys (warps per block,
steps per warp, chunks merged by their last block or by a second launch), arrays that do not start on 16 bytes,
and the CPU executor's race and bounds checks.
"""

import math

import numpy as np
import pytest

import gpt2_cupy
from gpt2_cupy import backend, kernels
from gpt2_cupy.llama import Llama, LlamaConfig
from gpt2_cupy.model import GPT, GPTConfig
from gpt2_cupy.ops import decode_attention as decode_ops
from gpt2_cupy.ops.arrays import BFLOAT16
from gpt2_cupy.ops.decode_attention import decode_attention_forward
from gpt2_cupy.testing import relative_error

TOLERANCE = 1e-5


def reference(q, keys, values, length):
    """(B, H, n, d) in float64: softmax(q kᵀ / √d) v over keys 0 .. length - n + i for new position i."""
    q, keys, values = (np.asarray(a, dtype=np.float64) for a in (q, keys, values))
    n, d = q.shape[-2:]
    group = q.shape[1] // keys.shape[1]
    keys, values = (np.repeat(a[:, :, :length], group, axis=1) for a in (keys, values))   # (B, H, length, d)
    scores = q @ np.swapaxes(keys, -1, -2) / math.sqrt(d)                               # (B, H, n, length)
    future = np.arange(length)[None, :] > (length - n + np.arange(n))[:, None]
    scores = np.where(future, -np.inf, scores)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return weights / weights.sum(axis=-1, keepdims=True) @ values


def test_reference_is_attention_of_the_last_rows(rng):
    # The reference against the definition written another way: causal attention over the whole sequence, of
    # which the decode step computes the last n rows (one key-value head per query head here).
    q, k, v = (rng.normal(size=(1, 2, 9, 4)) for _ in range(3))
    scores = np.where(np.tril(np.ones((9, 9), bool)), q @ np.swapaxes(k, -1, -2) / 2.0, -np.inf)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    whole = weights / weights.sum(axis=-1, keepdims=True) @ v
    assert relative_error(reference(q[:, :, 6:], k, v, 9), whole[:, :, 6:]) < 1e-12


CASES = [  # (B, H, H_kv, n, capacity, length, d)
    (1, 4, 1, 1, 100, 77, 64),       # one key head for 4 query heads, one new position
    (2, 8, 2, 1, 300, 300, 128),     # Llama's head size, a full cache, several chunks of keys
    (1, 3, 3, 3, 40, 25, 48),        # no grouping, 3 new positions (causal among them), a padded head
    (1, 2, 1, 5, 20, 9, 80),
    (1, 8, 1, 1, 64, 33, 256),       # 8 query heads per key head: 8 rows in a block
    (1, 4, 1, 3, 30, 30, 64),        # 12 rows (4 heads x 3 new positions): two blocks of 8
    (1, 2, 2, 2, 50, 2, 1),          # the prompt's own keys only; a head of one float
    (1, 4, 2, 1, 600, 517, 200),
    (1, 32, 8, 1, 700, 600, 64),     # Llama 3.2 1B: groups of 4, 11 chunks of 64 keys
    (1, 32, 8, 3, 700, 600, 64),     # ... with 3 new positions: 12 rows
    (1, 32, 32, 1, 650, 600, 128),   # Llama 2 7B: no grouping
    (1, 4, 2, 2, 90, 70, 32),
    (1, 6, 2, 1, 130, 129, 37),      # an odd head size, 3 heads a group
]
BF16_ROUNDING = 2.0 ** -8
DTYPES = [np.float32, BFLOAT16]


def case_arrays(rng, B, H, key_heads, n, capacity, length, d, dtype=np.float32):
    """q, keys, values as numpy arrays of dtype; past the length the cache holds NaN, which must never be read."""
    q = rng.normal(size=(B, H, n, d)).astype(dtype)
    keys, values = (rng.normal(size=(B, key_heads, capacity, d)).astype(dtype) for _ in range(2))
    keys[:, :, length:] = values[:, :, length:] = np.nan
    return q, keys, values


def tolerance(dtype):
    """float32: the float32 sums' error; bf16: one rounding of the output (float32 inside), as a bound."""
    return TOLERANCE if dtype == np.float32 else 2 * BF16_ROUNDING


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bf16"])
@pytest.mark.parametrize("B, H, key_heads, n, capacity, length, d", CASES)
def test_decode_matches_float64(rng, to_device, to_host, B, H, key_heads, n, capacity, length, d, dtype):
    q, keys, values = case_arrays(rng, B, H, key_heads, n, capacity, length, d, dtype)
    expected = reference(q, keys, values, length)
    out = decode_attention_forward(to_device(q), to_device(keys), to_device(values), length)
    assert out.dtype == dtype
    assert relative_error(to_host(out), expected) < tolerance(dtype)
    on_device = decode_attention_forward(to_device(q), to_device(keys), to_device(values),
                                         to_device(np.array([length], np.int32)))
    assert relative_error(to_host(on_device), expected) < tolerance(dtype)


def test_keys_split_into_chunks_as_the_grid_needs():
    # A warp takes 16 keys a step at Llama's shapes in bf16: 4 loads of 4 keys (d = 64, 8 lanes a key) for a
    # group of 4 rows, 8 loads of 2 keys (d = 128, 16 lanes a key) for one row; float32 rows of 64 take 16 lanes.
    assert decode_ops.keys_per_warp_step(64, 4, 2) == 16 and decode_ops.keys_per_warp_step(128, 1, 2) == 16
    assert decode_ops.keys_per_warp_step(64, 4, 4) == 8 and decode_ops.keys_per_warp_step(32, 8, 2) == 16
    assert decode_ops.keys_per_warp_step(256, 8, 4) == 1 and decode_ops.keys_per_warp_step(256, 1, 4) == 4
    # Fewer warps only where their merge space would pass 48 KiB of shared memory.
    assert decode_ops.warps_per_block(256, 8, 8) == 5 and decode_ops.warps_per_block(64, 4, 8) == 8
    # A chunk is one step of every warp where there is room: a cache of 700 positions is 11 chunks of 64 for 4
    # warps, at Llama 3.2 1B's 8 key heads and at Llama 2 7B's 32. At most 32 chunks a head (longer chunks for a
    # long cache), about 4 blocks per multiprocessor (132 on an H100 and on the CPU executor: 128 heads leave room
    # for 5 chunks, of which 4 of 192 keys cover the cache), and one chunk for a short cache.
    assert decode_ops.BLOCKS_PER_MULTIPROCESSOR == 4 and decode_ops.MOST_SPLITS == 32
    assert decode_ops.key_chunks(700, 64, 8) == (11, 64) and decode_ops.key_chunks(700, 64, 32) == (11, 64)
    assert decode_ops.key_chunks(8192, 64, 8) == (32, 256)
    assert decode_ops.key_chunks(700, 64, 128) == (4, 192)
    assert decode_ops.key_chunks(5, 64, 1) == (1, 64)
    assert decode_ops.rows_per_block(3) == 4 and decode_ops.rows_per_block(12) == 8   # 12 rows: 2 blocks
    source = kernels.source("decode_attention")   # the constants the op shares with the kernels
    for name in ("MOST_WARPS", "SPLITS_AT_ONCE", "COMBINE_THREADS"):
        assert f"#define {name} {getattr(decode_ops, name)} " in source.replace("\n", " \n")

    def launch(B, key_heads, group, d, capacity):
        shape = decode_ops.Launch(BFLOAT16, d, B * key_heads, group, capacity, True)
        return shape.warps, shape.splits, shape.chunk, shape.merge_in_last_block

    # Llama 3.2 1B: blocks of 8 warps fit one per multiprocessor (8 x 6 of them), and the last block of a head
    # merges its 4 rows x 64 columns with its 256 threads. Llama 2 7B: 8 warps would make 32 x 6 blocks, so 4 warps,
    # and 128 threads for its row of 128. At batch 8, or with a long cache, a second launch merges.
    assert launch(1, 8, 4, 64, 700) == (8, 6, 128, True)
    assert launch(1, 32, 1, 128, 650) == (4, 11, 64, True)
    assert launch(8, 8, 4, 64, 700) == (4, 6, 128, False)
    assert launch(1, 8, 4, 64, 4096) == (4, 32, 128, False)


POLICIES = {  # name: {attribute of the op's module: value} for the launch
    "as is": {},
    "1 warp a block": {"WIDE_WARPS": 1, "WARPS": 1},
    "4 warps a block": {"WIDE_WARPS": 4},
    "8 warps a block": {"WARPS": 8},
    "2 chunks: several steps per warp": {"MOST_SPLITS": 2},
    "one chunk: no merge": {"MOST_SPLITS": 1},
    "merged by a second launch": {"MERGE_IN_LAST_BLOCK": False},
    "merged in the last block, several elements a thread": {"merge_in_last_block": lambda splits, *_: splits > 1},
}


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bf16"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("B, H, key_heads, n, capacity, length, d",
                         [(1, 8, 2, 1, 700, 600, 64), (1, 4, 4, 2, 300, 257, 128), (2, 4, 1, 1, 200, 199, 80)])
def test_every_chunking_gives_the_same_attention(rng, to_device, to_host, monkeypatch, policy, dtype, B, H,
                                                 key_heads, n, capacity, length, d):
    # The merge by log-sum-exp gives the same attention however the keys are cut: between warps, between the
    # steps of a warp, between chunks (merged by the last block of a head, or by decode_attention_combine), or not
    # at all (one chunk writes out itself).
    for name, value in POLICIES[policy].items():
        monkeypatch.setattr(decode_ops, name, value)
    q, keys, values = case_arrays(rng, B, H, key_heads, n, capacity, length, d, dtype)
    expected = reference(q, keys, values, length)
    for given in (length, to_device(np.array([length], np.int32))):
        out = decode_attention_forward(to_device(q), to_device(keys), to_device(values), given)
        assert relative_error(to_host(out), expected) < tolerance(dtype)


def test_many_chunks_merge_to_the_same_attention(rng, to_device, to_host, monkeypatch):
    # A small GPU: with 1 multiprocessor the same keys are cut into fewer, longer chunks; the merge by
    # log-sum-exp gives the same attention either way.
    q = rng.normal(size=(1, 2, 1, 32)).astype(np.float32)
    keys, values = (rng.normal(0, 3, size=(1, 2, 700, 32)).astype(np.float32) for _ in range(2))
    expected = reference(q, keys, values, 700)
    assert decode_ops.key_chunks(700, 128, 2) == (6, 128)   # 4 warps of 32 keys (d = 32 in float32: 8 lanes a key)
    many = to_host(decode_attention_forward(to_device(q), to_device(keys), to_device(values), 700))
    monkeypatch.setattr(backend, "multiprocessor_count", lambda: 1)
    assert decode_ops.key_chunks(700, 128, 2) == (2, 384)
    few = to_host(decode_attention_forward(to_device(q), to_device(keys), to_device(values), 700))
    assert relative_error(many, expected) < TOLERANCE and relative_error(few, expected) < TOLERANCE


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bf16"])
def test_arrays_off_16_bytes_are_read_element_by_element(rng, to_device, to_host, dtype):
    # A view that starts one element into its allocation cannot be read 16 bytes at a time, even with d = 64.
    q, keys, values = case_arrays(rng, 1, 4, 2, 2, 90, 75, 64, dtype)
    expected = reference(q, keys, values, 75)

    def shifted(array):
        whole = to_device(np.concatenate([np.zeros(1, dtype), array.ravel()]))
        return whole[1:].reshape(array.shape)

    assert not decode_ops.float4_aligned(shifted(keys))
    out = decode_attention_forward(shifted(q), shifted(keys), shifted(values), 75)
    assert relative_error(to_host(out), expected) < tolerance(dtype)


def merged_in_last_block(monkeypatch, in_last_block):
    """Every launch with chunks merged by their last block (True) or by decode_attention_combine (False)."""
    monkeypatch.setattr(decode_ops, "merge_in_last_block", lambda splits, *_: in_last_block and splits > 1)


@pytest.mark.parametrize("in_last_block", [True, False], ids=["merged in the last block", "merged by a launch"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bf16"])
def test_a_captured_graph_follows_the_device_length(rng, to_device, to_host, monkeypatch, dtype, in_last_block):
    # One capture, replayed as the cache grows: the grid covers the capacity, chunks past the length do nothing,
    # and the last block of each head leaves its counter at zero for the next replay.
    from gpt2_cupy.graphs import CUDAGraph, graph, graph_pool_handle, use_pool

    merged_in_last_block(monkeypatch, in_last_block)

    B, H, key_heads, n, capacity, d = 1, 8, 2, 1, 300, 64
    q, keys, values = case_arrays(rng, B, H, key_heads, n, capacity, capacity, d, dtype)
    q_device, keys_device, values_device = to_device(q), to_device(keys), to_device(values)
    length = to_device(np.array([1], np.int32))
    pool, captured = graph_pool_handle(), CUDAGraph()
    with use_pool(pool):
        out = decode_attention_forward(q_device, keys_device, values_device, length)
    with graph(captured, pool=pool):
        decode_attention_forward(q_device, keys_device, values_device, length, out=out)
    for grown in (1, 63, 64, 65, 200, 300, 300):
        backend.copy_into(length, np.array([grown], np.int32))
        captured.replay()
        assert relative_error(to_host(out), reference(q, keys, values, grown)) < tolerance(dtype)
    assert not decode_ops.counters(1).any()


@pytest.mark.parametrize("in_last_block", [True, False], ids=["merged in the last block", "merged by a launch"])
def test_no_races_and_nothing_read_out_of_bounds(rng, monkeypatch, in_last_block):
    # The CPU executor's checks: every load and store of each launch, between the threads of a block (the warps'
    # merge in shared memory) and between blocks (the partial results, ordered by __threadfence and the ticket).
    merged_in_last_block(monkeypatch, in_last_block)
    for B, H, key_heads, n, capacity, length, d in [(1, 8, 2, 1, 300, 250, 64), (1, 4, 1, 3, 90, 61, 80)]:
        arrays = case_arrays(rng, B, H, key_heads, n, capacity, length, d)
        q, keys, values = (backend.xp.asarray(a) for a in arrays)
        with backend.checks(bounds=True, races=True):
            out = decode_attention_forward(q, keys, values, backend.xp.asarray(np.array([length], np.int32)))
        assert relative_error(backend.asnumpy(out), reference(*arrays, length)) < TOLERANCE


def test_bad_arguments(to_device):
    q = to_device(np.zeros((1, 4, 1, 32), np.float32))
    cache = to_device(np.zeros((1, 3, 10, 32), np.float32))
    with pytest.raises(ValueError, match="decode_attention_forward: keys and values have 3 heads"):
        decode_attention_forward(q, cache, cache, 5)
    cache = to_device(np.zeros((1, 2, 10, 32), np.float32))
    with pytest.raises(ValueError, match="length = 11, but the cache holds 10 positions"):
        decode_attention_forward(q, cache, cache, 11)
    with pytest.raises(ValueError, match="length = 0"):
        decode_attention_forward(q, cache, cache, 0)
    with pytest.raises(TypeError, match="length must be an int"):
        decode_attention_forward(q, cache, cache, 2.0)
    with pytest.raises(TypeError, match="length has dtype int64; it must be int32"):
        decode_attention_forward(q, cache, cache, to_device(np.array([3])))
    with pytest.raises(ValueError, match="decode_attention_forward: values"):
        decode_attention_forward(q, cache, to_device(np.zeros((1, 2, 9, 32), np.float32)), 3)
    wide = to_device(np.zeros((1, 2, 10, 257), np.float32))
    with pytest.raises(ValueError, match="head size d .* from 1 to 256, got 257"):
        decode_attention_forward(to_device(np.zeros((1, 4, 1, 257), np.float32)), wide, wide, 3)


# ---- generation: the cache against recomputing everything -------------------------------------------------

def greedy(model, prompt, steps, with_cache):
    """The prompt (B, T) followed by `steps` greedy tokens, and the logits of each new token's position."""
    ids, logits_seen = prompt, []
    with gpt2_cupy.no_grad():
        if with_cache:
            cache = model.new_kv_cache(prompt.shape[0], prompt.shape[1] + steps)
            logits, _ = model(backend.xp.asarray(prompt), kv_cache=cache)
        for step in range(steps):
            if not with_cache:
                logits, _ = model(backend.xp.asarray(ids))              # the whole sequence again
            last = backend.asnumpy(logits.data)[:, -1]
            logits_seen.append(last)
            token = last.argmax(axis=-1).astype(np.int32)[:, None]
            ids = np.concatenate([ids, token], axis=1)
            if with_cache and step < steps - 1:
                logits, _ = model(backend.xp.asarray(token), kv_cache=cache)   # one position: the decode kernel
    return ids, np.stack(logits_seen, axis=1)


def test_gpt2_greedy_generation_with_the_cache_equals_recomputing(rng):
    gpt2_cupy.manual_seed(3)
    model = GPT(GPTConfig(block_size=32, vocab_size=61, n_layer=2, n_head=4, n_embd=80))   # heads of 20
    model.eval()
    prompt = rng.integers(0, 61, size=(2, 5)).astype(np.int32)
    cached_ids, cached_logits = greedy(model, prompt, 12, with_cache=True)
    whole_ids, whole_logits = greedy(model, prompt, 12, with_cache=False)
    assert np.array_equal(cached_ids, whole_ids)
    assert relative_error(cached_logits, whole_logits) < 1e-5
