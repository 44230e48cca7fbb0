"""GPT-2 small's training speed at each float32 matmul precision, on a GPU.

    GPT2_CUPY_BACKEND=cuda python -m bench.train_precision     writes bench/train_precision.json (about a minute)
    python -m bench.train_precision --tiny                     on any backend: a tiny model, 2 steps per
                                                               precision, no timings kept, no file

GPT-2 124M (GPTConfig's defaults, vocabulary 50304) at B = 8, T = 1024, trained as gpt2_cupy.train does a
step (forward, backward, gradient norm clipped to 1, AdamW, gradients zeroed, the loss copied to the host)
under gpt2_cupy.set_float32_matmul_precision("highest"), ("high") and ("medium"): the Linear layers' and the
batched products in float32, TF32 and bf16 inputs; the fused attention kernels stay float32. One model for
all three, so each precision starts where the previous stopped: the speed does not depend on the weights.
For each, 3 steps to compile its kernels and fill the memory pool, then 10 timed steps.
"""

import argparse
import time

import numpy

from gpt2_cupy import backend, benchmark, set_float32_matmul_precision
from gpt2_cupy.autograd import manual_seed
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
    results = measure(GPT2, B, warmup=3, steps=10)
    highest = results["highest"]["tokens_per_second"]
    table = [f"GPT-2 124M, B = {B}, T = {T}: tokens/s"] + [
        f"  {precision:8} {result['tokens_per_second']:10,.0f}  {result['tokens_per_second'] / highest:5.2f}x highest"
        for precision, result in results.items()]
    benchmark.report("train_precision", {"model": "gpt2 124M, vocab 50304", "batch_size": B, "block_size": T,
                                         "warmup_steps": 3, "timed_steps": 10, "precisions": results}, table)


if __name__ == "__main__":
    main()
