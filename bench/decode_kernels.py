"""Chapter 17b's decode kernels timed one by one on a GPU, at Llama 3.2 1B's shapes in bf16 (batch 1, one new
token, a cache of 600 positions): each against the time its bytes take at the device's measured copy rate.
`python -m bench.decode_kernels` writes bench/decode_kernels.json, which the chapter shows on a machine without
a GPU; on a GPU the chapter measures with the same `measure()`.

Bytes that must move per call (bf16, 2 bytes an element):
    GEMV (N, K)             the weight, 2 N K (x and y are a few KB, read from L2)
    decode attention        the cache's keys and values of every key-value head: 2 H_kv length d, twice
    argmax (V)              the logits, 2 V
The kernels are launched from Python one at a time here, each queued behind the others (benchmark.seconds_per_call),
so a time includes the kernel's ramp up and down but no launch gap.
"""

import numpy

from gpt2_cupy import backend, benchmark
from gpt2_cupy.dtypes import BFLOAT16
from gpt2_cupy.elementwise import converted
from gpt2_cupy.ops.argmax import argmax_forward
from gpt2_cupy.ops.decode_attention import decode_attention_forward
from gpt2_cupy.ops.gemv import gemv_forward

# Llama 3.2 1B: 2048 channels, 32 query heads and 8 key-value heads of 64, an MLP of 8192, 128256 tokens.
C, H, H_KV, D, INTERMEDIATE, VOCAB = 2048, 32, 8, 64, 8192, 128256
CAPACITY, LENGTH = 700, 600
BF16 = 2


def runs(xp):
    """{name: (bytes that must move, a call)}, bf16 storage as a model generating in bf16 keeps it."""
    def bf16(*shape):
        return converted(xp.random.standard_normal(shape).astype(numpy.float32), BFLOAT16)

    x = bf16(1, C)
    products = {"GEMV q, k, v (3072 x 2048)": (H + 2 * H_KV) * D,
                "GEMV gate and up (16384 x 2048)": 2 * INTERMEDIATE,
                "GEMV o_proj (2048 x 2048)": C}
    table = {}
    for name, rows in products.items():
        weight, out = bf16(rows, C), xp.empty((1, rows), dtype=BFLOAT16)
        table[name] = (BF16 * rows * C, lambda weight=weight, out=out: gemv_forward(x, weight, out=out))
    down, hidden = bf16(C, INTERMEDIATE), bf16(1, INTERMEDIATE)
    table["GEMV down_proj (2048 x 8192)"] = (BF16 * C * INTERMEDIATE, lambda: gemv_forward(hidden, down))
    head = bf16(VOCAB, C)
    table["GEMV lm_head (128256 x 2048)"] = (BF16 * VOCAB * C, lambda: gemv_forward(x, head))
    q, keys, values = bf16(1, H, 1, D), bf16(1, H_KV, CAPACITY, D), bf16(1, H_KV, CAPACITY, D)
    table["decode attention (600 positions)"] = (2 * BF16 * H_KV * LENGTH * D,
                                                 lambda: decode_attention_forward(q, keys, values, LENGTH))
    logits = bf16(1, VOCAB)
    index = xp.empty((1, 1), dtype=numpy.int64)
    table["argmax (128256 logits)"] = (BF16 * VOCAB, lambda: argmax_forward(logits, out=index))
    return table


def measure():
    benchmark.require_gpu()
    copy = benchmark.copy_bandwidth() / 1e9
    results = {}
    for name, (bytes_moved, run) in runs(backend.xp).items():
        seconds = benchmark.seconds_per_call(run)
        results[name] = {"bytes": bytes_moved, "microseconds": seconds * 1e6,
                         "bound_microseconds": bytes_moved / (copy * 1e9) * 1e6}
    return {**benchmark.measured_on(), "copy_bandwidth_gb_per_s": copy,
            "datasheet_gb_per_s": benchmark.datasheet_gb_per_s(), "results": results}


def table(measured):
    copy = measured["copy_bandwidth_gb_per_s"]
    datasheet = measured.get("datasheet_gb_per_s") or benchmark.datasheet_gb_per_s(measured["device"])
    lines = [f"{measured['device']}, {measured['date']}: copy {copy:.0f} GB/s"
             + (f", datasheet {datasheet} GB/s" if datasheet else "") + "; Llama 3.2 1B's shapes, bf16, batch 1"]
    width = max(map(len, measured["results"]))
    for name, r in measured["results"].items():
        of_datasheet = (f", {r['bound_microseconds'] * copy / datasheet / r['microseconds']:6.1%} of the datasheet's"
                        if datasheet else "")
        lines.append(f"  {name:<{width}} {r['microseconds']:7.1f} µs, its bytes at the copy rate "
                     f"{r['bound_microseconds']:6.1f} µs: {r['bound_microseconds'] / r['microseconds']:6.1%} of the "
                     f"copy's bound{of_datasheet}")
    return lines


if __name__ == "__main__":
    measured = measure()
    benchmark.report("decode_kernels", measured, table(measured))
