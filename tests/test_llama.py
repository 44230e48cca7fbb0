"""gpt2_cupy.llama against a float64 numpy Llama written here from the equations, and its checkpoints.

The reference takes the model's state_dict and computes the logits as Hugging Face's modeling_llama does:
RMSNorm, rotate_half RoPE, grouped-query attention (query head h reads key head h // group), SwiGLU. Configs are
tiny and random, with and without grouping, head sizes 64 and 128 (and 80, between the fused kernels' tile widths),
rope_theta 10000 and 500000. The test at the end compares with transformers itself and is
skipped where torch or transformers is not installed.
"""

import json
import os

import numpy as np
import pytest

import gpt2_cupy
from gpt2_cupy import backend, safetensors_files
from gpt2_cupy.llama import Llama, LlamaConfig
from gpt2_cupy.testing import relative_error

CONFIGS = {  # (num_attention_heads, num_key_value_heads, head_dim, rope_theta)
    "no grouping, head 64, theta 1e4": (4, 4, 64, 10000.0),
    "2 groups, head 64, theta 5e5": (4, 2, 64, 500000.0),
    "1 key head, head 128, theta 1e4": (4, 1, 128, 10000.0),
    "no grouping, head 128, theta 5e5": (2, 2, 128, 500000.0),
}


def tiny_config(heads, kv_heads, head_dim, theta, **options):
    return LlamaConfig(vocab_size=37, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                       max_position_embeddings=32, rope_theta=theta, rms_norm_eps=1e-5, **options)


def random_model(config, seed=0):
    """A model whose norm weights are random too (they start at ones), so that mixing them up shows."""
    gpt2_cupy.manual_seed(seed)
    model = Llama(config)
    rng = np.random.default_rng(seed)
    for name, parameter in model.named_parameters():
        if parameter.ndim == 1:
            parameter.data[...] = backend.xp.asarray(rng.normal(1.0, 0.2, parameter.shape).astype(np.float32))
    return model


# ---- the float64 reference -------------------------------------------------------------------------------

def host_state(model):
    """The model's state_dict as numpy copies (its Tensors share the parameters' device arrays)."""
    return {name: value.numpy() for name, value in model.state_dict().items()}


def reference_logits(state, config, idx):
    """Logits (B, T, V) in float64 from a state_dict of numpy arrays."""
    w = {name: np.asarray(value, dtype=np.float64) for name, value in state.items()}
    H, Hkv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    B, T = idx.shape

    def rms_norm(x, weight):
        return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + config.rms_norm_eps) * weight

    inv_freq = 1.0 / config.rope_theta ** (np.arange(0, hd, 2) / hd)
    angles = np.arange(T)[:, None] * inv_freq[None, :]
    cos, sin = np.cos(np.concatenate([angles, angles], -1)), np.sin(np.concatenate([angles, angles], -1))

    def rope(x):  # (B, heads, T, hd), transformers' apply_rotary_pos_emb
        rotated = np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], axis=-1)
        return x * cos + rotated * sin

    x = w["model.embed_tokens.weight"][idx]
    causal = np.triu(np.ones((T, T), dtype=bool), k=1)
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}."
        h = rms_norm(x, w[p + "input_layernorm.weight"])
        q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(B, T, H, hd).transpose(0, 2, 1, 3)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(B, T, Hkv, hd).transpose(0, 2, 1, 3)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(B, T, Hkv, hd).transpose(0, 2, 1, 3)
        q, k = rope(q), rope(k)
        kv_head = np.arange(H) // (H // Hkv)
        scores = q @ k[:, kv_head].transpose(0, 1, 3, 2) / np.sqrt(hd)
        scores = np.where(causal, -np.inf, scores)
        probabilities = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probabilities /= probabilities.sum(axis=-1, keepdims=True)
        y = (probabilities @ v[:, kv_head]).transpose(0, 2, 1, 3).reshape(B, T, H * hd)
        x = x + y @ w[p + "self_attn.o_proj.weight"].T
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"])
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
    head = w["model.embed_tokens.weight"] if config.tie_word_embeddings else w["lm_head.weight"]
    return rms_norm(x, w["model.norm.weight"]) @ head.T


def reference_loss(state, config, idx, targets):
    logits = reference_logits(state, config, idx).reshape(-1, config.vocab_size)
    targets = targets.reshape(-1)
    counted = (targets != -100) & (targets != -1)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    log_probabilities = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    return -log_probabilities[counted, targets[counted]].mean()


