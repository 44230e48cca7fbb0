"""Chapter 09's graded exercises: cross-entropy's forward with one warp per row, and its backward from lse.

Rows whose target is ignore_index count for nothing: loss 0, gradient 0 (as torch.nn.functional.cross_entropy).
"""

import numpy

from gpt2_cupy.exercises.checker import Exercise, Input, Output, Scalar, blocks

ROWS_PER_BLOCK = 4  # blocks of 4 warps, one row each
IGNORE_INDEX = -1
# The first size is ragged (5 rows in blocks of 4) with rows of 33: a kernel without the row guard reads and
# writes within the guard regions after the arrays (on a GPU nothing past them is touched) and, on the CPU,
# past the end of the 16 bytes an array is aligned to, which the bounds check catches.
SIZES = ({"N": 5, "V": 33}, {"N": 1, "V": 1}, {"N": 6, "V": 1000}, {"N": 3, "V": 5003})


def _logits_and_targets(size, rng):
    N, V = size["N"], size["V"]
    logits = (3 * rng.standard_normal((N, V))).astype(numpy.float32)
    targets = rng.integers(0, V, N).astype(numpy.int32)
    targets[1::3] = IGNORE_INDEX  # rows 1, 4, ... ignored
    return logits, targets


def _log_sum_exp(logits):
    z = logits.astype(numpy.float64)
    top = z.max(axis=1, keepdims=True)
    return top[:, 0] + numpy.log(numpy.exp(z - top).sum(axis=1))


def _forward_arguments(size, rng):
    logits, targets = _logits_and_targets(size, rng)
    N, V = logits.shape
    return [Output("lse", (N,)), Output("row_losses", (N,)), Input("logits", logits), Input("targets", targets),
            Scalar("N", numpy.int32(N)), Scalar("V", numpy.int32(V)), Scalar("ignore_index", numpy.int32(IGNORE_INDEX))]


def _forward_reference(logits, targets, N, V, ignore_index):
    lse = _log_sum_exp(logits)
    counted = targets != ignore_index
    picked = logits.astype(numpy.float64)[numpy.arange(N), numpy.where(counted, targets, 0)]
    return {"lse": lse, "row_losses": numpy.where(counted, lse - picked, 0.0)}


def _backward_arguments(size, rng):
    logits, targets = _logits_and_targets(size, rng)
    N, V = logits.shape
    counted = max(int((targets != IGNORE_INDEX).sum()), 1)
    return [Output("dlogits", (N, V)), Input("logits", logits), Input("targets", targets),
            Input("lse", _log_sum_exp(logits).astype(numpy.float32)), Scalar("scale", numpy.float32(1 / counted)),
            Scalar("N", numpy.int32(N)), Scalar("V", numpy.int32(V)), Scalar("ignore_index", numpy.int32(IGNORE_INDEX))]


def _backward_reference(logits, targets, lse, scale, N, V, ignore_index):
    gradient = numpy.exp(logits.astype(numpy.float64) - lse.astype(numpy.float64)[:, None])
    counted = targets != ignore_index
    gradient[numpy.arange(N), numpy.where(counted, targets, 0)] -= 1.0
    gradient[~counted] = 0.0
    return {"dlogits": gradient * numpy.float64(scale)}


def _rows_launch(size):
    return (blocks(size["N"], ROWS_PER_BLOCK),), (32 * ROWS_PER_BLOCK,)


EXERCISES = [
    Exercise(
        id="09.forward_warp_per_row", title="Cross-entropy's forward, one warp per row (online softmax, shuffles)",
        kernel="cross_entropy_forward_warp", arguments=_forward_arguments, launch=_rows_launch,
        reference=_forward_reference, sizes=SIZES,
        # a float32 sum of up to 5003 exponentials, split over 32 lanes and merged in a tree
        rtol=1e-5, atol=1e-5),
    Exercise(
        id="09.backward_from_lse", title="Cross-entropy's backward from the saved lse, one warp per row",
        kernel="cross_entropy_backward_warp", arguments=_backward_arguments, launch=_rows_launch,
        reference=_backward_reference, sizes=SIZES,
        # one expf (a few ulp) and one product per element; the gradients are below 1 / (rows counted)
        rtol=1e-5, atol=1e-7),
]
