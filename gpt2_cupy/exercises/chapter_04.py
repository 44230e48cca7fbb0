"""Chapter 04's and 04b's graded exercises: row kernels with a warp per row and shuffles, and long rows with a
block per row."""

import numpy

from gpt2_cupy.exercises.checker import Exercise, Input, Output, Scalar, blocks

WARP_SIZE = 32
WARPS_PER_BLOCK = 8  # 256 threads, a row per warp
# (rows, columns, largest |x|): one element; rows that leave warps of the last block idle; rows shorter
# than a warp, longer than one, not multiples of 32; and inputs up to 1e4, where exp overflows float32
# unless the maximum is subtracted.
SIZES = ({"rows": 1, "columns": 1, "largest": 3}, {"rows": 5, "columns": 31, "largest": 3},
         {"rows": 9, "columns": 100, "largest": 3}, {"rows": 3, "columns": 1000, "largest": 10000})


def _row_arguments(outputs):
    def arguments(size, rng):
        rows, columns, largest = size["rows"], size["columns"], size["largest"]
        if largest > 100:
            x = rng.uniform(-largest, largest, (rows, columns)).astype(numpy.float32)
        else:
            x = rng.normal(0.0, largest, (rows, columns)).astype(numpy.float32)
        return [*outputs(rows, columns), Input("x", x), Scalar("rows", numpy.int32(rows)),
                Scalar("columns", numpy.int32(columns))]
    return arguments


def _launch(size):
    return (blocks(size["rows"], WARPS_PER_BLOCK),), (WARPS_PER_BLOCK * WARP_SIZE,)


def _log_softmax(x, rows, columns):
    z = x.astype(numpy.float64)
    shifted = z - z.max(axis=-1, keepdims=True)
    return {"out": shifted - numpy.log(numpy.exp(shifted).sum(axis=-1, keepdims=True))}


def _maximum_and_sum(x, rows, columns):
    z = x.astype(numpy.float64)
    maximum = z.max(axis=-1)
    return {"maximum": maximum, "sum": numpy.exp(z - maximum[:, None]).sum(axis=-1)}


EXERCISES = [
    Exercise(
        id="04.log_softmax", title="log-softmax, a warp per row", kernel="log_softmax_forward",
        arguments=_row_arguments(lambda rows, columns: [Output("out", (rows, columns))]),
        launch=_launch, reference=_log_softmax, sizes=SIZES,
        # out = z - m - log(d): float32 rounds z - m (up to 2e4) to 2^-24 of itself, and log(d) (d <= 1000
        # terms, each rounded) to a few 1e-7 of log(d) <= 7.
        rtol=1e-6, atol=1e-5),
    Exercise(
        id="04.online_max_and_sum", title="The online maximum and sum of a row, one pass, a warp per row",
        kernel="online_max_and_sum",
        arguments=_row_arguments(lambda rows, columns: [Output("maximum", (rows,)), Output("sum", (rows,))]),
        launch=_launch, reference=_maximum_and_sum, sizes=SIZES,
        # The maximum is one of the inputs, exactly; the sum of up to 1000 terms in (0, 1], each rescaled
        # a few times, is off by a few float32 roundings of the sum.
        rtol=1e-5, atol=0.0),
]


# ---- Chapter 04b: long rows, a block per row ----------------------------------------------------------------

BLOCK_THREADS = 256
BLOCKS_MULTIPLE = 8  # the grid is rounded up to a multiple of 8 blocks: a block past the last row must do nothing
# (rows, columns): one element; rows shorter than the block; longer, not multiples of anything; a long row
LONG_ROW_SIZES = ({"rows": 1, "columns": 1}, {"rows": 3, "columns": 100}, {"rows": 5, "columns": 1001},
                  {"rows": 2, "columns": 4099})


def _block_per_row_launch(size):
    return (blocks(size["rows"], BLOCKS_MULTIPLE) * BLOCKS_MULTIPLE,), (BLOCK_THREADS,)


def _online_block_arguments(size, rng):
    rows, columns = size["rows"], size["columns"]
    return [Output("y", (rows, columns)), Input("x", rng.normal(0.0, 3.0, (rows, columns)).astype(numpy.float32)),
            Scalar("rows", numpy.int32(rows)), Scalar("columns", numpy.int32(columns))]


def _softmax(x, rows, columns):
    z = x.astype(numpy.float64)
    e = numpy.exp(z - z.max(axis=-1, keepdims=True))
    return {"y": e / e.sum(axis=-1, keepdims=True)}


def _backward_block_arguments(size, rng):
    rows, columns = size["rows"], size["columns"]
    y = _softmax(rng.normal(0.0, 3.0, (rows, columns)), rows, columns)["y"].astype(numpy.float32)
    return [Output("dx", (rows, columns)), Input("dout", rng.standard_normal((rows, columns), dtype=numpy.float32)),
            Input("y", y), Scalar("rows", numpy.int32(rows)), Scalar("columns", numpy.int32(columns)),
            Scalar("scale", numpy.float32(0.125))]


def _softmax_backward(dout, y, rows, columns, scale):
    dout, y = dout.astype(numpy.float64), y.astype(numpy.float64)
    return {"dx": numpy.float64(scale) * y * (dout - (dout * y).sum(axis=-1, keepdims=True))}


EXERCISES += [
    Exercise(
        id="04b.online_block", title="Softmax of long rows: the online (m, d) over a block", kernel="softmax_online_block",
        arguments=_online_block_arguments, launch=_block_per_row_launch, reference=_softmax, sizes=LONG_ROW_SIZES,
        # y is at most 1: a few float32 roundings of each term and of the sum of up to 4099 terms
        rtol=1e-5, atol=1e-7),
    Exercise(
        id="04b.backward_block", title="Softmax backward of long rows: a block's dot product", kernel="softmax_backward_block",
        arguments=_backward_block_arguments, launch=_block_per_row_launch, reference=_softmax_backward,
        sizes=LONG_ROW_SIZES,
        # dx = s y (dout - dot): the dot product of up to 4099 terms rounds to a few 1e-7, times y <= 1
        rtol=1e-4, atol=1e-7),
]
