"""TFLOP/s of chapter 15b's Hopper GEMM levels against cuBLAS, on an H100 or H200.

    python -m bench.hopper_levels            writes bench/hopper_levels.json (GPU only)
    python -m bench.hopper_levels --tiny     on any backend: runs every level once at a small size and checks it

Each level (kernels/steps/hopper_level*.cu) computes C = A Bᵀ with bf16 A (M x K) and B (N x K), float32 C.
At each size every level, chapter 15a's mma.sync bf16 kernel, the shipped kernel (gpt2_cupy.ops.wgmma_matmul) and cuBLAS (torch.matmul on the
same bf16 tensors, with `out=` into a preallocated output of its own dtype, bf16: no allocation and no
conversion is timed) run in the same process; each result is checked against float64 before it is timed.
chapters/15b_hopper_gemm.ipynb imports this file.
"""

import argparse
import functools
from dataclasses import dataclass

import numpy

from gpt2_cupy import backend, benchmark, kernels
from gpt2_cupy.ops.tensor_core_matmul import launch_bf16_matmul
from gpt2_cupy.ops.wgmma_matmul import wgmma_matmul
from gpt2_cupy.precision import bf16_bits, bf16_values
from gpt2_cupy.tensor_map import tensor_map
from gpt2_cupy.testing import relative_error, torch_or_none

OPTIONS = ("-arch=sm_90a",)
SLICE_K = 64                                  # kernels/include/hopper_levels.cuh
BLOCK_N = 128
SIZES = ((4096, 4096, 4096), (8192, 768, 3072))   # square, and GPT-2's MLP down projection (B*T = 8192)
TOLERANCE = 1e-5                              # bf16 inputs are exact in float64; float32 sums of K terms


@dataclass(frozen=True)
class Level:
    """One level's kernel and launch: block rows, threads, dynamic shared bytes, and how it finds its operands."""
    file: str
    kernel: str
    block_m: int
    threads: int
    shared_bytes: int = 0
    tma: bool = True          # operands by tensor map (else by pointer)
    persistent: bool = False  # one block per multiprocessor, walking the tiles
    splits: int = 1           # stretches of K, each into its own slab of partial sums


def _stage_bytes(block_m):
    return block_m * SLICE_K * 2 + BLOCK_N * SLICE_K * 2


LEVELS = {
    "L1 cp.async, one stage": Level("steps/hopper_level1_cp_async", "hopper_level1", 64, 128, _stage_bytes(64) + 1024,
                                   tma=False),
    "L2 TMA, two stages": Level("steps/hopper_level2_tma", "hopper_level2", 64, 128, 2 * _stage_bytes(64) + 1024),
    "L3 producer warp, ring of 4": Level("steps/hopper_level3_producer", "hopper_level3", 64, 160,
                                         4 * _stage_bytes(64) + 1024),
    "L4 two consumer warpgroups": Level("steps/hopper_level4_two_consumers", "hopper_level4", 128, 288,
                                        4 * _stage_bytes(128) + 1024),
    "L5 persistent, grouped tile order": Level("steps/hopper_level5_persistent", "hopper_level5", 128, 288,
                                               4 * _stage_bytes(128) + 1024, persistent=True),
    "L6 ping-pong": Level("steps/hopper_level6_ping_pong", "hopper_level6", 128, 288, 4 * _stage_bytes(128) + 1024,
                          persistent=True),
    "L7 split-K in 4 stretches": Level("steps/hopper_level7_split_k", "hopper_level7", 128, 288,
                                       4 * _stage_bytes(128) + 1024, splits=4),
}


def _bf16_bits(x):
    """float32 numpy -> the nearest bf16 values' bits (uint16) on the backend, and those values as float64 numpy."""
    bits = bf16_bits(x)
    return backend.xp.asarray(bits), bf16_values(bits)


def check_sizes(level, M, N, K):
    """ValueError unless the level's whole-tile sizes hold."""
    if M % level.block_m or N % BLOCK_N or K % (SLICE_K * level.splits):
        raise ValueError(f"{level.kernel} takes M a multiple of {level.block_m}, N of {BLOCK_N} and K of "
                         f"{SLICE_K * level.splits}; got {M} x {N} x {K}")


