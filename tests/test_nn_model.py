"""nn.Module and GPT-2 assembled (chapter 12): gpt2_cupy.nn and gpt2_cupy.model.

The model's loss and every parameter's gradient are compared with an independent float64 numpy GPT-2
(forward and a hand-written backward, below; its backward is itself checked against finite differences)
with the same weights, on a tiny config. Against PyTorch (when installed, on the GPU machine): the same
weights in a PyTorch GPT-2 written here with torch's own ops, relative error < 1e-4 for loss and gradients
at n_layer = 2, n_embd = 128. Also: nanoGPT's parameter names and shapes, weight tying, GPT-2's
initialisation, the Module API, the save/load round trip, and the KV cache against the full forward.
"""

import math

import numpy as np
import pytest

import gpt2_cupy
from gpt2_cupy import nn
from gpt2_cupy.autograd import Tensor, no_grad
from gpt2_cupy.model import GPT, GPTConfig
from gpt2_cupy.testing import finite_difference_gradient, relative_error, torch_or_none
from tests import references

# Heads of 32 channels: the fused attention kernels take heads of 32 or 64.
TINY = dict(block_size=16, vocab_size=37, n_layer=2, n_head=2, n_embd=64)


# ---- a float64 numpy GPT-2, forward and backward ---------------------------------------------------------


def layer_norm(x, weight, bias):
    """(y, what layer_norm_backward needs) for a float64 (..., C) x."""
    return references.layer_norm(x, weight, bias)[0], (x, weight)


def layer_norm_backward(dout, saved):
    """(dx, dweight, dbias), the parameters' gradients summed over every row."""
    x, weight = saved
    dx, dweight_terms = references.layer_norm_backward(dout, x, weight)
    C = x.shape[-1]
    return dx, dweight_terms.reshape(-1, C).sum(0), dout.reshape(-1, C).sum(0)


def gelu(x):
    return references.gelu(x, "tanh")


def gelu_derivative(x):
    return references.gelu_derivative(x, "tanh")


