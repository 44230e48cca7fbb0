"""TFLOP/s of chapter 15a's tensor-core kernels (and 15b's wgmma) against cuBLAS, on a GPU.

    GPT2_CUPY_BACKEND=cuda python -m bench.tensor_cores           writes bench/tensor_cores.json (about 2 minutes)
    python -m bench.tensor_cores --tiny                           on any backend: runs every version once at a
                                                                  small size and checks it; no timings, no file

At 4096³ (C = A Bᵀ, the forward layout, B stored N x K) each kernel of the chapter and the package's op at
each precision (and, on an H100 or H200, the wgmma kernel of section 4.8 on bf16 copies, and on the float32
operands in TF32 and 3xTF32), against cuBLAS in
the same run: float32 through cupy.matmul (CUPY_TF32=0), TF32 and bf16
through PyTorch (torch.matmul with allow_tf32, and on bf16 tensors) when it is installed. Then GPT-2 small's
Linear products (8192 rows: forward x Wᵀ, input gradient dy W, weight gradient dW += dyᵀ x) at each precision
against cuBLAS at the same precision, and each product through wgmma (its operands as they lie) where it runs. Each result is checked against cuBLAS float32 before it is timed, and the
error of each precision against float64 is measured at 4096³. chapters/15a_tensor_cores_mma_sync.ipynb imports this file.
"""

import argparse
import os

os.environ["CUPY_TF32"] = "0"  # before CuPy is imported: cupy.matmul is cuBLAS in true float32

import numpy  # noqa: E402

from gpt2_cupy import backend, benchmark, kernels  # noqa: E402
from gpt2_cupy.ops.matmul import launch_float32_matmul  # noqa: E402
from gpt2_cupy.dispatch import tensor_core_matmul  # noqa: E402
from gpt2_cupy.ops.tensor_core_matmul import launch_bf16_matmul, launch_tf32_mma_sync, to_bf16  # noqa: E402
from gpt2_cupy.ops.wgmma_matmul import launch_tf32_wgmma_product, wgmma_matmul  # noqa: E402
from gpt2_cupy.testing import relative_error, torch_or_none  # noqa: E402

SQUARE = 4096
GPT2_ROWS = 8192
GPT2_LINEARS = {"attention qkv": (768, 2304), "attention projection": (768, 768),   # (C_in, C_out), as
                "MLP up": (768, 3072), "MLP down": (3072, 768),                       # bench/matmul.py,
                "output layer": (768, 50304)}                                         # and the vocabulary
TOLERANCE = {"float32": 1e-4, "highest": 1e-4, "high": 1e-2, "medium": 5e-2}   # against cuBLAS float32
PRECISION_NAMES = {"highest": "3xTF32", "high": "TF32", "medium": "bf16"}


def _random(shape, seed):
    return backend.xp.asarray(numpy.random.default_rng(seed).standard_normal(shape, dtype=numpy.float32))


def _blocks(n, size):
    return (n + size - 1) // size


def _has_wgmma():
    """wgmma runs on compute capability 9.0 (H100, H200), and on the CPU executor, which emulates it."""
    return backend.runs_wgmma()


def _torch():
    torch = torch_or_none()
    if torch is None or backend.name != "cuda":
        return None
    return torch


