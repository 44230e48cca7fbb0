"""Attention on tensor cores in bf16, TF32 and 3xTF32 on a GPU: against chapter 08's float32 fused kernels and
PyTorch's scaled_dot_product_attention in bf16 and in float32 with TF32 allowed, causal, forward and forward +
backward, in the same run; and the error against float64 of each float32 way (TF32, 3xTF32, chapter 08's).

    python -m bench.tensor_core_attention          prints a table and writes bench/tensor_core_attention.json
    python -m bench.tensor_core_attention --tiny   on any backend: every run once at small shapes, no timings,
                                                   no file (a check that the script itself works)

Shapes: GPT-2 124M's, B = 8, H = 12, T = 1024, d = 64; and Llama's, H = 32 query heads over H_kv = 8
key/value heads (grouped-query attention), T = 2048, d = 128, at B = 1, 2 and 4. TFLOP/s counts what a
causal kernel must do, half of each T x T x d product (2 T² d FLOP each, per head), as bench/attention.py
does: 2 B H T² d forward (S and P V), 7 B H T² d forward + backward (the backward's five: S recomputed, dP,
dV, dK, dQ). The kernel rows count the products each kernel does: the dk, dv pass 4 (S, dP, dV, dK), the
dq pass 3 (S, dP again, dQ).

  - ours: gpt2_cupy.ops.tensor_core_attention on bf16 arrays, and on float32 ones at precision "high" (TF32)
    and "highest" (3xTF32), with the tile shapes the op uses;
  - chapter 08's fused float32 kernels (gpt2_cupy.ops.attention) where they run: d = 32 or 64, one key and
    value head per query head (the GPT-2 shape);
  - torch.nn.functional.scaled_dot_product_attention(is_causal=True) on bf16 tensors, where PyTorch is
    installed (its flash kernel), and on float32 ones with torch.backends.cuda.matmul.allow_tf32 and
    cudnn.allow_tf32 set (its memory-efficient kernel); for grouped-query attention with enable_gqa=True
    where this PyTorch has it, else on K and V repeated per head beforehand (outside the timing, and said so);
  - each kernel of ours alone, in each format, with every candidate tile shape (TILE_CANDIDATES) whose
    shared memory fits a block, at the GPT-2 shape and at Llama's B = 4: what the op's FORWARD_TILES,
    DK_DV_TILES and DQ_TILES were chosen from, with the registers each kernel takes and the bytes it spills
    to local memory;
  - at the GPT-2 shape, max |error| / max |reference| of out, dq, dk and dv against float64 for TF32, 3xTF32
    and chapter 08's float32 kernels, all from the same float32 inputs, on the first ERROR_HEADS heads of
    the first batch element (the float64 reference of all of them would take a (B, H, T, T) float64 array).
"""

import sys
from pathlib import Path

import numpy
from ml_dtypes import bfloat16

from gpt2_cupy import backend, benchmark
from gpt2_cupy.ops import tensor_core_attention as ops
from gpt2_cupy.ops.attention import (HEAD_SIZES as FLOAT32_HEAD_SIZES, SHARED_BYTES_PER_BLOCK, attention_backward,
                                     attention_forward)
from gpt2_cupy.testing import torch_or_none

# name: (B, H, H_kv, T, d)
SHAPES = {"GPT-2 124M": (8, 12, 12, 1024, 64),
          "Llama GQA, B = 1": (1, 32, 8, 2048, 128),
          "Llama GQA, B = 2": (2, 32, 8, 2048, 128),
          "Llama GQA, B = 4": (4, 32, 8, 2048, 128)}
KERNEL_SHAPES = ("GPT-2 124M", "Llama GQA, B = 4")   # where each kernel's candidates are timed
ERROR_SHAPE, ERROR_HEADS = "GPT-2 124M", 4           # where, and on how many heads, errors are measured
TINY_SHAPES = {"GPT-2-like": (1, 2, 2, 80, 64), "Llama-like": (1, 4, 2, 80, 128)}
FORWARD, BOTH = "forward", "forward + backward"
CAUSAL_HALF_PRODUCTS = {FORWARD: 2, BOTH: 7}
KERNEL_PRODUCTS = {"forward": 2, "dk_dv": 4, "dq": 3, "row_dot": 0}
# our format's name: (the arrays' dtype, the op's precision, the kernels' format)
FORMATS = {"bf16": (bfloat16, None, "bfloat16"), "tf32": (numpy.float32, "high", "float"),
           "3xtf32": (numpy.float32, "highest", "Tf32x3")}
