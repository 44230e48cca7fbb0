"""Training against PyTorch on a GPU (chapter 14's benchmark).

    python -m bench.train [--steps 500] [--eval-interval 100] [--gpt2-steps 10] [--profile-steps 3]

1. The course preset (6 layers, 6 heads, 384 channels, T = 256, B = 64) on tinyshakespeare, trained by
   gpt2_cupy.train and by a minimal nanoGPT in PyTorch (float32, TF32 off) that starts from the same weights
   (our state_dict copied in) and sees the same batches, dropout 0, the same AdamW, schedule and clipping.
   Target: our validation loss within 2 % of PyTorch's at every evaluation. Overlay plot: bench/train.png.
2. Tokens per second of both, for the course preset and for the gpt2 preset (124M) at B = 8, T = 1024.
3. Where our time goes at the gpt2 preset: every Function's forward and backward timed with CUDA events,
   plus the optimizer's clip, step and zero, summed by name per training step.

Writes bench/train.json and bench/train.png, prints a table.
"""

import argparse
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from gpt2_cupy import backend, benchmark, data, functional, testing
from gpt2_cupy.autograd import Function
from gpt2_cupy.random import manual_seed
from gpt2_cupy.model import GPT, GPTConfig
from gpt2_cupy.train import Trainer, learning_rate, make_config

from bench.train_precision import training_step

HERE = Path(__file__).resolve().parent


# ---------------------------------------------------------------------------------------------------------
# nanoGPT in PyTorch, with our parameter names, so that our state_dict loads into it
# ---------------------------------------------------------------------------------------------------------


