"""Chapter 08's attention on a GPU: fused against naive against PyTorch, forward + backward, float32.

    python -m bench.attention          prints a table and writes bench/attention.json
    python -m bench.attention --quick  GPT-2's shape only: prints the table, writes nothing

GPT-2 small's shape, B = 8, H = 12, T = 1024, d = 64: the fused kernels (gpt2_cupy.ops.attention) and the
naive version (batched matmuls and chapter 04's softmax, the (B, H, T, T) scores written out), both
variants, and PyTorch's scaled_dot_product_attention(is_causal=True) in float32 with TF32 off, each timed
forward alone and forward + backward. TFLOP/s counts the causal half of the four T x T x d products of
the backward and the two of the forward that a causal kernel must do: 2 B H T² d FLOP forward (S and
P V, each half of 2 B H T² d), 5 half-products in the backward (S and dP recomputed, dV, dK, and dQ).

The fused softmax version is also timed kernel by kernel: the forward, and the backward's three launches
(rowdot, the dk, dv pass with its 4 half-products, the dq pass with its 3), each of the three big kernels
with every candidate number of rows per block (gpt2_cupy.ops.attention.ROW_CHOICES; the op uses
FORWARD_ROWS, BACKWARD_DK_DV_ROWS, BACKWARD_DQ_ROWS), and forward + backward with every kernel at 64 rows
and every kernel at 128. The table ends with the previous bench/attention.json's timings of the same names
where it has them, before this run replaces it.

Then longer sequences, T = 4096, 8192, 16384 at the same B and H: the naive version needs two (B, H, T, T)
float32 arrays (P, and dP, which becomes dS in place), 6.4 GB each at T = 4096 and 103 GB each at
T = 16384; the fused one needs O(T) beyond its inputs. The naive one runs where its arrays fit the
GPU and the kernels' int indexing (at most 2^31 elements), and the reason is recorded where they do not.
"""

import json
import sys
from pathlib import Path

from gpt2_cupy import backend, benchmark
from gpt2_cupy.ops.arrays import LARGEST_INT
from gpt2_cupy.ops import attention as attention_ops
from gpt2_cupy.ops.attention import (attention_backward, attention_backward_naive, attention_forward,
                                     attention_forward_naive)
from gpt2_cupy.testing import torch_or_none

B, H, T, D = 8, 12, 1024, 64
LONG_T = (4096, 8192, 16384)
FLOAT = 4


def causal_flop(T, products):
    """FLOP of `products` causal T x T x d matrix products over all heads: half of 2 T² d each."""
    return products * B * H * T * T * D


def inputs(T, cupy):
    random = cupy.random.default_rng(0)
    return [random.standard_normal((B, H, T, D), dtype=cupy.float32) for _ in range(4)]  # q, k, v, dout


def ours(T, cupy, variant):
    """{name: function}: the fused and naive versions, forward alone and forward + backward."""
    q, k, v, dout = inputs(T, cupy)

    def fused_both():
        out, lse = attention_forward(q, k, v, variant=variant)
        attention_backward(dout, q, k, v, out, lse, variant=variant)

    def fused_one_pass():
        out, lse = attention_forward(q, k, v, variant=variant)
        attention_backward(dout, q, k, v, out, lse, variant=variant, deterministic=False)

    def naive_both():
        _, p = attention_forward_naive(q, k, v, variant=variant)
        attention_backward_naive(dout, q, k, v, p, variant=variant)

    return {f"fused {variant}, forward": lambda: attention_forward(q, k, v, variant=variant),
            f"fused {variant}, forward + backward": fused_both,
            f"fused {variant}, one pass (dq atomics), forward + backward": fused_one_pass,
            f"naive {variant}, forward": lambda: attention_forward_naive(q, k, v, variant=variant),
            f"naive {variant}, forward + backward": naive_both}


def torch_runs(T):
    """{name: function} for PyTorch's scaled_dot_product_attention in float32, TF32 off; {} without torch."""
    torch = torch_or_none()
    if torch is None:
        return {}
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    generator = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, device="cuda", generator=generator, requires_grad=True) for _ in range(3))
    dout = torch.randn(B, H, T, D, device="cuda", generator=generator)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def both():
        q.grad = k.grad = v.grad = None
        sdpa(q, k, v, is_causal=True).backward(dout)

    def forward():
        with torch.no_grad():
            sdpa(q, k, v, is_causal=True)

    return {"torch scaled_dot_product_attention, forward": forward,
            "torch scaled_dot_product_attention, forward + backward": both}


