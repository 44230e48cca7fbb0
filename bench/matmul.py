"""GFLOP/s of chapter 01's matmul kernels against cuBLAS (cupy.matmul, float32) on a GPU.

    GPT2_CUPY_BACKEND=cuda python -m bench.matmul [--tune]        writes bench/matmul.json

Times each version of C = A @ B (naive, shared-memory tiles, register blocking, the four steps of section 4.4, and the package's
kernel) on square sizes and on GPT-2 small's Linear shapes (8192 rows = 8 sequences of 1024 tokens),
then the package's matmul on the three products of a Linear layer (x Wᵀ, dy W, dyᵀ x) against cuBLAS
doing the same, with and without split-K. --tune also times variants of the package kernel (block order,
slice depth) and forced numbers of K splits on three shapes.
cuBLAS runs in true float32 (CUPY_TF32=0; TF32 tensor cores would round the inputs to 10-bit mantissas).
chapters/01_matmul.ipynb imports this file for its benchmark cell.
"""

import argparse
import os

os.environ["CUPY_TF32"] = "0"  # before CuPy is imported: compare float32 with float32


import numpy  # noqa: E402

from gpt2_cupy import backend, benchmark, kernels  # noqa: E402
from gpt2_cupy.ops import matmul as ops_matmul  # noqa: E402
from gpt2_cupy.dispatch import matmul  # noqa: E402
from gpt2_cupy.ops.matmul import k_splits  # noqa: E402
from gpt2_cupy.testing import relative_error, torch_or_none  # noqa: E402

SQUARE_SIZES = (512, 1024, 2048, 4096)
GPT2_ROWS = 8192  # B * T = 8 * 1024
GPT2_LINEARS = {  # name: (C_in, C_out) of GPT-2 small's Linear layers
    "attention qkv": (768, 2304),
    "attention projection": (768, 768),
    "MLP up": (768, 3072),
    "MLP down": (3072, 768),
}


def _blocks(n, size):
    return (n + size - 1) // size


def _teaching_kernel(file_name, kernel_name, block, grid_of):
    kernel = kernels.function(file_name, kernel_name)

    def launcher(a, b, c):
        M, K = a.shape
        N = b.shape[1]
        grid = grid_of(M, N)
        args = (c, a, b, numpy.int32(M), numpy.int32(N), numpy.int32(K))
        return lambda: kernel(grid, block, args)

    return launcher


STEPS = {"+ float4 loads": "matmul_float4", "+ A transposed in shared memory": "matmul_transposed_a",
         "+ warp tiles": "matmul_warp_tiles", "+ double buffering": "matmul_double_buffered"}


def versions(with_torch=True):
    """{label: launcher(a, b, c) -> run()} for C = A @ B, slowest first, the references last."""
    found = {
        "naive, uncoalesced": _teaching_kernel("steps/matmul_naive", "matmul_naive_uncoalesced", (32, 8),
                                               lambda M, N: (_blocks(M, 32), _blocks(N, 8))),
        "naive": _teaching_kernel("steps/matmul_naive", "matmul_naive", (32, 8),
                                  lambda M, N: (_blocks(N, 32), _blocks(M, 8))),
        "shared-memory tiles": _teaching_kernel("steps/matmul_tiled", "matmul_tiled", (32, 32),
                                                lambda M, N: (_blocks(N, 32), _blocks(M, 32))),
        "register blocking": _teaching_kernel("steps/matmul_register_blocked", "matmul_register_blocked", (256,),
                                              lambda M, N: (_blocks(N, 128), _blocks(M, 128))),
        # chapter 01's four steps from register blocking to the package's kernel (N and K multiples of 4)
        **{label: _teaching_kernel(f"steps/{name}", name, (256,), lambda M, N: (_blocks(N, 128), _blocks(M, 128)))
           for label, name in STEPS.items()},
        "package kernel (gpt2_cupy matmul)": lambda a, b, c: (lambda: matmul(a, b, out=c)),
        "cuBLAS (cupy.matmul)": lambda a, b, c: (lambda: backend.xp.matmul(a, b, out=c)),
    }
    torch = _torch() if with_torch else None
    if torch is not None:
        def torch_launcher(a, b, c):
            ta, tb, tc = (torch.from_dlpack(x) for x in (a, b, c))
            return lambda: torch.matmul(ta, tb, out=tc)
        found["PyTorch (torch.matmul)"] = torch_launcher
    return found


def _torch():
    torch = torch_or_none()
    if torch is not None:
        torch.backends.cuda.matmul.allow_tf32 = False  # float32, like cuBLAS above
    return torch


