"""Benchmark of chapter 07 (dropout with Philox4x32-10) on a GPU.

    python -m bench.dropout   writes bench/dropout.json (device, date, results) and prints a table

GB/s of the chapter's first step (one element per thread, a Philox call each), dropout_forward and
dropout_backward (each reads n floats and writes n: 8 bytes per element; the mask is regenerated, never read)
against the device's copy bandwidth, at GPT-2 small's two dropout shapes with B = 8, T = 1024: the residual
stream (B, T, C) = 6.3M elements and the attention probabilities (B, H, T, T) = 101M elements. Also
dropout_forward allocating its output, as PyTorch's call does. PyTorch's dropout next to it when installed:
its forward writes a one-byte mask besides y (9 bytes per element) and its backward reads that mask (9 bytes);
both are counted in PyTorch's figures as the bytes it really moves.
"""

import numpy as np

from gpt2_cupy import backend, benchmark, kernels
from gpt2_cupy.ops.arrays import ceil_div
from gpt2_cupy.ops.dropout import advance_rng_state, dropout_backward, dropout_forward, new_rng_state
from gpt2_cupy.testing import torch_or_none

SHAPES = {"residual stream (8, 1024, 768)": (8, 1024, 768), "attention (8, 12, 1024, 1024)": (8, 12, 1024, 1024)}
P = 0.1
FLOAT = 4
THREADS_PER_BLOCK = 256


def rates(shape, state, cupy, torch):
    """{name: GB/s} of the dropout kernels and their references on arrays of `shape` (freed on return)."""
    n = int(np.prod(shape))
    x = cupy.random.default_rng(0).standard_normal(shape, dtype=cupy.float32)
    out = cupy.empty_like(x)
    ours = 2 * n * FLOAT
    one_per_thread = kernels.function("steps/dropout_one_per_thread")
    p = np.float32(P)
    runs = {
        "dropout, one element per thread (the first step)": (ours, lambda: one_per_thread(
            (ceil_div(n, THREADS_PER_BLOCK),), (THREADS_PER_BLOCK,), (out, x, state, p, np.int32(n)))),
        "dropout_forward": (ours, lambda: dropout_forward(x, P, state, out=out)),
        "dropout_forward, allocating y (as torch's does)": (ours, lambda: dropout_forward(x, P, state)),
        "dropout_backward": (ours, lambda: dropout_backward(x, P, state, out=out)),
        "advance_rng_state + dropout_forward": (ours, lambda: (advance_rng_state(state, n),
                                                              dropout_forward(x, P, state, out=out))),
        "cupy copy (the reference line)": (ours, lambda: cupy.copyto(out, x)),
    }
    if torch is not None:
        x_torch = torch.from_dlpack(x)
        _, mask = torch.ops.aten.native_dropout(x_torch, P, True)
        runs["torch native_dropout (writes y and a bool mask)"] = (
            ours + n, lambda: torch.ops.aten.native_dropout(x_torch, P, True))
        runs["torch native_dropout_backward (reads the mask)"] = (
            ours + n, lambda: torch.ops.aten.native_dropout_backward(x_torch, mask, 1 / (1 - P)))
    return {name: benchmark.gigabytes_per_second(moved, benchmark.seconds_per_call(run))
            for name, (moved, run) in runs.items()}


def measure():
    benchmark.require_gpu()
    cupy, torch = backend.xp, torch_or_none()
    results = {"copy_bandwidth_gb_per_s": benchmark.copy_bandwidth() / 1e9, "p": P, "gb_per_s": {}}
    state = new_rng_state(1234)
    for label, shape in SHAPES.items():
        results["gb_per_s"][label] = rates(shape, state, cupy, torch)
        cupy.get_default_memory_pool().free_all_blocks()  # one shape's arrays gone before the next are made
    return {**benchmark.measured_on(), **results}


def table(measured):
    ceiling = measured["copy_bandwidth_gb_per_s"]
    lines = [f"{measured['device']}, {measured['date']}: copy bandwidth {ceiling:.0f} GB/s, p = {measured['p']}"]
    for label, rates in measured["gb_per_s"].items():
        lines.append(f"{label}:")
        lines += benchmark.bandwidth_rows(rates, ceiling)
    return lines


def report(measured):
    """The table as one text, for a notebook to print."""
    return "\n".join(table(measured))


if __name__ == "__main__":
    measured = measure()
    benchmark.report("dropout", measured, table(measured))
