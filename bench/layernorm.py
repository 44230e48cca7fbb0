"""Achieved bandwidth of chapter 05's LayerNorm and DyT kernels on a GPU, against the copy and PyTorch.

    python -m bench.layernorm          prints a table and writes bench/layernorm.json

At GPT-2's (B, T, C) = (8, 1024, 768). Bytes counted are what each kernel must move, N = B·T rows:
  LayerNorm forward   read x, write y, mean, rstd          4 (2 N C + 2 N)
  LayerNorm backward  read dout, x, mean, rstd, write dx   4 (3 N C + 2 N)
  DyT forward         read x, write y                      4 (2 N C)
  DyT backward        read dout, x, write dx               4 (3 N C)
(the parameters, C floats, and the partial sums stay in the cache and are not counted).
An elementwise kernel with the backward's traffic (the residual add: read two arrays, write one) gives
the bandwidth that a kernel with no row or column work reaches at this size.
The backward kernels the ops use ("LayerNorm backward", "DyT backward") run next to the first versions
(column sums in registers, one finishing launch per parameter), to other rows-per-block choices, to DyT's
previous kernel (one row loaded at a time) and its candidates (row slots, rows loaded at once), and to the
two launches of the LayerNorm backward timed apart (what the column sums' finishing launch costs, with 8, 16
and 32 rows of threads), and to the DyT backward cut short (`return;` before its column sums, or before its
finishing step: what each costs); the table ends with the fastest DyT candidate.
Every run above uses the same arrays call after call, and an output written by one call can still sit in
the 50 MB L2 when the next call writes it again: those bytes never reach memory, which flatters a kernel
with a large output. The lines marked "in turn" cycle through 4 sets of arrays (300 MB, six times the L2),
so that every byte counted moves to or from memory. PyTorch's figures
use the same byte counts for its kernels (aten native_layer_norm and native_layer_norm_backward, and
`weight * tanh(alpha * x) + bias` as eager tensor expressions for DyT), so that GB/s compare times.
"""

import re

import numpy as np

from bench import layernorm_variants as variants
from gpt2_cupy import backend, benchmark, kernels
from gpt2_cupy.ops import dyt as dyt_ops
from gpt2_cupy.ops import layernorm as layernorm_ops
from gpt2_cupy.ops.dyt import dyt_backward, dyt_forward
from gpt2_cupy.ops.layernorm import layernorm_backward, layernorm_forward
from gpt2_cupy.ops.residual import residual_forward
from gpt2_cupy.testing import torch_or_none

B, T, C = 8, 1024, 768
N = B * T
FLOAT = 4  # bytes
FORWARD_BYTES, BACKWARD_BYTES = FLOAT * (2 * N * C + 2 * N), FLOAT * (3 * N * C + 2 * N)  # LayerNorm's
ELEMENTWISE_FORWARD_BYTES, ELEMENTWISE_BACKWARD_BYTES = FLOAT * 2 * N * C, FLOAT * 3 * N * C  # DyT's


def parameters(cupy, random):
    """weight, bias, alpha and their gradient buffers dweight, dbias, dalpha."""
    weight = 1 + 0.1 * random.standard_normal(C, dtype=cupy.float32)
    bias = 0.1 * random.standard_normal(C, dtype=cupy.float32)
    alpha = cupy.full((1,), 0.5, dtype=cupy.float32)
    return weight, bias, alpha, cupy.zeros_like(weight), cupy.zeros_like(bias), cupy.zeros_like(alpha)


def activations(cupy, random, weight, bias):
    """x, dout, y, dx, mean, rstd: what one call reads and writes, besides the parameters."""
    x, dout = (random.standard_normal((B, T, C), dtype=cupy.float32) for _ in range(2))
    y, dx = cupy.empty_like(x), cupy.empty_like(x)
    _, mean, rstd = layernorm_forward(x, weight, bias, out=y)
    return x, dout, y, dx, mean, rstd