def _random(shape, seed):
    rng = numpy.random.default_rng(seed)
    return backend.xp.asarray(rng.standard_normal(shape, dtype=numpy.float32))


def measure(M, N, K, chosen=None, with_torch=True):
    """{label: GFLOP/s} of C = A @ B for (M x K) @ (K x N); each result checked against cuBLAS's."""
    a, b = _random((M, K), 1), _random((K, N), 2)
    reference = backend.xp.matmul(a, b)
    flops = 2 * M * N * K
    result = {}
    for label, launcher in versions(with_torch).items():
        if chosen is not None and label not in chosen:
            continue
        c = backend.xp.full((M, N), numpy.nan, dtype=numpy.float32)
        run = launcher(a, b, c)
        run()
        error = relative_error(c, reference)
        if not error < 1e-4:
            raise AssertionError(f"{label} at {M}x{N}x{K}: relative error {error:.2e} against cuBLAS")
        result[label] = flops / benchmark.seconds_per_call(run) / 1e9
    return result


def linear_products(C_in, C_out, rows=GPT2_ROWS):
    """GFLOP/s of the package's matmul and of cuBLAS on one Linear layer's three products."""
    xp = backend.xp
    x, w, dy = _random((rows, C_in), 3), _random((C_out, C_in), 4), _random((rows, C_out), 5)
    dw = xp.zeros((C_out, C_in), dtype=numpy.float32)
    products = {
        "x Wᵀ (forward)": (rows, C_out, C_in,
                           lambda: matmul(x, w, transpose_b=True),
                           lambda: xp.matmul(x, w.T)),
        "dy W (input gradient)": (rows, C_in, C_out,
                                  lambda: matmul(dy, w),
                                  lambda: xp.matmul(dy, w)),
        "dW += dyᵀ x (weight gradient)": (C_out, C_in, rows,
                                          lambda: matmul(dy, x, transpose_a=True, out=dw, accumulate=True),
                                          lambda: dw.__iadd__(xp.matmul(dy.T, x))),
    }
    rows_out = []
    for product, (M, N, K, ours, cublas) in products.items():
        flop = 2 * M * N * K
        row = {"product": product, "M": M, "N": N, "K": K, "k_splits": k_splits(M, N, K)[0],
               "matmul": flop / benchmark.seconds_per_call(ours) / 1e9, "cuBLAS": flop / benchmark.seconds_per_call(cublas) / 1e9}
        if row["k_splits"] > 1:
            ops_matmul.k_splits = lambda *shape, **batch: (1, 0)  # the same kernel, one block per tile
            try:
                row["matmul without split-K"] = flop / benchmark.seconds_per_call(ours) / 1e9
            finally:
                ops_matmul.k_splits = k_splits
        rows_out.append(row)
    return rows_out


def _replaced(source, old, new):
    if old not in source:
        raise ValueError(f"tuning: {old!r} is not in kernels/matmul.cu any more")
    return source.replace(old, new)


ROW_MAJOR_ORDER = """    const int m0 = blockIdx.y * TILE_M;
    const int n0 = blockIdx.x * TILE_M;
"""
GROUPED_ORDER = """    const int group_rows = 8;  // consecutive blocks go down 8 tile rows, then one tile column right
    const int block_number = blockIdx.y * gridDim.x + blockIdx.x;
    const int group_size = group_rows * gridDim.x;
    const int first_tile_row = block_number / group_size * group_rows;
    const int rows_in_group = min((int)gridDim.y - first_tile_row, group_rows);
    const int m0 = (first_tile_row + block_number % group_size % rows_in_group) * TILE_M;
    const int n0 = (block_number % group_size / rows_in_group) * TILE_M;
"""


def tuning_variants():
    """The package kernel's source with other tile constants or launch settings: {description: source}."""
    source = kernels.source("matmul")
    return {
        "as shipped": source,
        "blocks in groups of 8 tile rows (L2 reuse)": _replaced(source, ROW_MAJOR_ORDER, GROUPED_ORDER),
        "TILE_K = 16": _replaced(source, "constexpr int TILE_K = 8;", "constexpr int TILE_K = 16;"),
    }


TUNING_SHAPES = ((4096, 4096, 4096), (GPT2_ROWS, 768, 3072), (2304, 768, GPT2_ROWS))  # square, MLP down, qkv dW