def torch_gpt(torch, config):
    nn, F = torch.nn, torch.nn.functional

    class CausalSelfAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
            self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)

        def forward(self, x):
            B, T, C = x.shape
            q, k, v = self.c_attn(x).split(config.n_embd, dim=2)
            q, k, v = (t.view(B, T, config.n_head, C // config.n_head).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
            self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

        def forward(self, x):
            return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
            self.attn = CausalSelfAttention()
            self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
            self.mlp = MLP()

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class TorchGPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.transformer = nn.ModuleDict(dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                h=nn.ModuleList([Block() for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            ))
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
            self.transformer.wte.weight = self.lm_head.weight

        def forward(self, idx, targets):
            B, T = idx.shape
            positions = torch.arange(T, device=idx.device)
            x = self.transformer.wte(idx) + self.transformer.wpe(positions)
            for block in self.transformer.h:
                x = block(x)
            logits = self.lm_head(self.transformer.ln_f(x))
            return F.cross_entropy(logits.reshape(B * T, -1), targets.reshape(B * T), ignore_index=-1)

    model = TorchGPT().cuda()
    return model


def torch_copy_of(torch, model):
    """A PyTorch GPT holding our model's current weights."""
    twin = torch_gpt(torch, model.config)
    state = {name: torch.from_numpy(value.numpy()) for name, value in model.state_dict().items()}
    twin.load_state_dict(state, strict=True)
    return twin


def torch_optimizer(torch, twin, config):
    decay = [p for p in twin.parameters() if p.dim() >= 2]
    no_decay = [p for p in twin.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=config.learning_rate, betas=(config.beta1, config.beta2), eps=1e-8)


def as_torch(torch, ids):
    return torch.from_dlpack(ids).long()


# ---------------------------------------------------------------------------------------------------------
# 1. The same training, twice
# ---------------------------------------------------------------------------------------------------------


def compare(torch, steps, eval_interval, batch_size):
    config = make_config(corpus="tinyshakespeare", preset="course", max_steps=steps, eval_interval=eval_interval,
                         warmup_steps=min(100, steps // 10), batch_size=batch_size, dropout=0.0,
                         checkpoint_interval=10 ** 9, progress=False,
                         out_dir=tempfile.mkdtemp(prefix="bench-train-"))
    ours = Trainer(config)
    twin = torch_copy_of(torch, ours.model)  # the initial weights, before our first step
    optimizer = torch_optimizer(torch, twin, config)
    batches = data.Batches(ours.corpus.train, config.batch_size, config.block_size, seed=config.seed)  # same seed
    validation = list(zip(range(ours.eval_batches), ours.val_batches.sequential()))

    def torch_validation_loss():
        twin.eval()
        with torch.no_grad():
            total = sum(twin(as_torch(torch, x), as_torch(torch, y)) for _, (x, y) in validation)
        twin.train()
        return float(total) / len(validation)

    records = ours.run()
    ours_val = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    ours_seconds = [r["seconds"] for r in records if "seconds" in r]

    torch_val, torch_seconds = {0: torch_validation_loss()}, []
    for step in range(steps):
        torch.cuda.synchronize()
        started = time.perf_counter()
        x, y = batches.sample()
        loss = twin(as_torch(torch, x), as_torch(torch, y))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(twin.parameters(), config.grad_clip)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, config)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()  # one host copy per step, as ours
        torch_seconds.append(time.perf_counter() - started)
        if (step + 1) % eval_interval == 0 or step + 1 == steps:
            torch_val[step + 1] = torch_validation_loss()

    evaluated = sorted(torch_val)
    relative = [abs(ours_val[s] - torch_val[s]) / torch_val[s] for s in evaluated]
    tokens = config.batch_size * config.block_size
    del twin, optimizer, ours
    return {
        "config": {"preset": "course", "batch_size": config.batch_size, "block_size": config.block_size,
                   "steps": steps, "learning_rate": config.learning_rate, "warmup_steps": config.warmup_steps},
        "steps": evaluated,
        "gpt2_cupy": {"val_loss": [ours_val[s] for s in evaluated]},
        "torch": {"val_loss": [torch_val[s] for s in evaluated]},
        "relative_difference": relative,
        "largest_relative_difference": max(relative),
        "within_2_percent": max(relative) < 0.02,
        "tokens_per_second": {"gpt2_cupy": tokens / float(np.median(ours_seconds[1:])),
                              "torch": tokens / float(np.median(torch_seconds[1:]))},
    }


def plot(comparison, path):
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6, 3.5), layout="constrained")
    axes = figure.add_subplot()
    for name in ("gpt2_cupy", "torch"):
        axes.plot(comparison["steps"], comparison[name]["val_loss"], "o-", label=name)
    axes.set_xlabel("step")
    axes.set_ylabel("validation loss")
    axes.set_title("course preset on tinyshakespeare: the same weights and batches")
    axes.legend()
    figure.savefig(path, dpi=100)


# ---------------------------------------------------------------------------------------------------------
# 2. and 3. GPT-2 small: tokens per second, and the time of each op
# ---------------------------------------------------------------------------------------------------------


GPT2 = GPTConfig(block_size=1024, vocab_size=50304, n_layer=12, n_head=12, n_embd=768)


def ours_gpt2(B, T):
    manual_seed(0)
    model = GPT(GPT2)
    optimizer = model.configure_optimizers(0.1, 6e-4, (0.9, 0.95))
    return model, optimizer, training_step(model, optimizer, B, T)


def seconds_per_step(step, steps, synchronize):
    for _ in range(2):
        step()  # compiles kernels, allocates the memory pool
    synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    synchronize()
    return (time.perf_counter() - started) / steps


def torch_gpt2_seconds(torch, B, T, steps):
    twin = torch_gpt(torch, GPT2)  # its own initial weights: the speed does not depend on them
    optimizer = torch_optimizer(torch, twin, make_config(preset="gpt2"))
    ids = torch.randint(0, 50257, (B, T + 1), device="cuda")

    def step():
        loss = twin(ids[:, :-1], ids[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(twin.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()

    seconds = seconds_per_step(step, steps, torch.cuda.synchronize)
    del twin, optimizer
    torch.cuda.empty_cache()
    return seconds


class OpTimer:
    """Wraps every Function of gpt2_cupy.functional (and the optimizer's calls) with a pair of CUDA events."""

    def __init__(self):
        self.events = []  # (name, start event, end event)
        self.patched = []

    def wrap(self, owner, attribute, name, static):
        original = getattr(owner, attribute)
        cupy = backend.xp

        def timed(*arguments, **options):
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            result = original(*arguments, **options)
            end.record()
            self.events.append((name, start, end))
            return result

        self.patched.append((owner, attribute, owner.__dict__[attribute]))
        setattr(owner, attribute, staticmethod(timed) if static else timed)

    def install(self, optimizer):
        for name, value in vars(functional).items():
            if isinstance(value, type) and issubclass(value, Function) and value is not Function:
                self.wrap(value, "forward", f"{name} forward", static=True)
                self.wrap(value, "backward", f"{name} backward", static=True)
        for method in ("clip_grad_norm_", "step", "zero_grad"):
            original = getattr(optimizer, method)
            optimizer.__dict__[method] = original
            self.wrap(optimizer, method, f"AdamW {method}", static=False)

    def remove(self):
        for owner, attribute, original in reversed(self.patched):
            setattr(owner, attribute, original)

    def milliseconds_by_name(self, steps):
        backend.synchronize()
        totals = defaultdict(float)
        for name, start, end in self.events:
            totals[name] += backend.xp.cuda.get_elapsed_time(start, end)
        return {name: ms / steps for name, ms in sorted(totals.items(), key=lambda item: -item[1])}


def gpt2_throughput(torch, B, T, steps, profile_steps):
    model, optimizer, step = ours_gpt2(B, T)
    ours = seconds_per_step(step, steps, backend.synchronize)
    timer = OpTimer()
    timer.install(optimizer)
    timer.events.clear()
    backend.synchronize()
    started = time.perf_counter()
    for _ in range(profile_steps):
        step()
    backend.synchronize()
    profiled_step = (time.perf_counter() - started) / profile_steps
    timer.remove()
    profile = timer.milliseconds_by_name(profile_steps)
    del model, optimizer, step
    backend.xp.get_default_memory_pool().free_all_blocks()
    result = {"gpt2_cupy": B * T / ours}
    if torch is not None:
        result["torch"] = B * T / torch_gpt2_seconds(torch, B, T, steps)
    return result, profile, profiled_step * 1e3


# ---------------------------------------------------------------------------------------------------------


def measure(arguments):
    benchmark.require_gpu()
    torch = testing.torch_or_none()
    if torch is not None:
        torch.backends.cuda.matmul.allow_tf32 = False  # float32 products in float32, as ours
        torch.backends.cudnn.allow_tf32 = False
    results = benchmark.measured_on()
    if torch is not None:
        comparison = compare(torch, arguments.steps, arguments.eval_interval, arguments.batch_size)
        plot(comparison, HERE / "train.png")
        results["comparison"] = comparison
    gpt2_speed, profile, profiled_ms = gpt2_throughput(torch, arguments.gpt2_batch, arguments.gpt2_length,
                                                       arguments.gpt2_steps, arguments.profile_steps)
    results["tokens_per_second"] = {"gpt2 (B=%d, T=%d)" % (arguments.gpt2_batch, arguments.gpt2_length): gpt2_speed}
    if torch is not None:
        results["tokens_per_second"]["course"] = results["comparison"]["tokens_per_second"]
    results["profile"] = profile
    results["profiled_step_ms"] = profiled_ms
    return results


def comparison_lines(comparison, heading):
    """The validation losses of a comparison, side by side, and whether they stay within 2 %."""
    lines = [f"{heading}, {comparison['config']['steps']} steps: validation loss (ours, torch, difference)"]
    for step, a, b, r in zip(comparison["steps"], comparison["gpt2_cupy"]["val_loss"],
                             comparison["torch"]["val_loss"], comparison["relative_difference"]):
        lines.append(f"  step {step:5}  {a:.4f}  {b:.4f}  {r:.2%}")
    lines.append(f"  within 2 % at every evaluation: {comparison['within_2_percent']}")
    return lines


def profile_lines(profile, heading, shown=20):
    """The time of each op per step, largest first, with its share of the events' sum."""
    total = sum(profile.values())
    lines = [f"{heading} (events sum {total:.1f} ms):"]
    for name, ms in list(profile.items())[:shown]:
        lines.append(f"  {name:32} {ms:8.2f} ms  {ms / total:6.1%}")
    return lines


def table(results):
    lines = [f"{results['device']}, {results['date']}"]
    if "comparison" in results:
        lines += comparison_lines(results["comparison"], "course preset")
    for label, speeds in results["tokens_per_second"].items():
        ratio = f"  (ours / torch = {speeds['gpt2_cupy'] / speeds['torch']:.2f})" if "torch" in speeds else ""
        lines.append(f"{label:18} tokens/s: " + ", ".join(f"{n} {v:,.0f}" for n, v in speeds.items()) + ratio)
    lines += profile_lines(results["profile"], f"gpt2 preset, time per step by op; a profiled step "
                           f"{results['profiled_step_ms']:.1f} ms wall")
    return lines


def main():
    parser = argparse.ArgumentParser(prog="python -m bench.train", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=500, help="course preset steps for the comparison")
    parser.add_argument("--eval-interval", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=64, help="B of the course comparison")
    parser.add_argument("--gpt2-steps", type=int, default=10, help="timed steps of the gpt2 preset")
    parser.add_argument("--gpt2-batch", type=int, default=8)
    parser.add_argument("--gpt2-length", type=int, default=1024)
    parser.add_argument("--profile-steps", type=int, default=3)
    results = measure(parser.parse_args())
    benchmark.report("train", results, table(results), keep=("bf16",))   # bench.train_bf16's section stays


if __name__ == "__main__":
    main()
