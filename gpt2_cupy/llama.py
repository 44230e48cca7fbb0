"""Llama, assembled from the course's kernels; the structure and the parameter names are Hugging Face's.

    idx (B, T) ─embed_tokens─ [LlamaDecoderLayer] × num_hidden_layers ─ norm ─ lm_head ─ logits (B, T, V)
    LlamaDecoderLayer:  x = x + self_attn(input_layernorm(x));  x = x + mlp(post_attention_layernorm(x))
    self_attn: q, k, v projections; RoPE on q and k (no position table); causal attention; o_proj
    mlp:       down_proj(silu(gate_proj(x)) * up_proj(x))   (Meta's w2(silu(w1 x) * w3 x))

    model = Llama(LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2))
    logits, loss = model(idx, targets)          # targets of -100 (Hugging Face) or -1 (our GPT) are ignored
    Llama.from_pretrained(directory), model.save_pretrained(directory, dtype="bfloat16")
    cache = model.new_kv_cache(batch_size, max_length); logits, _ = model(idx_new, kv_cache=cache)

Grouped-query attention: num_key_value_heads key and value heads, each shared by num_attention_heads //
num_key_value_heads query heads. Chapter 08's fused kernels read each key and value head for its whole group, with
no copy per query head (F.scaled_dot_product_attention(..., enable_gqa=True)), at any head size up to 256; the KV
cache stores the key and value heads once, and each generation step reads them with the decode kernel
(gpt2_cupy.ops.decode_attention).
"""

import json
import os
from dataclasses import asdict, dataclass, fields

import numpy

from gpt2_cupy import backend, nn, safetensors_files
from gpt2_cupy.autograd import Tensor, is_grad_enabled, no_grad
from gpt2_cupy.random import init_generator
from gpt2_cupy.elementwise import converted
from gpt2_cupy.graphs import CUDAGraph, graph, graph_pool_handle, use_pool
from gpt2_cupy.model import KVCache
from gpt2_cupy.nn import functional as F
from gpt2_cupy.ops.argmax import argmax_forward
from gpt2_cupy.ops.decode_attention import decode_attention_forward
from gpt2_cupy.ops.gemv import gemv_forward, gemv_rmsnorm_forward, gemv_rope_store
from gpt2_cupy.ops.linear import few_rows_times_bf16, linear_forward
from gpt2_cupy.ops.rope import rope_store_new_positions

# Generation, where the products are GEMVs; the same bits either way. Measured on an H200 (bench/llama_generation.py
# --settings, the captured decode step after 512 positions, tokens/s, 2026-11-27):
# - FOLD_ROPE: RoPE and the KV cache's store done by the q, k, v GEMV's blocks (gemv_rope_store) rather than by
#   rope_store_new_positions after it. Llama 3.2 1B 987 -> 1013, Llama 2 7B 228 -> 239 (norms not folded).
# - FOLD_NORMS_MOST_CHANNELS: the RMSNorm after each residual product (o_proj, down_proj) done by that GEMV's last
#   block (gemv_rmsnorm_forward) rather than by a kernel of its own, for models of at most this many channels
#   (0: never). With RoPE folded, Llama 3.2 1B (2048 channels) 1013 -> 1047 (61 % of the bound), Llama 2 7B
#   (4096) 239 -> 229. The launch saved is paid for in every block of the product: the GEMV with the norm takes
#   48 registers a thread where the plain one takes 32 (ptxas, sm_90), 5 blocks a multiprocessor instead of 8,
#   fewer loads in flight; the 7B's larger products lose more than the launch gave.
FOLD_ROPE = True
FOLD_NORMS_MOST_CHANNELS = 2048


