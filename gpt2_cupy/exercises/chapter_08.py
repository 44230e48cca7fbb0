"""Chapter 08's graded exercises: the fused forward with one warp per query row, and dV from query tiles.

One head, causal, (T, d) arrays in order; the references are the float64 attention of the chapter.
"""

import numpy

from gpt2_cupy.exercises.checker import Exercise, Input, Output, Scalar, blocks

ROWS_PER_BLOCK = 4     # the forward's block: 4 warps, one query row each
TILE = 64              # the dV kernel's block: one thread per key, queries in tiles of 64
DV_HEAD_SIZE = 64      # the dV kernel's head size, a constant of its source


def _scores(q, k):
    """q kᵀ / √d in float64, -inf above the diagonal (the causal mask)."""
    q, k = q.astype(numpy.float64), k.astype(numpy.float64)
    T, d = q.shape
    return numpy.where(numpy.tril(numpy.ones((T, T), bool)), q @ k.T / numpy.sqrt(d), -numpy.inf)


def _log_sum_exp(scores):
    top = scores.max(axis=1, keepdims=True)
    return top[:, 0] + numpy.log(numpy.exp(scores - top).sum(axis=1))


def _forward_arguments(size, rng):
    T, d = size["T"], size["d"]
    return [Output("out", (T, d)), Output("lse", (T,)),
            *(Input(name, rng.standard_normal((T, d), dtype=numpy.float32)) for name in ("q", "k", "v")),
            Scalar("T", numpy.int32(T)), Scalar("d", numpy.int32(d))]


def _forward_reference(q, k, v, T, d):
    scores = _scores(q, k)
    lse = _log_sum_exp(scores)
    return {"out": numpy.exp(scores - lse[:, None]) @ v.astype(numpy.float64), "lse": lse}


def _dv_arguments(size, rng):
    T, d = size["T"], DV_HEAD_SIZE
    q, k = (rng.standard_normal((T, d), dtype=numpy.float32) for _ in range(2))
    lse = _log_sum_exp(_scores(q, k)).astype(numpy.float32)  # what the forward saved
    return [Output("dv", (T, d)), Input("q", q), Input("k", k),
            Input("dout", rng.standard_normal((T, d), dtype=numpy.float32)), Input("lse", lse),
            Scalar("T", numpy.int32(T))]


def _dv_reference(q, k, dout, lse, T):
    p = numpy.exp(_scores(q, k) - lse.astype(numpy.float64)[:, None])  # P from the saved lse, as the kernel does
    return {"dv": p.T @ dout.astype(numpy.float64)}


EXERCISES = [
    Exercise(
        id="08.forward_warp_per_row", title="Fused causal attention, one warp per query row",
        kernel="attention_forward_warp", arguments=_forward_arguments,
        launch=lambda size: ((blocks(size["T"], ROWS_PER_BLOCK),), (32 * ROWS_PER_BLOCK,)),
        reference=_forward_reference,
        sizes=({"T": 1, "d": 64}, {"T": 17, "d": 64}, {"T": 70, "d": 32}, {"T": 45, "d": 50}),
        # float32 dot products of up to 64 terms and a sum of up to 70 weighted rows, each of order 1
        rtol=1e-4, atol=1e-5),
    Exercise(
        id="08.dv_query_tiles", title="dV of attention, one thread per key, the queries in shared-memory tiles",
        kernel="attention_backward_dv", arguments=_dv_arguments,
        launch=lambda size: ((blocks(size["T"], TILE),), (TILE,)),
        reference=_dv_reference,
        # T = 63 first: a kernel that writes past T writes 64 floats past dv's end, inside the guard region
        # after it (a missing guard at T = 1 would write 63 rows past it, beyond what the guard covers)
        sizes=({"T": 63}, {"T": 1}, {"T": 17}, {"T": 130}),
        # sums of up to 130 products P dO with P <= 1, each rounded in float32
        rtol=1e-4, atol=1e-5),
]
