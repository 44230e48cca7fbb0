"""Achieved bandwidth of the generated elementwise and reduction kernels (gpt2_cupy.elementwise, .reduction).

    python -m bench.generated_kernels           on a GPU: prints a table, writes bench/generated_kernels.json
    python -m bench.generated_kernels --check   anywhere (the CPU executor too): every case once at a tiny
                                                size, checked against numpy, nothing timed

Each case at 16M float32 elements: the bytes it must read and write over its median time per call, next to
the device's copy bandwidth (benchmark.copy_bandwidth(), the memory ceiling) and the same expression in
PyTorch eager, timed in the same run when PyTorch imports. The targets: elementwise with broadcasting at
least 85 % of copy, reductions over the last axis 80 %, over a middle axis 60 %.
"""

import sys

import numpy as np

from gpt2_cupy import backend, benchmark
from gpt2_cupy.elementwise import copy, elementwise
from gpt2_cupy.reduction import reduce
from gpt2_cupy.testing import relative_error, torch_or_none

FLOAT = 4  # bytes
ROWS, COLUMNS = 4096, 4096                 # 16M elements: the (rows, columns) cases
OUTER, MIDDLE, INNER = 16, 1024, 1024      # 16M elements: the middle-axis case


def cases(rows, columns, outer, middle, inner):
    """{name: (bytes moved, run() -> result, numpy reference(), torch run or None)} on fresh random arrays.

    Bytes moved count what must cross the memory bus at least once: every input element read, every
    output element written (a broadcast operand, read once per row from the cache, is counted once).
    """
    xp = backend.xp
    random = np.random.default_rng(0)
    x_host = random.standard_normal((rows, columns)).astype(np.float32)
    y_host = random.standard_normal((rows, columns)).astype(np.float32)
    w_host = random.standard_normal(columns).astype(np.float32)
    b_host = random.standard_normal(columns).astype(np.float32)
    cube_host = random.standard_normal((outer, middle, inner)).astype(np.float32)
    x, y, w, b, cube = (xp.asarray(a) for a in (x_host, y_host, w_host, b_host, cube_host))
    n, matrix = rows * columns, rows * columns * FLOAT
    runs = {
        "a + b, same shape (contiguous fast path)": (
            3 * matrix, lambda: elementwise("add", "a + b", [x, y]), lambda: x_host + y_host,
            lambda t: t["x"] + t["y"]),
        "x * w + b, (rows, C) with two (C,) broadcast": (
            2 * matrix, lambda: elementwise("scale_shift", "a * b + c", [x, w, b]), lambda: x_host * w_host + b_host,
            lambda t: t["x"] * t["w"] + t["b"]),
        "x + xᵀ, a transposed operand": (
            3 * matrix, lambda: elementwise("add", "a + b", [x, x.T]), lambda: x_host + x_host.T,
            lambda t: t["x"] + t["x"].T),
        "copy of xᵀ into rows (contiguous())": (
            2 * matrix, lambda: copy("contiguous", x.T), lambda: np.ascontiguousarray(x_host.T),
            lambda t: t["x"].T.contiguous()),
        "sum over the last axis": (
            matrix + rows * FLOAT, lambda: reduce("sum", "sum", x, (1,)), lambda: x_host.astype(np.float64).sum(1),
            lambda t: t["x"].sum(1)),
        "max over the last axis (values and indices)": (
            matrix + rows * 3 * FLOAT, lambda: reduce("max", "max", x, (1,))[0], lambda: x_host.max(1),
            lambda t: t["x"].max(1)),
        "sum over a middle axis (16, 1024, 1024) -> (16, 1024)": (
            n * FLOAT + outer * inner * FLOAT, lambda: reduce("sum", "sum", cube, (1,)),
            lambda: cube_host.astype(np.float64).sum(1), lambda t: t["cube"].sum(1)),
        "sum over the first axis": (
            matrix + columns * FLOAT, lambda: reduce("sum", "sum", x, (0,)), lambda: x_host.astype(np.float64).sum(0),
            lambda t: t["x"].sum(0)),
    }
    torch = torch_or_none()
    arrays = {"x": x, "y": y, "w": w, "b": b, "cube": cube}
    tensors = {name: torch.from_dlpack(array) for name, array in arrays.items()} if torch and \
        backend.name == "cuda" else None
    return {name: (bytes_moved, run, reference, (lambda f=torch_run: f(tensors)) if tensors else None)
            for name, (bytes_moved, run, reference, torch_run) in runs.items()}


def check(rows=67, columns=67, outer=3, middle=37, inner=45):
    """Every case once, at sizes that are multiples of nothing (square: x + xᵀ), against its numpy reference."""
    for name, (_, run, reference, _) in cases(rows, columns, outer, middle, inner).items():
        error = relative_error(run(), reference())
        print(f"  {name:<55s} relative error {error:.1e}")
        assert error < 1e-5, name


def measure():
    benchmark.require_gpu()
    results, torch_results = {}, {}
    for name, (bytes_moved, run, _, torch_run) in cases(ROWS, COLUMNS, OUTER, MIDDLE, INNER).items():
        results[name] = benchmark.gigabytes_per_second(bytes_moved, benchmark.seconds_per_call(run))
        if torch_run is not None:
            torch_results[name] = benchmark.gigabytes_per_second(bytes_moved, benchmark.seconds_per_call(torch_run))
    return {"copy_bandwidth_gb_per_s": benchmark.copy_bandwidth() / 1e9, "elements": ROWS * COLUMNS,
            "gb_per_s": results, "torch_gb_per_s": torch_results}


def table(measured):
    ceiling = measured["copy_bandwidth_gb_per_s"]
    lines = [f"{backend.device_name()}: copy bandwidth {ceiling:.0f} GB/s; {measured['elements']} elements",
             "generated kernels:"]
    lines += benchmark.bandwidth_rows(measured["gb_per_s"], ceiling)
    if measured["torch_gb_per_s"]:
        lines.append("PyTorch eager, the same expressions:")
        lines += benchmark.bandwidth_rows(measured["torch_gb_per_s"], ceiling)
    return lines


if __name__ == "__main__":
    if "--check" in sys.argv[1:]:
        check()                     # rows of 67: the strided kernel, one column per load
        check(rows=68, columns=68)  # rows of 68, a multiple of 4: the rows kernel, 4 columns per load
    else:
        measured = measure()
        benchmark.report("generated_kernels", measured, table(measured))
