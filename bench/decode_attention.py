"""The decode kernels (gpt2_cupy.ops.decode_attention) on a GPU: one new token's attention over a bf16 KV cache.

    python -m bench.decode_attention                  checks, then times; prints a table, writes nothing
    python -m bench.decode_attention --write          ... and writes bench/decode_attention.json
    python -m bench.decode_attention --baseline FILE  ... and times another implementation beside ours: a Python
                                                      file with decode_attention_forward(q, keys, values, length,
                                                      *, out=None) (an older version of the op, say)
    python -m bench.decode_attention --sweep          ... and times other choices of ours (SWEEP: warps per block,
                                                      chunks, who merges them)
    python -m bench.decode_attention --check          the checks only (they run on the CPU executor too)

What generation runs at every layer and step: B = 1, one new position, the length read from a device array, the
launches replayed from a CUDA graph. Shapes (SHAPES): Llama 3.2 1B's heads (32 query heads, 8 key-value heads of
64), Llama 2 7B's (32 and 32, of 128), the same at batch 8 and 4, and the 1B shape with a long cache; a cache of
700 positions filled to 600 unless said. Each is timed two ways:
- cold: a graph of one forward per layer over as many layers as fill COLD_BYTES of caches, several times the L2
  cache, so that every layer reads its keys and values from DRAM, as in a model whose weights flush the L2
  between layers; µs per forward = the graph's time over the layers;
- hot: HOT_REPEATS forwards over one layer's cache in a graph (the cache stays in L2).
At batch 1 the cache of a 1B layer is 1.2 MB, 0.3 µs at the H200's bandwidth: the time is latency (launches and
the chains of memory round trips inside them), which the table shows beside the bytes' time at the copy bandwidth.

The checks first: our forward against a float64 numpy reference, bf16 and float32, at the 1B and 7B shapes with
one and three new positions, the length given as an int, as a device array, and through a captured graph replayed
as the device length grows; with the chunks merged as the op chooses, always by a second launch, and always by the
last block.

Measured on an H100 80GB HBM3 (the kernel before this design as the baseline, cold, µs per forward): 1b 15.4 ->
6.8, 7b 14.4 -> 9.0, 1b batch 8 21.2 -> 11.1, 7b batch 4 27.8 -> 18.8, 1b long 20.1 -> 10.9.
"""

import argparse
import importlib.util
import math
from contextlib import contextmanager

import numpy as np

from gpt2_cupy import backend, benchmark
from gpt2_cupy.elementwise import converted
from gpt2_cupy.graphs import CUDAGraph, graph, graph_pool_handle, use_pool
from gpt2_cupy.ops import decode_attention as decode_ops
from gpt2_cupy.ops.arrays import BFLOAT16
from gpt2_cupy.testing import relative_error

SHAPES = {  # name: (B, H, H_kv, d, capacity, length)
    "1b": (1, 32, 8, 64, 700, 600),
    "7b": (1, 32, 32, 128, 700, 600),
    "1b batch 8": (8, 32, 8, 64, 700, 600),
    "7b batch 4": (4, 32, 32, 128, 700, 600),
    "1b long": (1, 32, 8, 64, 4096, 4000),
}
CHECKS = [  # (B, H, H_kv, n, capacity, length, d)
    (1, 32, 8, 1, 700, 600, 64), (1, 32, 8, 3, 700, 600, 64),
    (1, 32, 32, 1, 650, 600, 128), (1, 32, 32, 3, 650, 600, 128),
    (2, 8, 2, 1, 300, 299, 80),
]
IN_LAST_BLOCK = {"merge_in_last_block": lambda splits, *_: splits > 1}
BY_A_LAUNCH = {"MERGE_IN_LAST_BLOCK": False}
SWEEP = {  # name: {attribute of gpt2_cupy.ops.decode_attention: value}
    "4 warps": {"WIDE_WARPS": 4},
    "8 warps": {"WARPS": 8},
    "merged by a second launch": BY_A_LAUNCH,
    "merged in the last block": IN_LAST_BLOCK,
    "at most 8 chunks": {"MOST_SPLITS": 8},
    "2 blocks per SM": {"BLOCKS_PER_MULTIPROCESSOR": 2},
    "8 blocks per SM": {"BLOCKS_PER_MULTIPROCESSOR": 8},
}
COLD_BYTES = 256 * 2**20     # caches per cold graph: several times an H100's or H200's 50 MB of L2
HOT_REPEATS = 50
BF16_ROUNDING = 2.0 ** -8


def reference(q, keys, values, length):
    """(B, H, n, d) in float64: softmax(q kᵀ / √d) v over keys 0 .. length - n + i for new position i."""
    q, keys, values = (np.asarray(a, dtype=np.float64) for a in (q, keys, values))
    n, d = q.shape[-2:]
    group = q.shape[1] // keys.shape[1]
    keys, values = (np.repeat(a[:, :, :length], group, axis=1) for a in (keys, values))
    scores = q @ np.swapaxes(keys, -1, -2) / math.sqrt(d)
    scores = np.where(np.arange(length)[None, :] > (length - n + np.arange(n))[:, None], -np.inf, scores)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return weights / weights.sum(axis=-1, keepdims=True) @ values


