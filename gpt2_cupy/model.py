"""GPT-2, assembled from the course's kernels; the structure and the parameter names are nanoGPT's.

    idx (B, T) ──wte──┐
                      + ─drop─ [Block] × n_layer ─ ln_f ─ lm_head (= wteᵀ) ─ logits (B, T, V)
    positions ──wpe───┘
    Block:  x = x + attn(ln_1(x));  x = x + mlp(ln_2(x))

    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=128))
    logits, loss = model(idx, targets)          # idx, targets: integer backend arrays (B, T)
    loss.backward()
    optimizer = model.configure_optimizers(weight_decay=0.1, learning_rate=6e-4, betas=(0.9, 0.95))

    GPT.from_pretrained(directory), model.save_pretrained(directory)   Hugging Face GPT-2 checkpoints
    cache = model.new_kv_cache(batch_size, max_length)                  keys and values for generation
    logits, _ = model(idx_new, kv_cache=cache)                          only the new positions
"""

import math
from dataclasses import asdict, dataclass

import numpy

from gpt2_cupy import backend, nn, pretrained, safetensors_files
from gpt2_cupy.nn import functional as F
from gpt2_cupy.autograd import is_grad_enabled
from gpt2_cupy.random import init_generator
from gpt2_cupy.generation import KVCache


@dataclass
class GPTConfig:
    block_size: int = 1024      # the longest context: wpe has one row per position
    vocab_size: int = 50304     # GPT-2's 50257 padded up to a multiple of 64 for efficiency
    n_layer: int = 12
    n_head: int = 12            # n_embd must divide by it: each head sees n_embd // n_head channels
    n_embd: int = 768
    dropout: float = 0.0        # 0 for pretraining, 0.1+ for fine-tuning a small data set
    bias: bool = True           # biases in Linears and norms, as GPT-2; False is a little better and faster
    norm: str = "layernorm"     # "layernorm" (GPT-2) or "dyt" (dynamic tanh: no mean or variance)
    attention: str = "softmax"  # "softmax" (GPT-2) or "relu" (ReLU attention weights, chapter 08)


