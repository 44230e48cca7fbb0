"""Generation: the decode engine that runs a GPT or a Llama one new position at a time.

    cache = model.new_kv_cache(batch_size, max_length)     a KVCache: keys and values of every layer
    logits, _ = model(idx_new, kv_cache=cache)             only the new positions (GPT's forward, or llama_forward)
    tokens = generate(model, idx, max_new_tokens, temperature=1.0, top_k=None, seed=0, cuda_graph=False)
    token = next_token(logits_row, temperature, top_k, numpy_generator)      one draw on the host

The models hold the module tree and its forward; this module holds what only generation needs:

- KVCache: the keys and values of every position seen so far, which the decode kernel reads where they lie
  (gpt2_cupy.dispatch.decode_attention), each group of query heads sharing its key-value head's reads.
- SharedRows: Linear layers of one input (q, k and v; gate and up) whose bf16 weights are rows of one array,
  so that one product, or at batch 1 one GEMV launch, reads them all.
- llama_forward: Llama's decode step, one kernel call per line where the products are GEMVs: the residual
  add inside each product's launch, the RMSNorm after it in the same launch (FOLD_NORMS_MOST_CHANNELS), RoPE
  and the cache's store in the q, k, v GEMV (FOLD_ROPE). The same bits as the model's forward.
- DecodeGraph: that step captured once as a CUDA graph (the token and the positions in device memory) and
  replayed for every token; generate: nanoGPT's generate loop around it.
"""

import numpy

from gpt2_cupy import backend
from gpt2_cupy.autograd import Tensor, no_grad
from gpt2_cupy.dispatch import decode_attention, gemv_takes, linear_forward
from gpt2_cupy.elementwise import converted
from gpt2_cupy.graphs import CUDAGraph, graph, graph_pool_handle, use_pool
from gpt2_cupy.nn import functional as F
from gpt2_cupy.ops.argmax import argmax_forward
from gpt2_cupy.ops.gemv import gemv_forward, gemv_rmsnorm_forward, gemv_rope_store
from gpt2_cupy.ops.rope import rope_store_new_positions

# The decode step's folds, the same bits either way; the tokens/s that chose them are in
# bench/design_choices.json (bench/llama_generation.py --settings generation.FOLD_ROPE=False measures them).
FOLD_ROPE = True                   # RoPE and the cache's store in the q, k, v GEMV (gemv_rope_store)
# The RMSNorm after o_proj and down_proj in that GEMV's last block, for models of at most this many channels (0:
# never). The launch saved is paid for in every block of the product (more registers a thread, fewer loads in
# flight), which the larger products of wider models lose more than the launch gives.
FOLD_NORMS_MOST_CHANNELS = 2048


# ---- the cache -------------------------------------------------------------------------------------------

class KVCache:
    """The keys and values of every position seen so far, per layer: (B, heads, max_length, head_size) each
    (a Llama's key-value heads once, not once per query head), in dtype.

    With a cache, the model's input holds only new positions; their queries attend to every cached key
    and, causally, to each other. Only under no_grad: generation needs no gradients.
    """

    def __init__(self, layers, batch_size, heads, head_size, max_length, dtype=numpy.float32):
        shape = (batch_size, heads, max_length, head_size)
        self.keys = [backend.xp.zeros(shape, dtype) for _ in range(layers)]
        self.values = [backend.xp.zeros(shape, dtype) for _ in range(layers)]
        self.length = 0          # positions stored; the model advances it after each forward
        self.max_length = max_length
        # None, or int32 [first new position, length after the new positions] in device memory: then the
        # layers read the positions from there (a captured decode step, DecodeGraph), not from `length`.
        self.device_lengths = None

    def layer(self, index):
        return LayerCache(self, index)