def launch(level, a, b, c, blocks=None, source=None):
    """c = a bᵀ by `level`: a (M x K) and b (N x K) bf16 bits on the backend, c (M x N) float32. blocks: how
    many blocks a persistent level runs (default one per multiprocessor, at most one per tile). source: the
    level's CUDA C to compile instead of its file in kernels/ (a chapter's cell)."""
    (M, K), N = a.shape, b.shape[0]
    check_sizes(level, M, N, K)
    kernel = (kernels.function(level.file, level.kernel, options=OPTIONS) if source is None
              else _compiled(source, level.kernel))
    if kernel.max_dynamic_shared_size_bytes < level.shared_bytes:   # past 48 KiB a block must ask
        kernel.max_dynamic_shared_size_bytes = level.shared_bytes
    sizes = (numpy.int32(M), numpy.int32(N), numpy.int32(K))
    if not level.tma:
        return kernel((N // BLOCK_N, M // level.block_m), (level.threads,), (c, a, b, *sizes),
                      shared_mem=level.shared_bytes)
    a_map = tensor_map(a, level.block_m, SLICE_K)
    b_map = tensor_map(b, BLOCK_N, SLICE_K)
    if level.persistent:
        tiles = (M // level.block_m) * (N // BLOCK_N)
        grid = (blocks or min(tiles, backend.multiprocessor_count()),)
    else:
        grid = (N // BLOCK_N, M // level.block_m, level.splits)
    target = c if level.splits == 1 else backend.xp.empty((level.splits, M, N), dtype=numpy.float32)
    kernel(grid, (level.threads,), (target, a_map, b_map, *sizes), shared_mem=level.shared_bytes)
    if level.splits > 1:
        c[...] = target[0]
        for stretch in range(1, level.splits):   # in stretch order: the same sums every run
            c += target[stretch]
    return c


@functools.lru_cache(maxsize=None)
def _compiled(source, kernel_name):
    return backend.RawModule(code=source, options=OPTIONS).get_function(kernel_name)


def check(level, M, N, K, seed=0, blocks=None, source=None):
    """The relative error of `level` against float64 numpy on random bf16 inputs of M x N x K."""
    rng = numpy.random.default_rng(seed)
    (a, a64), (b, b64) = (_bf16_bits(rng.standard_normal(shape, dtype=numpy.float32)) for shape in ((M, K), (N, K)))
    c = backend.xp.full((M, N), numpy.nan, dtype=numpy.float32)
    launch(level, a, b, c, blocks, source)
    return relative_error(c, a64 @ b64.T)


def time_all(M, N, K, sources=None):
    """{label: TFLOP/s} of every level, chapter 15a's mma.sync kernel, the shipped kernel and cuBLAS at M x N x K,
    in one run. sources: {level label: CUDA C} to compile instead of the files (a chapter's cells, compiled once)."""
    sources = sources or {}
    rng = numpy.random.default_rng(1)
    (a, a64), (b, b64) = (_bf16_bits(rng.standard_normal(shape, dtype=numpy.float32)) for shape in ((M, K), (N, K)))
    reference = a64 @ b64.T
    c = backend.xp.empty((M, N), dtype=numpy.float32)
    runs = {label: (lambda level=level, source=sources.get(label): launch(level, a, b, c, source=source))
            for label, level in LEVELS.items()}
    runs["15a's mma.sync bf16 kernel"] = lambda: launch_bf16_matmul(a, b, c, K, transpose_b=True)
    runs["shipped wgmma_matmul"] = lambda: wgmma_matmul(a, b, out=c)
    speeds = {}
    for label, run in runs.items():
        c.fill(numpy.nan)
        run()
        error = relative_error(c, reference)
        if not error < TOLERANCE:
            raise AssertionError(f"{label} at {M} x {N} x {K}: relative error {error:.1e} against float64")
        speeds[label] = 2 * M * N * K / benchmark.seconds_per_call(run, warmup=2, repeat=10) / 1e12
    torch = torch_or_none()
    if torch is not None:
        # the same bf16 values (exact in float32), as bf16 tensors; cuBLAS writes its own dtype into tc16
        ta, tb = (torch.from_dlpack(backend.xp.asarray(x.astype(numpy.float32))).bfloat16() for x in (a64, b64))
        tc16 = torch.empty((M, N), dtype=torch.bfloat16, device=ta.device)
        torch.matmul(ta, tb.T, out=tc16)
        error = relative_error(backend.xp.from_dlpack(tc16.float()), reference)
        if not error < 1e-2:   # rounded once to bf16 (u = 2^-8)
            raise AssertionError(f"cuBLAS bf16 at {M} x {N} x {K}: relative error {error:.1e} against float64")
        speeds["cuBLAS bf16 (torch.matmul, out=)"] = 2 * M * N * K / benchmark.seconds_per_call(
            lambda: torch.matmul(ta, tb.T, out=tc16), warmup=2, repeat=10) / 1e12
    return speeds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="every level once at a small size (any backend)")
    arguments = parser.parse_args(argv)
    if arguments.tiny:
        for label, level in LEVELS.items():
            # 6 tiles, 5 slices each (more than a ring's 4 stages); a persistent level on 2 blocks of 3 tiles
            error = check(level, 2 * level.block_m, 3 * BLOCK_N, 5 * SLICE_K * level.splits, blocks=2)
            print(f"{label}: relative error {error:.1e} against float64")
            assert error < TOLERANCE
        return
    benchmark.require_gpu()
    results = {"note": "TFLOP/s = 2*M*N*K / median seconds per call; C = A Bᵀ, bf16 A and B, float32 C for ours, "
                       "bf16 C for cuBLAS (torch.matmul with out=)",
               "bf16_peak_tflops": benchmark.tensor_core_peak_tflops("bf16"), "sizes": {}}
    table = [f"\n{backend.device_name()}:"]
    for M, N, K in SIZES:
        speeds = time_all(M, N, K)
        results["sizes"][f"{M}x{N}x{K}"] = speeds
        table += [f"  {M} x {N} x {K} {label:36s} {tflops:7.1f} TFLOP/s" for label, tflops in speeds.items()]
    benchmark.report("hopper_levels", results, table)


if __name__ == "__main__":
    main()