@dataclass
class LlamaConfig:
    """Hugging Face's LlamaConfig field names and defaults (Llama 2 7B's sizes)."""
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008         # the MLP's width: about 8/3 hidden_size, so that 3 matrices cost 2 of GPT-2's
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = None        # None: as many as query heads (no grouping); Llama 3 8B has 8 for 32
    head_dim: int = None                   # None: hidden_size // num_attention_heads
    max_position_embeddings: int = 2048    # the longest context the cache may hold; RoPE has no table to size
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0            # 10000 in Llama 2, 500000 in Llama 3
    rope_interleaved: bool = False         # not Hugging Face's: True pairs channels 2i, 2i+1 as llama2.c does
    tie_word_embeddings: bool = False      # Llama's output head is its own matrix, not the embedding's transpose
    initializer_range: float = 0.02
    bos_token_id: int = 1
    eos_token_id: int = 2

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"LlamaConfig: num_key_value_heads = {self.num_key_value_heads} must divide "
                             f"num_attention_heads = {self.num_attention_heads}")
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig: head_dim = {self.head_dim} must be even: RoPE turns channels in pairs")

    @classmethod
    def from_hf(cls, hf):
        """A config from the dict of a Hugging Face config.json: transformers 4 (a top-level rope_theta) or
        transformers 5 (rope_parameters = {"rope_type": "default", "rope_theta": ...})."""
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise NotImplementedError(f"LlamaConfig: rope_type {rope_type!r} (scaled RoPE) is not supported yet; "
                                      "only the default frequencies")
        if hf.get("hidden_act", "silu") != "silu" or hf.get("attention_bias") or hf.get("mlp_bias"):
            raise NotImplementedError("LlamaConfig: only hidden_act='silu' without attention or MLP biases is "
                                      "supported, as in Meta's Llama")
        known = {f.name for f in fields(cls)}
        values = {name: value for name, value in hf.items() if name in known}
        if "rope_theta" in rope:
            values["rope_theta"] = rope["rope_theta"]
        for name in ("bos_token_id", "eos_token_id"):   # Llama 3 lists several end tokens: keep the first
            if isinstance(values.get(name), list):
                values[name] = values[name][0]
        return cls(**values)

    def to_hf(self, torch_dtype="float32"):
        """The config.json dict that transformers 4 and 5 read (both rope_theta and rope_parameters)."""
        if self.rope_interleaved:
            raise ValueError("save_pretrained: rope_interleaved=True is llama2.c's pairing, which Hugging Face's "
                             "Llama does not have; permute q_proj and k_proj back (gpt2_cupy.ops.rope) first")
        hf = {name: value for name, value in asdict(self).items() if name != "rope_interleaved"}
        return dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", attention_bias=False,
                    mlp_bias=False, attention_dropout=0.0, rope_scaling=None, use_cache=True,
                    rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
                    torch_dtype=torch_dtype, **hf)