class LayerCache:
    """One layer's view of a KVCache, for the forward of the positions start.. that come next."""

    def __init__(self, cache, index):
        self.cache, self.index, self.start = cache, index, cache.length

    def store(self, k, v):
        """Copy the new positions' keys and values (B, H, n, hs) into the cache, at positions start..start+n-1."""
        end = self.start + k.shape[2]
        if end > self.cache.max_length:
            raise ValueError(f"GPT: the kv_cache holds {self.cache.max_length} positions, {end} asked")
        self.cache.keys[self.index][:, :, self.start:end] = k._data
        self.cache.values[self.index][:, :, self.start:end] = v._data

    def attend(self, q, k, v, variant="softmax"):
        """Queries (B, H, n, hs) at positions start..start+n-1 over keys 0..start+n-1, the new ones stored first:
        the decode kernel, which reads the cache where it is, splits the keys across blocks and lets each group
        of query heads share its key-value head's reads."""
        if variant != "softmax":
            raise NotImplementedError("GPT: the kv_cache path computes softmax attention only")
        self.store(k, v)
        queries = backend.xp.ascontiguousarray(q._data)                       # (B, H, n, hs)
        return Tensor(decode_attention(queries, self.cache.keys[self.index], self.cache.values[self.index],
                                       self.start + q.shape[2]))


# ---- Linear layers of one input, one product ------------------------------------------------------------

class SharedRows:
    """Linear layers of one input whose weights are consecutive rows of one array, after share(): one product
    x [W1; W2; ...]ᵀ gives [x W1ᵀ, x W2ᵀ, ...] side by side, and at batch 1 one GEMV launch reads all the
    weights (q, k and v; gate and up). The parameters stay the layers' own (views into the array), so
    state_dict, load_state_dict and checkpoints see no difference. For inference: a plain array, no gradient."""

    def __init__(self, linears):
        self.linears, self.weight, self.views = linears, None, None

    def share(self):
        """Move the weights into one new array (each layer's weight then a view of its rows)."""
        self.weight = backend.xp.concatenate([linear.weight._data for linear in self.linears], axis=0)
        start, self.views = 0, []
        for linear in self.linears:
            rows = linear.out_features
            linear.weight._data = self.weight[start:start + rows]
            self.views.append(linear.weight._data)
            start += rows

    def together(self, x, gated=False):
        """The layers' outputs side by side, (..., Σ out_features), one array, for x (..., in_features).
        gated (two layers, gate and up; generation, see one_gemv): silu(gate) * up of the two, (...,
        out_features), in the product's own launch."""
        x = backend.xp.ascontiguousarray(x._data)
        return gemv_forward(x, self.shared_weight(), gated=True) if gated else linear_forward(x, self.shared_weight())

    def shared_weight(self):
        """The one array of the layers' rows, once it is checked that they still are its views."""
        if any(linear.weight._data is not view for linear, view in zip(self.linears, self.views)):
            raise RuntimeError("Llama: a projection's weight was replaced after its rows were shared; call "
                               "model.to(dtype) again")
        return self.weight

    def one_gemv(self, x):
        """Whether together(x) is one GEMV launch: shared bf16 rows times a generation step's few rows."""
        return self.weight is not None and gemv_takes(x._data, self.weight)

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


# ---- Llama's decode step ----------------------------------------------------------------------------------

def llama_forward(model, idx, cache):
    """The logits (B, T, V) of a Llama for new positions idx (B, T) after the cache's, under no_grad; the
    positions' keys and values stored in the cache, its length advanced by T. Each layer's residual adds
    happen inside the products before them, and each norm in that product's last launch where it is a GEMV:
    the bits of the model's forward, two launches fewer per layer."""
    T = idx.shape[1]
    layers = model.model.layers
    norms = [layer.input_layernorm for layer in layers] + [model.model.norm]
    x = model.embed(idx)                                                      # (B, T, C)
    h = norms[0](x)
    for number, layer in enumerate(layers):
        x, h = _attention_step(layer.self_attn, h, cache.layer(number), x, layer.post_attention_layernorm)
        x, h = _mlp_step(layer.mlp, h, x, norms[number + 1])
    logits = model.lm_head(h)                                                 # (B, T, V)
    cache.length += T
    return logits