def tokens(rng, config, B=2, T=9):
    return rng.integers(0, config.vocab_size, (B, T)).astype(np.int32)


# ---- the model -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", CONFIGS)
def test_logits_match_the_float64_reference(rng, to_device, to_host, name):
    config = tiny_config(*CONFIGS[name])
    model = random_model(config)
    idx = tokens(rng, config)
    logits, loss = model(to_device(idx))
    assert loss is None
    assert relative_error(to_host(logits.data), reference_logits(host_state(model), config, idx)) < 1e-5


def test_tied_embeddings_share_one_matrix(rng, to_device, to_host):
    config = tiny_config(4, 2, 64, 10000.0, tie_word_embeddings=True)
    model = random_model(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    idx = tokens(rng, config)
    logits, _ = model(to_device(idx))
    assert relative_error(to_host(logits.data), reference_logits(host_state(model), config, idx)) < 1e-5


def test_loss_ignores_minus_100_and_minus_1(rng, to_device):
    config = tiny_config(4, 2, 64, 10000.0)
    model = random_model(config)
    idx, targets = tokens(rng, config), tokens(rng, config)
    targets[0, :3], targets[1, -2:] = -100, -1
    _, loss = model(to_device(idx), to_device(targets))
    expected = reference_loss(host_state(model), config, idx, targets)
    assert abs(loss.item() - expected) < 1e-5 * abs(expected)


@pytest.mark.parametrize("name", ["2 groups, head 64, theta 5e5", "1 key head, head 128, theta 1e4"])
def test_every_parameter_gradient_matches_a_central_difference_of_the_reference(rng, to_device, to_host, name):
    """For each parameter w and a random direction u: sum(grad ⊙ u) = (L(w + h u) - L(w - h u)) / 2h, L in float64."""
    config = tiny_config(*CONFIGS[name])
    model = random_model(config)
    idx, targets = tokens(rng, config, T=6), tokens(rng, config, T=6)
    targets[0, 0] = -100
    _, loss = model(to_device(idx), to_device(targets))
    loss.backward()
    state = {name: value.astype(np.float64) for name, value in host_state(model).items()}
    step = 1e-5
    for name, parameter in model.named_parameters():
        direction = rng.normal(size=parameter.shape)
        analytic = float(np.sum(to_host(parameter.grad) * direction))
        original = state[name]
        state[name] = original + step * direction
        plus = reference_loss(state, config, idx, targets)
        state[name] = original - step * direction
        minus = reference_loss(state, config, idx, targets)
        state[name] = original
        numeric = (plus - minus) / (2 * step)
        assert abs(analytic - numeric) < 1e-4 * max(abs(numeric), 1e-2), name


@pytest.mark.parametrize("name", ["2 groups, head 64, theta 5e5", "1 key head, head 128, theta 1e4"])
def test_generation_with_the_kv_cache_equals_the_whole_forward(rng, to_device, to_host, name):
    config = tiny_config(*CONFIGS[name])
    model = random_model(config)
    idx = tokens(rng, config, T=10)
    with gpt2_cupy.no_grad():
        whole, _ = model(to_device(idx))
        cache = model.new_kv_cache(2, 16)
        pieces = [model(to_device(np.ascontiguousarray(idx[:, a:b])), kv_cache=cache)[0]
                  for a, b in ((0, 6), (6, 7), (7, 10))]
    assert cache.length == 10
    assert cache.keys[0].shape == (2, config.num_key_value_heads, 16, config.head_dim)  # a copy per key head
    stepped = np.concatenate([to_host(p.data) for p in pieces], axis=1)
    assert relative_error(stepped, to_host(whole.data)) < 1e-5


def test_head_size_between_the_tile_widths_matches_the_reference(rng, to_device, to_host):
    # Head size 80 runs in the fused kernels' tiles of 128, the columns past 80 zero; 2 query heads per key head.
    config = tiny_config(4, 2, 80, 10000.0)
    model = random_model(config)
    idx = tokens(rng, config)
    logits, _ = model(to_device(idx))
    assert relative_error(to_host(logits.data), reference_logits(host_state(model), config, idx)) < 1e-5


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 1, 128), (4, 2, 80)])
def test_greedy_generation_with_the_cache_equals_recomputing_the_sequence(rng, heads, kv_heads, head_dim):
    """Each step after the prompt runs the decode kernel over the cache; without the cache, every step runs the
    whole sequence through the fused attention again. The same tokens come out, from the same logits."""
    config = tiny_config(heads, kv_heads, head_dim, 10000.0)
    model = random_model(config)
    prompt = tokens(rng, config, B=2, T=4)
    results = {}
    with gpt2_cupy.no_grad():
        for with_cache in (True, False):
            ids, seen = prompt, []
            cache = model.new_kv_cache(2, 16) if with_cache else None
            logits, _ = model(backend.xp.asarray(ids), kv_cache=cache)
            for step in range(10):
                last = backend.asnumpy(logits.data)[:, -1]
                seen.append(last)
                ids = np.concatenate([ids, last.argmax(axis=-1).astype(np.int32)[:, None]], axis=1)
                if with_cache:
                    logits, _ = model(backend.xp.asarray(ids[:, -1:]), kv_cache=cache)   # one new position
                else:
                    logits, _ = model(backend.xp.asarray(ids))                           # the whole sequence
            results[with_cache] = ids, np.stack(seen, axis=1)
    assert np.array_equal(results[True][0], results[False][0])
    assert relative_error(results[True][1], results[False][1]) < 1e-5


