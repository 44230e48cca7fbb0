"""Chapter 16c's graded exercises: a kernel that a CUDA graph can replay at every step (its changing scalars
read from device memory), and a fused kernel that saves a launch (bias add and GELU in one)."""

import numpy

from gpt2_cupy.exercises.checker import Exercise, Input, Output, Scalar, blocks

THREADS_PER_BLOCK = 256
SIZES = ({"n": 1}, {"n": 255}, {"n": 257}, {"n": 3001})
BIAS_SIZES = ({"rows": 1, "columns": 1}, {"rows": 3, "columns": 100}, {"rows": 7, "columns": 257})
STEPS = 10


def _launch(count):
    return (blocks(count, THREADS_PER_BLOCK),), (THREADS_PER_BLOCK,)


def _sgd_arguments(size, rng):
    n = size["n"]
    return [Output("parameters", (n,), initial=rng.standard_normal(n).astype(numpy.float32)),
            Input("gradients", rng.standard_normal(n).astype(numpy.float32)),
            Input("schedule", numpy.linspace(1e-3, 1e-4, STEPS).astype(numpy.float32)),   # a learning rate per step
            Input("step", numpy.array([int(rng.integers(1, STEPS))], numpy.int32)),
            Scalar("n", numpy.int32(n))]


def _sgd(parameters, gradients, schedule, step, n):
    return {"parameters": parameters - float(schedule[step[0]]) * gradients.astype(numpy.float64)}


def _bias_gelu_arguments(size, rng):
    rows, columns = size["rows"], size["columns"]
    return [Output("y", (rows, columns)), Input("x", rng.normal(0.0, 2.0, (rows, columns)).astype(numpy.float32)),
            Input("bias", rng.normal(0.0, 0.5, columns).astype(numpy.float32)),
            Scalar("n", numpy.int32(rows * columns)), Scalar("columns", numpy.int32(columns))]


def _bias_gelu(x, bias, n, columns):
    z = x.astype(numpy.float64) + bias                  # GPT-2's GELU, the tanh form (chapter 03)
    return {"y": 0.5 * z * (1 + numpy.tanh(numpy.sqrt(2 / numpy.pi) * (z + 0.044715 * z ** 3)))}


EXERCISES = [
    Exercise(
        id="16c.sgd_device_scalars", title="An SGD step whose learning rate and step come from device memory",
        kernel="sgd_step", arguments=_sgd_arguments, launch=lambda size: _launch(size["n"]),
        reference=_sgd, sizes=SIZES,
        rtol=1e-6, atol=1e-7),   # one product and one subtraction in float32
    Exercise(
        id="16c.bias_gelu", title="Bias add and GELU fused: one launch instead of two", kernel="bias_gelu",
        arguments=_bias_gelu_arguments, launch=lambda size: _launch(size["rows"] * size["columns"]),
        reference=_bias_gelu, sizes=BIAS_SIZES,
        rtol=1e-5, atol=1e-6),   # tanhf within a few ulps, the sum x + bias rounded once
]