SHARED_BYTES = {"forward": ops.forward_shared_bytes, "dk_dv": ops.dk_dv_shared_bytes, "dq": ops.dq_shared_bytes}


def causal_flop(shape, products):
    """FLOP of `products` causal T x T x d products over all B H query heads: half of 2 T² d each."""
    B, H, _, T, d = shape
    return products * B * H * T * T * d


def arrays(shape, dtype=bfloat16, seed=0):
    """q, k, v, dout as backend arrays of dtype: q, dout (B, H, T, d), k, v (B, H_kv, T, d)."""
    B, H, H_kv, T, d = shape
    random = numpy.random.default_rng(seed)
    return [backend.xp.asarray(random.standard_normal(s, dtype=numpy.float32).astype(dtype))
            for s in ((B, H, T, d), (B, H_kv, T, d), (B, H_kv, T, d), (B, H, T, d))]


def ours(shape):
    """{name: run}: the op forward, and forward + backward, in each format."""
    runs = {}
    for fmt, (dtype, precision, _) in FORMATS.items():
        q, k, v, dout = arrays(shape, dtype)

        def forward(q=q, k=k, v=v, precision=precision):
            return ops.tensor_core_attention_forward(q, k, v, precision=precision)

        def both(q=q, k=k, v=v, dout=dout, precision=precision):
            out, lse = ops.tensor_core_attention_forward(q, k, v, precision=precision)
            ops.tensor_core_attention_backward(dout, q, k, v, out, lse, precision=precision)

        runs[f"tensor cores {fmt}, {FORWARD}"] = forward
        runs[f"tensor cores {fmt}, {BOTH}"] = both
    return runs


def chapter_08(shape):
    """{name: run, or why it does not run}: chapter 08's fused float32 kernels."""
    B, H, H_kv, T, d = shape
    names = [f"chapter 08 fused float32, {FORWARD}", f"chapter 08 fused float32, {BOTH}"]
    if d not in FLOAT32_HEAD_SIZES or H_kv != H:
        why = f"not run: chapter 08's kernels take d in {FLOAT32_HEAD_SIZES} and one key/value head per query head"
        return dict.fromkeys(names, why)
    random = backend.xp.random.default_rng(0)
    q, k, v, dout = (random.standard_normal((B, H, T, d), dtype=numpy.float32) for _ in range(4))

    def both():
        out, lse = attention_forward(q, k, v)
        attention_backward(dout, q, k, v, out, lse)

    return {names[0]: lambda: attention_forward(q, k, v), names[1]: both}


def torch_runs(shape):
    """{name: run, or a note}: PyTorch's scaled_dot_product_attention on bf16 tensors and on float32 ones with
    TF32 allowed; {} without PyTorch."""
    torch = torch_or_none()
    if torch is None or backend.name != "cuda":
        return {}
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    runs = {}
    for fmt, dtype in (("bf16", torch.bfloat16), ("float32 (TF32 allowed)", torch.float32)):
        runs.update(_torch_sdpa(torch, shape, fmt, dtype))
    return runs


