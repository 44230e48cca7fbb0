"""The decode kernel (gpt2_cupy.ops.decode_attention) against a float64 numpy reference written here, and generation
with the KV cache, which runs it at every step after the prompt, against generation that recomputes the whole
sequence at every step.

The reference repeats each key-value head for its group and masks, for new position i of n, the keys after
position length - n + i. Cases: head sizes on and between the tile widths (1, 48, 64, 80, 128, 200, 256), grouped
heads (4 query heads per key head, 1 key head for 8), several new positions at once, caches filled to less than
their capacity, lengths that split into several chunks of keys (and one that does not), and the length given as
a device array.
"""

import math

import numpy as np
import pytest

import gpt2_cupy
from gpt2_cupy import backend
from gpt2_cupy.llama import Llama, LlamaConfig
from gpt2_cupy.model import GPT, GPTConfig
from gpt2_cupy.ops import decode_attention as decode_ops
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
]


@pytest.mark.parametrize("B, H, key_heads, n, capacity, length, d", CASES)
def test_decode_matches_float64(rng, to_device, to_host, B, H, key_heads, n, capacity, length, d):
    q = rng.normal(size=(B, H, n, d)).astype(np.float32)
    keys, values = (rng.normal(size=(B, key_heads, capacity, d)).astype(np.float32) for _ in range(2))
    keys[:, :, length:] = values[:, :, length:] = np.nan   # past the length: never read, or the result would show it
    expected = reference(q, keys, values, length)
    out = decode_attention_forward(to_device(q), to_device(keys), to_device(values), length)
    assert relative_error(to_host(out), expected) < TOLERANCE
    on_device = decode_attention_forward(to_device(q), to_device(keys), to_device(values),
                                         to_device(np.array([length], np.int32)))
    assert relative_error(to_host(on_device), expected) < TOLERANCE


def test_keys_split_into_chunks_as_the_grid_needs():
    # About 8 blocks per multiprocessor (132 on an H100 and on the CPU executor): 8 key heads and 4096 keys
    # make 128 chunks of 32 keys (the shortest chunk); Llama 7B's 32 key heads make 32 chunks of 128; short
    # caches take chunks of at least 32 keys.
    assert decode_ops.BLOCKS_PER_MULTIPROCESSOR == 8 and decode_ops.SMALLEST_CHUNK == 32
    assert decode_ops.key_chunks(4096, 8) == (128, 32)
    assert decode_ops.key_chunks(4096, 32) == (32, 128)
    assert decode_ops.key_chunks(100, 1) == (4, 32)
    assert decode_ops.key_chunks(5, 1) == (1, 16)
    assert decode_ops.rows_per_block(3) == 4 and decode_ops.rows_per_block(12) == 8   # 12 rows: 2 blocks


def test_many_chunks_merge_to_the_same_attention(rng, to_device, to_host, monkeypatch):
    # A small GPU: with 1 multiprocessor the same keys are cut into fewer, longer chunks; the merge by
    # log-sum-exp gives the same attention either way.
    q = rng.normal(size=(1, 2, 1, 32)).astype(np.float32)
    keys, values = (rng.normal(0, 3, size=(1, 2, 700, 32)).astype(np.float32) for _ in range(2))
    expected = reference(q, keys, values, 700)
    many = to_host(decode_attention_forward(to_device(q), to_device(keys), to_device(values), 700))
    monkeypatch.setattr(backend, "multiprocessor_count", lambda: 1)
    assert decode_ops.key_chunks(700, 2)[0] == 4
    few = to_host(decode_attention_forward(to_device(q), to_device(keys), to_device(values), 700))
    assert relative_error(many, expected) < TOLERANCE and relative_error(few, expected) < TOLERANCE


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
