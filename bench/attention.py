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

Then Llama's heads (HEAD_CASES, B = 4, T = 1024): d = 128 with 32 heads, with 8 key-value heads for the 32 query
heads (grouped-query attention, no copy of k and v), and d = 80 (run in tiles of 128), fused against PyTorch's
scaled_dot_product_attention (enable_gqa=True, or k and v repeated where PyTorch is older than 2.5), float32.
And the decode kernel (gpt2_cupy.ops.decode_attention) at Llama 7B's shape, one new query per head, B = 1,
H = 32, H_kv = 8 or 32, a cache of 512, 2048 or 4096 positions, d = 128: GB/s of keys and values read
(2 H_kv T d floats, all it must move) against the copy bandwidth, beside the naive path it replaced (chapter 01's
batched matmul and chapter 04's softmax, the scores written out) and PyTorch's scaled_dot_product_attention.
"""

import json
import sys
from pathlib import Path

from gpt2_cupy import backend, benchmark
from gpt2_cupy.ops.arrays import LARGEST_INT
from gpt2_cupy.ops import attention as attention_ops
from gpt2_cupy.ops.attention import (attention_backward, attention_backward_naive, attention_forward,
                                     attention_forward_naive)
from gpt2_cupy.ops.decode_attention import decode_attention_forward
from gpt2_cupy.dispatch import batched_matmul
from gpt2_cupy.ops.softmax import softmax_forward
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
    causal = True
    common = (attention_ops.LaunchShape.of(q, k, v), causal, "softmax")
    attention_ops._rowdot(rowdot, dout, out, common[0])
    runs = {"kernel attention_backward_rowdot": (lambda: attention_ops._rowdot(rowdot, dout, out, common[0]), 0)}
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
    causal = True
    common = (attention_ops.LaunchShape.of(q, k, v), causal, "softmax")

    def both(rows):
        attention_ops._forward(out, lse, q, k, v, *common, rows)
        attention_ops._rowdot(rowdot, dout, out, common[0])
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


# ---- Llama's heads: d = 128, grouped-query attention, a head size between the tile widths ----------------

HEADS_B, HEADS_T = 4, 1024
HEAD_CASES = {"d = 128, 32 heads": (32, 32, 128),           # (query heads, key-value heads, d)
              "d = 128, 32 query heads, 8 key-value heads": (32, 8, 128),
              "d = 80, 32 heads": (32, 32, 80)}


def head_case_runs(cupy, heads, key_heads, d):
    """{name: (function, causal half-products)}: ours and PyTorch's, forward and forward + backward."""
    random = cupy.random.default_rng(0)
    q, dout = (random.standard_normal((HEADS_B, heads, HEADS_T, d), dtype=cupy.float32) for _ in range(2))
    k, v = (random.standard_normal((HEADS_B, key_heads, HEADS_T, d), dtype=cupy.float32) for _ in range(2))

    def both():
        out, lse = attention_forward(q, k, v)
        attention_backward(dout, q, k, v, out, lse)

    runs = {"fused, forward": (lambda: attention_forward(q, k, v), 2), "fused, forward + backward": (both, 7)}
    # The forward kernel alone with 64 and 128 queries per block: at d > 64 one block fills a multiprocessor's
    # shared memory either way, and 128 rows give it twice the warps.
    out, lse = cupy.empty_like(q), cupy.empty(q.shape[:-1], dtype=cupy.float32)
    shape = attention_ops.LaunchShape.of(q, k, v)
    for rows in attention_ops.ROW_CHOICES:
        runs[f"fused, forward kernel, {rows} rows"] = (
            lambda rows=rows: attention_ops._forward(out, lse, q, k, v, shape, True, "softmax", rows), 2)
    torch = torch_or_none()
    if torch is not None:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        tq, tk, tv = (torch.from_dlpack(a).clone().requires_grad_(True) for a in (q, k, v))
        tdout = torch.from_dlpack(dout)

        def attend():
            try:
                return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True,
                                                                        enable_gqa=key_heads != heads)
            except TypeError:  # PyTorch before 2.5: no enable_gqa; each key and value head repeated for its group
                group = heads // key_heads
                return torch.nn.functional.scaled_dot_product_attention(
                    tq, tk.repeat_interleave(group, 1), tv.repeat_interleave(group, 1), is_causal=True)

        def torch_forward():
            with torch.no_grad():
                attend()

        def torch_both():
            tq.grad = tk.grad = tv.grad = None
            attend().backward(tdout)

        runs["torch scaled_dot_product_attention, forward"] = (torch_forward, 2)
        runs["torch scaled_dot_product_attention, forward + backward"] = (torch_both, 7)
    return runs


def measure_head_cases(cupy):
    """{case: {name: {"seconds", "tflops"}}}; TFLOP/s counts the causal half-products as above."""
    results = {}
    for case, (heads, key_heads, d) in HEAD_CASES.items():
        results[case] = {}
        for name, (run, products) in head_case_runs(cupy, heads, key_heads, d).items():
            seconds = benchmark.seconds_per_call(run, warmup=2, repeat=10)
            flop = products * HEADS_B * heads * HEADS_T * HEADS_T * d
            results[case][name] = {"seconds": seconds, "tflops": benchmark.tflops(flop, seconds)}
        cupy.get_default_memory_pool().free_all_blocks()
    return results