def norm_layer(config):
    if config.norm == "layernorm":
        return nn.LayerNorm(config.n_embd, bias=config.bias)
    if config.norm == "dyt":
        return nn.DyT(config.n_embd, bias=config.bias)
    raise ValueError(f"GPTConfig: norm={config.norm!r}; use 'layernorm' or 'dyt'")


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        if config.n_embd % config.n_head != 0:
            raise ValueError(f"GPTConfig: n_embd = {config.n_embd} does not divide into n_head = {config.n_head}")
        if config.attention not in ("softmax", "relu"):
            raise ValueError(f"GPTConfig: attention={config.attention!r}; use 'softmax' or 'relu'")
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v in one product
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head, self.n_embd, self.attention = config.n_head, config.n_embd, config.attention

    def forward(self, x, layer_cache=None):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)                   # 3 × (B, T, C)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)       # (B, H, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)       # (B, H, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)       # (B, H, T, hs)
        if layer_cache is not None and layer_cache.start > 0:
            y = layer_cache.attend(q, k, v, self.attention)                   # new queries, all keys so far
        else:
            if layer_cache is not None:
                layer_cache.store(k, v)
            attend = F.scaled_dot_product_attention if self.attention == "softmax" else F.relu_attention
            y = attend(q, k, v, is_causal=True)                               # (B, H, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)                      # heads side by side again
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config):
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, config):
        self.ln_1 = norm_layer(config)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = norm_layer(config)
        self.mlp = MLP(config)

    def forward(self, x, layer_cache=None):
        x = x + self.attn(self.ln_1(x), layer_cache)
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, config):
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=norm_layer(config),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Weight tying: the output layer scores each token by its input embedding (one (V, C) matrix,
        # two uses; its gradient is the sum of both, added into one buffer).
        self.transformer.wte.weight = self.lm_head.weight
        self._init_weights()

    def _init_weights(self):
        """GPT-2's initialisation: N(0, 0.02) for weights, zero biases, and each residual projection
        scaled by 1/√(2·n_layer), since the residual stream sums 2·n_layer of them."""
        generator = init_generator()
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, parameter in self.named_parameters():
            if name.endswith("c_proj.weight"):
                values = generator.normal(0.0, residual_std, parameter.shape)
            elif name.endswith(".weight") and parameter.ndim == 2:       # Linear and Embedding tables
                values = generator.normal(0.0, 0.02, parameter.shape)
            elif name.endswith(".bias"):
                values = numpy.zeros(parameter.shape)
            else:                                                        # norm weights, DyT's alpha
                continue
            parameter._data[...] = backend.xp.asarray(values, dtype=numpy.float32)

    def get_num_params(self, non_embedding=True):
        """Parameters counted once (the tied matrix once); without the position table by default, as nanoGPT."""
        count = sum(p.numel() for p in self.parameters())
        return count - self.transformer.wpe.weight.numel() if non_embedding else count

    def forward(self, idx, targets=None, kv_cache=None):
        B, T = idx.shape
        if kv_cache is not None and is_grad_enabled():
            raise RuntimeError("GPT: a kv_cache is for generation; run the model under gpt2_cupy.no_grad()")
        start = 0 if kv_cache is None else kv_cache.length
        if start + T > self.config.block_size:
            raise ValueError(f"GPT: positions {start}..{start + T - 1} go past block_size = {self.config.block_size}")
        positions = _positions(B, start, T)                                   # (B, T): start, start+1, ...
        tok_emb = self.transformer.wte(idx)                                   # (B, T, C)
        pos_emb = self.transformer.wpe(positions)                             # (B, T, C)
        x = self.transformer.drop(tok_emb + pos_emb)
        for layer, block in enumerate(self.transformer.h):
            x = block(x, None if kv_cache is None else kv_cache.layer(layer))
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)                                              # (B, T, V)
        if kv_cache is not None:
            kv_cache.length += T
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(B * T, self.config.vocab_size), targets.reshape(B * T),
                                   ignore_index=-1)
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type=None):
        """AdamW with nanoGPT's two groups: matrices and embeddings decay, biases and norm weights do not."""
        return pretrained.adamw(self, weight_decay, learning_rate, betas)

    def new_kv_cache(self, batch_size, max_length):
        """Room for the keys and values of max_length positions in every layer, for generation
        (gpt2_cupy.generation.KVCache; each attention layer stores into and reads its layer of it)."""
        config = self.config
        if max_length > config.block_size:
            raise ValueError(f"new_kv_cache: max_length {max_length} > block_size {config.block_size}")
        return KVCache(config.n_layer, batch_size, config.n_head, config.n_embd // config.n_head, max_length)

    # ---- Hugging Face checkpoints ---------------------------------------------------------------------

    # GPT-2's original code stores these four as Conv1D weights, (in, out): transposed from Linear's.
    CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")

    @classmethod
    def from_pretrained(cls, directory, dropout=0.0):
        """A model from a local Hugging Face GPT-2 directory: config.json and model.safetensors, or shards with
        model.safetensors.index.json; weights in float32, float16 or bfloat16, read one tensor at a time
        (gpt2_cupy.safetensors_files, as Llama.from_pretrained reads them)."""
        hf = pretrained.read_config(directory)
        config = GPTConfig(block_size=hf["n_positions"], vocab_size=hf["vocab_size"], n_layer=hf["n_layer"],
                           n_head=hf["n_head"], n_embd=hf["n_embd"], dropout=dropout, bias=True)
        model = cls(config)
        loaded = set()
        for name, array in safetensors_files.read_tensors(directory):
            name = name if name.startswith(("transformer.", "lm_head.")) else "transformer." + name
            if name.endswith((".attn.bias", ".attn.masked_bias")):
                continue                           # the causal mask, stored as a buffer by older versions
            # One tensor at a time into its parameter, so the host never holds a second copy of the model.
            _, unexpected = model.load_state_dict({name: array.T if name.endswith(cls.CONV1D) else array},
                                                  strict=False)
            if unexpected:
                raise ValueError(f"{name}: the checkpoint has this tensor, which a GPT-2 of this config does not")
            loaded.add(name)
        loaded.add("lm_head.weight")               # tied to transformer.wte.weight: stored once
        pretrained.check_loaded([name for name, _ in model.named_parameters(remove_duplicate=False)], loaded, directory)
        return model

    def save_pretrained(self, directory, dtype="float32", max_shard_size=None):
        """Write config.json and model.safetensors (or shards of at most max_shard_size bytes with their index)
        that transformers.GPT2LMHeadModel.from_pretrained reads; dtype "float32", "float16" or "bfloat16"."""
        config = self.config
        if not config.bias or config.norm != "layernorm" or config.attention != "softmax":
            raise ValueError("save_pretrained: Hugging Face's GPT-2 has biases, LayerNorm and softmax attention; "
                             f"this model has bias={config.bias}, norm={config.norm!r}, attention={config.attention!r}")
        tensors = {name: parameter._data.T if name.endswith(self.CONV1D) else parameter._data
                   for name, parameter in self.named_parameters()}  # lm_head.weight is wte's: stored once
        hf = dict(architectures=["GPT2LMHeadModel"], model_type="gpt2", vocab_size=config.vocab_size,
                  n_positions=config.block_size, n_ctx=config.block_size, n_embd=config.n_embd,
                  n_layer=config.n_layer, n_head=config.n_head, n_inner=None, activation_function="gelu_new",
                  resid_pdrop=config.dropout, embd_pdrop=config.dropout, attn_pdrop=config.dropout,
                  layer_norm_epsilon=1e-5, initializer_range=0.02, tie_word_embeddings=True,
                  bos_token_id=50256, eos_token_id=50256, torch_dtype=dtype, gpt2_cupy_config=asdict(config))
        pretrained.write(directory, tensors, hf, dtype, max_shard_size)


_training_positions = {}


def _positions(B, start, T):
    """The (B, T) int32 array of positions start..start+T-1 in every row.

    Training asks for the same (B, 0, T) every step: that one is made once and kept.
    """
    if start == 0 and (B, T) in _training_positions:
        return _training_positions[B, T]
    row = backend.xp.arange(start, start + T, dtype=numpy.int32)
    positions = backend.xp.ascontiguousarray(backend.xp.broadcast_to(row, (B, T)))
    if start == 0:
        _training_positions[B, T] = positions
    return positions
