"""Llama in bf16 for generation, on small shapes: the bf16 ops of the decode path against float64 numpy, the bf16
model's logits against the float32 model's with the same weights, the decode step captured as a CUDA graph
against eager decoding, and the errors for what bf16 weights are not for.

bf16 keeps 8 significant bits: an op that computes in float32 and rounds once is within 2^-8 of the exact
result, relative; a model of a few such layers is compared with its float32 self within 3 % of the largest
logit (the rounding of every activation, weight and cache entry adds up over the layers).
"""

import math

import numpy as np
import pytest

import gpt2_cupy
from gpt2_cupy import backend, no_grad
from gpt2_cupy.random import manual_seed
from gpt2_cupy.llama import Llama, LlamaConfig
from gpt2_cupy.ops.arrays import BFLOAT16
from gpt2_cupy.ops.decode_attention import decode_attention_forward, decode_attention_store
from gpt2_cupy.ops.rmsnorm import rmsnorm_forward
from gpt2_cupy.ops.rope import rope_forward, rope_store_new_positions
from gpt2_cupy.ops.swiglu import swiglu_forward
from gpt2_cupy.testing import relative_error

BF16_ROUNDING = 2.0 ** -8
CONFIG = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)


def host(array):
    return np.asarray(backend.asnumpy(array), dtype=np.float64)


def bf16(rng, *shape):
    return backend.xp.asarray(rng.normal(size=shape).astype(BFLOAT16))


def test_rmsnorm_swiglu_rope_in_bf16(rng):
    x, weight = bf16(rng, 3, 130), bf16(rng, 130)
    y, rstd = rmsnorm_forward(x, weight)
    x64 = host(x)
    exact = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-6) * host(weight)
    assert y.dtype == BFLOAT16 and rstd.dtype == np.float32
    assert np.all(np.abs(host(y) - exact) <= BF16_ROUNDING * np.abs(exact) + 1e-5 * np.abs(exact).max())

    gate, up = bf16(rng, 5, 37), bf16(rng, 5, 37)
    g64 = host(gate)
    exact = g64 / (1 + np.exp(-g64)) * host(up)
    assert np.all(np.abs(host(swiglu_forward(gate, up)) - exact) <= BF16_ROUNDING * np.abs(exact) + 1e-6)

    # RoPE in bf16 and from a device position: the float32 rotation of the same values at the same position,
    # rounded once (the angle is float32 in both).
    q = bf16(rng, 1, 3, 2, 16)
    as_float32 = rope_forward(q.astype(np.float32), start=5)
    for start in (5, backend.xp.asarray(np.array([5], dtype=np.int32))):
        rotated = rope_forward(q, start=start)
        assert rotated.dtype == BFLOAT16
        assert np.all(np.abs(host(rotated) - host(as_float32)) <= BF16_ROUNDING * np.abs(host(as_float32)))
    assert np.array_equal(host(rope_forward(q.astype(np.float32), start=backend.xp.asarray(
        np.array([5], dtype=np.int32)))), host(as_float32))


