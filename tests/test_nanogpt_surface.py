"""A GPT and its training loop written as nanoGPT writes them, with only the imports changed.

The model and the loop below are our own code, but they make the same PyTorch calls as nanoGPT's model.py
and train.py: nn.Module subclasses with nn.Parameter(torch.ones(n)), F.layer_norm with an optional bias,
nn.ModuleDict/ModuleList, weight tying by assignment, self.apply(init), F.scaled_dot_product_attention
behind hasattr, a register_buffer'd tril mask for the slow path, logits[:, [-1], :], cross_entropy with
ignore_index=-1, AdamW groups picked by p.dim() and inspect.signature, np.memmap batches through
torch.from_numpy/torch.stack/pin_memory().to(device, non_blocking=True), estimate_loss under
@torch.no_grad(), gradient accumulation, GradScaler(enabled=False), autocast or nullcontext, clipping, the
cosine learning-rate schedule, torch.save/torch.load of a checkpoint dict, and generate with
topk/softmax/multinomial/cat.

The checks: the loss falls; the model's loss equals gpt2_cupy.model.GPT's on the same weights and batch;
a checkpoint resumes to the same next loss; generate returns valid ids of the right shape.
"""

import inspect
import math
import os
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import pytest

import gpt2_cupy as torch
import gpt2_cupy.nn as nn
from gpt2_cupy.nn import functional as F


# ---------------------------------------------------------------------------------------------------
# The model, in nanoGPT's style
# ---------------------------------------------------------------------------------------------------