def kernel_runs(cupy):
    """{name: (function, causal half-products)}: each kernel of the fused softmax version, launched alone,
    the three big ones with each candidate number of rows per block."""
    q, k, v, dout = inputs(T, cupy)
    out, lse = attention_forward(q, k, v)
    dq, dk, dv = (cupy.empty_like(q) for _ in range(3))
    rowdot = cupy.empty_like(lse)
    heads, causal = B * H, True
    common = (heads, T, D, causal, "softmax")
    attention_ops._rowdot(rowdot, dout, out, heads * T, D)
    runs = {"kernel attention_backward_rowdot": (lambda: attention_ops._rowdot(rowdot, dout, out, heads * T, D), 0)}
    for rows in attention_ops.ROW_CHOICES:
        runs[f"kernel attention_forward, {rows} rows"] = (
            lambda rows=rows: attention_ops._forward(out, lse, q, k, v, *common, rows), 2)
        runs[f"kernel attention_backward_dk_dv, {rows} rows"] = (
            lambda rows=rows: attention_ops._dk_dv(dk, dv, dout, q, k, v, lse, rowdot, *common, rows), 4)
        runs[f"kernel attention_backward_dq, {rows} rows"] = (
            lambda rows=rows: attention_ops._dq(dq, dout, q, k, v, lse, rowdot, *common, rows), 3)
    # The one-pass backward's kernel: dk, dv and dq (added into dq with atomics), 5 half-products.
    runs["kernel attention_backward_dk_dv with dq atomics, 64 rows"] = (
        lambda: attention_ops._dk_dv(dk, dv, dout, q, k, v, lse, rowdot, *common, attention_ops.TILE, dq), 5)
    return runs


def same_rows_runs(cupy):
    """{name: function}: forward + backward, softmax, with every kernel at the same number of rows per block."""
    q, k, v, dout = inputs(T, cupy)
    out, lse = cupy.empty_like(q), cupy.empty(q.shape[:-1], dtype=cupy.float32)
    dq, dk, dv = (cupy.empty_like(q) for _ in range(3))
    rowdot = cupy.empty_like(lse)
    heads, causal = B * H, True
    common = (heads, T, D, causal, "softmax")

    def both(rows):
        attention_ops._forward(out, lse, q, k, v, *common, rows)
        attention_ops._rowdot(rowdot, dout, out, heads * T, D)
        attention_ops._dk_dv(dk, dv, dout, q, k, v, lse, rowdot, *common, rows)
        attention_ops._dq(dq, dout, q, k, v, lse, rowdot, *common, rows)

    return {f"fused softmax, all kernels {rows} rows, forward + backward": lambda rows=rows: both(rows)
            for rows in attention_ops.ROW_CHOICES}


KERNEL_PRODUCTS = {}  # filled by measure_gpt2_shape: kernel name -> causal half-products


def flop_of(name, T):
    if name in KERNEL_PRODUCTS:
        return causal_flop(T, KERNEL_PRODUCTS[name])
    return causal_flop(T, 2 if name.endswith(", forward") else 7)


def measure_gpt2_shape(cupy):
    seconds = {}
    for variant in ("softmax", "relu"):
        for name, run in ours(T, cupy, variant).items():
            seconds[name] = benchmark.seconds_per_call(run, warmup=2, repeat=10)
        cupy.get_default_memory_pool().free_all_blocks()
    for name, run in same_rows_runs(cupy).items():
        seconds[name] = benchmark.seconds_per_call(run, warmup=2, repeat=10)
    for name, (run, products) in kernel_runs(cupy).items():
        KERNEL_PRODUCTS[name] = products
        seconds[name] = benchmark.seconds_per_call(run, warmup=2, repeat=20)
    cupy.get_default_memory_pool().free_all_blocks()
    for name, run in torch_runs(T).items():
        seconds[name] = benchmark.seconds_per_call(run, warmup=2, repeat=10)
    return seconds


