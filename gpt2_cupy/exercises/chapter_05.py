"""Chapter 05's and 05b's graded exercises: LayerNorm's relatives with a warp per row, and DyT's elementwise
forward and the first stage of its deterministic column sums."""

import numpy

from gpt2_cupy.exercises.checker import Exercise, Input, Output, Scalar, blocks

WARP_SIZE = 32
WARPS_PER_BLOCK = 8  # 256 threads, a row per warp
EPS = 1e-5  # GPT-2's
# (rows, columns): one element; rows shorter than a warp; GPT-2's 768; a length no power of two divides
ROW_SIZES = ({"rows": 1, "columns": 1}, {"rows": 9, "columns": 31}, {"rows": 5, "columns": 768},
             {"rows": 11, "columns": 100})
DYT_SIZES = ({"rows": 1, "columns": 1}, {"rows": 3, "columns": 100}, {"rows": 7, "columns": 33},
             {"rows": 70, "columns": 40})
ROW_SLOTS, COLUMNS_PER_BLOCK, ROWS_PER_BLOCK = 8, 32, 16  # dyt_partial_sums: blocks of (32, 8) threads


def _warp_per_row_launch(size):
    return (blocks(size["rows"], WARPS_PER_BLOCK),), (WARPS_PER_BLOCK * WARP_SIZE,)


def _rows(size, rng):
    return rng.normal(0.5, 2.0, (size["rows"], size["columns"])).astype(numpy.float32)


def _rmsnorm_arguments(size, rng):
    rows, columns = size["rows"], size["columns"]
    return [Output("y", (rows, columns)), Input("x", _rows(size, rng)),
            Input("weight", rng.normal(1.0, 0.3, columns).astype(numpy.float32)),
            Scalar("rows", numpy.int32(rows)), Scalar("columns", numpy.int32(columns)), Scalar("eps", numpy.float32(EPS))]


def _rmsnorm(x, weight, rows, columns, eps):
    z = x.astype(numpy.float64)
    return {"y": weight * z / numpy.sqrt((z * z).mean(axis=-1, keepdims=True) + numpy.float64(eps))}


def _layernorm_backward_arguments(size, rng):
    rows, columns = size["rows"], size["columns"]
    x = _rows(size, rng)
    z = x.astype(numpy.float64)
    mean = z.mean(axis=-1)
    rstd = 1 / numpy.sqrt(((z - mean[:, None]) ** 2).mean(axis=-1) + EPS)
    return [Output("dx", (rows, columns)),
            Input("dout", rng.standard_normal((rows, columns), dtype=numpy.float32)), Input("x", x),
            Input("weight", rng.normal(1.0, 0.3, columns).astype(numpy.float32)),
            Input("mean", mean.astype(numpy.float32)), Input("rstd", rstd.astype(numpy.float32)),
            Scalar("rows", numpy.int32(rows)), Scalar("columns", numpy.int32(columns))]


def _layernorm_backward(dout, x, weight, mean, rstd, rows, columns):
    # dx = rstd (g - mean(g) - x_hat mean(g x_hat)), g = weight dout, from the float32 mean and rstd given
    rstd = rstd.astype(numpy.float64)[:, None]
    x_hat = (x.astype(numpy.float64) - mean.astype(numpy.float64)[:, None]) * rstd
    g = weight.astype(numpy.float64) * dout
    return {"dx": rstd * (g - g.mean(axis=-1, keepdims=True) - x_hat * (g * x_hat).mean(axis=-1, keepdims=True))}


def _dyt_forward_arguments(size, rng):
    rows, columns = size["rows"], size["columns"]
    return [Output("y", (rows, columns)), Input("x", _rows(size, rng)), Input("alpha", numpy.array([0.6], numpy.float32)),
            Input("weight", rng.normal(1.0, 0.3, columns).astype(numpy.float32)),
            Input("bias", rng.normal(0.0, 0.3, columns).astype(numpy.float32)),
            Scalar("n", numpy.int32(rows * columns)), Scalar("columns", numpy.int32(columns))]


def _dyt_forward(x, alpha, weight, bias, n, columns):
    return {"y": weight * numpy.tanh(alpha.astype(numpy.float64) * x) + bias}


def _dyt_partial_sums_arguments(size, rng):
    rows, columns = size["rows"], size["columns"]
    row_blocks = blocks(rows, ROWS_PER_BLOCK)
    return [Output("weight_partials", (row_blocks, columns)), Output("bias_partials", (row_blocks, columns)),
            Input("dout", rng.standard_normal((rows, columns), dtype=numpy.float32)), Input("x", _rows(size, rng)),
            Input("alpha", numpy.array([0.6], numpy.float32)), Scalar("rows", numpy.int32(rows)),
            Scalar("columns", numpy.int32(columns)), Scalar("rows_per_block", numpy.int32(ROWS_PER_BLOCK))]


def _dyt_partial_sums(dout, x, alpha, rows, columns, rows_per_block):
    t = numpy.tanh(alpha.astype(numpy.float64) * x)
    row_blocks = blocks(rows, rows_per_block)
    padded = row_blocks * rows_per_block - rows  # zero rows, so that every block sums rows_per_block rows
    pad = lambda a: numpy.concatenate([a, numpy.zeros((padded, columns))]).reshape(row_blocks, rows_per_block, columns)
    return {"weight_partials": pad(dout * t).sum(axis=1), "bias_partials": pad(dout.astype(numpy.float64)).sum(axis=1)}


EXERCISES = [
    Exercise(
        id="05.rmsnorm_forward", title="RMSNorm forward, a warp per row", kernel="rmsnorm_forward",
        arguments=_rmsnorm_arguments, launch=_warp_per_row_launch, reference=_rmsnorm, sizes=ROW_SIZES,
        rtol=1e-5, atol=1e-6),  # a sum of 768 squares and an rsqrt, each a few float32 roundings
    Exercise(
        id="05.layernorm_backward_dx", title="LayerNorm's dx, a warp per row", kernel="layernorm_backward_dx",
        arguments=_layernorm_backward_arguments, launch=_warp_per_row_launch, reference=_layernorm_backward,
        sizes=ROW_SIZES,
        # dx is a difference of terms of size |g| rstd ~ 1, with two row means of 768 terms: a few 1e-7
        # absolute, far larger relative where the difference cancels.
        rtol=1e-4, atol=1e-5),
    Exercise(
        id="05b.dyt_forward", title="DyT forward, one thread per element", kernel="dyt_forward",
        arguments=_dyt_forward_arguments,
        launch=lambda size: ((blocks(size["rows"] * size["columns"], 256),), (256,)),
        reference=_dyt_forward, sizes=DYT_SIZES,
        rtol=1e-5, atol=1e-6),  # tanhf is within a few units in the last place
    Exercise(
        id="05b.dyt_partial_sums", title="DyT's weight and bias gradients: partial column sums in a fixed order",
        kernel="dyt_partial_sums", arguments=_dyt_partial_sums_arguments,
        launch=lambda size: ((blocks(size["columns"], COLUMNS_PER_BLOCK), blocks(size["rows"], ROWS_PER_BLOCK)),
                             (COLUMNS_PER_BLOCK, ROW_SLOTS)),
        reference=_dyt_partial_sums, sizes=DYT_SIZES,
        rtol=1e-5, atol=1e-5),  # sums of at most 16 terms of size ~1
]