def test_decode_attention_and_store_in_bf16(rng):
    B, H, H_kv, n, d, capacity, length = 1, 4, 2, 1, 64, 40, 23
    keys, values = bf16(rng, B, H_kv, capacity, d), bf16(rng, B, H_kv, capacity, d)
    k, v, q = bf16(rng, B, H_kv, n, d), bf16(rng, B, H_kv, n, d), bf16(rng, B, H, n, d)
    decode_attention_store(keys, values, k, v, backend.xp.asarray(np.array([length], dtype=np.int32)))
    assert np.array_equal(host(keys[:, :, length - 1:length]), host(k))
    assert np.array_equal(host(values[:, :, length - 1:length]), host(v))
    out = decode_attention_forward(q, keys, values, length)
    q64, k64, v64 = (np.repeat(host(a[:, :, :length]), H // H_kv, axis=1) if a is not q else host(a)
                     for a in (q, keys, values))
    scores = q64 @ np.swapaxes(k64, -1, -2) / math.sqrt(d)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    exact = weights / weights.sum(-1, keepdims=True) @ v64
    assert out.dtype == BFLOAT16
    assert relative_error(out, exact) < 2 * BF16_ROUNDING     # float32 softmax and sums, one rounding


@pytest.mark.parametrize("dtype", [np.float32, BFLOAT16])
@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_store_new_positions_equals_rope_then_store(rng, dtype, interleaved):
    """The fused step of generation gives the bits of rope_forward on q and k, then decode_attention_store."""
    B, n, H, H_kv, D, capacity, start = 2, 3, 4, 2, 16, 12, 7
    qkv = bf16(rng, B, n, (H + 2 * H_kv) * D).astype(dtype)       # one product's output: q, k, v side by side
    q, k, v = (backend.xp.ascontiguousarray(qkv[..., a * D:b * D]).reshape(B, n, b - a, D)
               for a, b in ((0, H), (H, H + H_kv), (H + H_kv, H + 2 * H_kv)))
    keys, values = (bf16(rng, B, H_kv, capacity, D).astype(dtype) for _ in range(2))
    expected_keys, expected_values = keys.copy(), values.copy()
    position = backend.xp.asarray(np.array([start], dtype=np.int32))
    rotated_q, rotated_k = (rope_forward(a, start=position, interleaved=interleaved) for a in (q, k))
    heads_first = lambda a: backend.xp.ascontiguousarray(a.transpose(0, 2, 1, 3))  # noqa: E731
    decode_attention_store(expected_keys, expected_values, heads_first(rotated_k), heads_first(v), start + n)
    for start_given in (start, position):
        keys_fused, values_fused = keys.copy(), values.copy()
        q_heads = rope_store_new_positions(qkv, keys_fused, values_fused, H, start=start_given,
                                           interleaved=interleaved)
        assert q_heads.shape == (B, H, n, D) and q_heads.dtype == dtype
        assert np.array_equal(host(q_heads), host(heads_first(rotated_q)))
        assert np.array_equal(host(keys_fused), host(expected_keys))
        assert np.array_equal(host(values_fused), host(expected_values))
    with pytest.raises(ValueError, match="do not fit a cache of 12"):
        rope_store_new_positions(qkv, keys, values, H, start=capacity - 1)
    with pytest.raises(ValueError, match="need 144"):
        rope_store_new_positions(qkv, keys, values, H + 1)


@pytest.fixture(scope="module")
def models():
    """A float32 Llama and its bf16 copy (model.to(bfloat16)), with the same weights before rounding."""
    manual_seed(0)
    model32, model16 = Llama(LlamaConfig(**CONFIG)), Llama(LlamaConfig(**CONFIG))
    model16.load_state_dict(model32.state_dict())
    model16.to(gpt2_cupy.bfloat16)
    return model32, model16


def test_bf16_model_holds_bf16_weights_and_cache(models):
    _, model16 = models
    assert model16.dtype == BFLOAT16
    assert {p.dtype for p in model16.parameters()} == {BFLOAT16}
    attention = model16.model.layers[0].self_attn   # q, k, v: rows of one array, read by one product
    assert backend.xp.may_share_memory(attention.q_proj.weight._data, attention.projections.weight)  # (arrays)
    assert attention.projections.weight.shape == (CONFIG["hidden_size"] * 2, CONFIG["hidden_size"])  # 4 + 2 + 2 heads of 16
    cache = model16.new_kv_cache(1, 8)
    assert cache.keys[0].dtype == BFLOAT16 and cache.values[1].dtype == BFLOAT16


def test_bf16_logits_follow_float32(models, rng):
    model32, model16 = models
    idx = backend.xp.asarray(rng.integers(0, CONFIG["vocab_size"], (2, 7)).astype(np.int32))
    with no_grad():
        logits32, _ = model32(idx)
        logits16, _ = model16(idx)
        cache = model16.new_kv_cache(2, 10)
        model16(idx[:, :5], kv_cache=cache)                               # prefill, then two decode steps
        step1, _ = model16(idx[:, 5:6], kv_cache=cache)
        step2, _ = model16(idx[:, 6:7], kv_cache=cache)
    assert logits16.dtype == BFLOAT16
    assert relative_error(logits16, logits32) < 0.03
    assert relative_error(step1[:, 0], logits32[:, 5]) < 0.03
    assert relative_error(step2[:, 0], logits32[:, 6]) < 0.03
    assert relative_error(logits16, logits32) > 1e-4                      # rounded: bf16 ran, not float32


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_decode_gives_the_eager_tokens(models, rng, dtype):
    model = models[0] if dtype == "float32" else models[1]
    idx = backend.xp.asarray(rng.integers(0, CONFIG["vocab_size"], (1, 4)).astype(np.int32))
    eager = model.generate(idx, 6, temperature=0)
    graph = model.generate(idx, 6, temperature=0, cuda_graph=True)
    assert eager.shape == (1, 10) and np.array_equal(host(eager[:, :4]), host(idx))
    assert np.array_equal(host(graph), host(eager))
    # Sampled tokens too: the graph replays the forward, the host draws from its logits with the same seed.
    sampled = model.generate(idx, 5, temperature=0.9, top_k=20, seed=3)
    assert np.array_equal(host(model.generate(idx, 5, temperature=0.9, top_k=20, seed=3, cuda_graph=True)),
                          host(sampled))


def test_graph_decode_equals_a_loop_of_full_forwards(models, rng):
    # Independent of the cache: greedy tokens from recomputing the whole sequence at every step. In float32, where
    # the two paths agree to 1e-6 (in bf16 they round differently, and random weights make near-ties).
    model32, _ = models
    idx = rng.integers(0, CONFIG["vocab_size"], (1, 3)).astype(np.int32)
    sequence = list(idx[0])
    with no_grad():
        for _ in range(4):
            logits, _ = model32(backend.xp.asarray(np.array([sequence], dtype=np.int32)))
            sequence.append(int(np.argmax(host(logits[0, -1]))))
    graph = model32.generate(backend.xp.asarray(idx), 4, temperature=0, cuda_graph=True)
    assert host(graph)[0].tolist() == sequence


def test_from_pretrained_in_bf16_reads_a_bf16_checkpoint_exactly(models, tmp_path):
    model32, _ = models
    model32.save_pretrained(tmp_path, dtype="bfloat16")
    loaded = Llama.from_pretrained(tmp_path, torch_dtype=gpt2_cupy.bfloat16)
    for (name, got), (_, original) in zip(loaded.named_parameters(), model32.named_parameters()):
        assert got.dtype == BFLOAT16, name
        assert np.array_equal(host(got.data), host(original.data).astype(np.float32).astype(BFLOAT16)
                              .astype(np.float64)), name


def test_bf16_weights_refuse_what_they_are_not_for(models, rng):
    _, model16 = models
    idx = backend.xp.asarray(rng.integers(0, CONFIG["vocab_size"], (1, 3)).astype(np.int32))
    with pytest.raises(RuntimeError, match="weights in bfloat16 are for inference; run the model under"):
        model16(idx)
    with pytest.raises(NotImplementedError, match="float16.* is not supported yet; parameters are float32 or bfloat16"):
        model16.to(np.float16)
    with pytest.raises(ValueError, match="max_position_embeddings = 64"):
        model16.generate(idx, 62)


def test_decode_with_norms_in_the_products_gives_the_bits_of_separate_norms(models, rng, monkeypatch):
    # Generation's norms after o_proj and down_proj done by those GEMVs' last blocks (FOLD_NORMS_MOST_CHANNELS): two
    # per layer, the last down_proj's giving the model's norm; the logits of prefill and decode steps are the bits
    # of the norms as kernels of their own.
    from gpt2_cupy import generation

    _, model16 = models
    idx = backend.xp.asarray(rng.integers(0, CONFIG["vocab_size"], (1, 7)).astype(np.int32))
    folded_launches = []
    fused = generation.gemv_rmsnorm_forward
    monkeypatch.setattr(generation, "gemv_rmsnorm_forward",
                        lambda *a, **k: folded_launches.append(1) or fused(*a, **k))

    def logits_of_steps(fold):
        monkeypatch.setattr(generation, "FOLD_NORMS_MOST_CHANNELS", CONFIG["hidden_size"] if fold else 0)
        with no_grad():
            cache = model16.new_kv_cache(1, 8)
            steps = [model16(idx[:, :5], kv_cache=cache)[0]]    # prefill: 5 rows, more than a GEMV's (tiled)
            steps += [model16(idx[:, t:t + 1], kv_cache=cache)[0] for t in (5, 6)]
        return [backend.asnumpy(logits.data).view(np.uint16) for logits in steps]

    separate = logits_of_steps(False)
    assert folded_launches == []
    folded = logits_of_steps(True)
    assert len(folded_launches) == 2 * 2 * CONFIG["num_hidden_layers"]   # two decode steps, two norms a layer
    for got, expected in zip(folded, separate):
        assert np.array_equal(got, expected)


def test_captured_decode_with_rope_and_norms_in_the_products_gives_the_bits_of_separate_kernels(models, rng,
                                                                                                 monkeypatch):
    # The captured step (DecodeGraph) with RoPE and the cache's store in the q, k, v GEMV (generation.FOLD_ROPE) and the
    # norms in o_proj's and down_proj's (FOLD_NORMS_MOST_CHANNELS): the logits of the warm-up and of replays are
    # the bits of the separate kernels. Two warps an output: the tiny model's products would take 8, where the q,
    # k, v product keeps its two kernels (gemv_rope_store).
    from gpt2_cupy import generation
    from gpt2_cupy.generation import DecodeGraph
    from gpt2_cupy.ops import gemv as gemv_ops

    _, model16 = models
    monkeypatch.setattr(gemv_ops, "_warps_per_output", lambda N, row_bytes: 2)
    idx = backend.xp.asarray(rng.integers(0, CONFIG["vocab_size"], (1, 5)).astype(np.int32))
    rope_launches = []
    fused = generation.gemv_rope_store
    monkeypatch.setattr(generation, "gemv_rope_store", lambda *a, **k: rope_launches.append(1) or fused(*a, **k))

    def logits_of_steps(fold):
        monkeypatch.setattr(generation, "FOLD_ROPE", fold)
        monkeypatch.setattr(generation, "FOLD_NORMS_MOST_CHANNELS", CONFIG["hidden_size"] if fold else 0)
        with no_grad():
            cache = model16.new_kv_cache(1, 9)
            logits, _ = model16(idx, kv_cache=cache)
            token = backend.xp.asarray(np.array([[3]], dtype=np.int64))
            step = DecodeGraph(model16, cache, token, greedy=True)
            steps = [step.run(first=True)] + [step.run() for _ in range(3)]
        return [backend.asnumpy(logits.data).copy().view(np.uint16) for logits in steps]

    separate = logits_of_steps(False)
    assert rope_launches == []
    folded = logits_of_steps(True)
    assert len(rope_launches) == 2 * CONFIG["num_hidden_layers"]   # the warm-up's and the capture's
    for got, expected in zip(folded, separate):
        assert np.array_equal(got, expected)