def op_runs(arrays, params):
    """{name: (bytes moved, function)}: the ops and the elementwise reference on one set of arrays."""
    x, dout, y, dx, mean, rstd = arrays
    weight, bias, alpha, dweight, dbias, dalpha = params
    return {
        "Elementwise with the backward's traffic (residual add)": (
            ELEMENTWISE_BACKWARD_BYTES, lambda: residual_forward(x, dout, out=dx)),
        "LayerNorm forward": (FORWARD_BYTES, lambda: layernorm_forward(x, weight, bias, out=y)),
        "LayerNorm backward": (BACKWARD_BYTES, lambda: layernorm_backward(
            dout, x, weight, mean, rstd, dweight=dweight, dbias=dbias, out=dx)),
        "DyT forward": (ELEMENTWISE_FORWARD_BYTES, lambda: dyt_forward(x, alpha, weight, bias, out=y)),
        "DyT backward": (ELEMENTWISE_BACKWARD_BYTES, lambda: dyt_backward(
            dout, x, alpha, weight, dalpha=dalpha, dweight=dweight, dbias=dbias, out=dx)),
    }


def kernel_definition(source, name):
    """The text of the __global__ function `name` in `source`, from its template line (if any) to its last brace."""
    start = re.search(r"(template <[^>]*>\s*)?__global__[^{;]*?\b" + name + r"\(", source).start()
    depth, end = 0, source.index("{", start)
    while True:
        depth += {"{": 1, "}": -1}.get(source[end], 0)
        end += 1
        if depth == 0:
            return source[start:end]


def stopped_before(file_name, name, marker, stopped_name, instance):
    """kernels/<file_name>.cu's kernel `name`, copied as `stopped_name` with `return;` on the line before the
    one that starts with `marker` (after its indentation): the same kernel cut short, so that its time says what
    the rest of it costs. Compiled with the file's own code ahead of it; returns the kernel <instance>."""
    source = kernels.source(file_name)
    definition = kernel_definition(source, name)
    indent, line = re.search(r"\n( *)(" + re.escape(marker) + ")", definition).groups()
    stopped = definition.replace(f"{name}(", f"{stopped_name}(", 1).replace(
        f"\n{indent}{line}", f"\n{indent}return;\n{indent}{line}", 1)
    name_expression = f"{stopped_name}<{instance}>"
    return backend.RawModule(code=f"{source}\n{stopped}", name_expressions=(name_expression,)).get_function(
        name_expression)