def measure_long(cupy):
    """{T: {name: seconds, or why it did not run}} for the softmax variant, forward + backward."""
    _, gpu_bytes = cupy.cuda.runtime.memGetInfo()
    results = {}
    for long_T in LONG_T:
        runs = ours(long_T, cupy, "softmax")
        results[long_T] = {"fused softmax, forward + backward":
                           benchmark.seconds_per_call(runs["fused softmax, forward + backward"], warmup=1, repeat=3)}
        naive_bytes = 2 * B * H * long_T * long_T * FLOAT  # P and dP (dS in place)
        name = "naive softmax, forward + backward"
        if naive_bytes > gpu_bytes:
            results[long_T][name] = (f"out of memory: P and dP need {naive_bytes / 1e9:.0f} GB, "
                                     f"the GPU has {gpu_bytes / 1e9:.0f} GB")
        elif B * H * long_T * long_T > LARGEST_INT:
            results[long_T][name] = "not run: P has more than 2^31 elements, beyond the kernels' int indexing"
        else:
            try:
                results[long_T][name] = benchmark.seconds_per_call(runs[name], warmup=1, repeat=3)
            except cupy.cuda.memory.OutOfMemoryError:
                results[long_T][name] = "out of memory"
        del runs
        cupy.get_default_memory_pool().free_all_blocks()
    return results


def measure(quick=False):
    benchmark.require_gpu()
    cupy = backend.xp
    seconds = measure_gpt2_shape(cupy)
    long = {} if quick else measure_long(cupy)
    square_bytes = {t: B * H * t * t * FLOAT for t in (T, *LONG_T)}
    return {**benchmark.measured_on(), "shape": {"B": B, "H": H, "T": T, "d": D},
            "seconds": seconds,
            "tflops": {name: benchmark.tflops(flop_of(name, T), s) for name, s in seconds.items()},
            "long_sequences_seconds": {str(t): r for t, r in long.items()},
            "bytes_of_one_B_H_T_T_array": {str(t): b for t, b in square_bytes.items()}}


def stored_before(path):
    """The seconds of the bench/attention.json that this run is about to replace, and its device; ({}, None)."""
    if not path.exists():
        return {}, None
    stored = json.loads(path.read_text())
    return stored.get("seconds", {}), f"{stored.get('device')}, {stored.get('date')}"


def report(measured, before=None, before_from=None):
    seconds, before = measured["seconds"], before or {}
    lines = [f"{measured['device']}, {measured['date']}: B={B} H={H} T={T} d={D}, float32. "
             f"Rows per block the op uses: forward {attention_ops.FORWARD_ROWS}, "
             f"dk, dv {attention_ops.BACKWARD_DK_DV_ROWS}, dq {attention_ops.BACKWARD_DQ_ROWS}"]
    if before:
        lines.append(f"  (before: the previous bench/attention.json, {before_from})")
    for name, s in seconds.items():
        rate = f"{measured['tflops'][name]:6.1f} TFLOP/s" if measured["tflops"][name] else " " * 14
        # A kernel's earlier entry may have no ", N rows": the kernels before the rows were a choice.
        earlier = before.get(name, before.get(name.split(",")[0]) if name.startswith("kernel") else None)
        previous = f"   before {earlier * 1e3:8.3f} ms" if isinstance(earlier, float) else ""
        lines.append(f"  {name:<60s} {s * 1e3:8.3f} ms  {rate}{previous}")
    torch_name = "torch scaled_dot_product_attention, forward + backward"
    for label, name in (("two passes", "fused softmax, forward + backward"),
                        ("one pass", "fused softmax, one pass (dq atomics), forward + backward")):
        fused = seconds[name]
        lines.append(f"  fused ({label}) vs naive, forward + backward: "
                     f"{seconds['naive softmax, forward + backward'] / fused:.2f}x faster (target >= 3x)")
        if torch_name in seconds:
            lines.append(f"  fused ({label}) vs torch, forward + backward: {seconds[torch_name] / fused:.2f}x "
                         "(target >= 1x: at least as fast)")
    if measured["long_sequences_seconds"]:
        lines.append("  long sequences, softmax, forward + backward:")
    for t, results in measured["long_sequences_seconds"].items():
        square = measured["bytes_of_one_B_H_T_T_array"][t] / 1e9
        cells = ", ".join(f"{name.split(' ')[0]} " + (f"{r * 1e3:.1f} ms" if isinstance(r, float) else r)
                          for name, r in results.items())
        lines.append(f"    T = {t:>5s}: {cells}   (one (B, H, T, T) array: {square:.1f} GB)")
    return "\n".join(lines)


def main():
    quick = "--quick" in sys.argv[1:]
    path = Path(__file__).with_suffix(".json")
    before, before_from = stored_before(path)
    measured = measure(quick)
    print(report(measured, before, before_from))
    if quick:
        return 0
    benchmark.write_results(path, measured)
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