def tune():
    """GFLOP/s of each tuning variant (A @ B, float4 path) on TUNING_SHAPES, checked against cuBLAS; and, on
    the non-square shapes, of the package's matmul with K split in 1, 2, 3, 4, 7 and 12 stretches."""
    xp = backend.xp
    results = {}
    for M, N, K in TUNING_SHAPES:
        shape = f"{M}x{N}x{K}"
        a, b = _random((M, K), 1), _random((K, N), 2)
        reference = xp.matmul(a, b)
        name = "matmul<false, false, true>"
        for description, source in tuning_variants().items():
            kernel = backend.RawModule(code=source, name_expressions=[name]).get_function(name)
            c = xp.empty((M, N), dtype=numpy.float32)
            grid = (_blocks(N, 128), _blocks(M, 128), 1)
            args = (c, a, b, numpy.int32(M), numpy.int32(N), numpy.int32(K), *(numpy.int64(0),) * 3,
                    numpy.int32(0), numpy.int32(0))
            run = lambda: kernel(grid, (256,), args)  # noqa: E731
            run()
            results[f"{shape}, {description}"] = {
                "gflops": 2 * M * N * K / benchmark.seconds_per_call(run) / 1e9, "relative_error": relative_error(c, reference),
                "registers": getattr(kernel, "num_regs", None)}
        if M != N:
            for splits in (1, 2, 3, 4, 7, 12):
                k_per_split = -(-K // (splits * 8)) * 8
                c = xp.empty((M, N), dtype=numpy.float32)
                forced = (splits, k_per_split) if splits > 1 else (1, 0)
                ops_matmul.k_splits = lambda *shape, **batch: forced  # noqa: B023
                try:
                    run = lambda: matmul(a, b, out=c)  # noqa: E731
                    run()
                    results[f"{shape}, package matmul with K split in {splits}"] = {
                        "gflops": 2 * M * N * K / benchmark.seconds_per_call(run) / 1e9, "relative_error": relative_error(c, reference),
                        "registers": None}
                finally:
                    ops_matmul.k_splits = k_splits
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tune", action="store_true", help="also time variants of the tile constants")
    arguments = parser.parse_args(argv)
    benchmark.require_gpu()

    cupy = backend.xp
    results = {
        "cupy": cupy.__version__,
        "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(),
        "CUPY_TF32": os.environ.get("CUPY_TF32"),
        "copy_bandwidth_GB_per_s": benchmark.copy_bandwidth() / 1e9,
        "note": "GFLOP/s = 2*M*N*K / median seconds per call; float32 everywhere",
        "square": [],
        "gpt2": [],
        "linear": [],
    }
    for size in SQUARE_SIZES:
        gflops = measure(size, size, size)
        results["square"].append({"M": size, "N": size, "K": size, "gflops": gflops})
        print(f"{size}³: " + ", ".join(f"{label} {value:,.0f}" for label, value in gflops.items()), flush=True)
    for name, (C_in, C_out) in GPT2_LINEARS.items():
        gflops = measure(GPT2_ROWS, C_out, C_in)
        results["gpt2"].append({"layer": name, "M": GPT2_ROWS, "N": C_out, "K": C_in, "gflops": gflops})
        print(f"{name} {GPT2_ROWS}x{C_in} @ {C_in}x{C_out}: "
              + ", ".join(f"{label} {value:,.0f}" for label, value in gflops.items()), flush=True)
    for name, (C_in, C_out) in GPT2_LINEARS.items():
        for row in linear_products(C_in, C_out):
            results["linear"].append({"layer": name, **row})
            unsplit = (f" (without split-K: {row['matmul without split-K']:,.0f})" if "matmul without split-K" in row
                       else "")
            print(f"{name}, {row['product']}: matmul {row['matmul']:,.0f}{unsplit}, cuBLAS {row['cuBLAS']:,.0f}",
                  flush=True)
    if arguments.tune:
        results["tuning"] = tune()
        for description, row in results["tuning"].items():
            print(f"tuning {description}: {row['gflops']:,.0f} GFLOP/s (error {row['relative_error']:.1e}, "
                  f"{row['registers']} registers)")

    at_4096 = next(row["gflops"] for row in results["square"] if row["M"] == 4096)
    cublas = at_4096["cuBLAS (cupy.matmul)"]
    results["at_4096"] = {label: {"gflops": value, "percent_of_cublas": 100 * value / cublas}
                          for label, value in at_4096.items()}
    table = [f"\n{backend.device_name()}, 4096³ float32:"]
    table += [f"  {label:40s} {row['gflops']:9,.0f} GFLOP/s  {row['percent_of_cublas']:5.1f} % of cuBLAS"
              for label, row in results["at_4096"].items()]
    benchmark.report("matmul", results, table)


if __name__ == "__main__":
    main()