class LlamaAttention(nn.Module):
    def __init__(self, config):
        self.n_heads, self.n_kv_heads, self.head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                                       config.head_dim)
        self.rope_theta, self.rope_interleaved = config.rope_theta, config.rope_interleaved
        self.q_proj = nn.Linear(config.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, config.hidden_size, bias=False)
        self.projections = SharedRows([self.q_proj, self.k_proj, self.v_proj])

    def forward(self, x, layer_cache=None, residual=None, norm=None):
        """The attention's output projection (B, T, C); residual + it when residual is given (generation), and
        then (that, norm(that)) when norm is given (project)."""
        B, T, _ = x.shape
        if layer_cache is not None and layer_cache.cache.device_lengths is not None:
            return self._decode_at_device_position(x, layer_cache, residual, norm)
        start = 0 if layer_cache is None else layer_cache.start
        q, k, v = (self.q_proj(x), self.k_proj(x), self.v_proj(x)) if self.projections.weight is None else \
            self.projections(x)                                             # bf16: one product for the three
        q = q.view(B, T, self.n_heads, self.head_dim)                       # (B, T, H, hd)
        k = k.view(B, T, self.n_kv_heads, self.head_dim)                    # (B, T, Hkv, hd)
        v = v.view(B, T, self.n_kv_heads, self.head_dim)                    # (B, T, Hkv, hd)
        q = F.rope(q, self.rope_theta, start, self.rope_interleaved)        # positions start..start+T-1
        k = F.rope(k, self.rope_theta, start, self.rope_interleaved)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H or Hkv, T, hd)
        if layer_cache is not None and start > 0:
            y = layer_cache.attend(q, k, v)                                 # new queries, all keys so far
        else:
            if layer_cache is not None:
                layer_cache.store(k, v)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # (B, H, T, hd)
        y = y.transpose(1, 2).contiguous().view(B, T, self.n_heads * self.head_dim)  # heads side by side again
        return project(self.o_proj, y, residual, norm)

    def _decode_at_device_position(self, x, layer_cache, residual, norm):
        """The attention of new positions whose first position and the cache's length after them are read
        from device memory (cache.device_lengths), so that one captured CUDA graph serves every step: one
        product for q, k and v, one launch to turn q and k and store k and v (the product's own where it is a
        GEMV and FOLD_ROPE), the decode kernel, and the output product with the residual add inside it."""
        B, T, _ = x.shape
        cache = layer_cache.cache
        first_position, length = cache.device_lengths[0:1], cache.device_lengths[1:2]
        keys, values = cache.keys[layer_cache.index], cache.values[layer_cache.index]
        rope = dict(theta=self.rope_theta, start=first_position, interleaved=self.rope_interleaved)
        if FOLD_ROPE and self.projections.one_gemv(x):                      # one launch for all of it
            q = gemv_rope_store(backend.xp.ascontiguousarray(x.data), self.projections.shared_weight(), keys,
                                values, self.n_heads, **rope)                        # (B, H, T, hd)
        else:
            if self.projections.weight is not None:
                qkv = self.projections.together(x)
            else:
                qkv = backend.xp.concatenate([linear(x).data for linear in (self.q_proj, self.k_proj, self.v_proj)],
                                             axis=-1)
            q = rope_store_new_positions(qkv, keys, values, self.n_heads, **rope)   # (B, H, T, hd)
        y = Tensor(decode_attention_forward(q, keys, values, length))                  # (B, H, T, hd)
        y = y.transpose(1, 2).contiguous().view(B, T, self.n_heads * self.head_dim)
        return project(self.o_proj, y, residual, norm)


def project(linear, x, residual, norm=None):
    """linear(x), or residual + linear(x) in one launch where the product is a GEMV's (gpt2_cupy.ops.linear's
    residual=); for generation, under no_grad. norm (an nn.RMSNorm, with residual): returns (y, norm(y)), the
    norm in the GEMV's last block up to FOLD_NORMS_MOST_CHANNELS (gemv_rmsnorm_forward: the same bits, one
    launch fewer)."""
    if residual is None:
        return linear(x)
    bias = None if linear.bias is None else linear.bias.data
    x, residual = backend.xp.ascontiguousarray(x.data), backend.xp.ascontiguousarray(residual.data)
    fold = norm is not None and linear.out_features <= FOLD_NORMS_MOST_CHANNELS
    if fold and few_rows_times_bf16(x, linear.weight.data):
        eps = numpy.finfo(numpy.float32).eps if norm.eps is None else norm.eps    # F.rms_norm's default
        y, normed = gemv_rmsnorm_forward(x, linear.weight.data, norm.weight.data, bias, residual=residual, eps=eps)
        return Tensor(y), Tensor(normed)
    y = Tensor(linear_forward(x, linear.weight.data, bias, residual=residual))
    return y if norm is None else (y, norm(y))


class LlamaMLP(nn.Module):
    def __init__(self, config):
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)   # Meta's w1
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)     # Meta's w3
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)   # Meta's w2
        self.projections = SharedRows([self.gate_proj, self.up_proj])

    def forward(self, x, residual=None, norm=None):
        """down_proj(silu(gate_proj(x)) * up_proj(x)); residual + it when residual is given (generation, where
        at a GEMV's few rows one launch takes the gate and up products and SwiGLU), and then (that, norm(that))
        when norm is given (project)."""
        if residual is not None and self.projections.one_gemv(x):
            return project(self.down_proj, Tensor(self.projections.together(x, gated=True)), residual, norm)
        if self.projections.weight is not None:                             # bf16: one product for both
            return project(self.down_proj, F.swiglu(*self.projections(x)), residual, norm)
        return project(self.down_proj, F.swiglu(self.gate_proj(x), self.up_proj(x)), residual, norm)


