"""Achieved bandwidth of chapter 03's elementwise kernels (GELU and the residual add) on a GPU.

    python -m bench.elementwise     prints a table and writes bench/elementwise.json

For each size, every kernel's GB/s (bytes it must read and write, over its median time per call, timed
over calls back to back so that Python's launch overhead overlaps the kernels' work) next to the
device's measured copy bandwidth (benchmark.copy_bandwidth(), the memory ceiling), CuPy's equivalent
expressions and, when PyTorch imports, PyTorch's GELU. Kernels: the package's kernels/gelu.cu and
kernels/residual.cu (one element per thread, and float4), plus the chapter's grid-stride GELU.
Also the device's idle memory latency (a pointer chase), which the chapter uses with Little's law.
"""

from functools import lru_cache

import numpy as np

from gpt2_cupy import backend, benchmark, kernels
from gpt2_cupy.testing import torch_or_none

THREADS_PER_BLOCK = 256
SIZES = [2**k for k in range(10, 27)]
FLOAT = 4  # bytes

# The chapter's teaching kernel (not in the package): a grid that fills the GPU once, each thread looping.
GRID_STRIDE_SOURCE = r"""
extern "C" __global__ void gelu_forward_grid_stride(float* y, const float* x, int n, int exact)
{
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        y[i] = gelu(x[i], exact);
    }
}
"""

# One thread follows a chain of loads, each address the value the previous load returned: nothing overlaps,
# so the time per step is the latency of one read from memory when the memory is otherwise idle.
POINTER_CHASE_SOURCE = r"""
extern "C" __global__ void pointer_chase(const int* following, int steps, int* last)
{
    int i = 0;
    for (int step = 0; step < steps; ++step) {
        i = following[i];
    }
    *last = i;
}
"""

SQRT_2_OVER_PI = float(np.sqrt(2 / np.pi))
CUBIC = 0.044715


def blocks_for(threads):
    return (threads + THREADS_PER_BLOCK - 1) // THREADS_PER_BLOCK


@lru_cache(maxsize=None)
def grid_stride_kernel():
    return backend.RawKernel(kernels.source("gelu") + GRID_STRIDE_SOURCE, "gelu_forward_grid_stride")


