"""Chapter 07's graded exercises: random numbers from Philox counters, in kernels the learner writes.

Both references compute Philox4x32-10 in numpy (philox_words), the function kernels/include/philox.cuh
computes, so that an exercise's expected output follows from its seed alone.
"""

import numpy

from gpt2_cupy.exercises.checker import Exercise, Input, Output, Scalar, blocks

THREADS_PER_BLOCK = 256
LOW_32 = numpy.uint64(0xFFFFFFFF)
MULTIPLIERS = (numpy.uint64(0xD2511F53), numpy.uint64(0xCD9E8D57))
KEY_STEPS = (numpy.uint64(0x9E3779B9), numpy.uint64(0xBB67AE85))
TWO_TO_MINUS_24 = 2.0**-24


def philox_words(counters, key):
    """Philox4x32-10 of each row of counters ((groups, 4) integers) under key (2 integers): (groups, 4) uint64."""
    c = [numpy.asarray(counters, dtype=numpy.uint64)[:, word] for word in range(4)]
    key0, key1 = numpy.uint64(key[0]), numpy.uint64(key[1])
    for _ in range(10):
        product0, product1 = MULTIPLIERS[0] * c[0], MULTIPLIERS[1] * c[2]
        c = [(product1 >> numpy.uint64(32)) ^ c[1] ^ key0, product1 & LOW_32,
             (product0 >> numpy.uint64(32)) ^ c[3] ^ key1, product0 & LOW_32]
        key0, key1 = (key0 + KEY_STEPS[0]) & LOW_32, (key1 + KEY_STEPS[1]) & LOW_32
    return numpy.stack(c, axis=1)


def _split(value):
    """The low and high 32-bit halves of a 64-bit number."""
    return int(value) & 0xFFFFFFFF, int(value) >> 32


def _uniforms(n, seed, offset):
    """u_i of the stream (seed, offset) for i < n, float32: counter (i // 4, 0, offset halves), word i % 4."""
    groups = numpy.arange((n + 3) // 4, dtype=numpy.uint64)
    offset_low, offset_high = _split(offset)
    counters = numpy.stack([groups, groups * 0, groups * 0 + offset_low, groups * 0 + offset_high], axis=1)
    words = philox_words(counters, _split(seed)).reshape(-1)[:n]
    return ((words >> numpy.uint64(8)).astype(numpy.float64) * TWO_TO_MINUS_24).astype(numpy.float32)


def _dropout_residual_arguments(size, rng):
    n = size["n"]
    return [Output("out", (n,)),
            Input("residual", rng.standard_normal(n, dtype=numpy.float32)),
            Input("x", rng.standard_normal(n, dtype=numpy.float32)),
            Scalar("seed", numpy.uint64(size["seed"])),
            Scalar("offset", numpy.uint64(size["offset"])),
            Scalar("p", numpy.float32(0.1)),
            Scalar("n", numpy.int32(n))]


def _dropout_residual_reference(residual, x, seed, offset, p, n):
    keep = _uniforms(n, seed, offset) >= p  # compared in float32, as the kernel compares
    return {"out": residual.astype(numpy.float64) + numpy.where(keep, x.astype(numpy.float64) / (1 - float(p)), 0.0)}


def _normal_arguments(size, rng):
    n = size["n"]
    return [Output("z", (n,)), Scalar("seed", numpy.uint64(size["seed"])), Scalar("n", numpy.int32(n))]


def _normal_reference(seed, n):
    groups = numpy.arange((n + 3) // 4, dtype=numpy.uint64)
    zeros = groups * 0
    words = philox_words(numpy.stack([groups, zeros, zeros, zeros], axis=1), _split(seed))
    u0 = ((words[:, 0::2] >> numpy.uint64(8)).astype(numpy.float64) + 1) * TWO_TO_MINUS_24  # in (0, 1]
    u1 = (words[:, 1::2] >> numpy.uint64(8)).astype(numpy.float64) * TWO_TO_MINUS_24
    radius = numpy.sqrt(-2 * numpy.log(u0))
    z = numpy.stack([radius * numpy.cos(2 * numpy.pi * u1), radius * numpy.sin(2 * numpy.pi * u1)], axis=2)
    return {"z": z.reshape(-1)[:n]}  # per group: z0, z1 of the first pair of words, then of the second


def _groups_launch(size):
    # one thread per group of 4 elements
    return (blocks(blocks(size["n"], 4), THREADS_PER_BLOCK),), (THREADS_PER_BLOCK,)


EXERCISES = [
    Exercise(
        id="07.dropout_residual", title="Dropout fused with the residual add: out = residual + dropout(x)",
        kernel="dropout_residual", arguments=_dropout_residual_arguments, launch=_groups_launch,
        reference=_dropout_residual_reference,
        sizes=({"n": 1, "seed": 7, "offset": 0}, {"n": 5, "seed": 1234, "offset": 4096},
               {"n": 1023, "seed": 2**40 + 3, "offset": 2**33 + 5}, {"n": 4099, "seed": 99, "offset": 12}),
        # x / (1 - p) rounded at most twice and the sum once; |out| stays below 16 for these inputs
        rtol=2.0**-22, atol=16 * 2.0**-23),
    Exercise(
        id="07.box_muller", title="Normal numbers from Philox by the Box-Muller transform", kernel="philox_normal",
        arguments=_normal_arguments, launch=_groups_launch, reference=_normal_reference,
        sizes=({"n": 1, "seed": 5}, {"n": 6, "seed": 5}, {"n": 1023, "seed": 2**33 + 1}, {"n": 4099, "seed": 77}),
        # float32 logf, sqrtf, cosf and 2 pi rounded to float32: a few 1e-7 of a radius up to 5.8
        rtol=1e-5, atol=2e-5),
]
