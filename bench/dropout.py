"""Benchmark of chapter 07 (dropout with Philox4x32-10) on a GPU.

    python -m bench.dropout   writes bench/dropout.json (device, date, results) and prints a table

GB/s of dropout_forward and dropout_backward (each reads n floats and writes n: 8 bytes per element; the
mask is regenerated, never read) against the device's copy bandwidth, at GPT-2 small's two dropout
shapes with B = 8, T = 1024: the residual stream (B, T, C) = 6.3M elements and the attention probabilities
(B, H, T, T) = 101M elements. PyTorch's dropout next to it when installed: its forward writes a one-byte
mask besides y (9 bytes per element) and its backward reads that mask (9 bytes); both are counted in
PyTorch's figures as the bytes it really moves.
"""

import sys
from pathlib import Path

import numpy as np

from gpt2_cupy import backend, benchmark
from gpt2_cupy.ops.dropout import advance_rng_state, dropout_backward, dropout_forward, new_rng_state

SHAPES = {"residual stream (8, 1024, 768)": (8, 1024, 768), "attention (8, 12, 1024, 1024)": (8, 12, 1024, 1024)}
P = 0.1
CALLS_PER_TIMING = 10
FLOAT = 4


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def seconds_per_call(run):
    def calls():
        for _ in range(CALLS_PER_TIMING):
            run()
    return benchmark.seconds_per_call(calls, warmup=2, repeat=10) / CALLS_PER_TIMING


def measure():
    if not benchmark.meaningful():
        raise SystemExit("Timings on the CPU executor say nothing about a GPU: run this on a GPU.")
    cupy, torch = backend.xp, _torch()
    results = {"copy_bandwidth_gb_per_s": benchmark.copy_bandwidth() / 1e9, "p": P, "gb_per_s": {}}
    state = new_rng_state(1234)
    for label, shape in SHAPES.items():
        n = int(np.prod(shape))
        x = cupy.random.default_rng(0).standard_normal(shape, dtype=cupy.float32)
        out = cupy.empty_like(x)
        ours = 2 * n * FLOAT
        runs = {
            "dropout_forward": (ours, lambda: dropout_forward(x, P, state, out=out)),
            "dropout_backward": (ours, lambda: dropout_backward(x, P, state, out=out)),
            "advance_rng_state + dropout_forward": (ours, lambda: (advance_rng_state(state, n),
                                                                  dropout_forward(x, P, state, out=out))),
            "cupy copy (the ceiling, for reference)": (ours, lambda: cupy.copyto(out, x)),
        }
        if torch is not None:
            x_torch = torch.from_dlpack(x)
            _, mask = torch.ops.aten.native_dropout(x_torch, P, True)
            runs["torch native_dropout (writes y and a bool mask)"] = (
                ours + n, lambda: torch.ops.aten.native_dropout(x_torch, P, True))
            runs["torch native_dropout_backward (reads the mask)"] = (
                ours + n, lambda: torch.ops.aten.native_dropout_backward(x_torch, mask, 1 / (1 - P)))
        results["gb_per_s"][label] = {name: benchmark.gigabytes_per_second(moved, seconds_per_call(run))
                                      for name, (moved, run) in runs.items()}
        del x, out
        cupy.get_default_memory_pool().free_all_blocks()
    return {**benchmark.measured_on(), **results}


def report(measured):
    ceiling = measured["copy_bandwidth_gb_per_s"]
    lines = [f"{measured['device']}, {measured['date']}: copy bandwidth {ceiling:.0f} GB/s, p = {measured['p']}"]
    for label, rates in measured["gb_per_s"].items():
        lines.append(f"{label}:")
        lines += [f"  {name:<50s} {rate:7.0f} GB/s  {rate / ceiling:6.1%} of copy" for name, rate in rates.items()]
    return "\n".join(lines)


def main():
    measured = measure()
    print(report(measured))
    path = Path(__file__).with_suffix(".json")
    benchmark.write_results(path, measured)
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
