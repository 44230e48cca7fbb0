"""GPT-2 small's training speed at each float32 matmul precision, on a GPU, against PyTorch in the same run.

    GPT2_CUPY_BACKEND=cuda python -m bench.train_precision     writes bench/train_precision.json (about two
                                                               minutes)
    python -m bench.train_precision --tiny                     on any backend: a tiny model, 2 steps per
                                                               precision, no timings kept, no file

GPT-2 124M (GPTConfig's defaults, vocabulary 50304) at B = 8, T = 1024, trained in float32 under
gpt2_cupy.set_float32_matmul_precision("highest"), ("high") and ("medium"): the products in float32 (3xTF32
on an H100's or H200's tensor cores), TF32 and bf16 inputs, attention with them (gpt2_cupy.precision).

  - eager: a step as gpt2_cupy.train does it (forward, backward, gradient norm clipped to 1, AdamW, gradients
    zeroed, the loss copied to the host) on one model for all three precisions, so each starts where the
    previous stopped: the speed does not depend on the weights. 3 steps to compile its kernels and fill the
    memory pool, then 10 timed steps.
  - graphs: gpt2_cupy.train's Trainer with its step captured as CUDA graphs (the default), on random tokens.
  - PyTorch, where installed: bench.train's nanoGPT twin, eager, in float32 with TF32 off (PyTorch's
    "highest") and on (torch.backends.cuda.matmul.allow_tf32 and cudnn.allow_tf32: its "high").
"""

import argparse
import time

import numpy

from gpt2_cupy import backend, benchmark, set_float32_matmul_precision, testing
from gpt2_cupy.random import manual_seed
from gpt2_cupy.model import GPT, GPTConfig
from gpt2_cupy.precision import PRECISIONS

GPT2 = GPTConfig(vocab_size=50304)
TINY = GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=1, n_embd=32)


def training_step(model, optimizer, B, T):
    """A step on one fixed batch of random tokens; returns the step function."""
    ids = backend.xp.random.randint(0, model.config.vocab_size, size=(B, T + 1)).astype(numpy.int32)
    inputs, targets = backend.xp.ascontiguousarray(ids[:, :-1]), backend.xp.ascontiguousarray(ids[:, 1:])

    def step():
        _, loss = model(inputs, targets)
        loss.backward()
        optimizer.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        return float(backend.asnumpy(loss.data))

    return step


def measure(config, B, warmup, steps):
    """{precision: {"tokens_per_second", "loss"}}: the mean over `steps` steps after `warmup` untimed ones."""
    manual_seed(0)
    model = GPT(config)
    optimizer = model.configure_optimizers(0.1, 6e-4, (0.9, 0.95))
    step = training_step(model, optimizer, B, config.block_size)
    results = {}
    try:
        for precision in PRECISIONS:
            set_float32_matmul_precision(precision)
            for _ in range(warmup):
                step()
            backend.synchronize()
            started = time.perf_counter()
            for _ in range(steps):
                loss = step()  # the host copy of the loss waits for the step's kernels
            seconds = (time.perf_counter() - started) / steps
            results[precision] = {"tokens_per_second": B * config.block_size / seconds, "loss": loss}
            print(f"{precision:8} {results[precision]['tokens_per_second']:10,.0f} tokens/s   loss {loss:.4f}",
                  flush=True)
    finally:
        set_float32_matmul_precision("highest")
    return results


def with_graphs(B, T, steps):
    """{precision: tokens/s} of gpt2_cupy.train's Trainer, its step captured as CUDA graphs, in float32."""
    from bench.train_bf16 import ours_speed, random_corpus   # bench.train_bf16 imports this module

    options = dict(corpus=random_corpus(), preset="gpt2", batch_size=B, block_size=T)
    speeds = {}
    try:
        for precision in PRECISIONS:
            speeds[precision], _ = ours_speed(dict(options, matmul_precision=precision), True, steps, "float32")
            print(f"{precision:8} {speeds[precision]:10,.0f} tokens/s with CUDA graphs", flush=True)
    finally:
        set_float32_matmul_precision("highest")
    return speeds


def torch_speeds(torch, B, T, steps):
    """{"float32": tokens/s, "tf32": tokens/s} of PyTorch's eager float32 step, TF32 off and on."""
    from bench.train import torch_gpt2_seconds

    speeds = {}
    for name, tf32 in (("float32", False), ("tf32", True)):
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
        speeds[name] = B * T / torch_gpt2_seconds(torch, B, T, steps)
        print(f"PyTorch {name:8} {speeds[name]:10,.0f} tokens/s", flush=True)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    return speeds


# The targets: ours at each precision against PyTorch's step (its eager float32, TF32 off or on)
TARGETS = (("highest", "float32", 1.5), ("high", "tf32", 1.0))


def table(results):
    B, T = results["batch_size"], results["block_size"]
    lines = [f"GPT-2 124M, B = {B}, T = {T}, float32: tokens/s", f"  {'':8} {'eager':>10} {'graphs':>10}"]
    for precision, result in results["precisions"].items():
        lines.append(f"  {precision:8} {result['tokens_per_second']:10,.0f} "
                     f"{result.get('tokens_per_second_graphs', float('nan')):10,.0f}")
    torch_results = results.get("torch")
    if torch_results:
        lines += [f"  PyTorch {name:8} {speed:10,.0f}" for name, speed in torch_results.items()]
        for precision, theirs, target in TARGETS:
            ours = results["precisions"][precision].get("tokens_per_second_graphs")
            if ours:
                lines.append(f"  {precision} with graphs / PyTorch {theirs}: {ours / torch_results[theirs]:.2f} "
                             f"(target {target})")
    return lines


def main():
    parser = argparse.ArgumentParser(prog="python -m bench.train_precision", description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny model, 2 steps per precision, no file")
    parser.add_argument("--batch-size", type=int, default=8)
    arguments = parser.parse_args()
    if arguments.tiny:
        measure(TINY, B=2, warmup=1, steps=1)
        return
    benchmark.require_gpu()
    B, T = arguments.batch_size, GPT2.block_size
    results = {"model": "gpt2 124M, vocab 50304", "batch_size": B, "block_size": T, "warmup_steps": 3,
               "timed_steps": 10, "precisions": measure(GPT2, B, warmup=3, steps=10)}
    backend.xp.get_default_memory_pool().free_all_blocks()
    for precision, speed in with_graphs(B, T, steps=10).items():
        results["precisions"][precision]["tokens_per_second_graphs"] = speed
    torch = testing.torch_or_none()
    if torch is not None:
        results["torch"] = torch_speeds(torch, B, T, steps=10)
    benchmark.report("train_precision", results, table(results))


if __name__ == "__main__":
    main()
