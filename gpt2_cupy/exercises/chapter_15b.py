"""Chapter 15b's graded exercises: pieces of the Hopper GEMM's levels, on wgmma (compiled for sm_90a)."""

import numpy

from gpt2_cupy.exercises.checker import Exercise, Input, Output, Scalar, blocks
from gpt2_cupy.precision import bf16_bits, bf16_values

OPTIONS = ("-arch=sm_90a",)
BLOCK_M, BLOCK_N, SLICE_K = 64, 128, 64        # kernels/include/hopper_levels.cuh, level 1
SHARED_BYTES = (BLOCK_M + BLOCK_N) * SLICE_K * 2 + 1024
# bf16 inputs are exact in float64, so what is left is float32 summation over K <= 256 terms of size ~1.
# Ragged M stops a few rows short of a tile: a store without its row check then lands within the checker's
# guard region after C (on a GPU, which has no bounds check, the guard is what sees it).
RTOL, ATOL = 1e-5, 1e-4


def _bf16_bits(rng, shape):
    """Random bf16 values as their bits (uint16): standard normal float32, rounded to nearest."""
    return bf16_bits(rng.standard_normal(shape, dtype=numpy.float32))


def _store_arguments(size, rng):
    M, N, K = size["M"], size["N"], size["K"]
    return [Output("C", (M, N)), Input("A", _bf16_bits(rng, (M, K))), Input("B", _bf16_bits(rng, (N, K))),
            Scalar("M", numpy.int32(M)), Scalar("N", numpy.int32(N)), Scalar("K", numpy.int32(K))]


def _split_arguments(size, rng):
    M, N, K, S = size["M"], size["N"], size["K"], size["stretches"]
    return [Output("partials", (S, M, N)), Input("A", _bf16_bits(rng, (M, K))), Input("B", _bf16_bits(rng, (N, K))),
            Scalar("M", numpy.int32(M)), Scalar("N", numpy.int32(N)), Scalar("K", numpy.int32(K)),
            Scalar("stretches", numpy.int32(S))]


def _partial_sums(A, B, M, N, K, stretches):
    """Stretch s's share of A Bᵀ: the sum over k in [s K / stretches, (s + 1) K / stretches)."""
    a, b, length = bf16_values(A), bf16_values(B), K // stretches
    return {"partials": numpy.stack([a[:, s * length:(s + 1) * length] @ b[:, s * length:(s + 1) * length].T
                                     for s in range(stretches)])}


EXERCISES = [
    Exercise(
        id="15b.accumulator_store", title="A warpgroup's accumulator to C", kernel="wgmma_tile_store",
        arguments=_store_arguments,
        launch=lambda size: ((size["N"] // BLOCK_N, blocks(size["M"], BLOCK_M)), (128,), SHARED_BYTES),
        reference=lambda A, B, M, N, K: {"C": bf16_values(A) @ bf16_values(B).T},
        sizes=({"M": 64, "N": 128, "K": 64}, {"M": 61, "N": 128, "K": 128}, {"M": 190, "N": 256, "K": 192}),
        rtol=RTOL, atol=ATOL, options=OPTIONS),
    Exercise(
        id="15b.split_k", title="Split K: a stretch of K per block, a slab per stretch", kernel="wgmma_split_k",
        arguments=_split_arguments,
        launch=lambda size: ((size["N"] // BLOCK_N, blocks(size["M"], BLOCK_M), size["stretches"]), (128,),
                             SHARED_BYTES),
        reference=_partial_sums,
        sizes=({"M": 64, "N": 128, "K": 128, "stretches": 2}, {"M": 61, "N": 128, "K": 192, "stretches": 3},
               {"M": 126, "N": 256, "K": 256, "stretches": 2}),
        rtol=RTOL, atol=ATOL, options=OPTIONS),
]