def candidates(cupy):
    """{name: (bytes moved, function that runs it once)}."""
    random = cupy.random.default_rng(0)
    params = parameters(cupy, random)
    weight, bias, alpha, dweight, dbias, dalpha = params
    x, dout, y, dx, mean, rstd = arrays = activations(cupy, random, weight, bias)
    ops = op_runs(arrays, params)

    layout = (4, 6)  # float4 groups, K = 6: C = 768
    rows_per_block = layernorm_ops.ROWS_PER_BLOCK

    def layernorm_backward_with(rows):
        return lambda: variants.layernorm_backward_shared(layout, dx, dweight, dbias, dout, x, weight, mean, rstd,
                                                          N, C, rows)

    def dyt_backward_with(rows, row_slots, rows_at_once):
        return lambda: variants.dyt_backward_columns(4, dx, dalpha, dweight, dbias, dout, x, alpha, weight, N, C,
                                                     rows_per_block=rows, row_slots=row_slots,
                                                     rows_at_once=rows_at_once)

    # The LayerNorm backward's two launches, each alone: the row kernel writing its blocks' partial sums,
    # and column_sums_accumulate adding them into dweight and dbias.
    warps = layernorm_ops.shared_warps(C)
    blocks = -(-N // rows_per_block)
    partials = cupy.zeros((2, blocks, C), dtype=cupy.float32)
    row_kernel = kernels.function("layernorm", "layernorm_backward_shared<4, 6>", name_expressions=layernorm_ops.NAMES)

    def layernorm_rows_alone():
        row_kernel((blocks,), (warps * 32,), (dx, partials[0], partials[1], dout, x, weight, mean, rstd, np.int32(N),
                                              np.int32(C), np.int32(rows_per_block)), shared_mem=2 * warps * C * 4)

    # The DyT backward cut short (its counters untouched): where its time beyond an elementwise kernel's goes.
    instance = f"4, {dyt_ops.ROW_SLOTS}, {dyt_ops.ROWS_AT_ONCE}"
    dyt_stopped = {part: stopped_before("dyt", "dyt_backward_columns", marker, name, instance)
                   for part, marker, name in (
                       ("its finishing step (partial sums written)", "__threadfence();  // each thread's partial",
                        "dyt_backward_without_finishing"),
                       ("its column sums (dx alone)", "// 1. The block's row slots", "dyt_backward_dx_alone"))}

    step = backend.RawKernel(kernels.source("steps/layernorm_forward_warp_per_row"), "layernorm_forward_warp_per_row")
    rows = np.int32(N)

    def scalar_loads():  # the package's kernel with one float per load: layernorm_forward<1, 32>
        layernorm_ops._forward((1, 32), y, mean, rstd, x, weight, bias, N, C, 1e-5)

    runs = {
        "Elementwise with the backward's traffic (residual add)": ops[
            "Elementwise with the backward's traffic (residual add)"],
        "LayerNorm forward, a warp per row (step)": (FORWARD_BYTES, lambda: step(
            (N // 8,), (256,), (y, mean, rstd, x, weight, rows, np.int32(C), np.float32(1e-5)))),
        "LayerNorm forward, row in registers, float loads": (FORWARD_BYTES, scalar_loads),
        "LayerNorm forward": ops["LayerNorm forward"],
        "LayerNorm backward": ops["LayerNorm backward"],
        "LayerNorm backward, column sums in registers (first kernel)": (BACKWARD_BYTES, lambda: (
            variants.layernorm_backward_registers(layout, dx, dweight, dbias, dout, x, weight, mean, rstd, N, C))),
        **{f"LayerNorm backward, {rows} rows per block": (BACKWARD_BYTES, layernorm_backward_with(rows))
           for rows in (32, 48, 96, 128) if rows != rows_per_block},
        "LayerNorm backward, the row kernel alone": (BACKWARD_BYTES, layernorm_rows_alone),
        "LayerNorm backward, column_sums_accumulate alone": (  # its own bytes: the partials read, the sums
            partials.nbytes + 4 * FLOAT * C, lambda: layernorm_ops.add_column_sums((dweight, dbias), partials)),
        **{f"LayerNorm backward, column_sums_accumulate alone, {stripes} rows of threads": (
            partials.nbytes + 4 * FLOAT * C,
            lambda stripes=stripes: variants.add_column_sums((dweight, dbias), partials, stripes))
           for stripes in (16, 32)},
        "DyT forward": ops["DyT forward"],
        "DyT backward": ops["DyT backward"],
        "DyT backward, a warp per row (first kernel)": (ELEMENTWISE_BACKWARD_BYTES, lambda: variants.dyt_backward_rows(
            layout, dx, dalpha, dweight, dbias, dout, x, alpha, weight, N, C)),
        "DyT backward, one row at a time (previous)": (ELEMENTWISE_BACKWARD_BYTES, dyt_backward_with(128, 8, 1)),
        **{f"DyT backward, stopped before {part}": (ELEMENTWISE_BACKWARD_BYTES, lambda kernel=kernel: (
            variants.dyt_backward_columns(4, dx, dalpha, dweight, dbias, dout, x, alpha, weight, N, C, kernel=kernel)))
           for part, kernel in dyt_stopped.items()},
        **{f"DyT backward, {rows} rows per block, {slots} row slots, {at_once} at once": (
            ELEMENTWISE_BACKWARD_BYTES, dyt_backward_with(rows, slots, at_once))
           for rows in (64, 128, 256) for slots, at_once in variants.DYT_CANDIDATES if slots * at_once <= rows},
    }
    torch = torch_or_none()
    if torch is None:
        return runs
    x_t, dout_t, weight_t, bias_t = (torch.from_dlpack(a) for a in (x, dout, weight, bias))
    alpha_t = torch.from_dlpack(alpha)
    _, mean_t, rstd_t = torch.ops.aten.native_layer_norm(x_t, (C,), weight_t, bias_t, 1e-5)
    runs["torch LayerNorm forward (native_layer_norm)"] = (
        FORWARD_BYTES, lambda: torch.ops.aten.native_layer_norm(x_t, (C,), weight_t, bias_t, 1e-5))
    runs["torch LayerNorm backward (native_layer_norm_backward)"] = (
        BACKWARD_BYTES, lambda: torch.ops.aten.native_layer_norm_backward(
            dout_t, x_t, (C,), mean_t, rstd_t, weight_t, bias_t, [True, True, True]))
    runs["torch DyT forward (tensor expression)"] = (
        ELEMENTWISE_FORWARD_BYTES, lambda: weight_t * torch.tanh(alpha_t * x_t) + bias_t)
    leaves = [a.clone().requires_grad_() for a in (x_t, alpha_t, weight_t, bias_t)]

    def torch_dyt_forward_and_backward():  # eager autograd: the forward's tensors, then the backward's
        y_t = leaves[2] * torch.tanh(leaves[1] * leaves[0]) + leaves[3]
        return torch.autograd.grad(y_t, leaves, dout_t)

    runs["torch DyT forward + backward (autograd)"] = (ELEMENTWISE_FORWARD_BYTES + ELEMENTWISE_BACKWARD_BYTES,
                                                       torch_dyt_forward_and_backward)
    return runs


SETS = 4  # of arrays, 75 MB each: six times the H100's 50 MB L2
ROTATING = f" ({SETS} sets of arrays in turn)"


def rotating_candidates(cupy):
    """{name + ROTATING: (bytes moved, function)}: the ops and the elementwise reference, each call on the
    next of SETS sets of arrays, so that no call finds its inputs or its last output in the L2."""
    random = cupy.random.default_rng(1)
    params = parameters(cupy, random)
    sets = [op_runs(activations(cupy, random, *params[:2]), params) for _ in range(SETS)]
    turn = [0]

    def in_turn(name):
        def next_set():
            turn[0] = (turn[0] + 1) % SETS
            sets[turn[0]][name][1]()
        return next_set

    return {name + ROTATING: (bytes_moved, in_turn(name)) for name, (bytes_moved, _) in sets[0].items()}


def measure():
    benchmark.require_gpu()
    cupy = backend.xp
    results = {}
    for name, (bytes_moved, run) in {**candidates(cupy), **rotating_candidates(cupy)}.items():
        seconds = benchmark.seconds_per_call(run)
        results[name] = {"gb_per_s": benchmark.gigabytes_per_second(bytes_moved, seconds),
                         "microseconds": seconds * 1e6}
    return {**benchmark.measured_on(), "copy_bandwidth_gb_per_s": benchmark.copy_bandwidth() / 1e9,
            "shape": [B, T, C], "results": results}


def table(measured):
    ceiling = measured["copy_bandwidth_gb_per_s"]
    lines = [f"{measured['device']}, {measured['date']}: copy bandwidth {ceiling:.0f} GB/s; (B, T, C) = "
             f"{tuple(measured['shape'])}"]
    results = measured["results"]
    lines += benchmark.bandwidth_rows({name: value["gb_per_s"] for name, value in results.items()}, ceiling,
                                      {name: value["microseconds"] / 1e6 for name, value in results.items()})
    ours = results["LayerNorm forward"]["microseconds"] + results["LayerNorm backward"]["microseconds"]
    lines.append(f"  LayerNorm forward + backward: {ours:.1f} µs")
    if "torch LayerNorm forward (native_layer_norm)" in results:
        theirs = (results["torch LayerNorm forward (native_layer_norm)"]["microseconds"]
                  + results["torch LayerNorm backward (native_layer_norm_backward)"]["microseconds"])
        lines.append(f"  torch LayerNorm forward + backward: {theirs:.1f} µs")
    candidates = [name for name in results if name.startswith("DyT backward, ") and "at once" in name]
    if candidates:
        best = min(candidates, key=lambda name: results[name]["microseconds"])
        lines.append(f"  fastest DyT candidate: {best}: {results[best]['microseconds']:.1f} µs, "
                     f"{results[best]['gb_per_s'] / ceiling:.1%} of the copy")
    dyt = results["DyT forward"]["microseconds"] + results["DyT backward"]["microseconds"]
    lines.append(f"  DyT forward + backward: {dyt:.1f} µs")
    if "torch DyT forward + backward (autograd)" in results:
        lines.append(f"  torch DyT forward + backward: "
                     f"{results['torch DyT forward + backward (autograd)']['microseconds']:.1f} µs")
    return lines


if __name__ == "__main__":
    measured = measure()
    benchmark.report("layernorm", measured, table(measured))
