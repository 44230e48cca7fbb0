"""Chapter 06's graded exercises: the fused token-and-position lookup, and the scatter-add summed by groups."""

import numpy

from gpt2_cupy.exercises.checker import Exercise, Input, Output, Scalar, blocks

THREADS_PER_BLOCK = 256
COLUMNS_PER_BLOCK = 128  # embedding_backward_grouped: blockIdx.y picks the id, x the columns
# (B, T, V, C): one element; C not a multiple of anything; several blocks per row; ids that repeat
LOOKUP_SIZES = ({"B": 1, "T": 1, "V": 1, "C": 1}, {"B": 2, "T": 9, "V": 50, "C": 13}, {"B": 3, "T": 17, "V": 7, "C": 100})
# (N, V, C): one position; ids with empty groups; long groups; more columns than a block
GROUPED_SIZES = ({"N": 1, "V": 1, "C": 1}, {"N": 37, "V": 5, "C": 13}, {"N": 100, "V": 40, "C": 33},
                 {"N": 60, "V": 7, "C": 130})


def _lookup_arguments(size, rng):
    B, T, V, C = size["B"], size["T"], size["V"], size["C"]
    ids = rng.integers(0, V, (B, T)).astype(numpy.int32)
    if B * T > 2:
        ids.flat[1], ids.flat[-1] = V, -1  # ids outside the table: their rows must be NaN
    return [Output("out", (B, T, C)), Input("ids", ids),
            Input("wte", rng.standard_normal((V, C), dtype=numpy.float32)),
            Input("wpe", rng.standard_normal((T + 3, C), dtype=numpy.float32)),
            Scalar("B", numpy.int32(B)), Scalar("T", numpy.int32(T)), Scalar("V", numpy.int32(V)), Scalar("C", numpy.int32(C))]


def _lookup(ids, wte, wpe, B, T, V, C):
    valid = (0 <= ids) & (ids < V)
    rows = numpy.where(valid[..., None], wte.astype(numpy.float64)[numpy.where(valid, ids, 0)], numpy.nan)
    return {"out": rows + wpe.astype(numpy.float64)[:T]}


def _grouped_arguments(size, rng):
    N, V, C = size["N"], size["V"], size["C"]
    ids = rng.integers(0, V, N) if V < 10 else rng.integers(0, V // 2, N)  # half the ids have no positions
    grouped = numpy.argsort(ids, kind="stable").astype(numpy.int32)     # positions in order of id, then position
    starts = numpy.concatenate([[0], numpy.cumsum(numpy.bincount(ids, minlength=V))]).astype(numpy.int32)
    return [Output("dweight", (V, C)), Input("dout", rng.standard_normal((N, C), dtype=numpy.float32)),
            Input("grouped", grouped), Input("starts", starts), Scalar("V", numpy.int32(V)), Scalar("C", numpy.int32(C))]


def _grouped(dout, grouped, starts, V, C):
    sums = numpy.zeros((V, C))
    for v in range(V):
        sums[v] = dout[grouped[starts[v]:starts[v + 1]]].astype(numpy.float64).sum(axis=0)
    return {"dweight": sums}


EXERCISES = [
    Exercise(
        id="06.token_position_forward", title="GPT-2's input: a token row plus a position row, one thread per element",
        kernel="token_position_forward", arguments=_lookup_arguments,
        launch=lambda size: ((blocks(size["B"] * size["T"] * size["C"], THREADS_PER_BLOCK),), (THREADS_PER_BLOCK,)),
        reference=_lookup, sizes=LOOKUP_SIZES, rtol=2.0**-24),  # one float32 addition, rounded once
    Exercise(
        id="06.grouped_backward", title="The embedding's backward, summed group by group in a fixed order",
        kernel="embedding_backward_grouped", arguments=_grouped_arguments,
        launch=lambda size: ((blocks(size["C"], COLUMNS_PER_BLOCK), size["V"]), (COLUMNS_PER_BLOCK,)),
        reference=_grouped, sizes=GROUPED_SIZES,
        rtol=1e-5, atol=1e-5),  # sums of at most a few dozen standard normal rows
]
