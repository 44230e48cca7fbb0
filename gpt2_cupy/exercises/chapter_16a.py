"""Chapter 16a's graded exercises: float32 to bf16 rounded to nearest with ties to even, and the unscaling of
loss-scaled gradients with the overflow flag that tells the optimizer to skip the step."""

import ml_dtypes
import numpy

from gpt2_cupy.exercises.checker import Exercise, Input, Output, Scalar, blocks

THREADS_PER_BLOCK = 256
SIZES = ({"n": 1}, {"n": 255}, {"n": 257}, {"n": 3001})   # not multiples of the block
INVERSE_SCALE = 2.0 ** -16   # a power of two: multiplying by it is exact, so the check can ask for exact results


def _launch(size):
    return (blocks(size["n"], THREADS_PER_BLOCK),), (THREADS_PER_BLOCK,)


def _values(n, rng):
    """Normal values over many magnitudes, with the cases rounding must get right at the front: exact ties
    (to even, up and down), the largest float that rounds to infinity, infinities and a NaN."""
    x = (rng.standard_normal(n) * 10.0 ** rng.integers(-30, 30, n)).astype(numpy.float32)
    special = numpy.array([0x3F808000, 0x3F818000, 0x3F80FFFF, 0x7F7FFFFF, 0x7F800000, 0xFF800000, 0x7FC00001],
                          dtype=numpy.uint32).view(numpy.float32)
    count = min(n, special.size)
    x[:count] = special[:count]
    return x


def _bf16_round_arguments(size, rng):
    n = size["n"]
    return [Output("out", (n,), dtype=numpy.int32), Input("x", _values(n, rng)), Scalar("n", numpy.int32(n))]


def _bf16_bits(x, n):
    """The bits of the nearest bf16 (ties to even; a NaN stays a quiet NaN), as ml_dtypes rounds."""
    bits = x.astype(ml_dtypes.bfloat16).view(numpy.uint16).astype(numpy.int64)
    quiet_nan = (x.view(numpy.uint32).astype(numpy.int64) | 0x400000) >> 16
    return {"out": numpy.where(numpy.isnan(x), quiet_nan, bits)}


def _unscale_arguments(size, rng):
    n = size["n"]
    gradients = (rng.standard_normal(n) * 2.0 ** 14).astype(numpy.float32)   # gradients times a loss scale
    if n > 2000:
        gradients[n // 2] = numpy.nan   # an overflow in the backward (inf - inf) left a NaN
    return [Output("unscaled", (n,)), Output("found_infinite", (1,), dtype=numpy.int32, initial=numpy.zeros(1, numpy.int32)),
            Input("gradients", gradients), Input("inverse_scale", numpy.array([INVERSE_SCALE], numpy.float32)),
            Scalar("n", numpy.int32(n))]


def _unscale(gradients, inverse_scale, n, found_infinite):
    unscaled = gradients.astype(numpy.float64) * float(inverse_scale[0])
    return {"unscaled": unscaled, "found_infinite": numpy.array([int(not numpy.isfinite(unscaled).all())])}


EXERCISES = [
    Exercise(
        id="16a.bf16_round", title="float32 to bf16, to nearest with ties to even", kernel="float_to_bf16",
        arguments=_bf16_round_arguments, launch=_launch, reference=_bf16_bits, sizes=SIZES,
        rtol=0.0, atol=0.0),   # bits: exactly equal
    Exercise(
        id="16a.unscale_check", title="Unscale loss-scaled gradients and flag an overflow",
        kernel="unscale_and_check", arguments=_unscale_arguments, launch=_launch, reference=_unscale, sizes=SIZES,
        rtol=0.0, atol=0.0),   # a power-of-two scale: exact
]
