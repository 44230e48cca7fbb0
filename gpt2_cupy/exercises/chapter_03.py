"""Chapter 03's graded exercises: elementwise activations, forward and backward."""

import math

import numpy

from gpt2_cupy.exercises.checker import Exercise, Input, Output, Scalar, blocks

THREADS_PER_BLOCK = 256
SIZES = ({"n": 1}, {"n": 255}, {"n": 257}, {"n": 4099})
# Values where the formulas cancel or overflow: 0, a tiny number, the root of GELU', the tails.
SPECIAL = [0.0, 1e-30, -0.7524614, -3.0, 3.0, -5.2, -10.0, 10.0, -20.0, 20.0]
# The chapter's error with a floor: |y - r| <= 1e-5 (|r| + 0.1), a relative error of 1e-5 where |r| >> 0.1
# and an absolute one of 1e-6 near zero, where float32 rounds the terms that cancel, not the result.
RTOL, ATOL = 1e-5, 1e-6
SQRT_2_OVER_PI, CUBIC = math.sqrt(2 / math.pi), 0.044715


def _activations(n, rng):
    """n float32 inputs: the special values first, then normal with standard deviation 3 (the tails too)."""
    return numpy.concatenate([SPECIAL, rng.normal(0.0, 3.0, n)])[:n].astype(numpy.float32)


def _gelu_arguments(size, rng):
    n = size["n"]
    return [Output("y", (n,)), Input("x", _activations(n, rng)), Scalar("n", numpy.int32(n))]


def _gelu_tanh(x, n):
    x = x.astype(numpy.float64)
    u = SQRT_2_OVER_PI * (x + CUBIC * x**3)
    with numpy.errstate(over="ignore"):  # exp(-2u) is inf for u << 0, and x / inf the right 0
        return {"y": x / (1 + numpy.exp(-2 * u))}


def _silu_backward_arguments(size, rng):
    n = size["n"]
    return [Output("dx", (n,)), Input("x", _activations(n, rng)),
            Input("dy", rng.uniform(-1.0, 1.0, n).astype(numpy.float32)), Scalar("n", numpy.int32(n))]


def _silu_backward(x, dy, n):
    x = x.astype(numpy.float64)
    sigma = 1 / (1 + numpy.exp(-x))
    return {"dx": dy.astype(numpy.float64) * (sigma + x * sigma * (1 - sigma))}


def _one_thread_per_element(size):
    return (blocks(size["n"], THREADS_PER_BLOCK),), (THREADS_PER_BLOCK,)


EXERCISES = [
    Exercise(
        id="03.gelu_forward_sigmoid", title="GELU (tanh form) as x / (1 + exp(-2u))", kernel="gelu_forward_sigmoid",
        arguments=_gelu_arguments, launch=_one_thread_per_element, reference=_gelu_tanh,
        sizes=SIZES, rtol=RTOL, atol=ATOL),
    Exercise(
        id="03.silu_backward", title="SiLU's backward: dx = dy (sigma + x sigma (1 - sigma))", kernel="silu_backward",
        arguments=_silu_backward_arguments, launch=_one_thread_per_element, reference=_silu_backward,
        sizes=SIZES, rtol=RTOL, atol=ATOL),
]
