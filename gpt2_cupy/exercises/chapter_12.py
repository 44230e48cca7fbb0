"""Chapter 12's graded exercises: c_fc's bias fused with the GELU, and the tied lm_head's share of the
embedding's gradient."""

import numpy

from gpt2_cupy.exercises.checker import Exercise, Input, Output, Scalar, blocks

THREADS_PER_BLOCK = 256
TILE = 16  # tied_head_gradient's blocks are TILE x TILE threads


def _bias_gelu_arguments(size, rng):
    rows, columns = size["rows"], size["columns"]
    return [Output("out", (rows, columns)),
            Input("x", rng.standard_normal((rows, columns), dtype=numpy.float32) * numpy.float32(2.0)),
            Input("bias", rng.standard_normal(columns, dtype=numpy.float32)),
            Scalar("rows", numpy.int32(rows)),
            Scalar("columns", numpy.int32(columns))]


def _bias_gelu_reference(x, bias, rows, columns):
    h = x.astype(numpy.float64) + bias.astype(numpy.float64)
    return {"out": 0.5 * h * (1 + numpy.tanh(numpy.sqrt(2 / numpy.pi) * (h + 0.044715 * h**3)))}


def _tied_arguments(size, rng):
    rows, vocab, channels = size["rows"], size["vocab"], size["channels"]
    return [Output("dwte", (vocab, channels), initial=rng.standard_normal((vocab, channels), dtype=numpy.float32)),
            Input("dlogits", rng.standard_normal((rows, vocab), dtype=numpy.float32)),
            Input("x", rng.standard_normal((rows, channels), dtype=numpy.float32)),
            Scalar("rows", numpy.int32(rows)),
            Scalar("vocab", numpy.int32(vocab)),
            Scalar("channels", numpy.int32(channels))]


def _tied_reference(dwte, dlogits, x, rows, vocab, channels):
    f = numpy.float64
    return {"dwte": dwte.astype(f) + dlogits.astype(f).T @ x.astype(f)}


EXERCISES = [
    Exercise(
        id="12.bias_gelu", title="c_fc's bias and the GELU in one pass", kernel="bias_gelu",
        arguments=_bias_gelu_arguments,
        launch=lambda size: ((blocks(size["rows"] * size["columns"], THREADS_PER_BLOCK),), (THREADS_PER_BLOCK,)),
        reference=_bias_gelu_reference,
        sizes=({"rows": 1, "columns": 1}, {"rows": 5, "columns": 77}, {"rows": 8, "columns": 256},
               {"rows": 13, "columns": 300}),
        rtol=1e-5, atol=1e-6),  # tanhf is within a few ulp; near GELU's zero the absolute error counts
    Exercise(
        id="12.tied_head_gradient", title="The tied lm_head's share of the embedding's gradient",
        kernel="tied_head_gradient",
        arguments=_tied_arguments,
        launch=lambda size: ((blocks(size["channels"], TILE), blocks(size["vocab"], TILE)), (TILE, TILE)),
        reference=_tied_reference,
        sizes=({"rows": 1, "vocab": 1, "channels": 1}, {"rows": 6, "vocab": 37, "channels": 20},
               {"rows": 16, "vocab": 65, "channels": 48}, {"rows": 33, "vocab": 100, "channels": 17}),
        rtol=1e-5, atol=1e-5),  # float32 sums of up to 33 products of size 1
]
