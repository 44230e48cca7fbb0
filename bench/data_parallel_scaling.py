"""Training on several GPUs of one machine through NCCL, against one GPU, by the train command itself.

    python -m bench.data_parallel_scaling [--nproc 2] [--steps 40]     on a machine with that many GPUs;
                                                                       writes bench/data_parallel_scaling.json

GPT-2 124M's shape (the gpt2 preset) on tinyshakespeare, B = 8 rows per GPU, T = 1024, float32 at the default
"highest" precision, each run a fresh `python -m gpt2_cupy.train` whose log.jsonl gives every step's tokens/s
and loss:

    one GPU                      the plain trainer (its step captured as CUDA graphs)
    N GPUs                       --nproc N: every rank a B-row share of each step, gradients averaged by NCCL
    one GPU, N micro-batches     --grad-accum N: the same N·B rows a step as N GPUs take, on one GPU
    N GPUs, ZeRO-1               --nproc N --zero: AdamW's state sharded over the ranks

Tokens/s: the median over the steps after the first five (compiling, capturing). Scaling: N GPUs' tokens/s
against N times one GPU's. Equality: each step's loss on N GPUs against one GPU with N micro-batches, which
compute the same sums in another order (float32 rounding apart). chapters/18_data_parallel.ipynb shows the
stored results.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from gpt2_cupy import backend, benchmark

B, T = 8, 1024
WARM_STEPS = 5


def train(out_dir, steps, *options):
    """The per-step records of one `python -m gpt2_cupy.train` run into out_dir."""
    command = [sys.executable, "-m", "gpt2_cupy.train", "--corpus", "tinyshakespeare", "--preset", "gpt2",
               "--batch-size", str(B), "--block-size", str(T), "--steps", str(steps), "--eval-interval", "1000000",
               "--checkpoint-interval", "1000000", "--no-progress", "--seed", "7", "--out-dir", str(out_dir),
               *options]
    subprocess.run(command, check=True)
    lines = (out_dir / "log.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if "loss" in record and "val_loss" not in record]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    arguments = parser.parse_args(argv)
    benchmark.require_gpu()
    gpus = backend.xp.cuda.runtime.getDeviceCount()
    if gpus < arguments.nproc:
        raise SystemExit(f"--nproc {arguments.nproc} needs as many GPUs; this machine has {gpus}")
    N, steps = arguments.nproc, arguments.steps
    runs = {"one GPU": (), f"{N} GPUs": ("--nproc", str(N)), f"one GPU, {N} micro-batches": ("--grad-accum", str(N)),
            f"{N} GPUs, ZeRO-1": ("--nproc", str(N), "--zero")}
    records = {}
    with tempfile.TemporaryDirectory(prefix="bench-data-parallel-") as directory:
        for number, (name, options) in enumerate(runs.items()):
            records[name] = train(Path(directory) / str(number), steps, *options)
    speeds = {name: statistics.median(r["tokens_per_second"] for r in rows[WARM_STEPS:])
              for name, rows in records.items()}
    together, accumulated = records[f"{N} GPUs"], records[f"one GPU, {N} micro-batches"]
    differences = [abs(a["loss"] - b["loss"]) for a, b in zip(together, accumulated)]
    results = dict(model="gpt2 preset on tinyshakespeare, float32 (highest)", batch_size_per_gpu=B, block_size=T,
                   nproc=N, steps=steps, gpus=[backend.xp.cuda.runtime.getDeviceProperties(i)["name"].decode()
                                               for i in range(N)],
                   tokens_per_second=speeds, scaling=speeds[f"{N} GPUs"] / (N * speeds["one GPU"]),
                   losses={name: [r["loss"] for r in rows] for name, rows in records.items()},
                   largest_loss_difference=max(differences),
                   largest_relative_loss_difference=max(d / abs(b["loss"]) for d, b in zip(differences, accumulated)))
    table = [f"{name:28} {speed:>10,.0f} tokens/s" for name, speed in speeds.items()]
    table.append(f"{N} GPUs against {N} x one GPU: {results['scaling']:.2f}")
    table.append(f"loss on {N} GPUs against one GPU with {N} micro-batches, {steps} steps: largest difference "
                 f"{results['largest_loss_difference']:.1e} (relative {results['largest_relative_loss_difference']:.1e})")
    benchmark.report("data_parallel_scaling", results, table)


if __name__ == "__main__":
    main()