def candidates(n, cupy, multiprocessors):
    """{name: (bytes moved, function that runs it once)} for arrays of n float32 elements."""
    gelu = kernels.module("gelu", name_expressions=("gelu_forward<float>", "gelu_backward<float>"))
    residual = kernels.module("residual")
    grid_stride = grid_stride_kernel()
    random = cupy.random.default_rng(0)
    x = random.standard_normal(n, dtype=cupy.float32)
    dy = random.standard_normal(n, dtype=cupy.float32)
    out = cupy.empty_like(x)
    size = np.int32(n)
    tanh, erf = np.int32(0), np.int32(1)
    one_per_thread, float4 = (blocks_for(n),), (blocks_for((n + 3) // 4),)
    one_wave = (min(blocks_for(n), multiprocessors * (2048 // THREADS_PER_BLOCK)),)
    block = (THREADS_PER_BLOCK,)

    def launcher(module, name, grid, arrays, *flags):
        kernel = module.get_function(name)
        return lambda: kernel(grid, block, (*arrays, size, *flags))

    two, three = 2 * n * FLOAT, 3 * n * FLOAT
    runs = {
        "gelu_forward, one element per thread": (two, launcher(gelu, "gelu_forward<float>", one_per_thread, (out, x), tanh)),
        "gelu_forward, grid-stride (one wave)": (two, lambda: grid_stride(one_wave, block, (out, x, size, tanh))),
        "gelu_forward_float4": (two, launcher(gelu, "gelu_forward_float4", float4, (out, x), tanh)),
        "gelu_forward_float4, exact (erf)": (two, launcher(gelu, "gelu_forward_float4", float4, (out, x), erf)),
        "gelu_backward, one element per thread": (three, launcher(gelu, "gelu_backward<float>", one_per_thread,
                                                                  (out, x, dy), tanh)),
        "gelu_backward_float4": (three, launcher(gelu, "gelu_backward_float4", float4, (out, x, dy), tanh)),
        "gelu_backward_float4, exact (erf)": (three, launcher(gelu, "gelu_backward_float4", float4,
                                                              (out, x, dy), erf)),
        "residual_add, one element per thread": (three, launcher(residual, "residual_add", one_per_thread,
                                                                 (out, x, dy))),
        "residual_add_float4": (three, launcher(residual, "residual_add_float4", float4, (out, x, dy))),
        "cupy: GELU as an array expression": (
            two, lambda: 0.5 * x * (1 + cupy.tanh(SQRT_2_OVER_PI * (x + CUBIC * x**3)))),
        "cupy: x + branch (cupy.add)": (three, lambda: cupy.add(x, dy, out=out)),
    }
    torch = torch_or_none()
    if torch is None:
        return runs
    x_torch, dy_torch = torch.from_dlpack(x), torch.from_dlpack(dy)
    runs["torch: gelu(approximate='tanh')"] = (
        two, lambda: torch.nn.functional.gelu(x_torch, approximate="tanh"))
    runs["torch: gelu_backward(approximate='tanh')"] = (
        three, lambda: torch.ops.aten.gelu_backward(dy_torch, x_torch, approximate="tanh"))
    return runs


def idle_memory_latency(megabytes=1024, steps=200_000):
    """Seconds for one read from GPU memory: a pointer chase through a random cycle much larger than L2."""
    cupy = backend.xp
    n = megabytes * 2**20 // FLOAT
    order = cupy.random.permutation(n).astype(cupy.int32)
    following = cupy.empty(n, dtype=cupy.int32)
    following[order] = cupy.roll(order, -1)  # one cycle through all n slots, in random order
    del order
    chase = backend.RawKernel(POINTER_CHASE_SOURCE, "pointer_chase")
    last = cupy.zeros(1, dtype=cupy.int32)

    def walk(count):
        return lambda: chase((1,), (1,), (following, np.int32(count), last))

    short = benchmark.seconds_per_call(walk(1000), warmup=1, repeat=3)
    long = benchmark.seconds_per_call(walk(1000 + steps), warmup=1, repeat=3)
    return (long - short) / steps


def measure(sizes=SIZES):
    """{'device', 'date', 'copy_bandwidth_gb_per_s', 'sizes', 'gb_per_s': {kernel: [GB/s per size]}}."""
    benchmark.require_gpu()
    cupy = backend.xp
    multiprocessors = cupy.cuda.Device().attributes["MultiProcessorCount"]
    results = {}
    for n in sizes:
        for name, (bytes_moved, run) in candidates(n, cupy, multiprocessors).items():
            seconds = benchmark.seconds_per_call(run)
            results.setdefault(name, []).append(benchmark.gigabytes_per_second(bytes_moved, seconds))
        cupy.get_default_memory_pool().free_all_blocks()
    return {
        "copy_bandwidth_gb_per_s": benchmark.copy_bandwidth() / 1e9,
        "idle_memory_latency_ns": idle_memory_latency() * 1e9,
        "multiprocessors": multiprocessors,
        "threads_per_block": THREADS_PER_BLOCK,
        "sizes": list(sizes),
        "gb_per_s": results,
    }


def table(measured, at=2**24):
    ceiling = measured["copy_bandwidth_gb_per_s"]
    column = measured["sizes"].index(at)
    lines = [f"{backend.device_name()}: copy bandwidth {ceiling:.0f} GB/s, idle memory latency "
             f"{measured['idle_memory_latency_ns']:.0f} ns; at {at} elements:"]
    lines += benchmark.bandwidth_rows({name: values[column] for name, values in measured["gb_per_s"].items()},
                                      ceiling)
    return lines


if __name__ == "__main__":
    measured = measure()
    benchmark.report("elementwise", measured, table(measured))