def check(forward, cases=CHECKS, dtypes=(np.float32, BFLOAT16)):
    """(lines of text, one per case; whether every result is within its tolerance of the float64 reference)."""
    xp, rng, lines, good = backend.xp, np.random.default_rng(0), [], True
    for (B, H, key_heads, n, capacity, length, d) in cases:
        for dtype in dtypes:
            tolerance = 1e-5 if dtype == np.float32 else 2 * BF16_ROUNDING
            q = rng.normal(size=(B, H, n, d)).astype(dtype)
            keys, values = (rng.normal(size=(B, key_heads, capacity, d)).astype(dtype) for _ in range(2))
            keys[:, :, length:] = values[:, :, length:] = np.nan  # never to be read
            device = [xp.asarray(a) for a in (q, keys, values)]
            device_length = xp.asarray(np.array([length], np.int32))
            errors = [relative_error(backend.asnumpy(forward(*device, given)), reference(q, keys, values, length))
                      for given in (length, device_length)]
            # One capture, replayed as the device length grows (the cache was filled ahead of it).
            pool, captured = graph_pool_handle(), CUDAGraph()
            with use_pool(pool):
                out = forward(*device, device_length)
            with graph(captured, pool=pool):
                forward(*device, device_length, out=out)
            for grown in (n, length // 2, length, length):
                backend.copy_into(device_length, np.array([grown], np.int32))
                captured.replay()
                errors.append(relative_error(backend.asnumpy(out), reference(q, keys, values, grown)))
            ok = max(errors) < tolerance  # NaN fails too
            good = good and ok
            name = f"B={B} H={H} H_kv={key_heads} n={n} d={d} capacity={capacity} length={length} {np.dtype(dtype).name}"
            lines.append(f"  {name:<70s} largest relative error {max(errors):.2e} (tolerance {tolerance:.0e})"
                         + ("" if ok else "   FAILED"))
    return lines, good


def cache_arrays(shape, layers):
    """(q, keys, values) per layer, bf16 on the device, drawn there."""
    B, H, key_heads, d, capacity, _ = SHAPES[shape]
    random = backend.xp.random.default_rng(0)

    def normal(*size):
        return converted(random.standard_normal(size, dtype=np.float32), BFLOAT16)

    return [(normal(B, H, 1, d), normal(B, key_heads, capacity, d), normal(B, key_heads, capacity, d))
            for _ in range(layers)]


def captured_forwards(forward, layers_arrays, length, repeats):
    """A CUDAGraph of `repeats` passes over the layers, one forward each, and the outputs it writes."""
    pool, captured = graph_pool_handle(), CUDAGraph()
    with use_pool(pool):
        outs = [forward(q, keys, values, length) for q, keys, values in layers_arrays]
    with graph(captured, pool=pool):
        for _ in range(repeats):
            for (q, keys, values), out in zip(layers_arrays, outs):
                forward(q, keys, values, length, out=out)
    return captured, outs


def seconds_per_forward(forward, shape, cold, arrays_by_layers):
    """Median GPU seconds of one forward replayed from a graph, cold (a layer's cache read from DRAM) or hot."""
    *_, length = SHAPES[shape]
    device_length = backend.xp.asarray(np.array([length], np.int32))
    layers_arrays = arrays_by_layers if cold else arrays_by_layers[:1]
    repeats = 1 if cold else HOT_REPEATS
    captured, _ = captured_forwards(forward, layers_arrays, device_length, repeats)
    if not benchmark.meaningful():  # the CPU executor: the graph replays once, nothing is timed
        captured.replay()
        return float("nan")
    return benchmark.seconds_per_call(captured.replay, repeat=15) / (len(layers_arrays) * repeats)


def layer_bytes(shape):
    B, H, key_heads, d, capacity, _ = SHAPES[shape]
    return 2 * B * key_heads * capacity * d * 2


def read_bytes(shape):
    """Bytes a forward must read at least: the keys and values of `length` positions, bf16."""
    B, H, key_heads, d, _, length = SHAPES[shape]
    return 2 * B * key_heads * length * d * 2


@contextmanager
def settings(changes):
    """The op's module attributes changed inside the block."""
    saved = {name: getattr(decode_ops, name) for name in changes}
    for name, value in changes.items():
        setattr(decode_ops, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(decode_ops, name, value)


def partial_only(q, keys, values, length, *, out=None):
    """Our first kernel alone (its partial results not merged): what the combine adds is the difference."""
    out = backend.xp.empty_like(q) if out is None else out
    B, H, n, d = q.shape
    launch = decode_ops.Launch.of(q, keys, values, d, B * keys.shape[1], H // keys.shape[1] * n, keys.shape[2],
                                  length, 0)
    partials = launch.partial_buffers()
    decode_ops._partial(launch, out, *partials, None, q, keys, values, length, 0, n)
    return out


def load_baseline(path):
    spec = importlib.util.spec_from_file_location("decode_attention_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.decode_attention_forward


def launch_shape(shape):
    B, H, key_heads, d, capacity, _ = SHAPES[shape]
    launch = decode_ops.Launch(BFLOAT16, d, B * key_heads, H // key_heads, capacity, True)
    merge = "" if launch.splits == 1 else ", merged in 1 launch" if launch.merge_in_last_block else ", 2 launches"
    return f"{launch.splits} chunks of {launch.chunk}, {launch.warps} warps{merge}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="the checks only")
    parser.add_argument("--write", action="store_true", help="write bench/decode_attention.json")
    parser.add_argument("--baseline", help="a Python file with another decode_attention_forward to time")
    parser.add_argument("--sweep", action="store_true", help="also time other chunkings of ours")
    parser.add_argument("--shape", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--dry-run", action="store_true", help="build and replay every graph once, time nothing "
                        "(what the CPU executor can do)")
    args = parser.parse_args(argv)

    ours = decode_ops.decode_attention_forward
    failed = []
    for name, changes in (("ours", {}), ("ours, merged by a second launch", BY_A_LAUNCH),
                          ("ours, merged in the last block", IN_LAST_BLOCK)):
        print(f"{benchmark.measured_on()['device']}: {name} against float64")
        with settings(changes):
            lines, good = check(ours)
        print("\n".join(lines))
        failed += [] if good else [name]
    if args.check:
        raise SystemExit(f"checks FAILED: {', '.join(failed)}" if failed else 0)
    if not args.dry_run:
        benchmark.require_gpu()
    baseline = load_baseline(args.baseline) if args.baseline else None
    if baseline is not None:
        print(f"baseline {args.baseline}: against float64 at the timed shapes")
        lines, good = check(baseline, [CHECKS[0], CHECKS[2]], (BFLOAT16,))
        print("\n".join(lines))
        failed += [] if good else ["baseline"]

    copy = benchmark.copy_bandwidth() if benchmark.meaningful() else float("nan")
    results = {"copy_GB_per_s": copy / 1e9, "shapes": {}}
    arrays = {}  # shape: the cold graphs' layers
    for shape in args.shape:
        layers = 2 if args.dry_run else max(1, math.ceil(COLD_BYTES / layer_bytes(shape)))
        arrays[shape] = cache_arrays(shape, layers)
        timed = {"ours": ours, "ours, first kernel alone": partial_only}
        if baseline is not None:
            timed["baseline"] = baseline
        entry = {"shape": dict(zip(("B", "H", "H_kv", "d", "capacity", "length"), SHAPES[shape])),
                 "layers_cold": layers, "launch": launch_shape(shape), "bytes_read": read_bytes(shape),
                 "bytes_time_us": read_bytes(shape) / copy * 1e6, "us": {}}
        for name, forward in timed.items():
            entry["us"][name] = {kind: seconds_per_forward(forward, shape, kind == "cold", arrays[shape]) * 1e6
                                 for kind in ("cold", "hot")}
        results["shapes"][shape] = entry
    table = summary(results, baseline is not None, failed)
    print("\n".join(table), flush=True)

    if args.sweep:
        print("\nour kernels with other chunkings (µs per forward, cold):")
        for shape in args.shape:
            entry = results["shapes"][shape]
            entry["sweep_cold_us"] = {"as is": entry["us"]["ours"]["cold"]}
            for name, changes in SWEEP.items():
                with settings(changes):
                    launch = launch_shape(shape)
                    microseconds = seconds_per_forward(ours, shape, True, arrays[shape]) * 1e6
                entry["sweep_cold_us"][name] = microseconds
                print(f"  {shape:<11s} {name:<28s} {launch:<50s} {microseconds:6.2f} µs", flush=True)
    del arrays

    if args.write and benchmark.meaningful() and not failed:
        benchmark.report("decode_attention", results, table)
    else:
        print("\n".join(table))
    if failed:
        raise SystemExit(1)


def summary(results, with_baseline, failed):
    """The table's lines: µs per forward at each shape, ours and the baseline's."""
    table = [f"\n{benchmark.measured_on()['device']}, bf16, one new token, µs per forward replayed in a CUDA graph "
             "(cold: caches from DRAM; hot: from L2)"]
    header = f"  {'shape':<11s} {'bytes at copy BW':>16s} {'ours cold':>10s} {'hot':>6s} {'1st kernel':>10s}"
    if with_baseline:
        header += f" {'baseline cold':>13s} {'hot':>6s} {'speed-up cold':>13s}"
    table.append(header + "   our launch")
    for shape, entry in results["shapes"].items():
        us = entry["us"]
        line = (f"  {shape:<11s} {entry['bytes_time_us']:14.2f}µs {us['ours']['cold']:8.2f}µs "
                f"{us['ours']['hot']:5.2f} {us['ours, first kernel alone']['cold']:9.2f}")
        if with_baseline:
            line += (f" {us['baseline']['cold']:12.2f}µs {us['baseline']['hot']:5.2f} "
                     f"{us['baseline']['cold'] / us['ours']['cold']:12.1f}x")
        table.append(line + f"   {entry['launch']}")
    if failed:
        table.append(f"  checks FAILED: {', '.join(failed)}")
    return table

if __name__ == "__main__":
    main()
