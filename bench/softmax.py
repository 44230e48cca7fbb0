"""Achieved bandwidth of chapter 04's softmax kernels on a GPU, against the copy, PyTorch and CuPy.

    python -m bench.softmax          prints a table and writes bench/softmax.json

Two shapes: GPT-2's attention scores, (B·H·T, T) = (8·12·1024, 1024), and its logits, (B·T, V) =
(8·1024, 50257). Bytes counted are what each direction must move: the forward reads x and writes y
(8 bytes per element), the backward reads dout and y and writes dx (12 bytes per element); the causal
forward reads only the lower triangle (about half of x) and writes all of y. GB/s is those bytes over the
median time per call, next to the device's copy bandwidth (benchmark.copy_bandwidth()). "forward" and
"backward" are what the package runs. At the logits shape the long-row kernels also run one by one: the
shared-memory kernels (the row read from global memory once; the package's choice when the row fits) and
the two-pass kernels (the row read twice; the fallback), each with several grids (one block per row, or
1 or 2 blocks per multiprocessor, each looping over rows), and the shared-memory kernels compiled with
the other number of float4 loads in flight per thread: 8 for the forward (the package's: 4), 4 for the
backward (the package's: 8 of each array). At the attention shape the warp-per-row kernels run one by one
too: the package's float4 kernels (softmax_*_warp<4, 8>) next to the one-float-per-load ones they replaced
(softmax_*_warp<1, 32>), in blocks of 4 warps as well as the package's 8, and the forward compiled with
-DFORWARD_WARP_ROW_BLOCKS=3 and 6 (the package's: 5), registers for that many blocks of 256 threads per
multiprocessor.
"""

import numpy as np

from bench import softmax_variants
from gpt2_cupy import backend, benchmark, kernels
from gpt2_cupy.ops import softmax as softmax_ops
from gpt2_cupy.ops.arrays import WARP_SIZE, ceil_div
from gpt2_cupy.ops.softmax import softmax_backward, softmax_forward
from gpt2_cupy.testing import torch_or_none

SHAPES = {"attention scores (8*12*1024, 1024)": (8 * 12 * 1024, 1024),
          "logits (8*1024, 50257)": (8 * 1024, 50257)}
FLOAT = 4  # bytes


# The shared-memory kernels compiled with the other number of float4 loads in flight per thread.
OTHER_LOADS_IN_FLIGHT = {"forward": ("-DVECTORS_PER_STEP=8", 8), "backward": ("-DBACKWARD_VECTORS_PER_STEP=4", 4)}


def other_loads_in_flight(direction):
    """softmax_{direction}_shared compiled with OTHER_LOADS_IN_FLIGHT[direction]'s option."""
    option, _ = OTHER_LOADS_IN_FLIGHT[direction]
    kernel = kernels.function("softmax", f"softmax_{direction}_shared", options=(option,),
                              name_expressions=softmax_ops.NAMES)
    kernel.max_dynamic_shared_size_bytes = (backend.shared_memory_per_block()
                                            - softmax_ops.REDUCTION_SHARED_BYTES)
    return kernel


# The forward warp kernels compiled to fit another number of 256-thread blocks per multiprocessor.
OTHER_FORWARD_BLOCKS = (3, 6)


def warp_rows(direction, columns, width, warps_per_block, options=()):
    """launch(rows, *arguments): softmax_{direction}_warp<width, K> over `rows` rows, a warp each, in blocks
    of warps_per_block warps; arguments are the kernel's own, outputs first."""
    kernel = softmax_variants.warp_kernel(direction, columns, width, options)

    def launch(rows, *arguments):
        kernel((ceil_div(rows, warps_per_block),), (warps_per_block * WARP_SIZE,), arguments)

    return launch


def warp_row_candidates(x, y, dout, dx, rows, columns, forward_bytes, backward_bytes):
    """The warp-per-row kernels one by one: {name: (bytes moved, function that runs it once)}."""
    one, no_causal = np.float32(1.0), np.int32(0)
    sizes = (np.int32(rows), np.int32(columns))
    variants = {"one float per load": (1, softmax_ops.WARPS_PER_BLOCK),
                "float4, 8 warps per block": (4, softmax_ops.WARPS_PER_BLOCK),
                "float4, 4 warps per block": (4, 4)}
    runs = {}
    for label, (width, warps) in variants.items():
        forward = warp_rows("forward", columns, width, warps)
        backward = warp_rows("backward", columns, width, warps)
        runs[f"forward, {label}"] = (forward_bytes, lambda f=forward: f(rows, y, x, *sizes, one, no_causal))
        runs[f"backward, {label}"] = (backward_bytes, lambda b=backward: b(rows, dx, dout, y, *sizes, one))
    for blocks in OTHER_FORWARD_BLOCKS:
        option = f"-DFORWARD_WARP_ROW_BLOCKS={blocks}"
        forward = warp_rows("forward", columns, 4, softmax_ops.WARPS_PER_BLOCK, (option,))
        runs[f"forward, float4, registers for {blocks} blocks per SM"] = (
            forward_bytes, lambda f=forward: f(rows, y, x, *sizes, one, no_causal))
    return runs