def _attention_step(attention, x, layer_cache, residual, norm):
    """residual + the attention's output projection (B, T, C), and norm of that."""
    if layer_cache.cache.device_lengths is not None:
        return _attention_at_device_position(attention, x, layer_cache, residual, norm)
    start = layer_cache.start
    q, k, v = attention.heads(x, start)                                       # (B, H or Hkv, T, hd)
    if start > 0:
        y = layer_cache.attend(q, k, v)                                       # new queries, all keys so far
    else:
        layer_cache.store(k, v)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # (B, H, T, hd)
    return project(attention.o_proj, attention.heads_side_by_side(y), residual, norm)


def _attention_at_device_position(attention, x, layer_cache, residual, norm):
    """The attention of new positions whose first position and the cache's length after them are read
    from device memory (cache.device_lengths), so that one captured CUDA graph serves every step: one
    product for q, k and v, one launch to turn q and k and store k and v (the product's own where it is a
    GEMV and FOLD_ROPE), the decode kernel, and the output product with the residual add inside it."""
    cache = layer_cache.cache
    first_position, length = cache.device_lengths[0:1], cache.device_lengths[1:2]
    keys, values = cache.keys[layer_cache.index], cache.values[layer_cache.index]
    rope = dict(theta=attention.rope_theta, start=first_position, interleaved=attention.rope_interleaved)
    projections = attention.projections
    if FOLD_ROPE and projections.one_gemv(x):                                 # one launch for all of it
        q = gemv_rope_store(backend.xp.ascontiguousarray(x._data), projections.shared_weight(), keys, values,
                            attention.n_heads, **rope)                        # (B, H, T, hd)
    else:
        if projections.weight is not None:
            qkv = projections.together(x)
        else:
            qkv = backend.xp.concatenate([linear(x)._data for linear in projections.linears], axis=-1)
        q = rope_store_new_positions(qkv, keys, values, attention.n_heads, **rope)   # (B, H, T, hd)
    y = Tensor(decode_attention(q, keys, values, length))                    # (B, H, T, hd)
    return project(attention.o_proj, attention.heads_side_by_side(y), residual, norm)


def _mlp_step(mlp, x, residual, norm):
    """residual + down_proj(silu(gate_proj(x)) * up_proj(x)), and norm of that; at a GEMV's few rows one launch
    takes the gate and up products and SwiGLU."""
    projections = mlp.projections
    if projections.one_gemv(x):
        return project(mlp.down_proj, Tensor(projections.together(x, gated=True)), residual, norm)
    if projections.weight is not None:                                        # bf16: one product for both
        return project(mlp.down_proj, F.swiglu(*projections(x)), residual, norm)
    return project(mlp.down_proj, F.swiglu(mlp.gate_proj(x), mlp.up_proj(x)), residual, norm)


def project(linear, x, residual, norm):
    """(y, norm(y)) for y = residual + linear(x), the add in the product's launch where it is a GEMV's; the norm
    (an nn.RMSNorm) in the GEMV's last block up to FOLD_NORMS_MOST_CHANNELS (gemv_rmsnorm_forward: the same bits,
    one launch fewer)."""
    bias = None if linear.bias is None else linear.bias._data
    x, residual = backend.xp.ascontiguousarray(x._data), backend.xp.ascontiguousarray(residual._data)
    if linear.out_features <= FOLD_NORMS_MOST_CHANNELS and gemv_takes(x, linear.weight._data):
        eps = numpy.finfo(numpy.float32).eps if norm.eps is None else norm.eps    # F.rms_norm's default
        y, normed = gemv_rmsnorm_forward(x, linear.weight._data, norm.weight._data, bias, residual=residual, eps=eps)
        return Tensor(y), Tensor(normed)
    y = Tensor(linear_forward(x, linear.weight._data, bias, residual=residual))
    return y, norm(y)