def square_versions(a, b, c):
    """{label: (precision, run[, result])} for c = a bᵀ with a: M x K, b: N x K; each run() writes c, or, where
    a third element is given, its own output, which result() returns as a float32 array."""
    (M, K), N = a.shape, b.shape[0]
    sizes = (numpy.int32(M), numpy.int32(N), numpy.int32(K))
    tiled = kernels.function("steps/tf32_matmul_tiled", "tf32_matmul_tiled")
    pipelined = kernels.function("steps/tf32_matmul_tiled", "tf32_matmul_pipelined")
    grid = (_blocks(N, 64), _blocks(M, 64))
    a16, b16 = to_bf16(a)[0], to_bf16(b)[0]
    # where tensor_core_matmul sends a large 2-D product: the label says which kernel ran
    routed = "wgmma" if _has_wgmma() else "mma.sync"
    versions = {
        "TF32 step: 64 x 64 tiles, ldmatrix": ("high", lambda: tiled(grid, (128,), (c, a, b, *sizes))),
        "TF32 step: 3-stage cp.async pipeline": ("high", lambda: pipelined(grid, (128,), (c, a, b, *sizes))),
        "TF32 mma.sync (tf32_matmul<1>)": ("high", lambda: launch_tf32_mma_sync(a, b, c, transpose_b=True)),
        "3xTF32 mma.sync (tf32_matmul<3>)": ("highest", lambda: launch_tf32_mma_sync(a, b, c, transpose_b=True,
                                                                                    products=3)),
        f"TF32 tensor_core_matmul(high) → {routed}": ("high", lambda: tensor_core_matmul(a, b, transpose_b=True, out=c,
                                                                               precision="high")),
        f"3xTF32 tensor_core_matmul(highest) → {routed}": ("highest", lambda: tensor_core_matmul(
            a, b, transpose_b=True, out=c, precision="highest")),
        "bf16 (bf16_matmul on bf16 copies)": ("medium", lambda: launch_bf16_matmul(a16, b16, c, K,
                                                                                      transpose_b=True)),
        f"bf16 with conversion tensor_core_matmul(medium) → {routed}": ("medium", lambda: tensor_core_matmul(
            a, b, transpose_b=True, out=c, precision="medium")),
        "float32 (chapter 01's kernel)": ("float32", lambda: launch_float32_matmul(a, b, c, transpose_b=True)),
    }
    if _has_wgmma():
        versions["bf16 wgmma (wgmma_matmul on bf16 copies)"] = ("medium", lambda: wgmma_matmul(a16, b16, out=c))
        versions["TF32 wgmma"] = ("high", lambda: launch_tf32_wgmma_product(a, b, c, transpose_b=True))
        versions["3xTF32 wgmma"] = ("highest", lambda: launch_tf32_wgmma_product(a, b, c, transpose_b=True,
                                                                                 products=3))
    if backend.name == "cuda":
        versions["cuBLAS float32 (cupy.matmul)"] = ("float32", lambda: backend.xp.matmul(a, b.T, out=c))
    torch = _torch()
    if torch is not None:
        ta, tb, tc = (torch.from_dlpack(x) for x in (a, b, c))
        ta16, tb16 = ta.bfloat16(), tb.bfloat16()

        def torch_tf32():
            torch.backends.cuda.matmul.allow_tf32 = True
            try:
                torch.matmul(ta, tb.T, out=tc)
            finally:
                torch.backends.cuda.matmul.allow_tf32 = False

        versions["cuBLAS TF32 (torch, allow_tf32)"] = ("high", torch_tf32)
        # cuBLAS writes bf16 into its own preallocated bf16 output: the same work as the bf16 kernels, with no
        # allocation and no conversion timed beside it; the check reads that output back as float32.
        tc16 = torch.empty(tc.shape, dtype=torch.bfloat16, device=tc.device)
        versions["cuBLAS bf16 (torch, bf16 tensors)"] = ("medium", lambda: torch.matmul(ta16, tb16.T, out=tc16),
                                                         lambda: backend.xp.from_dlpack(tc16.float()))
    return versions


def seconds(run):
    """Median seconds per call on a GPU; on the CPU executor one call, untimed (nan)."""
    if benchmark.meaningful():
        return benchmark.seconds_per_call(run, warmup=2, repeat=10)
    run()
    return float("nan")


def square(size):
    """{label: {"tflops", "precision", "error_vs_float64"}} at size³ (errors against float64 on the GPU)."""
    xp = backend.xp
    a, b = _random((size, size), 1), _random((size, size), 2)
    reference32 = xp.matmul(a, b.T)
    reference64 = a.astype(xp.float64) @ b.astype(xp.float64).T
    c = xp.empty((size, size), dtype=numpy.float32)
    results = {}
    for label, (precision, run, *own_output) in square_versions(a, b, c).items():
        c.fill(numpy.nan)  # every element must be written
        run()
        result = own_output[0]() if own_output else c
        error = relative_error(result, reference32)
        if not error < TOLERANCE[precision]:
            raise AssertionError(f"{label} at {size}³: relative error {error:.2e} against cuBLAS float32")
        results[label] = {"precision": precision, "error_vs_float64": relative_error(result, reference64),
                          "tflops": 2 * size**3 / seconds(run) / 1e12}
        speed = f"{results[label]['tflops']:.1f} TFLOP/s" if benchmark.meaningful() else "untimed"
        print(f"{size}³ {label}: {speed}, error vs float64 {results[label]['error_vs_float64']:.1e}", flush=True)
    return results


def wgmma_product(product, x, w, dy, dw):
    """A run of one Linear product through wgmma_matmul on bf16 copies of its operands, none transposed."""
    x16, w16, dy16 = (to_bf16(v)[0] for v in (x, w, dy))
    if product.startswith("x Wᵀ"):
        return lambda: wgmma_matmul(x16, w16)
    if product.startswith("dy W"):
        return lambda: wgmma_matmul(dy16, w16, transpose_b=False)
    return lambda: wgmma_matmul(dy16, x16, out=dw, accumulate=True, transpose_a=True, transpose_b=False)


