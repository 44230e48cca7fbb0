"""Chapter 08's ladder on a GPU: each step of the fused attention timed against the one before, float32.

    python -m bench.attention_steps     prints a table and writes bench/attention_steps.json

GPT-2 small's shape, B = 8, H = 12, T = 1024, d = 64, causal: the naive forward (chapter 01's batched
matmul and chapter 04's softmax, the (B, H, T, T) scores written out), the teaching kernels of
kernels/steps/ (one thread per query row reading keys and values from global memory; the same with key and
value tiles in shared memory), and the package's tuned kernel (kernels/attention.cu); then the backward,
naive, one thread per row (kernels/steps/attention_backward_rows.cu) and tuned. TFLOP/s counts the causal
half of the products a fused kernel must do: 2 in the forward (S and P V), 5 in the backward (S and dP
recomputed, dV, dK, dQ), each B H T² d FLOP.
"""

import numpy as np

from gpt2_cupy import backend, benchmark, kernels
from gpt2_cupy.ops.arrays import ceil_div
from gpt2_cupy.ops.attention import (attention_backward, attention_backward_naive, attention_forward,
                                     attention_forward_naive)

B, H, T, D = 8, 12, 1024, 64
ROWS_PER_BLOCK = 64  # the steps' threads per block: one query (or key) row each


def step(file_name, kernel_name):
    """A kernel of kernels/steps/<file_name>.cu instantiated for head size D."""
    full_name = f"{kernel_name}<{D}>"
    return kernels.function(f"steps/{file_name}", full_name, name_expressions=(full_name,))


def runs(cupy):
    """{name: function} for the forward steps, then the backward steps."""
    random = cupy.random.default_rng(0)
    q, k, v, dout = (random.standard_normal((B * H, T, D), dtype=cupy.float32) for _ in range(4))
    out, lse = cupy.empty_like(q), cupy.empty((B * H, T), dtype=cupy.float32)
    dq, dk, dv, rowdot = cupy.empty_like(q), cupy.empty_like(q), cupy.empty_like(q), cupy.empty_like(lse)
    grid, block = (ceil_div(T, ROWS_PER_BLOCK), B * H), (ROWS_PER_BLOCK,)
    length, causal = np.int32(T), np.int32(1)
    forward_row = step("attention_forward_row", "attention_forward_row")
    forward_tiles = step("attention_forward_key_tiles", "attention_forward_key_tiles")
    dq_row = step("attention_backward_rows", "attention_backward_dq_row")
    dk_dv_row = step("attention_backward_rows", "attention_backward_dk_dv_row")
    forward_tiles(grid, block, (out, lse, q, k, v, length, causal))  # the out and lse the backward steps read
    _, p = attention_forward_naive(q, k, v)
    tuned_out, tuned_lse = attention_forward(q, k, v)

    def backward_rows():
        dq_row(grid, block, (dq, rowdot, dout, out, q, k, v, lse, length, causal))
        dk_dv_row(grid, block, (dk, dv, dout, q, k, v, lse, rowdot, length, causal))

    return {
        "forward: naive (matmul, softmax, matmul)": lambda: attention_forward_naive(q, k, v),
        "forward: one thread per query row": lambda: forward_row(grid, block, (out, lse, q, k, v, length, causal)),
        "forward: + key and value tiles in shared memory":
            lambda: forward_tiles(grid, block, (out, lse, q, k, v, length, causal)),
        "forward: tuned (kernels/attention.cu)": lambda: attention_forward(q, k, v),
        "backward: naive (matmuls and softmax backward)": lambda: attention_backward_naive(dout, q, k, v, p),
        "backward: one thread per row (dq, then dk and dv)": backward_rows,
        "backward: tuned (kernels/attention.cu)":
            lambda: attention_backward(dout, q, k, v, tuned_out, tuned_lse),
    }


def measure():
    benchmark.require_gpu()
    cupy = backend.xp
    seconds = {name: benchmark.seconds_per_call(run) for name, run in runs(cupy).items()}
    products = {"forward": 2, "backward": 5}
    flop = {name: products[name.split(":")[0]] * B * H * T * T * D for name in seconds}
    return {**benchmark.measured_on(), "shape": {"B": B, "H": H, "T": T, "d": D},
            "seconds": seconds, "tflops": {name: benchmark.tflops(flop[name], s) for name, s in seconds.items()}}


def table(measured):
    lines = [f"{measured['device']}, {measured['date']}: B={B} H={H} T={T} d={D}, causal, float32"]
    previous = None
    for name, s in measured["seconds"].items():
        versus = "" if previous is None or name.split(":")[0] != previous[0].split(":")[0] else \
            f"  {previous[1] / s:5.2f}x the step before"
        lines.append(f"  {name:<52s} {s * 1e3:8.3f} ms {measured['tflops'][name]:6.2f} TFLOP/s{versus}")
        previous = (name, s)
    return lines


def report(measured):
    """The table as one text, for a notebook to print."""
    return "\n".join(table(measured))


if __name__ == "__main__":
    measured = measure()
    benchmark.report("attention_steps", measured, table(measured))