def _torch_sdpa(torch, shape, fmt, dtype):
    B, H, H_kv, T, d = shape
    generator = torch.Generator(device="cuda").manual_seed(0)

    def tensor(heads):
        return torch.randn(B, heads, T, d, device="cuda", generator=generator, dtype=dtype)

    q, k, v, dout = tensor(H), tensor(H_kv), tensor(H_kv), tensor(H)
    sdpa, options, how = torch.nn.functional.scaled_dot_product_attention, {}, ""
    if H_kv != H:
        try:
            sdpa(q[:, :, :16], k[:, :, :16], v[:, :, :16], is_causal=True, enable_gqa=True)
            options = {"enable_gqa": True}
            how = " (enable_gqa=True)"
        except TypeError:  # a PyTorch before enable_gqa: K and V repeated per head, outside the timing
            k, v = (x.repeat_interleave(H // H_kv, dim=1) for x in (k, v))
            how = " (K, V repeated per head before timing)"
    for x in (q, k, v):
        x.requires_grad_(True)

    def forward():
        with torch.no_grad():
            sdpa(q, k, v, is_causal=True, **options)

    def both():
        q.grad = k.grad = v.grad = None
        sdpa(q, k, v, is_causal=True, **options).backward(dout)

    return {f"torch sdpa {fmt}{how}, {FORWARD}": forward, f"torch sdpa {fmt}{how}, {BOTH}": both}


def kernel_runs(shape):
    """({name: (run, products), or a note}, {name: registers}): each of our kernels alone, in each format, with
    every candidate tile shape; and the registers and local-memory bytes (spills) of each kernel that runs."""
    runs, registers = {}, {}
    for fmt in FORMATS:
        format_runs, format_registers = _format_kernel_runs(shape, fmt)
        runs.update(format_runs)
        registers.update(format_registers)
    return runs, registers


KERNEL_NAMES = {"forward": "tensor_core_attention_forward", "dk_dv": "tensor_core_attention_backward_dk_dv",
                "dq": "tensor_core_attention_backward_dq"}


def _format_kernel_runs(shape, fmt):
    B, H, H_kv, T, d = shape
    dtype, precision, kernel_format = FORMATS[fmt]
    q, k, v, dout = arrays(shape, dtype)
    xp, scale = backend.xp, numpy.float32(d ** -0.5)
    out, lse = ops.tensor_core_attention_forward(q, k, v, precision=precision)
    row_dot = xp.empty((B, H, T), dtype=numpy.float32)
    dq, dk, dv = xp.empty_like(q), xp.empty_like(k), xp.empty_like(v)
    defaults = {"forward": ops.FORWARD_TILES[kernel_format][d], "dk_dv": ops.DK_DV_TILES[kernel_format][d],
                "dq": ops.DQ_TILES[kernel_format][d]}
    launches = {"forward": lambda tiles: ops._forward(out, lse, q, k, v, True, scale, *tiles, kernel_format),
                "dk_dv": lambda tiles: ops._dk_dv(dk, dv, dout, q, k, v, lse, row_dot, True, scale, *tiles,
                                                  kernel_format),
                "dq": lambda tiles: ops._dq(dq, dout, q, k, v, lse, row_dot, True, scale, *tiles, kernel_format)}
    rows = {"forward": "queries", "dk_dv": "keys", "dq": "queries"}     # what a warp owns 16 of per strip
    other = {"forward": "keys", "dk_dv": "queries", "dq": "keys"}      # what a tile holds
    runs = {f"kernel {fmt} row_dot": (lambda: ops._row_dot(row_dot, dout, out), KERNEL_PRODUCTS["row_dot"])}
    registers = {}
    ops._row_dot(row_dot, dout, out)
    for kernel, candidates in ops.TILE_CANDIDATES.items():
        for warps, tile, strips in candidates:
            used = " (the op's)" if (warps, tile, strips) == defaults[kernel] else ""
            name = (f"kernel {fmt} {kernel}, {warps} warps of {16 * strips} {rows[kernel]}, {tile} {other[kernel]}"
                    f"{used}")
            shared = SHARED_BYTES[kernel](d, warps, tile, strips, numpy.dtype(dtype).itemsize)
            if shared > SHARED_BYTES_PER_BLOCK:
                runs[name] = f"not run: {shared // 1024} KB of shared memory, above a block's {SHARED_BYTES_PER_BLOCK // 1024}"
                continue
            runs[name] = (lambda launch=launches[kernel], tiles=(warps, tile, strips): launch(tiles),
                          KERNEL_PRODUCTS[kernel])
            compiled = ops._kernel(KERNEL_NAMES[kernel], kernel_format, d, warps, tile, strips, shared)
            if hasattr(compiled, "num_regs"):   # CuPy's kernels; the CPU executor has no registers to count
                registers[name] = {"registers": compiled.num_regs, "spilled bytes": compiled.local_size_bytes}
    return runs, registers


def float64_reference(q, k, v, dout):
    """out, dq, dk, dv of causal attention with scale 1/√d, in float64 on the backend, from (heads, T, d) arrays."""
    xp = backend.xp
    q, k, v, dout = (x.astype(numpy.float64) for x in (q, k, v, dout))
    T, d = q.shape[-2:]
    scale = d ** -0.5
    scores = scale * q @ xp.swapaxes(k, -1, -2)
    scores = xp.where(xp.tril(xp.ones((T, T), dtype=bool)), scores, -xp.inf)
    p = xp.exp(scores - scores.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    dp = dout @ xp.swapaxes(v, -1, -2)
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True))
    return p @ v, scale * ds @ k, scale * xp.swapaxes(ds, -1, -2) @ q, xp.swapaxes(p, -1, -2) @ dout


def float32_errors(shape):
    """{way: {result: max |error| / max |reference|}} of TF32, 3xTF32 and chapter 08's float32 kernels against
    float64, all from the same float32 inputs, on the first ERROR_HEADS heads of batch element 0 (H_kv = H)."""
    B, H, H_kv, T, d = shape
    q, k, v, dout = arrays(shape, numpy.float32)
    head = (0, slice(0, ERROR_HEADS))
    references = float64_reference(*(x[head] for x in (q, k, v, dout)))

    def tensor_cores(precision):
        out, lse = ops.tensor_core_attention_forward(q, k, v, precision=precision)
        return (out, *ops.tensor_core_attention_backward(dout, q, k, v, out, lse, precision=precision))

    def chapter_08_kernels():
        out, lse = attention_forward(q, k, v)
        return (out, *attention_backward(dout, q, k, v, out, lse))

    ways = {"tensor cores tf32": lambda: tensor_cores("high"), "tensor cores 3xtf32": lambda: tensor_cores("highest")}
    if d in FLOAT32_HEAD_SIZES and H_kv == H:
        ways["chapter 08 fused float32"] = chapter_08_kernels
    errors = {}
    for way, run in ways.items():
        results = run()
        errors[way] = {name: float(abs(result[head].astype(numpy.float64) - reference).max() / abs(reference).max())
                       for name, result, reference in zip(("out", "dq", "dk", "dv"), results, references)}
    return errors


def timed(runs, flop, tiny=False):
    """({name: seconds, or a note}, {name: TFLOP/s}) of {name: run, or a note}; tiny: each run once, untimed.
    flop(name): the FLOP one run does, or None."""
    seconds, tflops = {}, {}
    for name, run in runs.items():
        if isinstance(run, str):
            seconds[name] = run
        elif tiny:
            run()
        else:
            seconds[name] = benchmark.seconds_per_call(run, warmup=2, repeat=10)
            tflops[name] = benchmark.tflops(flop(name), seconds[name]) if flop(name) else None
    if backend.name == "cuda":
        backend.xp.get_default_memory_pool().free_all_blocks()
    return seconds, tflops


def measure_shape(shape, tiny=False):
    """Ours, chapter 08's and PyTorch's, forward and forward + backward, at one shape."""
    runs = {**ours(shape), **chapter_08(shape), **torch_runs(shape)}
    return timed(runs, lambda name: causal_flop(shape, CAUSAL_HALF_PRODUCTS[name.rsplit(", ", 1)[1]]), tiny)


def measure_kernels(shape, tiny=False):
    """Each of our kernels alone, with every candidate tile shape, at one shape; and their registers."""
    runs, registers = kernel_runs(shape)
    products = {name: run[1] for name, run in runs.items() if not isinstance(run, str)}
    seconds, tflops = timed({name: run if isinstance(run, str) else run[0] for name, run in runs.items()},
                            lambda name: causal_flop(shape, products[name]), tiny)
    return seconds, tflops, registers


def shape_report(shape_name, seconds, tflops, registers=None):
    """Lines of the table for one shape: each run's time and TFLOP/s (and registers), then ours against the
    others."""
    B, H, H_kv, T, d = SHAPES[shape_name]
    lines = [f"  {shape_name}: B={B} H={H} H_kv={H_kv} T={T} d={d}"]
    for name, s in seconds.items():
        if isinstance(s, str):
            lines.append(f"    {name:<62s} {s}")
            continue
        rate = f"{tflops[name]:7.1f} TFLOP/s" if tflops.get(name) else ""
        used = (registers or {}).get(name)
        used = f"  {used['registers']} registers, {used['spilled bytes']} bytes spilled" if used else ""
        lines.append(f"    {name:<62s} {s * 1e3:9.3f} ms {rate}{used}")
    for fmt, other in (("bf16", "torch sdpa bf16"), ("bf16", "chapter 08 fused float32"),
                       ("tf32", "torch sdpa float32 (TF32 allowed)"), ("tf32", "chapter 08 fused float32"),
                       ("3xtf32", "chapter 08 fused float32"), ("3xtf32", "tensor cores tf32")):
        for part in (FORWARD, BOTH):
            mine = seconds.get(f"tensor cores {fmt}, {part}")
            theirs = [s for name, s in seconds.items() if name.startswith(other) and name.endswith(f", {part}")]
            if mine and theirs and isinstance(theirs[0], float):
                lines.append(f"    ours {fmt} vs {other}, {part}: {theirs[0] / mine:.2f}x (above 1: ours faster)")
    return lines


def error_report(shape_name, errors):
    lines = [f"  {shape_name}, max |error| / max |reference| against float64 on {ERROR_HEADS} heads:"]
    for way, results in errors.items():
        lines.append(f"    {way:<30s} " + "  ".join(f"{name} {error:.2e}" for name, error in results.items()))
    return lines


def main():
    tiny = "--tiny" in sys.argv[1:]
    if tiny:
        for shape in TINY_SHAPES.values():
            measure_shape(shape, tiny=True)
            measure_kernels(shape, tiny=True)
            if shape[1] == shape[2]:   # float32_errors' reference has one key/value head per query head
                float32_errors(shape)
        print(f"every run went through once at {TINY_SHAPES} on the {backend.name} backend")
        return 0
    benchmark.require_gpu()
    torch = torch_or_none()
    measured = {**benchmark.measured_on(), "torch": torch.__version__ if torch is not None else None,
                "shapes": {name: dict(zip(("B", "H", "H_kv", "T", "d"), shape)) for name, shape in SHAPES.items()},
                "tiles": {"forward": ops.FORWARD_TILES, "dk_dv": ops.DK_DV_TILES, "dq": ops.DQ_TILES},
                "seconds": {}, "tflops": {}, "registers": {}, "errors": {}}
    print(f"{measured['device']}, {measured['date']}: causal attention, bf16, TF32 and 3xTF32 (chapter 08: "
          f"float32), PyTorch {measured['torch'] or 'not installed'}")
    path = Path(__file__).with_suffix(".json")
    # GPT-2's shape first (the comparisons, the errors, each kernel's candidates), then Llama's; the file is
    # written after each step, so that a run cut short keeps what it measured.
    steps = ([(ERROR_SHAPE, float32_errors)] + [(name, measure_shape) for name in SHAPES if name == ERROR_SHAPE]
             + [(name, measure_kernels) for name in KERNEL_SHAPES]
             + [(name, measure_shape) for name in SHAPES if name != ERROR_SHAPE])
    for name, measure in steps:
        if measure is float32_errors:
            measured["errors"][name] = errors = float32_errors(SHAPES[name])
            print("\n".join(error_report(name, errors)), flush=True)
            benchmark.write_results(path, measured)
            continue
        seconds, tflops, *registers = measure(SHAPES[name])
        registers = registers[0] if registers else {}
        measured["seconds"].setdefault(name, {}).update(seconds)
        measured["tflops"].setdefault(name, {}).update(tflops)
        if registers:
            measured["registers"].setdefault(name, {}).update(registers)
        print("\n".join(shape_report(name, seconds, tflops, registers)), flush=True)
        benchmark.write_results(path, measured)
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