def test_kv_cache_needs_no_grad(to_device):
    model = random_model(tiny_config(4, 2, 64, 10000.0))
    with pytest.raises(RuntimeError, match="no_grad"):
        model(to_device(np.zeros((1, 2), np.int32)), kv_cache=model.new_kv_cache(1, 4))


def test_config_refuses_groups_that_do_not_divide():
    with pytest.raises(ValueError, match="num_key_value_heads = 3 must divide num_attention_heads = 4"):
        LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=3)


def test_config_json_of_transformers_4_and_5():
    common = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, rms_norm_eps=1e-5, hidden_act="silu", model_type="llama")
    version_4 = LlamaConfig.from_hf({**common, "rope_theta": 500000.0, "rope_scaling": None})
    version_5 = LlamaConfig.from_hf({**common, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}})
    assert version_4 == version_5
    assert (version_4.rope_theta, version_4.num_key_value_heads, version_4.head_dim) == (500000.0, 2, 16)
    with pytest.raises(NotImplementedError, match="llama3"):
        LlamaConfig.from_hf({**common, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0}})


# ---- checkpoints -----------------------------------------------------------------------------------------

def bfloat16_reference(values):
    """Round float32 values to bfloat16 (8 significant bits, ties to even) with float64 arithmetic."""
    mantissa, exponent = np.frexp(values.astype(np.float64))       # values = mantissa 2^exponent, |mantissa| in [0.5, 1)
    return np.ldexp(np.round(mantissa * 256) / 256, exponent)      # np.round: half to even


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("sharded", [False, True])
def test_save_and_load_round_trip(tmp_path, rng, to_device, to_host, dtype, sharded):
    config = tiny_config(4, 2, 64, 500000.0)
    model = random_model(config)
    model.save_pretrained(tmp_path, dtype=dtype, max_shard_size=40_000 if sharded else None)
    files = sorted(os.listdir(tmp_path))
    if sharded:
        assert "model.safetensors.index.json" in files and "model-00002-of-" in " ".join(files)
    else:
        assert files == ["config.json", "model.safetensors"]
    loaded = Llama.from_pretrained(tmp_path)
    assert loaded.config == config
    for (name, original), (_, restored) in zip(host_state(model).items(), host_state(loaded).items()):
        expected = {"float32": lambda a: a, "float16": lambda a: a.astype(np.float16).astype(np.float32),
                    "bfloat16": bfloat16_reference}[dtype](original)
        assert np.array_equal(restored, expected), name
    idx = tokens(rng, config)
    logits, _ = loaded(to_device(idx))
    assert relative_error(to_host(logits.data), reference_logits(host_state(loaded), config, idx)) < 1e-5


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_infinities_and_nan_survive_half_precision(tmp_path, dtype):
    model = random_model(tiny_config(2, 2, 64, 10000.0))
    special = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 1.0], np.float32)
    model.model.norm.weight.data[:6] = backend.xp.asarray(special)
    model.save_pretrained(tmp_path, dtype=dtype)
    restored = Llama.from_pretrained(tmp_path).model.norm.weight.detach().numpy()[:6]
    assert np.array_equal(restored, special, equal_nan=True)
    assert np.array_equal(np.signbit(restored), np.signbit(special))