# ---- the decode kernel: one new query per head over a KV cache ------------------------------------------------

DECODE_HEADS, DECODE_D = 32, 128
DECODE_KEY_HEADS = (8, 32)
DECODE_LENGTHS = (512, 2048, 4096)


def naive_decode(q, keys, values):
    """The path the KV cache took before the decode kernel: the group's queries as rows of one matrix per key
    head, scores = q kᵀ (written out), softmax, @ values (one new position: no mask)."""
    B, heads, n, d = q.shape
    key_heads, length = keys.shape[1], keys.shape[2]
    queries = q.reshape(B * key_heads, heads // key_heads * n, d)
    scores = batched_matmul(queries, keys.reshape(B * key_heads, length, d), transpose_b=True)
    weights = softmax_forward(scores, scale=1.0 / DECODE_D ** 0.5, out=scores)
    return batched_matmul(weights, values.reshape(B * key_heads, length, d))


def measure_decode(cupy):
    """{"H_kv = ..., T = ...": {name: {"seconds", "gb_per_s"}}}: bytes = the keys and values read."""
    torch = torch_or_none()
    results = {}
    for key_heads in DECODE_KEY_HEADS:
        for length in DECODE_LENGTHS:
            random = cupy.random.default_rng(0)
            q = random.standard_normal((1, DECODE_HEADS, 1, DECODE_D), dtype=cupy.float32)
            keys, values = (random.standard_normal((1, key_heads, length, DECODE_D), dtype=cupy.float32)
                            for _ in range(2))
            runs = {"decode kernel": lambda: decode_attention_forward(q, keys, values, length),
                    "naive (batched matmul + softmax)": lambda: naive_decode(q, keys, values)}
            if torch is not None:
                tq, tk, tv = (torch.from_dlpack(a) for a in (q, keys, values))
                group = DECODE_HEADS // key_heads

                def torch_run():
                    try:
                        return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, enable_gqa=group > 1)
                    except TypeError:
                        return torch.nn.functional.scaled_dot_product_attention(
                            tq, tk.repeat_interleave(group, 1), tv.repeat_interleave(group, 1))

                runs["torch scaled_dot_product_attention"] = torch_run
            bytes_read = 2 * key_heads * length * DECODE_D * FLOAT
            case = results[f"H_kv = {key_heads}, T = {length}"] = {}
            for name, run in runs.items():
                seconds = benchmark.seconds_per_call(run, warmup=3, repeat=20)
                case[name] = {"seconds": seconds, "gb_per_s": benchmark.gigabytes_per_second(bytes_read, seconds)}
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
            "bytes_of_one_B_H_T_T_array": {str(t): b for t, b in square_bytes.items()},
            "head_cases": {} if quick else {"shape": {"B": HEADS_B, "T": HEADS_T}, **measure_head_cases(cupy)},
            "decode": {} if quick else {"shape": {"B": 1, "H": DECODE_HEADS, "d": DECODE_D},
                                        "copy_bandwidth_gb_per_s": benchmark.copy_bandwidth() / 1e9,
                                        **measure_decode(cupy)}}


def stored_before(path):
    """The seconds of the bench/attention.json that this run is about to replace, and its device; ({}, None)."""
    if not path.exists():
        return {}, None
    stored = json.loads(path.read_text())
    return stored.get("seconds", {}), f"{stored.get('device')}, {stored.get('date')}"


def llama_report(measured):
    """Lines for the head cases and the decode kernel, where measured has them."""
    lines = []
    if measured.get("head_cases"):
        lines.append(f"  Llama's heads, B = {HEADS_B}, T = {HEADS_T}, causal, float32:")
    for case, runs in measured.get("head_cases", {}).items():
        if case == "shape":
            continue
        for name, r in runs.items():
            lines.append(f"    {case + ', ' + name:<90s} {r['seconds'] * 1e3:8.3f} ms  {r['tflops']:6.1f} TFLOP/s")
    decode = measured.get("decode", {})
    if decode:
        ceiling = decode["copy_bandwidth_gb_per_s"]
        lines.append(f"  decode, B = 1, H = {DECODE_HEADS}, d = {DECODE_D}, one new query: GB/s of keys and values read "
                     f"(copy: {ceiling:.0f} GB/s)")
    for case, runs in decode.items():
        if case in ("shape", "copy_bandwidth_gb_per_s"):
            continue
        for name, r in runs.items():
            lines.append(f"    {case + ', ' + name:<70s} {r['seconds'] * 1e6:8.1f} µs  {r['gb_per_s']:6.0f} GB/s "
                         f"{r['gb_per_s'] / ceiling:6.1%} of copy")
    return lines


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
    lines += llama_report(measured)
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
