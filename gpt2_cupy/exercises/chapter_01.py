"""Chapter 01's graded exercises: matrix products with shared-memory tiles."""

import numpy

from gpt2_cupy.exercises.checker import Exercise, Input, Output, Scalar, blocks

TILE = 32
# (M, N, K): one element; sizes that leave ragged edge tiles in every dimension; K over several tiles
SIZES = ({"M": 1, "N": 1, "K": 1}, {"M": 33, "N": 65, "K": 47}, {"M": 70, "N": 31, "K": 100})
# A sum of K products is rounded at most K times, each time by 2^-24 of the partial sum: for standard
# normal inputs and K <= 100 the error stays far below 1e-4 (random signs make it smaller still).
RTOL, ATOL = 1e-5, 1e-4


def _product_arguments(transpose_b):
    def arguments(size, rng):
        M, N, K = size["M"], size["N"], size["K"]
        return [Output("C", (M, N)),
                Input("A", rng.standard_normal((M, K), dtype=numpy.float32)),
                Input("B", rng.standard_normal((N, K) if transpose_b else (K, N), dtype=numpy.float32)),
                Scalar("M", numpy.int32(M)), Scalar("N", numpy.int32(N)), Scalar("K", numpy.int32(K))]
    return arguments


def _product(A, B, M, N, K):
    return {"C": A.astype(numpy.float64) @ B.astype(numpy.float64)}


def _product_transposed_b(A, B, M, N, K):
    return {"C": A.astype(numpy.float64) @ B.astype(numpy.float64).T}


EXERCISES = [
    Exercise(
        id="01.column_blocked", title="Tiles in shared memory, four outputs per thread", kernel="matmul_column_blocked",
        arguments=_product_arguments(transpose_b=False),
        launch=lambda size: ((blocks(size["N"], TILE), blocks(size["M"], TILE)), (TILE, 8)),
        reference=_product, sizes=SIZES, rtol=RTOL, atol=ATOL),
    Exercise(
        id="01.tiled_transposed_b", title="C = A Bᵀ with shared-memory tiles", kernel="matmul_tiled_transposed_b",
        arguments=_product_arguments(transpose_b=True),
        launch=lambda size: ((blocks(size["N"], TILE), blocks(size["M"], TILE)), (TILE, TILE)),
        reference=_product_transposed_b, sizes=SIZES, rtol=RTOL, atol=ATOL),
]