def test_bfloat16_rounds_to_nearest_even_and_overflows_to_infinity():
    values = np.array([1 + 2**-8, 1 + 3 * 2**-8, np.finfo(np.float32).max, -3.4e38, 1e-40], np.float32)
    bits = safetensors_files.float32_to_bfloat16_bits(values)
    back = safetensors_files.bfloat16_bits_to_float32(bits)
    assert back[0] == 1.0 and back[1] == 1 + 2**-6     # ties go to the even neighbour
    assert back[2] == np.inf and back[3] == -np.inf     # past bfloat16's largest, 3.3895e38: infinity
    assert back[4] == np.float32(2.0**-133)             # bfloat16's subnormals are 2^-133 apart: 1e-40 is 1.09 of them
    rng = np.random.default_rng(5)
    random = rng.normal(0, 10, 10000).astype(np.float32)
    assert np.array_equal(safetensors_files.bfloat16_bits_to_float32(safetensors_files.float32_to_bfloat16_bits(random)),
                          bfloat16_reference(random))


def _rewrite(directory, change):
    """Rewrite the checkpoint in directory after change({name: array}) edits its tensors."""
    tensors = dict(safetensors_files.read_tensors(directory))
    change(tensors)
    safetensors_files.write_tensors(directory, tensors)


def test_bad_checkpoints_are_refused_with_the_tensor_named(tmp_path):
    model = random_model(tiny_config(4, 2, 64, 10000.0))
    model.save_pretrained(tmp_path)
    _rewrite(tmp_path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight: missing"):
        Llama.from_pretrained(tmp_path)

    model.save_pretrained(tmp_path)
    _rewrite(tmp_path, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": np.zeros((256, 48), np.float32)}))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight: shape \(256, 48\)"):
        Llama.from_pretrained(tmp_path)

    model.save_pretrained(tmp_path)
    _rewrite(tmp_path, lambda t: t.update({"model.layers.0.extra.weight": np.zeros(3, np.float32)}))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.extra\.weight: the checkpoint has this tensor"):
        Llama.from_pretrained(tmp_path)

    model.save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    header["model.norm.weight"]["dtype"] = "F64"   # 8 bytes per value: the stored byte count no longer fits either
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (length - len(encoded))
    assert len(encoded) == length
    path.write_bytes(data[:8] + encoded + data[8 + length:])
    with pytest.raises(ValueError, match=r"model\.norm\.weight: dtype F64"):
        Llama.from_pretrained(tmp_path)


# ---- against transformers (where torch and transformers are installed: the GPU machine) -------------------

@pytest.mark.parametrize("stored", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("name", CONFIGS)
def test_logits_match_transformers_both_ways(tmp_path, rng, to_device, to_host, name, stored):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = tiny_config(*CONFIGS[name])
    idx = tokens(rng, config)

    # ours -> theirs: our checkpoint, read by LlamaForCausalLM in float32
    ours = random_model(config)
    ours.save_pretrained(tmp_path / "ours", dtype=stored)
    ours = Llama.from_pretrained(tmp_path / "ours")   # the weights as stored, for both sides
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "ours", torch_dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    with torch.no_grad():
        expected = theirs(torch.from_numpy(idx.astype(np.int64))).logits.double().numpy()
    logits, _ = ours(to_device(idx))
    assert np.abs(to_host(logits.data) - expected).max() < 1e-4

    # theirs -> ours: a randomly initialised LlamaForCausalLM, saved by transformers
    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(**{k: v for k, v in config.to_hf().items()
                                            if k not in ("architectures", "model_type", "torch_dtype")})
    theirs = transformers.LlamaForCausalLM(hf_config).to(getattr(torch, stored)).float().eval()
    with torch.no_grad():
        for parameter in theirs.parameters():
            if parameter.ndim == 1:
                parameter.normal_(1.0, 0.2)  # norm weights away from ones
    theirs.to(getattr(torch, stored)).save_pretrained(tmp_path / "theirs")
    theirs = theirs.float()
    with torch.no_grad():
        expected = theirs(torch.from_numpy(idx.astype(np.int64))).logits.double().numpy()
    logits, _ = Llama.from_pretrained(tmp_path / "theirs")(to_device(idx))
    assert np.abs(to_host(logits.data) - expected).max() < 1e-4