# ---- the captured step and the loop ----------------------------------------------------------------------

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
        self.first_logits = Tensor(warm_up_logits._data.copy())
        del warm_up_logits
        self.graph = CUDAGraph()
        with graph(self.graph, pool=pool):
            self.logits = self._step()                                           # recorded, not run
        cache.length = position + 1   # the warm-up's step; device_lengths already hold the next one's

    def _step(self):
        logits, _ = self.model(self.token, kv_cache=self.cache)
        backend.xp.add(self.cache.device_lengths, 1, out=self.cache.device_lengths)
        if self.greedy:
            argmax_forward(logits._data[:, -1], out=self.token)
        return logits

    def run(self, first=False):
        """The next step, returning its logits (B, 1, V): the warm-up already ran the first one; every later
        one is a replay, into the logits array the capture made."""
        if first:
            return self.first_logits
        self.graph.replay()
        self.cache.length += 1
        return self.logits


def context_length(config):
    """How many positions the model attends over: GPT's block_size, Llama's max_position_embeddings."""
    return getattr(config, "block_size", None) or config.max_position_embeddings


def next_token(logits, temperature, top_k, generator, allowed=None):
    """One token id drawn from the logits of one position (a numpy float vector); only among the tokens
    where allowed (a boolean vector, or None for all) is True."""
    logits = numpy.asarray(logits, dtype=numpy.float64)
    if allowed is not None:
        logits = numpy.where(allowed, logits, -numpy.inf)  # before top-k, so that the k are all allowed
    if temperature == 0:
        return int(numpy.argmax(logits))  # greedy
    logits = logits / temperature
    if top_k is not None and top_k < logits.size:
        kth_largest = numpy.partition(logits, -top_k)[-top_k]
        logits = numpy.where(logits < kth_largest, -numpy.inf, logits)  # only the top k remain possible
    probabilities = numpy.exp(logits - logits.max())
    probabilities /= probabilities.sum()
    return int(generator.choice(probabilities.size, p=probabilities))


def generate(model, idx, max_new_tokens, temperature=1.0, top_k=None, seed=0, cuda_graph=False):
    """idx (B, T) of token ids continued by max_new_tokens tokens: (B, T + max_new_tokens), as nanoGPT's
    generate. temperature=0 is greedy, chosen on the device; otherwise the tokens are drawn on the host
    from softmax(logits / temperature), among the top_k most likely if given (numpy's generator, seed).

    A static KV cache of T + max_new_tokens positions, filled by one forward of the prompt; then one
    forward per new token. cuda_graph=True captures that decode step once as a CUDA graph (the token,
    the position and the cache length in device memory) and replays it for every token: no Python and
    no launch cost per kernel, one replay per token (gpt2_cupy.graphs; the CPU executor replays too)."""
    idx = idx._data if isinstance(idx, Tensor) else idx
    B, T = idx.shape
    if T + max_new_tokens > context_length(model.config):
        raise ValueError(f"generate: {T} + {max_new_tokens} positions; the model holds "
                         f"max_position_embeddings = {context_length(model.config)}")
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
        cache = model.new_kv_cache(B, T + max_new_tokens)
        logits, _ = model(idx, kv_cache=cache)                                   # the prompt: prefill
        token = choose(logits._data[:, -1])
        step = DecodeGraph(model, cache, token, greedy=temperature == 0) if cuda_graph and max_new_tokens > 1 else None
        for i in range(max_new_tokens):
            backend.copy_into(generated[:, i:i + 1], token)
            if i == max_new_tokens - 1:
                break
            if step is None:
                logits, _ = model(token, kv_cache=cache)
                token = choose(logits._data[:, -1])
            else:
                logits = step.run(first=i == 0)
                if temperature != 0:
                    backend.copy_into(step.token, choose(logits._data[:, -1]))
                token = step.token
    return xp.concatenate([idx.astype(numpy.int64), generated], axis=1)
