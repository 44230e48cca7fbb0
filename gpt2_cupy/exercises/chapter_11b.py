"""Chapter 11b's graded exercises: LayerNorm's elementwise tail fused by hand, and its row statistics in one
kernel."""

import numpy

from gpt2_cupy.exercises.checker import Exercise, Input, Output, Scalar, blocks

THREADS_PER_BLOCK = 256
ROW_THREADS = 128   # row_mean_rstd: one block of this many threads per row
EPS = 1e-5


def _tail_arguments(size, rng):
    rows, columns = size["rows"], size["columns"]
    return [Output("out", (rows, columns)),
            Input("x", rng.standard_normal((rows, columns), dtype=numpy.float32)),
            Input("mean", rng.standard_normal(rows, dtype=numpy.float32) * numpy.float32(0.1)),
            Input("rstd", rng.uniform(0.5, 2.0, rows).astype(numpy.float32)),
            Input("weight", rng.standard_normal(columns, dtype=numpy.float32)),
            Input("bias", rng.standard_normal(columns, dtype=numpy.float32)),
            Scalar("rows", numpy.int32(rows)),
            Scalar("columns", numpy.int32(columns))]


def _tail_reference(x, mean, rstd, weight, bias, rows, columns):
    f = numpy.float64
    return {"out": (x.astype(f) - mean.astype(f)[:, None]) * rstd.astype(f)[:, None] * weight.astype(f)
            + bias.astype(f)}


def _statistics_arguments(size, rng):
    rows, columns = size["rows"], size["columns"]
    x = rng.standard_normal((rows, columns), dtype=numpy.float32) * numpy.float32(2.0) + numpy.float32(3.0)
    return [Output("mean", (rows,)), Output("rstd", (rows,)), Input("x", x),
            Scalar("columns", numpy.int32(columns)), Scalar("eps", numpy.float32(EPS))]


def _statistics_reference(x, columns, eps):
    x = x.astype(numpy.float64)
    return {"mean": x.mean(axis=1), "rstd": 1.0 / numpy.sqrt(x.var(axis=1) + numpy.float64(eps))}


EXERCISES = [
    Exercise(
        id="11b.layernorm_tail", title="LayerNorm's four elementwise launches as one kernel",
        kernel="layernorm_tail",
        arguments=_tail_arguments,
        launch=lambda size: ((blocks(size["rows"] * size["columns"], THREADS_PER_BLOCK),), (THREADS_PER_BLOCK,)),
        reference=_tail_reference,
        sizes=({"rows": 1, "columns": 1}, {"rows": 3, "columns": 85}, {"rows": 17, "columns": 64},
               {"rows": 9, "columns": 333}),
        rtol=1e-6, atol=1e-6),  # four float32 operations, each rounded
    Exercise(
        id="11b.row_mean_rstd", title="A row's mean and 1/std in one kernel, a block per row",
        kernel="row_mean_rstd",
        arguments=_statistics_arguments,
        launch=lambda size: ((size["rows"],), (ROW_THREADS,)),
        reference=_statistics_reference,
        sizes=({"rows": 1, "columns": 1}, {"rows": 3, "columns": 100}, {"rows": 5, "columns": 128},
               {"rows": 4, "columns": 769}),
        rtol=1e-5, atol=1e-6),  # float32 sums over up to 769 columns
]