def candidates(rows, columns, cupy):
    """{name: (bytes moved, function that runs it once)} for a (rows, columns) float32 input."""
    random = cupy.random.default_rng(0)
    x = random.standard_normal((rows, columns), dtype=cupy.float32)
    dout = random.standard_normal((rows, columns), dtype=cupy.float32)
    y, dx = cupy.empty_like(x), cupy.empty_like(x)
    elements = rows * columns
    forward_bytes, backward_bytes = 2 * elements * FLOAT, 3 * elements * FLOAT
    softmax_forward(x, out=y)
    runs = {
        "forward": (forward_bytes, lambda: softmax_forward(x, out=y)),
        "backward": (backward_bytes, lambda: softmax_backward(dout, y, out=dx)),
    }
    if columns <= softmax_ops.LONGEST_WARP_ROW:
        runs.update(warp_row_candidates(x, y, dout, dx, rows, columns, forward_bytes, backward_bytes))
    if columns > softmax_ops.LONGEST_WARP_ROW:  # the long-row kernels, each with its grids
        one, no_causal = np.float32(1.0), np.int32(0)
        grids = {"shared memory": ((0, "one block per row"), (1, "1 block per SM")),
                 "two passes": ((0, "one block per row"), (1, "1 block per SM"), (2, "2 blocks per SM"))}
        for kernel, kernel_grids in grids.items():
            shared = kernel == "shared memory"
            for per_multiprocessor, label in kernel_grids:
                runs[f"forward, {kernel}, {label}"] = (forward_bytes, lambda p=per_multiprocessor, s=shared:
                    softmax_variants.forward(y, x, rows, columns, one, no_causal, blocks_per_multiprocessor=p,
                                             shared_memory=s))
                runs[f"backward, {kernel}, {label}"] = (backward_bytes, lambda p=per_multiprocessor, s=shared:
                    softmax_variants.backward(dx, dout, y, rows, columns, one, blocks_per_multiprocessor=p,
                                              shared_memory=s))
        shared_bytes = softmax_ops.cached_row_bytes(columns)
        other = {direction: other_loads_in_flight(direction) for direction in ("forward", "backward")}
        loads = {direction: count for direction, (_, count) in OTHER_LOADS_IN_FLIGHT.items()}
        runs[f"forward, shared memory, {loads['forward']} float4 loads in flight"] = (forward_bytes, lambda: other["forward"](
            (rows,), (softmax_ops.THREADS_PER_LONG_ROW,), (y, x, np.int32(rows), np.int32(columns), one, no_causal),
            shared_mem=shared_bytes))
        runs[f"backward, shared memory, {loads['backward']} float4 loads in flight"] = (backward_bytes, lambda: other["backward"](
            (rows,), (softmax_ops.THREADS_PER_LONG_ROW,), (dx, dout, y, np.int32(rows), np.int32(columns), one),
            shared_mem=shared_bytes))
    if rows % columns == 0:  # square blocks of rows: the causal version applies
        T = columns
        read = rows // T * T * (T + 1) // 2 * FLOAT
        x_square = x.reshape(rows // T, T, T)
        y_square = y.reshape(rows // T, T, T)
        runs["forward, causal"] = (read + elements * FLOAT,
                                   lambda: softmax_forward(x_square, causal=True, out=y_square))
        if columns <= softmax_ops.LONGEST_WARP_ROW:
            runs["forward, causal, one float per load"] = (read + elements * FLOAT, lambda: softmax_variants.forward(
                y, x, rows, columns, np.float32(1.0), np.int32(1), width=1))

    def cupy_softmax():
        e = cupy.exp(x - x.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)

    runs["cupy: exp(x - max) / sum, forward"] = (forward_bytes, cupy_softmax)
    runs["cupy: y * (dout - sum(dout * y)), backward"] = (
        backward_bytes, lambda: y * (dout - (dout * y).sum(axis=-1, keepdims=True)))
    torch = torch_or_none()
    if torch is None:
        return runs
    x_torch, y_torch, dout_torch = (torch.from_dlpack(a) for a in (x, y, dout))
    runs["torch.softmax, forward"] = (forward_bytes, lambda: torch.softmax(x_torch, dim=-1))
    runs["torch softmax backward (_softmax_backward_data)"] = (
        backward_bytes, lambda: torch._softmax_backward_data(dout_torch, y_torch, -1, torch.float32))
    return runs


def measure():
    benchmark.require_gpu()
    cupy = backend.xp
    results = {}
    for label, (rows, columns) in SHAPES.items():
        results[label] = {}
        for name, (bytes_moved, run) in candidates(rows, columns, cupy).items():
            results[label][name] = benchmark.gigabytes_per_second(bytes_moved, benchmark.seconds_per_call(run))
        cupy.get_default_memory_pool().free_all_blocks()
    return {**benchmark.measured_on(), "copy_bandwidth_gb_per_s": benchmark.copy_bandwidth() / 1e9,
            "shapes": {label: list(shape) for label, shape in SHAPES.items()}, "gb_per_s": results}


def table(measured):
    ceiling = measured["copy_bandwidth_gb_per_s"]
    lines = [f"{measured['device']}, {measured['date']}: copy bandwidth {ceiling:.0f} GB/s"]
    for label, results in measured["gb_per_s"].items():
        lines.append(f"{label}:")
        lines += benchmark.bandwidth_rows(results, ceiling)
    return lines


if __name__ == "__main__":
    measured = measure()
    benchmark.report("softmax", measured, table(measured))