def linear_products(C_in, C_out, rows=GPT2_ROWS):
    """The three products of one Linear layer at each precision, and cuBLAS at the same precision."""
    xp = backend.xp
    x, w, dy = _random((rows, C_in), 3), _random((C_out, C_in), 4), _random((rows, C_out), 5)
    dw = xp.zeros((C_out, C_in), dtype=numpy.float32)
    products = {  # name: (M, N, K, ours(precision), cuBLAS float32 on the same operands)
        "x Wᵀ (forward)": (rows, C_out, C_in, lambda p: tensor_core_matmul(x, w, transpose_b=True, precision=p),
                           lambda: xp.matmul(x, w.T)),
        "dy W (input gradient)": (rows, C_in, C_out, lambda p: tensor_core_matmul(dy, w, precision=p),
                                  lambda: xp.matmul(dy, w)),
        "dW += dyᵀ x (weight gradient)": (C_out, C_in, rows, lambda p: tensor_core_matmul(
            dy, x, transpose_a=True, out=dw, accumulate=True, precision=p), lambda: xp.matmul(dy.T, x)),
    }
    torch = _torch()
    rows_out = []
    for product, (M, N, K, ours, cublas) in products.items():
        flop = 2 * M * N * K
        row = {"product": product, "M": M, "N": N, "K": K}
        for precision in ("highest", "high", "medium"):
            if product.startswith("dW"):
                dw.fill(0)
            error = relative_error(ours(precision), cublas())
            if not error < TOLERANCE[precision]:
                raise AssertionError(f"{product} {M}x{N}x{K} at {precision}: relative error {error:.2e}")
            row[PRECISION_NAMES[precision]] = flop / seconds(lambda: ours(precision)) / 1e12  # noqa: B023
        if _has_wgmma():   # wgmma_matmul on bf16 copies, each operand read as it lies (float32 out)
            wgmma_run = wgmma_product(product, x, w, dy, dw)
            if product.startswith("dW"):
                dw.fill(0)
            error = relative_error(wgmma_run(), cublas())
            if not error < TOLERANCE["medium"]:
                raise AssertionError(f"{product} {M}x{N}x{K} through wgmma: relative error {error:.2e}")
            row["bf16 wgmma"] = flop / seconds(wgmma_run) / 1e12
        if backend.name == "cuda":
            row["cuBLAS float32"] = flop / seconds(cublas) / 1e12
        if torch is not None:
            tx, tw, tdy, tdw = (torch.from_dlpack(v) for v in (x, w, dy, dw))
            operands = {"x Wᵀ (forward)": (tx, tw.T), "dy W (input gradient)": (tdy, tw),
                        "dW += dyᵀ x (weight gradient)": (tdy.T, tx)}[product]
            accumulate = product.startswith("dW")
            bf16 = tuple(v.bfloat16() for v in operands)

            def tf32_run():
                torch.backends.cuda.matmul.allow_tf32 = True
                try:
                    return tdw.addmm_(*operands) if accumulate else torch.matmul(*operands)
                finally:
                    torch.backends.cuda.matmul.allow_tf32 = False

            # bf16 in, bf16 out (cuBLAS's bf16 GEMM), with the weight gradient added to a float32 buffer
            bf16_run = ((lambda: tdw.add_(torch.matmul(*bf16))) if accumulate else (lambda: torch.matmul(*bf16)))
            row["cuBLAS TF32"] = flop / seconds(tf32_run) / 1e12
            row["cuBLAS bf16"] = flop / seconds(bf16_run) / 1e12
        rows_out.append(row)
    return rows_out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="every version once at a small size (any backend)")
    arguments = parser.parse_args(argv)
    if arguments.tiny:
        square(96)
        for row in linear_products(64, 192, rows=80):
            print(f"attention qkv at C = 64, {row['product']}: checked")
        print("every version ran and matched cuBLAS float32 (or numpy) within its precision's tolerance")
        return
    benchmark.require_gpu()
    cupy = backend.xp
    torch = _torch()
    results = {
        "cupy": cupy.__version__,
        "torch": torch.__version__ if torch is not None else None,
        "note": "TFLOP/s = 2*M*N*K / median seconds per call; cuBLAS float32 via cupy.matmul (CUPY_TF32=0), "
                "cuBLAS TF32 and bf16 via torch.matmul; square products are A Bᵀ with B stored N x K",
        "at_4096": square(SQUARE),
        "linear": [],
    }
    for name, (C_in, C_out) in GPT2_LINEARS.items():
        for row in linear_products(C_in, C_out):
            results["linear"].append({"layer": name, **row})
            print(f"{name}, {row['product']}: " + ", ".join(f"{key} {value:.1f}" for key, value in row.items()
                                                          if isinstance(value, float)), flush=True)
    table = [f"\n{backend.device_name()}, {SQUARE}³:"]
    table += [f"  {label:52s} {row['tflops']:7.1f} TFLOP/s  error vs float64 {row['error_vs_float64']:.1e}"
              for label, row in results["at_4096"].items()]
    benchmark.report("tensor_cores", results, table)


if __name__ == "__main__":
    main()