def reference_gpt2(params, idx, targets, n_layer, n_head):
    """Loss and {name: gradient} of a float64 GPT-2 (nanoGPT's names, LayerNorm, softmax attention)."""
    wte, wpe = params["transformer.wte.weight"], params["transformer.wpe.weight"]
    B, T = idx.shape
    C = wte.shape[1]
    hs = C // n_head
    causal = np.tril(np.ones((T, T), bool))
    x = wte[idx] + wpe[:T]
    saved = []
    for layer in range(n_layer):
        p = {name[len(f"transformer.h.{layer}."):]: value for name, value in params.items()
             if name.startswith(f"transformer.h.{layer}.")}
        a, ln_1 = layer_norm(x, p["ln_1.weight"], p["ln_1.bias"])
        qkv = a @ p["attn.c_attn.weight"].T + p["attn.c_attn.bias"]
        q, k, v = (qkv[..., i * C:(i + 1) * C].reshape(B, T, n_head, hs).transpose(0, 2, 1, 3) for i in range(3))
        scores = np.where(causal, q @ k.transpose(0, 1, 3, 2) / math.sqrt(hs), -np.inf)
        att = np.exp(scores - scores.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        y = (att @ v).transpose(0, 2, 1, 3).reshape(B, T, C)
        x1 = x + y @ p["attn.c_proj.weight"].T + p["attn.c_proj.bias"]
        m, ln_2 = layer_norm(x1, p["ln_2.weight"], p["ln_2.bias"])
        h = m @ p["mlp.c_fc.weight"].T + p["mlp.c_fc.bias"]
        x2 = x1 + gelu(h) @ p["mlp.c_proj.weight"].T + p["mlp.c_proj.bias"]
        saved.append((p, a, ln_1, q, k, v, att, y, m, ln_2, h))
        x = x2
    f, ln_f = layer_norm(x, params["transformer.ln_f.weight"], params["transformer.ln_f.bias"])
    logits = f @ wte.T
    shifted = logits - logits.max(-1, keepdims=True)
    probabilities = np.exp(shifted) / np.exp(shifted).sum(-1, keepdims=True)
    kept = targets != -1
    flat_p, flat_t = probabilities.reshape(B * T, -1), targets.reshape(-1)
    loss = -np.log(flat_p[kept.reshape(-1), flat_t[kept.reshape(-1)]]).mean()

    grads = {name: np.zeros_like(value) for name, value in params.items()}
    dlogits = flat_p.copy()
    dlogits[np.arange(B * T), np.where(flat_t < 0, 0, flat_t)] -= 1
    dlogits[~kept.reshape(-1)] = 0
    dlogits = (dlogits / kept.sum()).reshape(B, T, -1)
    grads["transformer.wte.weight"] += dlogits.reshape(B * T, -1).T @ f.reshape(B * T, C)
    dx, grads["transformer.ln_f.weight"], grads["transformer.ln_f.bias"] = layer_norm_backward(dlogits @ wte, ln_f)
    for layer in reversed(range(n_layer)):
        p, a, ln_1, q, k, v, att, y, m, ln_2, h = saved[layer]
        g = {}
        dh = (dx @ p["mlp.c_proj.weight"]) * gelu_derivative(h)
        g["mlp.c_proj.weight"] = dx.reshape(B * T, C).T @ gelu(h).reshape(B * T, -1)
        g["mlp.c_proj.bias"] = dx.reshape(B * T, C).sum(0)
        g["mlp.c_fc.weight"] = dh.reshape(B * T, -1).T @ m.reshape(B * T, C)
        g["mlp.c_fc.bias"] = dh.reshape(B * T, -1).sum(0)
        dm, g["ln_2.weight"], g["ln_2.bias"] = layer_norm_backward(dh @ p["mlp.c_fc.weight"], ln_2)
        dx1 = dx + dm
        g["attn.c_proj.weight"] = dx1.reshape(B * T, C).T @ y.reshape(B * T, C)
        g["attn.c_proj.bias"] = dx1.reshape(B * T, C).sum(0)
        dy = (dx1 @ p["attn.c_proj.weight"]).reshape(B, T, n_head, hs).transpose(0, 2, 1, 3)
        datt = dy @ v.transpose(0, 1, 3, 2)
        dv = att.transpose(0, 1, 3, 2) @ dy
        dscores = att * (datt - (datt * att).sum(-1, keepdims=True)) / math.sqrt(hs)
        dq, dk = dscores @ k, dscores.transpose(0, 1, 3, 2) @ q
        dqkv = np.concatenate([d.transpose(0, 2, 1, 3).reshape(B, T, C) for d in (dq, dk, dv)], axis=-1)
        g["attn.c_attn.weight"] = dqkv.reshape(B * T, -1).T @ a.reshape(B * T, C)
        g["attn.c_attn.bias"] = dqkv.reshape(B * T, -1).sum(0)
        da, g["ln_1.weight"], g["ln_1.bias"] = layer_norm_backward(dqkv @ p["attn.c_attn.weight"], ln_1)
        dx = dx1 + da
        for name, value in g.items():
            grads[f"transformer.h.{layer}.{name}"] = value
    np.add.at(grads["transformer.wte.weight"], idx.reshape(-1), dx.reshape(B * T, C))
    grads["transformer.wpe.weight"][:T] = dx.sum(0)
    return loss, grads


def tiny_batch(rng, config, B=2, T=7):
    idx = rng.integers(0, config.vocab_size, size=(B, T))
    targets = rng.integers(0, config.vocab_size, size=(B, T))
    targets[1, 2] = -1  # an ignored position
    return idx, targets


def test_the_float64_reference_backward_matches_finite_differences(rng):
    config = GPTConfig(**TINY)
    params = {name: rng.normal(0.0, 0.3, shape) for name, shape in _shapes(config).items()}
    params["transformer.h.0.ln_1.weight"] += 1.0
    idx, targets = tiny_batch(rng, config, T=4)
    _, grads = reference_gpt2(params, idx, targets, config.n_layer, config.n_head)
    for name in ["transformer.h.0.attn.c_attn.weight", "transformer.h.1.ln_2.bias", "transformer.wte.weight",
                 "transformer.wpe.weight", "transformer.h.0.ln_1.weight"]:
        array = params[name]
        subset = (slice(0, 2),) * array.ndim   # a corner of each array: finite differences cost 2 runs per entry
        view = array[subset]
        numeric = finite_difference_gradient(
            lambda: reference_gpt2(params, idx, targets, config.n_layer, config.n_head)[0], view)
        assert relative_error(grads[name][subset], numeric) < 1e-6, name


def _shapes(config):
    C, V = config.n_embd, config.vocab_size
    shapes = {"transformer.wte.weight": (V, C), "transformer.wpe.weight": (config.block_size, C)}
    for layer in range(config.n_layer):
        prefix = f"transformer.h.{layer}."
        shapes.update({prefix + "ln_1.weight": (C,), prefix + "ln_1.bias": (C,),
                       prefix + "attn.c_attn.weight": (3 * C, C), prefix + "attn.c_attn.bias": (3 * C,),
                       prefix + "attn.c_proj.weight": (C, C), prefix + "attn.c_proj.bias": (C,),
                       prefix + "ln_2.weight": (C,), prefix + "ln_2.bias": (C,),
                       prefix + "mlp.c_fc.weight": (4 * C, C), prefix + "mlp.c_fc.bias": (4 * C,),
                       prefix + "mlp.c_proj.weight": (C, 4 * C), prefix + "mlp.c_proj.bias": (C,)})
    shapes.update({"transformer.ln_f.weight": (C,), "transformer.ln_f.bias": (C,), "lm_head.weight": (V, C)})
    return shapes


# ---- the model ------------------------------------------------------------------------------------------

def test_state_dict_has_nanogpts_names_and_shapes():
    config = GPTConfig(**TINY)
    state = GPT(config).state_dict()
    assert {name: value.shape for name, value in state.items()} == _shapes(config)
    assert list(state) == list(_shapes(config))   # and nanoGPT's order
    assert all(value.dtype == np.float32 and isinstance(value, Tensor) for value in state.values())


def test_weights_are_tied_and_counted_once():
    model = GPT(GPTConfig(**TINY))
    assert model.lm_head.weight is model.transformer.wte.weight
    names = [name for name, _ in model.named_parameters()]
    assert "lm_head.weight" not in names and "transformer.wte.weight" in names
    C, V, L = 64, 37, 2
    per_block = 2 * C + 3 * C * C + 3 * C + C * C + C + 2 * C + 4 * C * C + 4 * C + 4 * C * C + C
    assert model.get_num_params(non_embedding=False) == V * C + 16 * C + L * per_block + 2 * C


def test_initialisation_is_gpt2s():
    gpt2_cupy.manual_seed(0)
    config = GPTConfig(block_size=64, vocab_size=512, n_layer=3, n_head=4, n_embd=128)
    state = {name: value.numpy() for name, value in GPT(config).state_dict().items()}
    # 16384 to 65536 draws per matrix: the sample std is within 2 % of the intended one.
    assert abs(state["transformer.h.0.mlp.c_proj.weight"].std() / (0.02 / math.sqrt(6)) - 1) < 0.02
    assert abs(state["transformer.h.2.attn.c_attn.weight"].std() / 0.02 - 1) < 0.02
    assert abs(state["transformer.wte.weight"].std() / 0.02 - 1) < 0.02
    assert np.all(state["transformer.h.1.attn.c_attn.bias"] == 0) and np.all(state["transformer.ln_f.weight"] == 1)
    gpt2_cupy.manual_seed(0)
    again = {name: value.numpy() for name, value in GPT(config).state_dict().items()}
    assert all(np.array_equal(state[name], again[name]) for name in state)   # the seed fixes the weights


def test_loss_and_every_gradient_match_the_float64_reference(rng, to_device, to_host):
    config = GPTConfig(**TINY)
    model = GPT(config)
    params = {name: rng.normal(0.0, 0.2, shape) for name, shape in _shapes(config).items()}
    for name in params:
        if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
            params[name] += 1.0
    params["lm_head.weight"] = params["transformer.wte.weight"]
    model.load_state_dict(params)
    idx, targets = tiny_batch(rng, config)
    _, loss = model(to_device(idx), to_device(targets))
    loss.backward()
    expected_loss, expected_grads = reference_gpt2(params, idx, targets, config.n_layer, config.n_head)
    assert relative_error(to_host(loss._data), expected_loss) < 1e-5
    for name, parameter in model.named_parameters():
        error = relative_error(to_host(parameter.grad), expected_grads[name])
        assert error < 1e-4, f"{name}: relative error {error:.3g}"


def reference_loss(params, idx, targets, config):
    """The float64 loss of a GPT with config's norm ("layernorm" or "dyt") and attention ("softmax" or "relu")."""
    B, T = idx.shape
    C, H = config.n_embd, config.n_head

    def norm(x, prefix):
        if config.norm == "dyt":
            return params[prefix + "weight"] * np.tanh(params[prefix + "alpha"] * x) + params[prefix + "bias"]
        return layer_norm(x, params[prefix + "weight"], params[prefix + "bias"])[0]

    x = params["transformer.wte.weight"][idx] + params["transformer.wpe.weight"][:T]
    for layer in range(config.n_layer):
        prefix = f"transformer.h.{layer}."
        p = lambda name: params[prefix + name]  # noqa: E731
        qkv = norm(x, prefix + "ln_1.") @ p("attn.c_attn.weight").T + p("attn.c_attn.bias")
        q, k, v = (qkv[..., i * C:(i + 1) * C].reshape(B, T, H, C // H).transpose(0, 2, 1, 3) for i in range(3))
        scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(C // H)
        causal = np.tril(np.ones((T, T), bool))
        if config.attention == "relu":
            weights = np.where(causal, np.maximum(scores, 0.0), 0.0)
        else:
            weights = np.exp(np.where(causal, scores, -np.inf) - scores.max(-1, keepdims=True))
            weights /= weights.sum(-1, keepdims=True)
        y = (weights @ v).transpose(0, 2, 1, 3).reshape(B, T, C)
        x = x + y @ p("attn.c_proj.weight").T + p("attn.c_proj.bias")
        h = norm(x, prefix + "ln_2.") @ p("mlp.c_fc.weight").T + p("mlp.c_fc.bias")
        x = x + gelu(h) @ p("mlp.c_proj.weight").T + p("mlp.c_proj.bias")
    logits = (norm(x, "transformer.ln_f.") @ params["transformer.wte.weight"].T).reshape(B * T, -1)
    shifted = logits - logits.max(-1, keepdims=True)
    log_p = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    kept = targets.reshape(-1) != -1
    return -log_p[kept, targets.reshape(-1)[kept]].mean()


@pytest.mark.parametrize("norm, attention", [("dyt", "softmax"), ("layernorm", "relu"), ("dyt", "relu")])
def test_variants_match_the_float64_loss_and_finite_differences(norm, attention, rng, to_device, to_host):
    config = GPTConfig(**TINY, norm=norm, attention=attention)
    model = GPT(config)
    norm_weights = ("ln_1.weight", "ln_2.weight", "ln_f.weight")   # near 1, as trained ones are
    params = {name: rng.normal(0.0, 0.2, value.shape) + (1.0 if name.endswith(norm_weights) else 0.0)
              for name, value in model.state_dict().items()}
    params["lm_head.weight"] = params["transformer.wte.weight"]
    model.load_state_dict(params)
    idx, targets = tiny_batch(rng, config, T=5)
    _, loss = model(to_device(idx), to_device(targets))
    loss.backward()
    assert relative_error(to_host(loss._data), reference_loss(params, idx, targets, config)) < 1e-5
    for name, parameter in model.named_parameters():   # two entries of every parameter
        gradient = to_host(parameter.grad)
        for flat_index in rng.choice(gradient.size, size=min(2, gradient.size), replace=False):
            index = np.unravel_index(flat_index, gradient.shape)
            numeric = finite_difference_gradient(lambda: reference_loss(params, idx, targets, config),
                                                 _entry_view(params[name], index), h=1e-5)
            error = abs(gradient[index] - numeric.item()) / np.abs(gradient).max()
            assert error < 1e-4, f"{name}{index}: error {error:.3g} of the largest entry"


def _entry_view(array, index):
    """A one-element view of array[index], which finite_difference_gradient changes in place."""
    return array[tuple(slice(i, i + 1) for i in index)]


def test_kv_cache_gives_the_logits_of_the_full_forward(rng, to_device, to_host):
    config = GPTConfig(**TINY)
    model = GPT(config)
    idx = to_device(rng.integers(0, config.vocab_size, size=(2, 10)))
    with no_grad():
        full, _ = model(idx)
        cache = model.new_kv_cache(batch_size=2, max_length=12)
        pieces = [model(to_device(to_host(idx)[:, start:end]), kv_cache=cache)[0]
                  for start, end in [(0, 5), (5, 6), (6, 9), (9, 10)]]   # a prompt, one token, three, one
    assert cache.length == 10
    cached = np.concatenate([to_host(piece._data) for piece in pieces], axis=1)
    assert relative_error(cached, to_host(full._data)) < 1e-5
    with pytest.raises(RuntimeError, match="no_grad"):
        model(idx[:, :1], kv_cache=cache)


def test_dropout_is_on_in_training_and_off_in_evaluation(rng, to_device, to_host):
    model = GPT(GPTConfig(**TINY, dropout=0.5))
    idx = to_device(rng.integers(0, 37, size=(2, 7)))
    with no_grad():
        first, second = (to_host(model(idx)[0]._data) for _ in range(2))
        model.eval()
        third, fourth = (to_host(model(idx)[0]._data) for _ in range(2))
    assert not np.array_equal(first, second)      # fresh masks each call
    assert np.array_equal(third, fourth)
    assert not any(module.training for _, module in model.named_modules())


def test_module_api(rng, to_device, to_host):
    layer = nn.Linear(5, 3)
    assert [name for name, _ in layer.named_parameters()] == ["weight", "bias"]
    assert abs(to_host(layer.weight._data)).max() <= 1 / math.sqrt(5)   # PyTorch's U(±1/√in)
    buffers = [np.ones(p.shape, np.float32) for p in layer.parameters()]
    for parameter, buffer in zip(layer.parameters(), buffers):
        parameter.grad = to_device(buffer)
    grads = [p.grad for p in layer.parameters()]
    layer.zero_grad(set_to_none=False)
    assert all(p.grad is g and not to_host(g).any() for p, g in zip(layer.parameters(), grads))
    layer.zero_grad()                                   # PyTorch's default: set_to_none=True
    assert all(p.grad is None for p in layer.parameters())
    state = {"weight": np.zeros((3, 5), np.float32), "bias": np.arange(3, dtype=np.float32)}
    data = layer.weight._data
    layer.load_state_dict(state)
    assert layer.weight._data is data and np.array_equal(to_host(layer.bias._data), state["bias"])
    with pytest.raises(RuntimeError, match="Error\\(s\\) in loading state_dict for Linear:\n\tMissing key\\(s\\) in "
                                           "state_dict: 'bias'"):
        layer.load_state_dict({"weight": state["weight"]})
    with pytest.raises(RuntimeError, match="size mismatch for weight"):
        layer.load_state_dict({"weight": np.zeros((5, 3), np.float32), "bias": state["bias"]})
    x = Tensor(to_device(rng.normal(size=(2, 5)).astype(np.float32)))
    assert relative_error(to_host(layer(x)._data), to_host(x._data) @ state["weight"].T + state["bias"]) < 1e-6


def test_save_and_load_round_trip(tmp_path, rng, to_device, to_host):
    config = GPTConfig(**TINY)
    model = GPT(config)
    model.save_pretrained(tmp_path)
    loaded = GPT.from_pretrained(tmp_path)
    assert loaded.config == config
    assert all(np.array_equal(value.numpy(), loaded.state_dict()[name].numpy())
               for name, value in model.state_dict().items())
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    idx = to_device(rng.integers(0, 37, size=(1, 5)))
    with no_grad():
        assert np.array_equal(to_host(model(idx)[0]._data), to_host(loaded(idx)[0]._data))


def test_configure_optimizers_groups_as_nanogpt():
    model = GPT(GPTConfig(**TINY))
    optimizer = model.configure_optimizers(weight_decay=0.1, learning_rate=6e-4, betas=(0.9, 0.95))
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert {p.ndim for p in decay["params"]} == {2} and {p.ndim for p in no_decay["params"]} == {1}
    assert len(decay["params"]) + len(no_decay["params"]) == len(model.parameters())


def test_positions_past_block_size_are_refused(to_device):
    model = GPT(GPTConfig(**TINY))
    with pytest.raises(ValueError, match="block_size"):
        model(to_device(np.zeros((1, 17), np.int64)))


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="n_head"):
        GPT(GPTConfig(**{**TINY, "n_head": 3}))
    with pytest.raises(ValueError, match="norm"):
        GPT(GPTConfig(**TINY, norm="rmsnorm"))


# ---- against PyTorch (on the GPU machine, where torch is installed) --------------------------------------

torch = torch_or_none()


@pytest.mark.skipif(torch is None, reason="PyTorch is not installed here (it is on the GPU machine)")
def test_loss_and_gradients_match_pytorch(rng, to_device, to_host):
    config = GPTConfig(block_size=64, vocab_size=512, n_layer=2, n_head=4, n_embd=128)
    gpt2_cupy.manual_seed(3)
    model = GPT(config)
    state = {name: value.numpy() for name, value in model.state_dict().items()}
    idx, targets = tiny_batch(rng, config, B=4, T=64)
    _, loss = model(to_device(idx), to_device(targets))
    loss.backward()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    params = {name: torch.tensor(value, device=device, requires_grad=True) for name, value in state.items()
              if name != "lm_head.weight"}
    torch.backends.cuda.matmul.allow_tf32 = False
    torch_loss = _torch_gpt2(torch, params, torch.tensor(idx, device=device), torch.tensor(targets, device=device),
                             config)
    torch_loss.backward()
    assert relative_error(to_host(loss._data), torch_loss.item()) < 1e-4
    for name, parameter in model.named_parameters():
        error = relative_error(to_host(parameter.grad), params[name].grad.cpu().numpy())
        assert error < 1e-4, f"{name}: relative error {error:.3g}"


def _torch_gpt2(torch, p, idx, targets, config):
    functional = torch.nn.functional
    B, T = idx.shape
    C, H = config.n_embd, config.n_head
    x = p["transformer.wte.weight"][idx] + p["transformer.wpe.weight"][:T]
    for layer in range(config.n_layer):
        q = lambda name: p[f"transformer.h.{layer}.{name}"]  # noqa: E731
        a = functional.layer_norm(x, (C,), q("ln_1.weight"), q("ln_1.bias"))
        qkv = functional.linear(a, q("attn.c_attn.weight"), q("attn.c_attn.bias"))
        qs, ks, vs = (t.view(B, T, H, C // H).transpose(1, 2) for t in qkv.split(C, dim=2))
        y = functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + functional.linear(y, q("attn.c_proj.weight"), q("attn.c_proj.bias"))
        m = functional.layer_norm(x, (C,), q("ln_2.weight"), q("ln_2.bias"))
        h = functional.gelu(functional.linear(m, q("mlp.c_fc.weight"), q("mlp.c_fc.bias")), approximate="tanh")
        x = x + functional.linear(h, q("mlp.c_proj.weight"), q("mlp.c_proj.bias"))
    x = functional.layer_norm(x, (C,), p["transformer.ln_f.weight"], p["transformer.ln_f.bias"])
    logits = functional.linear(x, p["transformer.wte.weight"])
    return functional.cross_entropy(logits.view(B * T, -1), targets.view(-1), ignore_index=-1)


def test_named_modules_has_no_trailing_dots_and_lists_a_shared_module_once():
    model = GPT(GPTConfig(**TINY))
    names = [name for name, _ in model.named_modules()]
    assert names[:4] == ["", "transformer", "transformer.wte", "transformer.wpe"]
    assert "transformer.h.1.mlp.c_proj" in names and not any(name.endswith(".") for name in names)
    shared = nn.Linear(3, 3)
    outer = nn.ModuleDict(dict(first=shared, second=shared, inner=nn.ModuleDict(dict(again=shared))))
    assert [name for name, _ in outer.named_modules()] == ["", "first", "inner"]
    assert len(list(outer.modules())) == 3
    assert [name for name, _ in outer.named_modules(remove_duplicate=False)] == ["", "first", "second", "inner",
                                                                                "inner.again"]
    assert [name for name, _ in outer.named_parameters()] == ["first.weight", "first.bias"]
