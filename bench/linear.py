"""Benchmark of chapter 02 (Linear) on a GPU: the bias gradient, and the whole layer forward and backward.

    python -m bench.linear   writes bench/linear.json (device, date, results) and prints a table

The bias gradient db = Σ_n dy[n, :] reads dy once, so it is measured in GB/s of dy read, next to the
device's copy rate (bytes read plus written per second), cupy's dy.sum(axis=0) and, when installed,
PyTorch's. Each timing launches several calls back to back, so that Python's launch overhead overlaps the
GPU's work, as it does in a training step.
The layer is measured in TFLOP/s (2 N C_in C_out for the forward, twice that for the backward), next to
the same layer written with cupy (cuBLAS) and, when installed, torch.nn.functional.linear with autograd.
Sizes are GPT-2 small's (C = 768) with B = 32 sequences of T = 1024 tokens: every dy is larger than an
H100's 50 MB L2 cache, so each call really reads memory.
"""

import sys

import numpy as np

from gpt2_cupy import backend, benchmark, kernels
from gpt2_cupy.ops.arrays import ceil_div
from gpt2_cupy.dispatch import linear_backward, linear_forward
from gpt2_cupy.ops.linear import bias_backward
from gpt2_cupy.testing import torch_or_none

ROWS = 32 * 1024  # B * T
BIAS_WIDTHS = (768, 2304, 3072)  # c_proj, c_attn, c_fc outputs
LAYERS = ((768, 2304), (768, 3072), (3072, 768))  # (C_in, C_out) of c_attn, c_fc, the MLP's c_proj


def bias_gradient_rates(rows=ROWS, widths=BIAS_WIDTHS, seed=0):
    """{C_out: {implementation: GB/s of dy read}} for the column sum of a (rows, C_out) float32 dy."""
    cupy, torch = backend.xp, torch_or_none()
    one_thread_per_column = kernels.function("bias_column_sum")
    rng = np.random.default_rng(seed)
    return {columns: column_sum_rates(cupy.asarray(rng.standard_normal((rows, columns), dtype=np.float32)),
                                      one_thread_per_column, cupy, torch)
            for columns in widths}


def column_sum_rates(dy, one_thread_per_column, cupy, torch):
    """{implementation: GB/s of dy read} for the column sum of one dy (freed on return)."""
    rows, columns = dy.shape
    dbias = cupy.zeros(columns, dtype=cupy.float32)
    runs = {
        "one thread per column (version 1)": lambda: one_thread_per_column(
            (ceil_div(columns, 256),), (256,), (dbias, dy, np.int32(rows), np.int32(columns))),
        "gpt2_cupy bias_backward (version 2)": lambda: bias_backward(dy, dbias),
        "cupy dy.sum(axis=0)": lambda: dy.sum(axis=0),
    }
    if torch is not None:
        dy_torch = torch.from_dlpack(dy)
        runs["torch dy.sum(0)"] = lambda: dy_torch.sum(0)
    return {name: benchmark.gigabytes_per_second(dy.nbytes, benchmark.seconds_per_call(run))
            for name, run in runs.items()}


def layer_rates(rows=ROWS, layers=LAYERS, seed=0):
    """{"C_in->C_out": {implementation: TFLOP/s}} for the forward and the backward of one linear layer."""
    cupy, torch = backend.xp, torch_or_none()
    rng = np.random.default_rng(seed)
    results = {}
    for c_in, c_out in layers:
        x = cupy.asarray(rng.standard_normal((rows, c_in), dtype=np.float32))
        weight = cupy.asarray((rng.standard_normal((c_out, c_in)) / np.sqrt(c_in)).astype(np.float32))
        bias = cupy.asarray(rng.standard_normal(c_out, dtype=np.float32))
        dy = cupy.asarray(rng.standard_normal((rows, c_out), dtype=np.float32))
        dweight, dbias = cupy.zeros_like(weight), cupy.zeros_like(bias)
        dx, y = cupy.empty_like(x), cupy.empty((rows, c_out), dtype=cupy.float32)
        forward_flops = 2 * rows * c_in * c_out

        def cupy_backward():
            cupy.matmul(dy, weight, out=dx)
            dweight[...] += dy.T @ x
            dbias[...] += dy.sum(axis=0)

        runs = {
            "gpt2_cupy forward": (lambda: linear_forward(x, weight, bias, out=y), forward_flops),
            "gpt2_cupy backward": (lambda: linear_backward(dy, x, weight, dweight=dweight, dbias=dbias, out=dx), 2 * forward_flops),
            "cupy forward": (lambda: cupy.add(x @ weight.T, bias, out=y), forward_flops),
            "cupy backward": (cupy_backward, 2 * forward_flops),
        }
        if torch is not None:
            # torch's default float32 matmul does not use TF32 (torch.backends.cuda.matmul.allow_tf32 is False)
            x_t, w_t, b_t, dy_t = (torch.from_dlpack(a) for a in (x, weight, bias, dy))
            w_t.requires_grad_(True)
            b_t.requires_grad_(True)
            x_t.requires_grad_(True)
            y_t = torch.nn.functional.linear(x_t, w_t, b_t)
            runs["torch forward"] = (lambda: torch.nn.functional.linear(x_t, w_t, b_t), forward_flops)
            runs["torch backward"] = (
                lambda: torch.autograd.grad(y_t, (x_t, w_t, b_t), dy_t, retain_graph=True), 2 * forward_flops)
        results[f"{c_in}->{c_out}"] = {name: benchmark.tflops(flops, benchmark.seconds_per_call(run))
                                       for name, (run, flops) in runs.items()}
    return results


def main():
    benchmark.require_gpu()
    torch = torch_or_none()
    results = {
        "rows": ROWS,
        "copy_bandwidth_GBps": benchmark.copy_bandwidth() / 1e9,
        "torch": torch.__version__ if torch is not None else None,
        "bias_gradient_GBps": bias_gradient_rates(),
        "layer_TFLOPs": layer_rates(),
    }
    table = [f"{backend.device_name()}, device copy rate {results['copy_bandwidth_GBps']:.0f} GB/s"]
    for columns, rates in results["bias_gradient_GBps"].items():
        table.append(f"bias gradient, N = {ROWS}, C_out = {columns} (GB/s of dy read):")
        table += benchmark.bandwidth_rows(rates, results["copy_bandwidth_GBps"])
    for layer, rates in results["layer_TFLOPs"].items():
        table += [f"linear {layer:10s}, N = {ROWS}: {name:20s} {rate:6.1f} TFLOP/s" for name, rate in rates.items()]
    benchmark.report("linear", results, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
