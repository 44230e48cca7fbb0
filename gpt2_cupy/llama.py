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
    model.generate(idx, max_new_tokens, temperature=1.0, top_k=None, seed=0, cuda_graph=False)

Grouped-query attention: num_key_value_heads key and value heads, each shared by num_attention_heads //
num_key_value_heads query heads. Chapter 08's fused kernels read each key and value head for its whole group, with
no copy per query head (F.scaled_dot_product_attention(..., enable_gqa=True)), at any head size up to 256; the KV
cache stores the key and value heads once, and each generation step reads them with the decode kernel.
Generation's machinery (the cache, the decode step with its GEMV folds, the captured step) is
gpt2_cupy.generation's: a forward with a kv_cache and generate hand the model to it.
"""

from dataclasses import asdict, dataclass, fields

import numpy

from gpt2_cupy import backend, generation, nn, pretrained, safetensors_files
from gpt2_cupy.autograd import Tensor, is_grad_enabled
from gpt2_cupy.random import init_generator
from gpt2_cupy.elementwise import converted
from gpt2_cupy.generation import SharedRows
from gpt2_cupy.nn import functional as F


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

    def forward(self, x):
        """The attention's output projection (B, T, C) of x (B, T, C)."""
        q, k, v = self.heads(x, 0)                                          # (B, H or Hkv, T, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # (B, H, T, hd)
        return self.o_proj(self.heads_side_by_side(y))

    def heads(self, x, start):
        """q, k, v heads (B, H or Hkv, T, hd) of x (B, T, C) at positions start..start+T-1, RoPE applied."""
        B, T, _ = x.shape
        q, k, v = (self.q_proj(x), self.k_proj(x), self.v_proj(x)) if self.projections.weight is None else \
            self.projections(x)                                             # bf16: one product for the three
        q = q.view(B, T, self.n_heads, self.head_dim)                       # (B, T, H, hd)
        k = k.view(B, T, self.n_kv_heads, self.head_dim)                    # (B, T, Hkv, hd)
        v = v.view(B, T, self.n_kv_heads, self.head_dim)                    # (B, T, Hkv, hd)
        q = F.rope(q, self.rope_theta, start, self.rope_interleaved)        # positions start..start+T-1
        k = F.rope(k, self.rope_theta, start, self.rope_interleaved)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)    # (B, H or Hkv, T, hd)

    def heads_side_by_side(self, y):
        """(B, H, T, hd) -> (B, T, H·hd): the heads side by side again, o_proj's input."""
        B, _, T, _ = y.shape
        return y.transpose(1, 2).contiguous().view(B, T, self.n_heads * self.head_dim)


class LlamaMLP(nn.Module):
    def __init__(self, config):
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)   # Meta's w1
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)     # Meta's w3
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)   # Meta's w2
        self.projections = SharedRows([self.gate_proj, self.up_proj])

    def forward(self, x):
        """down_proj(silu(gate_proj(x)) * up_proj(x))."""
        if self.projections.weight is not None:                             # bf16: one product for both
            return self.down_proj(F.swiglu(*self.projections(x)))
        return self.down_proj(F.swiglu(self.gate_proj(x), self.up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config):
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


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
                parameter._data[...] = backend.xp.asarray(values, dtype=numpy.float32)

    def get_num_params(self, non_embedding=True):
        """Parameters counted once (a tied matrix once); without the input embedding by default."""
        count = sum(p.numel() for p in self.parameters())
        untied_embedding = not self.config.tie_word_embeddings
        return count - self.model.embed_tokens.weight.numel() if non_embedding and untied_embedding else count

    def forward(self, idx, targets=None, kv_cache=None):
        idx = idx._data if isinstance(idx, Tensor) else idx
        B, T = idx.shape
        if kv_cache is not None and is_grad_enabled():
            raise RuntimeError("Llama: a kv_cache is for generation; run the model under gpt2_cupy.no_grad()")
        if self.dtype != numpy.float32 and is_grad_enabled():
            raise RuntimeError(f"Llama: weights in {self.dtype} are for inference; run the model under "
                               "gpt2_cupy.no_grad(), or train in float32 (with gpt2_cupy.autocast for bf16)")
        if kv_cache is not None:                # generation: the decode engine's step
            return generation.llama_forward(self, idx, kv_cache), None
        x = self.embed(idx)                                                    # (B, T, C)
        for layer in self.model.layers:
            x = layer(x)
        logits = self.lm_head(self.model.norm(x))                              # (B, T, V)
        loss = None
        if targets is not None:
            targets = targets._data if isinstance(targets, Tensor) else targets
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

    def embed(self, idx):
        """The rows of embed_tokens for idx. A bf16 table (a model converted for generation) is gathered as
        it is stored, 2-byte words, by the array module's take: no rounding, and nothing to convert."""
        weight = self.model.embed_tokens.weight
        if weight.dtype == numpy.float32:
            return self.model.embed_tokens(idx)
        words = backend.xp.take(weight._data.view(numpy.uint16), idx, axis=0)    # (B, T, C) of bf16 bits
        return Tensor(words.view(weight.dtype))

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type=None):
        """AdamW with two groups: matrices decay, norm weights do not."""
        return pretrained.adamw(self, weight_decay, learning_rate, betas)

    def new_kv_cache(self, batch_size, max_length):
        """Room for the keys (after RoPE) and values of max_length positions in every layer, for generation:
        one copy per key-value head, in the weights' dtype (a bf16 model keeps a bf16 cache)."""
        config = self.config
        if max_length > config.max_position_embeddings:
            raise ValueError(f"new_kv_cache: max_length {max_length} > max_position_embeddings "
                             f"{config.max_position_embeddings}")
        return generation.KVCache(config.num_hidden_layers, batch_size, config.num_key_value_heads, config.head_dim,
                                  max_length, dtype=self.dtype)

    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, seed=0, cuda_graph=False):
        """idx (B, T) continued by max_new_tokens tokens, (B, T + max_new_tokens): gpt2_cupy.generation.generate."""
        return generation.generate(self, idx, max_new_tokens, temperature, top_k, seed, cuda_graph)

    # ---- Hugging Face checkpoints ---------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, directory, torch_dtype=None):
        """A model from a local Hugging Face Llama directory: config.json and model.safetensors, or shards with
        model.safetensors.index.json; weights in float32, float16 or bfloat16, read one tensor at a time.
        torch_dtype (transformers' name): None or float32 keeps float32 parameters; bfloat16 stores them in
        bf16 for generation (a bf16 checkpoint exactly)."""
        config = LlamaConfig.from_hf(pretrained.read_config(directory))
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
            parameters[name]._data[...] = converted(backend.xp.asarray(array), parameters[name].dtype)
            loaded.add(name)
        tied = {"lm_head.weight", "model.embed_tokens.weight"}
        if config.tie_word_embeddings and loaded & tied:
            loaded |= tied                   # one matrix under two names, stored under either
        pretrained.check_loaded(parameters, loaded, directory)
        return model

    def save_pretrained(self, directory, dtype="float32", max_shard_size=None):
        """Write config.json and model.safetensors (or shards of at most max_shard_size bytes with their index)
        that transformers.LlamaForCausalLM.from_pretrained reads; dtype "float32", "float16" or "bfloat16"."""
        tensors = {name: parameter._data for name, parameter in self.named_parameters(remove_duplicate=False)}
        if self.config.tie_word_embeddings:
            del tensors["lm_head.weight"]    # stored once, as Hugging Face does
        pretrained.write(directory, tensors, self.config.to_hf(torch_dtype=dtype), dtype, max_shard_size)