class SharedRows:
    """Linear layers of one input whose weights are consecutive rows of one array, after share(): one product
    x [W1; W2; ...]ᵀ gives [x W1ᵀ, x W2ᵀ, ...] side by side, and at batch 1 one GEMV launch reads all the
    weights (q, k and v; gate and up). The parameters stay the layers' own (views into the array), so
    state_dict, load_state_dict and checkpoints see no difference. For inference: a plain array, no gradient."""

    def __init__(self, linears):
        self.linears, self.weight, self.views = linears, None, None

    def share(self):
        """Move the weights into one new array (each layer's weight then a view of its rows)."""
        self.weight = backend.xp.concatenate([linear.weight.data for linear in self.linears], axis=0)
        start, self.views = 0, []
        for linear in self.linears:
            rows = linear.out_features
            linear.weight.data = self.weight[start:start + rows]
            self.views.append(linear.weight.data)
            start += rows

    def together(self, x, gated=False):
        """The layers' outputs side by side, (..., Σ out_features), one array, for x (..., in_features).
        gated (two layers, gate and up; generation, see one_gemv): silu(gate) * up of the two, (...,
        out_features), in the product's own launch."""
        x = backend.xp.ascontiguousarray(x.data)
        return gemv_forward(x, self.shared_weight(), gated=True) if gated else linear_forward(x, self.shared_weight())

    def shared_weight(self):
        """The one array of the layers' rows, once it is checked that they still are its views."""
        if any(linear.weight.data is not view for linear, view in zip(self.linears, self.views)):
            raise RuntimeError("Llama: a projection's weight was replaced after its rows were shared; call "
                               "model.to(dtype) again")
        return self.weight

    def one_gemv(self, x):
        """Whether together(x) is one GEMV launch: shared bf16 rows times a generation step's few rows."""
        return self.weight is not None and few_rows_times_bf16(x.data, self.weight)

    def __call__(self, x):
        """The layers' outputs (..., out_features) for x (..., in_features), as Tensors: views of the one product's
        output, which RoPE, SwiGLU and the attention read where they lie."""
        together = self.together(x)
        outputs, start = [], 0
        for linear in self.linears:
            rows = linear.out_features
            outputs.append(Tensor(together[..., start:start + rows]))
            start += rows
        return outputs


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config):
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))

    def generation_forward(self, x, h, layer_cache, next_norm):
        """Generation (no gradient): x the residual stream (B, T, C), h = input_layernorm(x); returns the layer's
        output and next_norm of it (the next layer's input_layernorm, or the model's norm). Each residual add
        happens inside the product before it, and each norm after it in that product's last launch where it
        is a GEMV (project): the bits of forward's kernels, two launches fewer per layer."""
        x, h = self.self_attn(h, layer_cache, residual=x, norm=self.post_attention_layernorm)
        return self.mlp(h, residual=x, norm=next_norm)