class LayerNorm(nn.Module):
    """LayerNorm whose bias can be left out, as nanoGPT's is."""

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input):
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class SelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head, self.n_embd, self.dropout = config.n_head, config.n_embd, config.dropout
        self.flash = hasattr(torch.nn.functional, "scaled_dot_product_attention") and config.flash
        if not self.flash:
            self.register_buffer("bias", torch.tril(torch.ones(config.block_size, config.block_size))
                                 .view(1, 1, config.block_size, config.block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.flash:
            y = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            att = F.softmax(att, dim=-1)
            att = self.attn_dropout(att)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate=config.gelu)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = SelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


@dataclass
class Config:
    block_size: int = 16
    vocab_size: int = 48
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64     # head size 32: the fused attention takes 32 and 64
    dropout: float = 0.0
    bias: bool = True
    gelu: str = "none"   # nanoGPT's nn.GELU() is the exact one; GPT-2 (and gpt2_cupy.model.GPT) use "tanh"
    flash: bool = True   # False: the slow path, attention from @, masked_fill and softmax


class NanoStyleGPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        # nanoGPT's module tree, which gpt2_cupy.model.GPT also has: the state_dict names must match
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying by assignment
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def get_num_params(self, non_embedding=True):
        n_params = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n_params -= self.transformer.wpe.weight.numel()
        return n_params

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        device = idx.device
        b, t = idx.size()
        assert t <= self.config.block_size
        pos = torch.arange(0, t, dtype=torch.long, device=device)
        tok_emb = self.transformer.wte(idx)
        pos_emb = self.transformer.wpe(pos)
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            logits = self.lm_head(x[:, [-1], :])  # a list index keeps the time dimension
            loss = None
        return logits, loss

    def crop_block_size(self, block_size):
        assert block_size <= self.config.block_size
        self.config.block_size = block_size
        self.transformer.wpe.weight = nn.Parameter(self.transformer.wpe.weight[:block_size])
        for block in self.transformer.h:
            if hasattr(block.attn, "bias"):
                block.attn.bias = block.attn.bias[:, :, :block_size, :block_size]

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        param_dict = {pn: p for pn, p in self.named_parameters()}
        param_dict = {pn: p for pn, p in param_dict.items() if p.requires_grad}
        decay_params = [p for n, p in param_dict.items() if p.dim() >= 2]
        nodecay_params = [p for n, p in param_dict.items() if p.dim() < 2]
        optim_groups = [
            {"params": decay_params, "weight_decay": weight_decay},
            {"params": nodecay_params, "weight_decay": 0.0},
        ]
        fused_available = "fused" in inspect.signature(torch.optim.AdamW).parameters
        use_fused = fused_available and device_type == "cuda"
        extra_args = dict(fused=True) if use_fused else dict()
        return torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas, **extra_args)

    def estimate_mfu(self, fwdbwd_per_iter, dt):
        N = self.get_num_params()
        cfg = self.config
        L, H, Q, T = cfg.n_layer, cfg.n_head, cfg.n_embd // cfg.n_head, cfg.block_size
        flops_per_iter = (6 * N + 12 * L * H * Q * T) * T * fwdbwd_per_iter
        return flops_per_iter * (1.0 / dt) / 312e12

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        for _ in range(max_new_tokens):
            idx_cond = idx if idx.size(1) <= self.config.block_size else idx[:, -self.config.block_size:]
            logits, _ = self(idx_cond)
            logits = logits[:, -1, :] / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("Inf")
            probs = F.softmax(logits, dim=-1)
            idx_next = torch.multinomial(probs, num_samples=1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx


# ---------------------------------------------------------------------------------------------------
# The training loop, in the style of nanoGPT's train.py
# ---------------------------------------------------------------------------------------------------

@dataclass
class Args:
    batch_size: int = 4
    block_size: int = 16
    gradient_accumulation_steps: int = 2
    learning_rate: float = 3e-3
    min_lr: float = 3e-4
    warmup_iters: int = 2
    lr_decay_iters: int = 12
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    eval_iters: int = 2
    device: str = "cuda" if torch.cuda.is_available() else "cpu"


def write_dataset(directory, vocab_size, seed=0):
    """train.bin and val.bin as nanoGPT's prepare.py writes them: uint16 token ids, back to back.
    The text repeats a short pattern, so a few steps of training lower the loss."""
    rng = np.random.default_rng(seed)
    pattern = rng.integers(0, vocab_size, size=23)
    ids = np.tile(pattern, 60)
    ids[rng.random(ids.size) < 0.05] = rng.integers(0, vocab_size)  # a little noise
    ids.astype(np.uint16)[:1200].tofile(os.path.join(directory, "train.bin"))
    ids.astype(np.uint16)[1200:].tofile(os.path.join(directory, "val.bin"))


class Trainer:
    def __init__(self, args, data_dir, model, optimizer=None):
        self.args, self.data_dir = args, data_dir
        self.device = args.device
        self.device_type = "cuda" if "cuda" in self.device else "cpu"
        dtype = "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float16"
        dtype = "float32"  # what the tests compare; the line above is the one nanoGPT has
        ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
        self.ctx = nullcontext() if self.device_type == "cpu" else torch.amp.autocast(
            device_type=self.device_type, dtype=ptdtype)
        self.model = model
        self.model.to(self.device)
        self.scaler = torch.cuda.amp.GradScaler(enabled=(dtype == "float16"))
        self.optimizer = optimizer or model.configure_optimizers(
            args.weight_decay, args.learning_rate, (args.beta1, args.beta2), self.device_type)

    def get_batch(self, split):
        # a new memmap each batch, as nanoGPT does, to keep its pages from piling up
        data = np.memmap(os.path.join(self.data_dir, f"{split}.bin"), dtype=np.uint16, mode="r")
        a = self.args
        ix = torch.randint(len(data) - a.block_size, (a.batch_size,))
        x = torch.stack([torch.from_numpy((data[i:i + a.block_size]).astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy((data[i + 1:i + 1 + a.block_size]).astype(np.int64)) for i in ix])
        if self.device_type == "cuda":
            x, y = x.pin_memory().to(self.device, non_blocking=True), y.pin_memory().to(self.device, non_blocking=True)
        else:
            x, y = x.to(self.device), y.to(self.device)
        return x, y

    @torch.no_grad()
    def estimate_loss(self):
        out = {}
        self.model.eval()
        for split in ["train", "val"]:
            losses = torch.zeros(self.args.eval_iters)
            for k in range(self.args.eval_iters):
                X, Y = self.get_batch(split)
                with self.ctx:
                    logits, loss = self.model(X, Y)
                losses[k] = loss.item()
            out[split] = losses.mean()
        self.model.train()
        return out

    def get_lr(self, it):
        a = self.args
        if it < a.warmup_iters:
            return a.learning_rate * (it + 1) / (a.warmup_iters + 1)
        if it > a.lr_decay_iters:
            return a.min_lr
        decay_ratio = (it - a.warmup_iters) / (a.lr_decay_iters - a.warmup_iters)
        assert 0 <= decay_ratio <= 1
        coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
        return a.min_lr + coeff * (a.learning_rate - a.min_lr)

    def step(self, iter_num, X, Y):
        """One optimizer step over gradient_accumulation_steps micro-batches; returns the next batch and the
        last micro-batch's loss, scaled back up as nanoGPT logs it."""
        lr = self.get_lr(iter_num)
        for param_group in self.optimizer.param_groups:
            param_group["lr"] = lr
        for micro_step in range(self.args.gradient_accumulation_steps):
            with self.ctx:
                logits, loss = self.model(X, Y)
                loss = loss / self.args.gradient_accumulation_steps
            X, Y = self.get_batch("train")  # fetched while the GPU works, in nanoGPT
            self.scaler.scale(loss).backward()
        if self.args.grad_clip != 0.0:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return X, Y, loss.item() * self.args.gradient_accumulation_steps


def host(value):
    """A tensor's (or an array's) values as a float64 numpy array."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    return np.asarray(value, dtype=np.float64)


# ---------------------------------------------------------------------------------------------------
# The tests
# ---------------------------------------------------------------------------------------------------

def test_train_checkpoint_resume_and_generate(tmp_path):
    torch.manual_seed(1337)
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 products: the resume check is exact
    torch.backends.cudnn.allow_tf32 = True
    write_dataset(tmp_path, Config.vocab_size)
    args = Args()
    model_args = dict(n_layer=2, n_head=2, n_embd=64, block_size=args.block_size, bias=True,
                      vocab_size=Config.vocab_size, dropout=0.0)
    model = NanoStyleGPT(Config(**model_args))
    assert model.get_num_params() == sum(p.numel() for p in model.parameters()) - 16 * 64
    trainer = Trainer(args, str(tmp_path), model)
    assert isinstance(torch.compile(model), nn.Module)

    first = trainer.estimate_loss()
    assert abs(float(first["val"]) - math.log(Config.vocab_size)) < 0.2  # near uniform at the start
    X, Y = trainer.get_batch("train")
    losses = []
    for iter_num in range(8):
        X, Y, lossf = trainer.step(iter_num, X, Y)
        losses.append(lossf)
    assert 0 < model.estimate_mfu(args.batch_size * args.gradient_accumulation_steps, 1.0) < 1
    after = trainer.estimate_loss()
    assert after["val"] < first["val"] - 0.5, (first, after)
    assert f"{after['train']:.4f}" == f"{float(after['train']):.4f}"

    # a checkpoint as nanoGPT writes it, then a resume into a fresh model and optimizer
    iter_num = 8
    checkpoint = {"model": model.state_dict(), "optimizer": trainer.optimizer.state_dict(),
                  "model_args": model_args, "iter_num": iter_num, "best_val_loss": after["val"],
                  "config": dict(vars(args))}
    ckpt_path = os.path.join(tmp_path, "ckpt.pt")
    torch.save(checkpoint, ckpt_path)

    saved_batch = (X, Y)
    torch.manual_seed(99)
    _, _, expected_next = trainer.step(iter_num, *saved_batch)
    expected_weights = {k: host(v) for k, v in model.state_dict().items()}

    checkpoint = torch.load(ckpt_path, map_location=args.device)
    resumed_args = dict(model_args)
    for k in ["n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size"]:
        resumed_args[k] = checkpoint["model_args"][k]
    resumed = NanoStyleGPT(Config(**resumed_args))
    state_dict = {"_orig_mod." + k: v for k, v in checkpoint["model"].items()}  # as a compiled model saves
    unwanted_prefix = "_orig_mod."
    for k, v in list(state_dict.items()):
        if k.startswith(unwanted_prefix):
            state_dict[k[len(unwanted_prefix):]] = state_dict.pop(k)
    resumed.load_state_dict(state_dict)
    assert checkpoint["iter_num"] == iter_num and checkpoint["config"]["batch_size"] == args.batch_size
    assert float(checkpoint["best_val_loss"]) == float(after["val"])
    for name, value in resumed.state_dict().items():   # the round trip is exact
        np.testing.assert_array_equal(host(value), host(checkpoint["model"][name]))
    resumed_trainer = Trainer(args, str(tmp_path), resumed)
    resumed_trainer.optimizer.load_state_dict(checkpoint["optimizer"])
    checkpoint = None
    torch.manual_seed(99)
    _, _, resumed_next = resumed_trainer.step(iter_num, *saved_batch)
    assert resumed_next == expected_next
    for name, value in resumed.state_dict().items():
        np.testing.assert_array_equal(host(value), expected_weights[name])
    assert resumed.transformer.wte.weight is resumed.lm_head.weight  # tying survives load_state_dict

    resumed.eval()
    start = torch.tensor([[1, 2, 3]], dtype=torch.long, device=args.device)
    out = resumed.generate(start, max_new_tokens=20, temperature=0.8, top_k=5)  # crosses block_size
    assert tuple(out.shape) == (1, 23)
    ids = out[0].tolist()
    assert ids[:3] == [1, 2, 3] and all(isinstance(i, int) and 0 <= i < Config.vocab_size for i in ids)


@pytest.mark.parametrize("flash", [True, False])
def test_loss_equals_the_package_gpt_on_the_same_weights(flash):
    from gpt2_cupy.model import GPT, GPTConfig

    torch.manual_seed(7)
    config = Config(gelu="tanh", flash=flash)  # GPT-2's GELU, which gpt2_cupy.model.GPT uses
    ours = NanoStyleGPT(config)
    reference = GPT(GPTConfig(block_size=config.block_size, vocab_size=config.vocab_size,
                              n_layer=config.n_layer, n_head=config.n_head, n_embd=config.n_embd))
    state = {k: v for k, v in ours.state_dict().items() if not k.endswith(".attn.bias")}  # the mask buffer
    assert set(state) == set(reference.state_dict())
    reference.load_state_dict(state)
    idx = torch.randint(config.vocab_size, (3, config.block_size))
    targets = torch.randint(config.vocab_size, (3, config.block_size))
    targets[0, :4] = -1  # ignored positions, as nanoGPT's ignore_index=-1 allows
    _, loss = ours(idx, targets)
    _, expected = reference(idx, targets)
    assert abs(loss.item() - expected.item()) < 1e-5 * abs(expected.item())
    logits, none = ours(idx)
    assert none is None and tuple(logits.shape) == (3, 1, config.vocab_size)
    full, _ = reference(idx)
    np.testing.assert_allclose(host(logits)[:, 0], host(full)[:, -1], rtol=1e-4, atol=1e-5)

    # nanoGPT's own nn.GELU() is the exact one: the loss moves by far less than training changes it
    exact = NanoStyleGPT(Config(gelu="none", flash=flash))
    exact.load_state_dict(ours.state_dict())
    assert abs(exact(idx, targets)[1].item() - expected.item()) < 1e-3


def test_crop_block_size_and_the_switches_of_train_py():
    torch.manual_seed(3)
    model = NanoStyleGPT(Config(flash=False))
    model.crop_block_size(8)
    assert tuple(model.transformer.wpe.weight.shape) == (8, 64)
    assert tuple(model.transformer.h[0].attn.bias.shape) == (1, 1, 8, 8)
    logits, loss = model(torch.randint(48, (2, 8)), torch.randint(48, (2, 8)))
    assert tuple(logits.shape) == (2, 8, 48) and math.isfinite(loss.item())
    scaler = torch.cuda.amp.GradScaler(enabled=False)
    assert scaler.scale(loss) is loss
    with torch.amp.autocast(device_type="cpu", dtype=torch.bfloat16):
        assert torch.equal(model(torch.zeros(1, 8, dtype=torch.long))[0], model(torch.zeros(1, 8, dtype=torch.long))[0])
    assert not torch.equal(torch.ones(2), torch.ones(3)) and not torch.equal(torch.ones(2), torch.zeros(2))
    # get_batch's CUDA branch: pinning and a non-blocking copy keep the values
    x = torch.from_numpy(np.arange(6, dtype=np.int64).reshape(2, 3))
    assert x.pin_memory().to("cuda", non_blocking=True).tolist() == [[0, 1, 2], [3, 4, 5]]
    # torch.compile is the identity here, also as a decorator with arguments
    assert torch.compile(model) is model and torch.compile(mode="max-autotune")(len) is len
    # sample.py seeds both generators; here they are one
    torch.manual_seed(5); a = torch.rand(3).tolist()
    torch.cuda.manual_seed(5); assert torch.rand(3).tolist() == a
    # a 0-d tensor formats as its value; other shapes refuse a format spec, as PyTorch's do
    assert f"{torch.tensor(2.5):.3f}" == "2.500"
    with pytest.raises(TypeError):
        f"{torch.ones(2):.3f}"
