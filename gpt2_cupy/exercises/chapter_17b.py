"""Chapter 17b's graded exercises: a GEMV with one warp per output and 16-byte loads, and the merge of
flash-decoding's chunks."""

import numpy

from gpt2_cupy.exercises.checker import Exercise, Input, Output, Scalar, blocks

GEMV_WARPS = 8          # gemv_float4: a warp per output, 8 outputs a block of 256 threads
COMBINE_THREADS = 128   # decode_combine: a thread per output element


def _gemv_arguments(size, rng):
    N, K = size["N"], size["K"]
    return [Output("y", (N,)),
            Input("x", rng.standard_normal(K, dtype=numpy.float32)),
            Input("weight", rng.standard_normal((N, K), dtype=numpy.float32)),
            Scalar("N", numpy.int32(N)),
            Scalar("K", numpy.int32(K))]


def _combine_arguments(size, rng):
    splits, rows, d = size["splits"], size["rows"], size["d"]
    return [Output("out", (rows, d)),
            Input("partial_out", rng.standard_normal((splits, rows, d), dtype=numpy.float32)),
            Input("partial_max", (3.0 * rng.standard_normal((splits, rows))).astype(numpy.float32)),
            Input("partial_sum", rng.uniform(1.0, 10.0, (splits, rows)).astype(numpy.float32)),
            Scalar("splits", numpy.int32(splits)),
            Scalar("rows", numpy.int32(rows)),
            Scalar("d", numpy.int32(d))]


def _combine_reference(partial_out, partial_max, partial_sum, splits, rows, d):
    m, l, o = (a.astype(numpy.float64) for a in (partial_max, partial_sum, partial_out))
    scale = numpy.exp(m - m.max(axis=0, keepdims=True))                  # (splits, rows)
    return {"out": (o * scale[..., None]).sum(axis=0) / (l * scale).sum(axis=0)[:, None]}


EXERCISES = [
    Exercise(
        id="17b.gemv_float4", title="One row times a matrix: a warp per output, 16-byte loads", kernel="gemv_float4",
        arguments=_gemv_arguments,
        launch=lambda size: ((blocks(size["N"], GEMV_WARPS),), (GEMV_WARPS * 32,)),
        reference=lambda x, weight, N, K: {"y": weight.astype(numpy.float64) @ x.astype(numpy.float64)},
        sizes=({"N": 1, "K": 4}, {"N": 7, "K": 100}, {"N": 33, "K": 260}, {"N": 77, "K": 1028}),
        rtol=1e-5, atol=1e-4),   # a float32 sum of up to 1028 products of size ~1: errors of a few 1e-6 times √K
    Exercise(
        id="17b.decode_combine", title="Merge flash-decoding's chunks by their log-sum-exp", kernel="decode_combine",
        arguments=_combine_arguments,
        launch=lambda size: ((blocks(size["rows"] * size["d"], COMBINE_THREADS),), (COMBINE_THREADS,)),
        reference=_combine_reference,
        sizes=({"splits": 1, "rows": 1, "d": 1}, {"splits": 3, "rows": 5, "d": 16}, {"splits": 7, "rows": 4, "d": 64},
               {"splits": 11, "rows": 9, "d": 65}),
        rtol=1e-5, atol=1e-6),
]
