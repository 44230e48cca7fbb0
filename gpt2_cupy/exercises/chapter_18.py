"""Chapter 18's graded exercises: the two halves of ZeRO-1's gradient work as kernels. A reduce-scatter by
hand (rank r's shard of the average, from the N ranks' buffers), and the sum of squares of one shard (the part
of the gradient norm each rank computes before a one-number all-reduce adds the parts up)."""

import numpy

from gpt2_cupy.exercises.checker import Exercise, Input, Output, Scalar, blocks

THREADS_PER_BLOCK = 256
SHARD_SIZES = ({"ranks": 1, "shard": 1}, {"ranks": 2, "shard": 255}, {"ranks": 3, "shard": 257},
               {"ranks": 4, "shard": 1000})
SQUARE_SIZES = ({"n": 1}, {"n": 255}, {"n": 257}, {"n": 3001})


def _launch(count):
    return (blocks(count, THREADS_PER_BLOCK),), (THREADS_PER_BLOCK,)


def _reduce_scatter_arguments(size, rng):
    ranks, shard = size["ranks"], size["shard"]
    n = ranks * shard
    return [Output("shard", (shard,)),
            Input("buffers", rng.standard_normal(ranks * n).astype(numpy.float32)),   # rank k's: [k n, (k+1) n)
            Scalar("ranks", numpy.int32(ranks)), Scalar("n", numpy.int32(n)),
            Scalar("rank", numpy.int32(ranks - 1))]   # the last shard: a missing rank offset shows


def _reduce_scatter(buffers, ranks, n, rank):
    shard = n // ranks
    return {"shard": buffers.reshape(ranks, n)[:, rank * shard:(rank + 1) * shard].astype(numpy.float64).mean(axis=0)}


def _sum_of_squares_arguments(size, rng):
    n = size["n"]
    return [Output("total", (1,), initial=numpy.zeros(1, numpy.float32)),
            Input("gradients", rng.standard_normal(n).astype(numpy.float32)),
            Scalar("n", numpy.int32(n))]


def _sum_of_squares(total, gradients, n):
    return {"total": total + numpy.sum(gradients.astype(numpy.float64) ** 2, keepdims=True)}


EXERCISES = [
    Exercise(
        id="18.reduce_scatter", title="A reduce-scatter by hand: rank r's shard of the N ranks' average",
        kernel="reduce_scatter", arguments=_reduce_scatter_arguments,
        launch=lambda size: _launch(size["shard"]), reference=_reduce_scatter, sizes=SHARD_SIZES,
        rtol=1e-6, atol=1e-6),   # at most 4 float32 additions and a division; atol for sums that cancel
    Exercise(
        id="18.shard_sum_of_squares", title="The sum of squares of a gradient shard: a block reduction, one "
        "atomic add a block", kernel="sum_of_squares", arguments=_sum_of_squares_arguments,
        launch=lambda size: _launch(size["n"]), reference=_sum_of_squares, sizes=SQUARE_SIZES,
        rtol=1e-5, atol=0.0),   # float32 sums of positive terms: a tree per block, blocks in any order
]
