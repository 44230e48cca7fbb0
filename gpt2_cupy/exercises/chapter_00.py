"""Chapter 00's graded exercises: one thread per element, in one and in two dimensions."""

import numpy

from gpt2_cupy.exercises.checker import Exercise, Input, Output, Scalar, blocks

THREADS_PER_BLOCK = 256
TILE = 16  # matrix_add's blocks are TILE x TILE threads


def _scale_and_add_arguments(size, rng):
    n = size["n"]
    return [Output("out", (n,)),
            Input("x", rng.standard_normal(n, dtype=numpy.float32)),
            Input("y", rng.standard_normal(n, dtype=numpy.float32)),
            Scalar("alpha", numpy.float32(0.1)),
            Scalar("n", numpy.int32(n))]


def _scale_and_add_reference(x, y, alpha, n):
    return {"out": numpy.float64(alpha) * x.astype(numpy.float64) + y.astype(numpy.float64)}


def _matrix_add_arguments(size, rng):
    rows, columns = size["rows"], size["columns"]
    return [Output("out", (rows, columns)),
            Input("a", rng.standard_normal((rows, columns), dtype=numpy.float32)),
            Input("b", rng.standard_normal((rows, columns), dtype=numpy.float32)),
            Scalar("rows", numpy.int32(rows)),
            Scalar("columns", numpy.int32(columns))]


def _matrix_add_launch(size):
    # x walks the columns, y the rows: grid = (blocks along x, blocks along y)
    return (blocks(size["columns"], TILE), blocks(size["rows"], TILE)), (TILE, TILE)


EXERCISES = [
    Exercise(
        id="00.scale_and_add", title="Scale and add (SAXPY): out = alpha * x + y", kernel="scale_and_add",
        arguments=_scale_and_add_arguments,
        launch=lambda size: ((blocks(size["n"], THREADS_PER_BLOCK),), (THREADS_PER_BLOCK,)),
        reference=_scale_and_add_reference,
        sizes=({"n": 1}, {"n": 255}, {"n": 257}, {"n": 3001}),
        # A fused multiply-add rounds once, a multiplication then an addition twice: each rounding is at most
        # 2^-24 of its result, and |alpha x| + |y| stays below 8 for these inputs.
        rtol=2.0**-23, atol=2 * 8 * 2.0**-24),
    Exercise(
        id="00.matrix_add", title="Add two matrices with a two-dimensional grid", kernel="matrix_add",
        arguments=_matrix_add_arguments, launch=_matrix_add_launch,
        reference=lambda a, b, rows, columns: {"out": a.astype(numpy.float64) + b.astype(numpy.float64)},
        sizes=({"rows": 1, "columns": 1}, {"rows": 37, "columns": 53}, {"rows": 16, "columns": 17},
               {"rows": 70, "columns": 48}),
        rtol=2.0**-24),  # one float32 addition: the exact sum rounded once
]
