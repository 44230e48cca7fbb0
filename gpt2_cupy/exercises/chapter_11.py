"""Chapter 11's graded exercises: the two ways a gradient reaches a leaf's buffer, both added in place."""

import numpy

from gpt2_cupy.exercises.checker import Exercise, Input, Output, Scalar, blocks

THREADS_PER_BLOCK = 256


def _accumulate_arguments(size, rng):
    n = size["n"]
    return [Output("grad", (n,), initial=rng.standard_normal(n, dtype=numpy.float32)),   # what earlier passes left
            Input("gradient", rng.standard_normal(n, dtype=numpy.float32)),
            Scalar("n", numpy.int32(n))]


def _broadcast_arguments(size, rng):
    rows, columns = size["rows"], size["columns"]
    return [Output("dbias", (columns,), initial=rng.standard_normal(columns, dtype=numpy.float32)),
            Input("dout", rng.standard_normal((rows, columns), dtype=numpy.float32)),
            Scalar("rows", numpy.int32(rows)),
            Scalar("columns", numpy.int32(columns))]


EXERCISES = [
    Exercise(
        id="11.accumulate_gradient", title="Add a leaf's gradient into its buffer, in place",
        kernel="accumulate_gradient",
        arguments=_accumulate_arguments,
        launch=lambda size: ((blocks(size["n"], THREADS_PER_BLOCK),), (THREADS_PER_BLOCK,)),
        reference=lambda grad, gradient, n: {"grad": grad.astype(numpy.float64) + gradient.astype(numpy.float64)},
        sizes=({"n": 1}, {"n": 255}, {"n": 257}, {"n": 3001}),
        rtol=2.0**-24, atol=2.0**-24),  # one float32 addition, rounded once (atol: sums that cancel to near 0)
    Exercise(
        id="11.broadcast_gradient", title="The gradient of a broadcast bias: a sum over the rows, added in place",
        kernel="broadcast_gradient",
        arguments=_broadcast_arguments,
        launch=lambda size: ((blocks(size["columns"], THREADS_PER_BLOCK),), (THREADS_PER_BLOCK,)),
        reference=lambda dbias, dout, rows, columns: {"dbias": dbias.astype(numpy.float64)
                                                      + dout.astype(numpy.float64).sum(axis=0)},
        sizes=({"rows": 1, "columns": 1}, {"rows": 7, "columns": 255}, {"rows": 33, "columns": 257},
               {"rows": 64, "columns": 1000}),
        rtol=1e-5, atol=1e-5),  # float32 sums of up to 65 terms of size 1
]
