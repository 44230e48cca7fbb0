"""A GPT written the way the textbooks write it, with only PyTorch's imports changed: LayerNorm from mean and
var, GELU from tanh and pow, attention from @, a tril mask, masked_fill and softmax(dim=-1). It must match a
float64 numpy forward of the same weights, and train."""

import math

import numpy as np

import gpt2_cupy as torch
import gpt2_cupy.nn as nn
from gpt2_cupy.nn import functional as F


# ---- the model, as a textbook writes it ---------------------------------------------------------------------

class LayerNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(dim))
        self.shift = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        mean = x.mean(dim=-1, keepdim=True)
        var = x.var(dim=-1, keepdim=True, unbiased=False)
        norm_x = (x - mean) / torch.sqrt(var + self.eps)
        return self.scale * norm_x + self.shift


class GELU(nn.Module):
    def forward(self, x):
        return 0.5 * x * (1 + torch.tanh(torch.sqrt(torch.tensor(2.0 / torch.pi)) * (x + 0.044715 * torch.pow(x, 3))))


class MultiHeadAttention(nn.Module):
    def __init__(self, d_in, d_out, context_length, num_heads):
        super().__init__()
        self.d_out, self.num_heads, self.head_dim = d_out, num_heads, d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=False)
        self.W_key = nn.Linear(d_in, d_out, bias=False)
        self.W_value = nn.Linear(d_in, d_out, bias=False)
        self.out_proj = nn.Linear(d_out, d_out)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), diagonal=1))

    def forward(self, x):
        b, num_tokens, d_in = x.shape
        keys = self.W_key(x).view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        queries = self.W_query(x).view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        values = self.W_value(x).view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        attn_scores = queries @ keys.transpose(2, 3)
        mask_bool = self.mask.bool()[:num_tokens, :num_tokens]
        attn_scores = attn_scores.masked_fill(mask_bool, -torch.inf)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        context_vec = (attn_weights @ values).transpose(1, 2)
        context_vec = context_vec.contiguous().view(b, num_tokens, self.d_out)
        return self.out_proj(context_vec)


class TransformerBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.att = MultiHeadAttention(cfg["emb_dim"], cfg["emb_dim"], cfg["context_length"], cfg["n_heads"])
        self.ff = nn.Sequential(nn.Linear(cfg["emb_dim"], 4 * cfg["emb_dim"]), GELU(),
                                nn.Linear(4 * cfg["emb_dim"], cfg["emb_dim"]))
        self.norm1, self.norm2 = LayerNorm(cfg["emb_dim"]), LayerNorm(cfg["emb_dim"])

    def forward(self, x):
        x = x + self.att(self.norm1(x))
        x = x + self.ff(self.norm2(x))
        return x


class GPTModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.tok_emb = nn.Embedding(cfg["vocab_size"], cfg["emb_dim"])
        self.pos_emb = nn.Embedding(cfg["context_length"], cfg["emb_dim"])
        self.trf_blocks = nn.Sequential(*[TransformerBlock(cfg) for _ in range(cfg["n_layers"])])
        self.final_norm = LayerNorm(cfg["emb_dim"])
        self.out_head = nn.Linear(cfg["emb_dim"], cfg["vocab_size"], bias=False)

    def forward(self, in_idx):
        batch_size, seq_len = in_idx.shape
        tok_embeds = self.tok_emb(in_idx)
        pos_embeds = self.pos_emb(torch.arange(seq_len))
        x = tok_embeds + pos_embeds
        x = self.trf_blocks(x)
        x = self.final_norm(x)
        return self.out_head(x)


CONFIG = {"vocab_size": 29, "context_length": 8, "emb_dim": 16, "n_heads": 2, "n_layers": 2}


# ---- the same forward in float64 numpy --------------------------------------------------------------------------

def numpy_forward(p, ids):
    def layer_norm(x, prefix):
        mean = x.mean(-1, keepdims=True)
        return (x - mean) / np.sqrt(x.var(-1, keepdims=True) + 1e-5) * p[prefix + "scale"] + p[prefix + "shift"]

    def gelu(x):
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))

    B, T = ids.shape
    H, hs = CONFIG["n_heads"], CONFIG["emb_dim"] // CONFIG["n_heads"]
    x = p["tok_emb.weight"][ids] + p["pos_emb.weight"][np.arange(T)]
    for layer in range(CONFIG["n_layers"]):
        prefix = f"trf_blocks.{layer}."
        a = layer_norm(x, prefix + "norm1.")
        q, k, v = (
            (a @ p[prefix + f"att.{name}.weight"].T).reshape(B, T, H, hs).transpose(0, 2, 1, 3)
            for name in ("W_query", "W_key", "W_value"))
        scores = np.where(np.triu(np.ones((T, T)), 1) == 1, -np.inf, q @ k.transpose(0, 1, 3, 2)) / math.sqrt(hs)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        context = (weights @ v).transpose(0, 2, 1, 3).reshape(B, T, H * hs)
        x = x + context @ p[prefix + "att.out_proj.weight"].T + p[prefix + "att.out_proj.bias"]
        h = layer_norm(x, prefix + "norm2.") @ p[prefix + "ff.0.weight"].T + p[prefix + "ff.0.bias"]
        x = x + gelu(h) @ p[prefix + "ff.2.weight"].T + p[prefix + "ff.2.bias"]
    return layer_norm(x, "final_norm.") @ p["out_head.weight"].T


def test_textbook_gpt_matches_numpy_and_trains():
    torch.manual_seed(123)
    model = GPTModel(CONFIG)
    ids = torch.randint(0, CONFIG["vocab_size"], (3, CONFIG["context_length"]))
    targets = torch.randint(0, CONFIG["vocab_size"], (3, CONFIG["context_length"]))

    weights = {name: p.detach().numpy().astype(np.float64) for name, p in model.named_parameters()}
    logits = model(ids)
    expected = numpy_forward(weights, ids.numpy())
    error = np.abs(logits.detach().numpy() - expected).max() / np.abs(expected).max()
    assert error < 1e-5, f"relative error {error:.3g} against the float64 forward"

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for _ in range(6):
        logits = model(ids)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] > math.log(CONFIG["vocab_size"]) - 0.5       # about uniform at the start
    assert all(later < earlier for earlier, later in zip(losses, losses[1:])), losses
    assert losses[-1] < losses[0] - 0.3, losses