class LlamaModel(nn.Module):
    def __init__(self, config):
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class Llama(nn.Module):
    def __init__(self, config):
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.model.embed_tokens.weight = self.lm_head.weight   # one (V, C) matrix, two uses
        self._init_weights()

    def _init_weights(self):
        """Hugging Face's initialisation: N(0, initializer_range) for every matrix, ones for the norms."""
        generator = init_generator()
        for name, parameter in self.named_parameters():
            if parameter.ndim == 2:
                values = generator.normal(0.0, self.config.initializer_range, parameter.shape)
                parameter.data[...] = backend.xp.asarray(values, dtype=numpy.float32)

    def get_num_params(self, non_embedding=True):
        """Parameters counted once (a tied matrix once); without the input embedding by default."""
        count = sum(p.numel() for p in self.parameters())
        untied_embedding = not self.config.tie_word_embeddings
        return count - self.model.embed_tokens.weight.numel() if non_embedding and untied_embedding else count

    def forward(self, idx, targets=None, kv_cache=None):
        idx = idx.data if isinstance(idx, Tensor) else idx
        B, T = idx.shape
        if kv_cache is not None and is_grad_enabled():
            raise RuntimeError("Llama: a kv_cache is for generation; run the model under gpt2_cupy.no_grad()")
        if self.dtype != numpy.float32 and is_grad_enabled():
            raise RuntimeError(f"Llama: weights in {self.dtype} are for inference; run the model under "
                               "gpt2_cupy.no_grad(), or train in float32 (with gpt2_cupy.autocast for bf16)")
        x = self._embed(idx)                                                   # (B, T, C)
        if kv_cache is None:
            for layer in self.model.layers:
                x = layer(x)
            h = self.model.norm(x)
        else:                                   # generation: each layer also gives the norm that follows it
            layers = self.model.layers
            norms = [layer.input_layernorm for layer in layers] + [self.model.norm]
            h = norms[0](x)
            for number, layer in enumerate(layers):
                x, h = layer.generation_forward(x, h, kv_cache.layer(number), norms[number + 1])
        logits = self.lm_head(h)                                               # (B, T, V)
        if kv_cache is not None:
            kv_cache.length += T
        loss = None
        if targets is not None:
            targets = targets.data if isinstance(targets, Tensor) else targets
            targets = backend.xp.where(targets == -1, -100, targets).reshape(B * T)  # -1 (our GPT's) as -100
            loss = F.cross_entropy(logits.view(B * T, self.config.vocab_size), targets, ignore_index=-100)
        return logits, loss

    def to(self, *arguments, **options):
        """nn.Module.to; in bf16 (inference), the weights of q, k, v and of gate, up also become rows of one
        array per layer (SharedRows), read by one product each."""
        super().to(*arguments, **options)
        for layer in self.model.layers:
            for shared in (layer.self_attn.projections, layer.mlp.projections):
                if self.dtype == numpy.float32:
                    shared.weight = shared.views = None
                elif shared.weight is None or shared.weight.dtype != self.dtype:
                    shared.share()
        return self

    @property
    def dtype(self):
        """The parameters' dtype (PyTorch's model.dtype): float32, or bfloat16 after model.to(bfloat16)."""
        return self.lm_head.weight.dtype

    def _embed(self, idx):
        """The rows of embed_tokens for idx. A bf16 table (a model converted for generation) is gathered as
        it is stored, 2-byte words, by the array module's take: no rounding, and nothing to convert."""
        weight = self.model.embed_tokens.weight
        if weight.dtype == numpy.float32:
            return self.model.embed_tokens(idx)
        words = backend.xp.take(weight.data.view(numpy.uint16), idx, axis=0)    # (B, T, C) of bf16 bits
        return Tensor(words.view(weight.dtype))

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type=None):
        """AdamW with two groups: matrices decay, norm weights do not."""
        from gpt2_cupy import optim

        parameters = self.parameters()
        groups = [{"params": [p for p in parameters if p.ndim >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in parameters if p.ndim < 2], "weight_decay": 0.0}]
        return optim.AdamW(groups, lr=learning_rate, betas=betas)

    def new_kv_cache(self, batch_size, max_length):
        """Room for the keys and values of max_length positions in every layer, for generation, in the
        weights' dtype (a bf16 model keeps a bf16 cache)."""
        return LlamaKVCache(self.config, batch_size, max_length, dtype=self.dtype)

    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, seed=0, cuda_graph=False):
        """idx (B, T) of token ids continued by max_new_tokens tokens: (B, T + max_new_tokens), as nanoGPT's
        generate. temperature=0 is greedy, chosen on the device; otherwise the tokens are drawn on the host
        from softmax(logits / temperature), among the top_k most likely if given (numpy's generator, seed).

        A static KV cache of T + max_new_tokens positions, filled by one forward of the prompt; then one
        forward per new token. cuda_graph=True captures that decode step once as a CUDA graph (the token,
        the position and the cache length in device memory) and replays it for every token: no Python and
        no launch cost per kernel, one replay per token (gpt2_cupy.graphs; the CPU executor replays too)."""
        from gpt2_cupy.sample import next_token

        idx = idx.data if isinstance(idx, Tensor) else idx
        B, T = idx.shape
        if T + max_new_tokens > self.config.max_position_embeddings:
            raise ValueError(f"generate: {T} + {max_new_tokens} positions; the model holds "
                             f"max_position_embeddings = {self.config.max_position_embeddings}")
        if temperature < 0:
            raise ValueError(f"generate: temperature = {temperature}; it must be >= 0")
        xp, generator = backend.xp, numpy.random.default_rng(seed)

        def choose(logits):                                   # (B, V) -> (B, 1) int64 token ids on the device
            if temperature == 0:
                return argmax_forward(xp.ascontiguousarray(logits))
            rows = backend.asnumpy(converted(logits, numpy.float32))
            return xp.asarray(numpy.array([[next_token(row, temperature, top_k, generator)] for row in rows]))

        generated = xp.empty((B, max_new_tokens), dtype=numpy.int64)
        with no_grad():
            cache = self.new_kv_cache(B, T + max_new_tokens)
            logits, _ = self(idx, kv_cache=cache)                                   # the prompt: prefill
            token = choose(logits.data[:, -1])
            step = DecodeGraph(self, cache, token, greedy=temperature == 0) if cuda_graph and max_new_tokens > 1 else None
            for i in range(max_new_tokens):
                backend.copy_into(generated[:, i:i + 1], token)
                if i == max_new_tokens - 1:
                    break
                if step is None:
                    logits, _ = self(token, kv_cache=cache)
                    token = choose(logits.data[:, -1])
                else:
                    logits = step.run(first=i == 0)
                    if temperature != 0:
                        backend.copy_into(step.token, choose(logits.data[:, -1]))
                    token = step.token
        return xp.concatenate([idx.astype(numpy.int64), generated], axis=1)

    # ---- Hugging Face checkpoints ---------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, directory, torch_dtype=None):
        """A model from a local Hugging Face Llama directory: config.json and model.safetensors, or shards with
        model.safetensors.index.json; weights in float32, float16 or bfloat16, read one tensor at a time.
        torch_dtype (transformers' name): None or float32 keeps float32 parameters; bfloat16 stores them in
        bf16 for generation (a bf16 checkpoint exactly)."""
        with open(os.path.join(directory, "config.json")) as file:
            config = LlamaConfig.from_hf(json.load(file))
        model = cls(config)
        if torch_dtype is not None:
            model.to(torch_dtype)
        parameters = dict(model.named_parameters(remove_duplicate=False))
        loaded = set()
        for name, array in safetensors_files.read_tensors(directory):
            if name.endswith("rotary_emb.inv_freq"):
                continue                     # older checkpoints store RoPE's frequencies; they are recomputed
            if name not in parameters:
                raise ValueError(f"{name}: the checkpoint has this tensor, which a Llama of this config does not")
            if array.shape != parameters[name].shape:
                raise ValueError(f"{name}: shape {array.shape} in the checkpoint, {parameters[name].shape} in the "
                                 "model its config.json describes")
            parameters[name].data[...] = converted(backend.xp.asarray(array), parameters[name].dtype)
            loaded.add(name)
        tied = {"lm_head.weight", "model.embed_tokens.weight"}
        if config.tie_word_embeddings and loaded & tied:
            loaded |= tied                   # one matrix under two names, stored under either
        missing = [name for name in parameters if name not in loaded]
        if missing:
            raise ValueError(f"{missing[0]}: missing from the checkpoint in {directory}"
                             + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        return model

    def save_pretrained(self, directory, dtype="float32", max_shard_size=None):
        """Write config.json and model.safetensors (or shards of at most max_shard_size bytes with their index)
        that transformers.LlamaForCausalLM.from_pretrained reads; dtype "float32", "float16" or "bfloat16"."""
        os.makedirs(directory, exist_ok=True)
        tensors = {name: parameter.data for name, parameter in self.named_parameters(remove_duplicate=False)}
        if self.config.tie_word_embeddings:
            del tensors["lm_head.weight"]    # stored once, as Hugging Face does
        safetensors_files.write_tensors(directory, tensors, dtype=dtype, max_shard_bytes=max_shard_size)
        with open(os.path.join(directory, "config.json"), "w") as file:
            json.dump(self.config.to_hf(torch_dtype=dtype), file, indent=2)


class LlamaKVCache(KVCache):
    """The keys (after RoPE) and values of every position seen so far, per layer: (B, Hkv, max_length, hd) each,
    one copy per key-value head, not per query head. Storing and attending are GPT-2's cache's (gpt2_cupy.model):
    the decode kernel lets each group of query heads read its key-value head."""

    def __init__(self, config, batch_size, max_length, dtype=numpy.float32):
        if max_length > config.max_position_embeddings:
            raise ValueError(f"new_kv_cache: max_length {max_length} > max_position_embeddings "
                             f"{config.max_position_embeddings}")
        shape = (batch_size, config.num_key_value_heads, max_length, config.head_dim)
        self.keys = [backend.xp.zeros(shape, dtype) for _ in range(config.num_hidden_layers)]
        self.values = [backend.xp.zeros(shape, dtype) for _ in range(config.num_hidden_layers)]
        self.length = 0          # positions stored; the model advances it after each forward
        self.max_length = max_length
        # None, or int32 [first new position, length after the new positions] in device memory: then the
        # layers read the positions from there (a captured decode step, DecodeGraph), not from `length`.
        self.device_lengths = None


class DecodeGraph:
    """One decode step of a Llama (one new token per sequence) captured as a CUDA graph and replayed per token.

    The step reads its token from `token` (B, 1) int64 and the positions from cache.device_lengths, and ends
    by adding 1 to both positions (and, greedy, by writing the argmax of its logits into `token`), so that
    replaying it again is the next step. Built at the cache's current length: the warm-up before the capture
    is the step at that position, run eagerly; run(first=True) counts it, later run() calls replay."""

    def __init__(self, model, cache, token, greedy):
        self.model, self.cache, self.greedy = model, cache, greedy
        self.token = backend.xp.array(token, dtype=numpy.int64)               # the graph's own input buffer
        position = cache.length
        cache.device_lengths = backend.xp.asarray(numpy.array([position, position + 1], dtype=numpy.int32))
        pool = graph_pool_handle()
        with use_pool(pool):
            warm_up_logits = self._step()                                        # the warm-up: step `position`
        # Its logits copied out of the pool: a block the warm-up still held would be missing at the capture,
        # which needs as many free blocks of each size as the warm-up used.
        self.first_logits = Tensor(warm_up_logits.data.copy())
        del warm_up_logits
        self.graph = CUDAGraph()
        with graph(self.graph, pool=pool):
            self.logits = self._step()                                           # recorded, not run
        cache.length = position + 1   # the warm-up's step; device_lengths already hold the next one's

    def _step(self):
        logits, _ = self.model(self.token, kv_cache=self.cache)
        backend.xp.add(self.cache.device_lengths, 1, out=self.cache.device_lengths)
        if self.greedy:
            argmax_forward(logits.data[:, -1], out=self.token)
        return logits

    def run(self, first=False):
        """The next step, returning its logits (B, 1, V): the warm-up already ran the first one; every later
        one is a replay, into the logits array the capture made."""
        if first:
            return self.first_logits
        self.graph.replay()
        self.cache.length += 1
        return self.logits
