"""Chapter 16b's graded exercises: FlashAttention's two accumulations written plainly, one thread per row or
element, so that the idea is the whole exercise: the online softmax's step over one tile of keys (rescale
what was summed against the old maximum), and the dV pass's sum over queries of P^T dO."""

import numpy

from gpt2_cupy.exercises.checker import Exercise, Input, Output, Scalar, blocks

THREADS_PER_BLOCK = 32
# (rows, keys, d): one row; fewer rows than a block; a block and one; GPT-2's head size
STEP_SIZES = ({"rows": 1, "keys": 1, "d": 1}, {"rows": 5, "keys": 16, "d": 8}, {"rows": 33, "keys": 7, "d": 16},
              {"rows": 40, "keys": 16, "d": 64})
DV_SIZES = ({"T": 1, "d": 1}, {"T": 17, "d": 8}, {"T": 40, "d": 64}, {"T": 33, "d": 5})


def _step_arguments(size, rng):
    rows, keys, d = size["rows"], size["keys"], size["d"]
    old_max = rng.normal(0.0, 1.0, rows).astype(numpy.float32)
    old_max[0] = -numpy.inf          # a row that has seen no key yet: its sums are zero
    old_sum = rng.uniform(1.0, 3.0, rows).astype(numpy.float32)
    old_sum[0] = 0.0
    o = rng.standard_normal((rows, d)).astype(numpy.float32)
    o[0] = 0.0
    return [Output("o", (rows, d), initial=o), Output("row_max", (rows,), initial=old_max),
            Output("row_sum", (rows,), initial=old_sum),
            Input("scores", rng.normal(0.0, 2.0, (rows, keys)).astype(numpy.float32)),
            Input("v", rng.standard_normal((keys, d)).astype(numpy.float32)),
            Scalar("rows", numpy.int32(rows)), Scalar("keys", numpy.int32(keys)), Scalar("d", numpy.int32(d))]


def _step(o, row_max, row_sum, scores, v, rows, keys, d):
    s = scores.astype(numpy.float64)
    new_max = numpy.maximum(row_max.astype(numpy.float64), s.max(axis=1))
    correction = numpy.exp(row_max - new_max)          # exp(-inf) = 0: nothing summed before
    p = numpy.exp(s - new_max[:, None])
    return {"row_max": new_max, "row_sum": row_sum * correction + p.sum(axis=1),
            "o": o * correction[:, None] + p @ v.astype(numpy.float64)}


def _dv_arguments(size, rng):
    T, d = size["T"], size["d"]
    scores = rng.normal(0.0, 1.5, (T, T)).astype(numpy.float32)
    masked = numpy.where(numpy.tril(numpy.ones((T, T), bool)), scores.astype(numpy.float64), -numpy.inf)
    lse = numpy.log(numpy.exp(masked).sum(axis=1)).astype(numpy.float32)
    return [Output("dv", (T, d), initial=rng.standard_normal((T, d)).astype(numpy.float32)),
            Input("scores", scores), Input("lse", lse), Input("dout", rng.standard_normal((T, d)).astype(numpy.float32)),
            Scalar("T", numpy.int32(T)), Scalar("d", numpy.int32(d))]


def _dv(dv, scores, lse, dout, T, d):
    causal = numpy.tril(numpy.ones((T, T), bool))      # query i sees keys j <= i
    p = numpy.where(causal, numpy.exp(scores.astype(numpy.float64) - lse[:, None]), 0.0)
    return {"dv": dv + p.T @ dout.astype(numpy.float64)}


EXERCISES = [
    Exercise(
        id="16b.online_softmax_step", title="One step of the online softmax: rescale, then add a tile of keys",
        kernel="online_softmax_step", arguments=_step_arguments,
        launch=lambda size: ((blocks(size["rows"], THREADS_PER_BLOCK),), (THREADS_PER_BLOCK,)),
        reference=_step, sizes=STEP_SIZES,
        rtol=1e-5, atol=1e-5),   # sums of 16 terms of size ~1 and expf's few ulps
    Exercise(
        id="16b.dv_accumulate", title="The dV pass: add P^T dO, P recomputed from the log-sum-exp",
        kernel="dv_accumulate", arguments=_dv_arguments,
        launch=lambda size: ((blocks(size["d"], 8), blocks(size["T"], 8)), (8, 8)),
        reference=_dv, sizes=DV_SIZES,
        rtol=1e-5, atol=1e-5),   # sums of at most 40 products of size ~1
]
