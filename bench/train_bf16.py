"""Training in bf16 with CUDA graphs against PyTorch's bf16 autocast, on a GPU (the benchmark of chapters 16a and 16c).

    python -m bench.train_bf16 [--steps 1000] [--eval-interval 100] [--timed-steps 10]

1. Loss parity: the course preset (6 layers, 384 channels, T = 256, B = 64) on tinyshakespeare, trained by
   gpt2_cupy.train with --dtype bf16 (CUDA graphs on) and by bench.train's nanoGPT in PyTorch under
   torch.autocast(dtype=torch.bfloat16), from the same weights and batches, dropout 0, the same AdamW,
   schedule and clipping. Target: validation losses within 2 % at every evaluation. Plot: bench/train_bf16.png.
2. Tokens per second and peak memory at the gpt2 preset (124M, B = 8, T = 1024) and at the course preset:
   ours in bf16 with graphs and without; PyTorch bf16 autocast eager and with torch.compile.
   Memory: ours, the bytes CuPy's pools hold after the steps (the graphs' private pool and the default
   one); PyTorch's, torch.cuda.max_memory_allocated over its steps.
3. Where the time of our bf16 step goes at the gpt2 preset, by op (eager, each Function timed with events).

Writes its results under "bf16" in bench/train.json (beside bench.train's float32 results) and
bench/train_bf16.png, prints a table. --steps 0 skips the loss comparison and keeps the stored one.
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from gpt2_cupy import backend, benchmark, data, testing
from gpt2_cupy.train import Trainer, learning_rate, make_config

from bench.train import (GPT2, OpTimer, as_torch, comparison_lines, profile_lines, torch_copy_of, torch_gpt,
                         torch_optimizer)

HERE = Path(__file__).resolve().parent
STORED = HERE / "train.json"   # bench.train's results and, under "bf16", this benchmark's
COURSE = dict(corpus="tinyshakespeare", preset="course", batch_size=64, block_size=256)


def random_corpus():
    """A directory with train.bin and val.bin of random GPT-2 token ids: speed does not depend on the text."""
    directory = Path(tempfile.mkdtemp(prefix="bench-corpus-"))
    generator = np.random.default_rng(0)
    data.write_tokens(directory / "train.bin", generator.integers(0, 50257, 2_000_000))
    data.write_tokens(directory / "val.bin", generator.integers(0, 50257, 200_000))
    return str(directory)


def trainer(options, **overrides):
    settings = dict(max_steps=10**6, checkpoint_interval=10**9, progress=False,
                    out_dir=tempfile.mkdtemp(prefix="bench-train-bf16-"))
    config = make_config(**{"dtype": "bf16", **settings, **options, **overrides})
    return Trainer(config)


# ---------------------------------------------------------------------------------------------------------
# 1. The same training in bf16, twice
# ---------------------------------------------------------------------------------------------------------


def compare(torch, steps, eval_interval):
    ours = trainer(COURSE, max_steps=steps, eval_interval=eval_interval, warmup_steps=min(100, steps // 10),
                   dropout=0.0, vocab_size=None)
    config = ours.config
    twin = torch_copy_of(torch, ours.model)   # the initial weights, before our first step
    optimizer = torch_optimizer(torch, twin, config)
    batches = data.Batches(data.read_tokens(ours.corpus.train), config.batch_size, config.block_size, seed=config.seed)
    validation = list(ours.validation_batches())
    autocast = torch.autocast("cuda", dtype=torch.bfloat16)

    def torch_validation_loss():
        twin.eval()
        with torch.no_grad(), autocast:
            total = sum(float(twin(as_torch(torch, x), as_torch(torch, y))) for x, y in validation)
        twin.train()
        return total / len(validation)

    records = ours.run()
    ours_val = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    torch_val = {0: torch_validation_loss()}
    for step in range(steps):
        x, y = batches.sample()
        with autocast:
            loss = twin(as_torch(torch, x), as_torch(torch, y))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(twin.parameters(), config.grad_clip)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, config)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % eval_interval == 0 or step + 1 == steps:
            torch_val[step + 1] = torch_validation_loss()
    evaluated = sorted(torch_val)
    relative = [abs(ours_val[s] - torch_val[s]) / torch_val[s] for s in evaluated]
    del twin, optimizer, ours
    return {"config": {**COURSE, "steps": steps, "learning_rate": config.learning_rate,
                       "warmup_steps": config.warmup_steps, "dtype": "bf16", "cuda_graph": True},
            "steps": evaluated,
            "gpt2_cupy": {"val_loss": [ours_val[s] for s in evaluated]},
            "torch": {"val_loss": [torch_val[s] for s in evaluated]},
            "relative_difference": relative,
            "largest_relative_difference": max(relative),
            "within_2_percent": max(relative) < 0.02}


def plot(comparison, path):
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6, 3.5), layout="constrained")
    axes = figure.add_subplot()
    for name, label in (("gpt2_cupy", "gpt2_cupy, bf16 + CUDA graphs"), ("torch", "PyTorch, bf16 autocast")):
        axes.plot(comparison["steps"], comparison[name]["val_loss"], "o-", label=label)
    axes.set_xlabel("step")
    axes.set_ylabel("validation loss")
    axes.set_title("course preset in bf16: the same weights and batches")
    axes.legend()
    figure.savefig(path, dpi=100)


# ---------------------------------------------------------------------------------------------------------
# 2. Tokens per second and memory
# ---------------------------------------------------------------------------------------------------------


def ours_speed(options, cuda_graph, steps, dtype="bf16"):
    """(tokens/s, pool bytes) of our training steps in dtype; the first steps (compiling, capturing) untimed."""
    cupy = backend.xp
    run = trainer(options, cuda_graph=cuda_graph, eval_interval=10**6, dtype=dtype)
    for _ in range(3):
        run.train_step()
    started = time.perf_counter()
    for _ in range(steps):
        run.train_step()   # ends with the step's one host read: the GPU has caught up
    seconds = (time.perf_counter() - started) / steps
    pools = [cupy.get_default_memory_pool()] + ([run.graphs.pool.memory] if cuda_graph and run.graphs.pool else [])
    held = sum(pool.total_bytes() for pool in pools)
    tokens = run.config.batch_size * run.config.block_size
    del run
    cupy.get_default_memory_pool().free_all_blocks()
    return tokens / seconds, held


def torch_speed(torch, model_config, B, T, steps, compiled):
    """(tokens/s, peak bytes) of PyTorch bf16 autocast steps, eager or through torch.compile."""
    twin = torch_gpt(torch, model_config)
    optimizer = torch_optimizer(torch, twin, make_config(preset="gpt2"))
    model = torch.compile(twin) if compiled else twin
    ids = torch.randint(0, model_config.vocab_size, (B, T + 1), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids[:, :-1], ids[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(twin.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - started) / steps
    peak = torch.cuda.max_memory_allocated()
    del model, twin, optimizer
    torch.cuda.empty_cache()
    return B * T / seconds, peak


def speeds(torch, steps):
    from gpt2_cupy.model import GPTConfig

    results = {}
    course_config = GPTConfig(block_size=256, vocab_size=50304, n_layer=6, n_head=6, n_embd=384, dropout=0.0)
    for label, options, model_config, B, T in (
            ("gpt2 (B=8, T=1024)", dict(corpus=random_corpus(), preset="gpt2", batch_size=8, block_size=1024),
             GPT2, 8, 1024),
            ("course (B=64, T=256)", dict(COURSE, dropout=0.0), course_config, 64, 256)):
        entry = {}
        runs = [("gpt2_cupy bf16 + graphs", True, "bf16"), ("gpt2_cupy bf16 eager", False, "bf16")]
        if label.startswith("course"):  # a graph's replay must beat eager in float32 ("highest") too
            runs += [("gpt2_cupy float32 + graphs", True, "float32"), ("gpt2_cupy float32 eager", False, "float32")]
        for name, cuda_graph, dtype in runs:
            tokens, held = ours_speed(options, cuda_graph, steps, dtype)
            entry[name] = {"tokens_per_second": tokens, "memory_bytes": held}
            print(f"{label}: {name:26} {tokens:12,.0f} tokens/s  {held / 2**30:6.2f} GiB", flush=True)
        if torch is not None:
            for name, compiled in (("torch bf16 autocast", False), ("torch bf16 autocast + compile", True)):
                tokens, peak = torch_speed(torch, model_config, B, T, steps, compiled)
                entry[name] = {"tokens_per_second": tokens, "memory_bytes": peak}
                print(f"{label}: {name:26} {tokens:12,.0f} tokens/s  {peak / 2**30:6.2f} GiB", flush=True)
        results[label] = entry
    return results


# ---------------------------------------------------------------------------------------------------------
# 3. Where the time goes
# ---------------------------------------------------------------------------------------------------------


def profile(steps):
    run = trainer(dict(corpus=random_corpus(), preset="gpt2", batch_size=8, block_size=1024),
                  cuda_graph=False, eval_interval=10**6)
    for _ in range(2):
        run.train_step()
    timer = OpTimer()
    timer.install(run.optimizer)
    timer.events.clear()
    for _ in range(steps):
        run.train_step()
    timer.remove()
    by_name = timer.milliseconds_by_name(steps)
    del run
    backend.xp.get_default_memory_pool().free_all_blocks()
    return by_name


def measure(arguments):
    benchmark.require_gpu()
    torch = testing.torch_or_none()
    results = benchmark.measured_on()
    if torch is not None and arguments.steps > 0:
        results["comparison"] = compare(torch, arguments.steps, arguments.eval_interval)
        results["comparison_measured_on"] = benchmark.measured_on()
        plot(results["comparison"], HERE / "train_bf16.png")
    else:
        stored = json.loads(STORED.read_text()).get("bf16", {}) if STORED.exists() else {}
        if "comparison" in stored:
            results["comparison"] = stored["comparison"]
            results["comparison_measured_on"] = stored.get("comparison_measured_on",
                                                           {"device": stored["device"], "date": stored["date"]})
    results["speed"] = speeds(torch, arguments.timed_steps)
    results["profile"] = profile(3)
    return results


def table(results):
    lines = [f"{results['device']}, {results['date']}"]
    if "comparison" in results:
        lines += comparison_lines(results["comparison"], "course preset in bf16")
    for label, entry in results["speed"].items():
        lines.append(label)
        for name, value in entry.items():
            lines.append(f"  {name:30} {value['tokens_per_second']:12,.0f} tokens/s  "
                         f"{value['memory_bytes'] / 2**30:6.2f} GiB")
    lines += profile_lines(results["profile"], "gpt2 preset in bf16, eager: time per step by op")
    return lines


def main():
    parser = argparse.ArgumentParser(prog="python -m bench.train_bf16", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=1000,
                        help="course preset steps of the loss comparison (0: keep the stored comparison)")
    parser.add_argument("--eval-interval", type=int, default=100)
    parser.add_argument("--timed-steps", type=int, default=10)
    results = measure(parser.parse_args())
    benchmark.report("train", results, table(results), section="bf16")


if __name__ == "__main__":
    main()
