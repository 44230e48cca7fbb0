"""Chapter 02's graded exercises: the bias gradient, a column sum added into its buffer."""

import numpy

from gpt2_cupy.exercises.checker import Exercise, Input, Output, Scalar, blocks

STRIP = 32        # columns per block in column_sum_strip
ROWS_OF_THREADS = 8
SIZES = ({"rows": 1, "columns": 1}, {"rows": 111, "columns": 37}, {"rows": 300, "columns": 70})
# A float32 sum of n terms is off by at most about n 2^-24 (sum of |terms|): for these 300 standard normal
# rows that is below 4e-3 in the worst case; random signs keep it near sqrt(n) 2^-24 |terms|, far below 5e-4.
RTOL, ATOL = 1e-5, 5e-4


def _column_sum_arguments(size, rng):
    rows, columns = size["rows"], size["columns"]
    return [Output("sums", (columns,), initial=rng.standard_normal(columns, dtype=numpy.float32)),
            Input("matrix", rng.standard_normal((rows, columns), dtype=numpy.float32)),
            Scalar("rows", numpy.int32(rows)), Scalar("columns", numpy.int32(columns))]


def _column_sums_added(sums, matrix, rows, columns):
    return {"sums": sums.astype(numpy.float64) + matrix.astype(numpy.float64).sum(axis=0)}


EXERCISES = [
    Exercise(
        id="02.column_sum_strip", title="Bias gradient: a block of 32 x 8 threads per strip of 32 columns",
        kernel="column_sum_strip", arguments=_column_sum_arguments,
        launch=lambda size: ((blocks(size["columns"], STRIP),), (STRIP, ROWS_OF_THREADS)),
        reference=_column_sums_added, sizes=SIZES, rtol=RTOL, atol=ATOL),
    Exercise(
        id="02.column_sum_block_per_column", title="Bias gradient: one block per column, shuffles and shared memory",
        kernel="column_sum_block_per_column", arguments=_column_sum_arguments,
        launch=lambda size: ((size["columns"],), (256,)),
        reference=_column_sums_added, sizes=SIZES, rtol=RTOL, atol=ATOL),
]
