"""Chapter 14's graded exercises: the mean loss as a deterministic reduction, and drawing the next token at a
temperature."""

import numpy

from gpt2_cupy.exercises.checker import Exercise, Input, Output, Scalar, blocks

LOSS_THREADS = 256   # mean_loss: one block of this many threads
ROWS_PER_BLOCK = 32  # sample_token: one thread per row


def _mean_loss_arguments(size, rng):
    n = size["n"]
    return [Output("loss", (1,)),
            Input("losses", rng.uniform(0.0, 8.0, n).astype(numpy.float32)),   # per-token cross-entropies
            Scalar("n", numpy.int32(n))]


def _sample_arguments(size, rng):
    rows, vocab = size["rows"], size["vocab"]
    return [Output("tokens", (rows,), dtype=numpy.int32),
            Input("logits", rng.standard_normal((rows, vocab), dtype=numpy.float32) * numpy.float32(3.0)),
            Input("uniforms", rng.uniform(0.0, 1.0, rows).astype(numpy.float32)),
            Scalar("temperature", numpy.float32(size["temperature"])),
            Scalar("rows", numpy.int32(rows)),
            Scalar("vocab", numpy.int32(vocab))]


def _sample_reference(logits, uniforms, temperature, rows, vocab):
    z = logits.astype(numpy.float64) / numpy.float64(temperature)
    weights = numpy.exp(z - z.max(axis=1, keepdims=True))
    running = numpy.cumsum(weights, axis=1)
    threshold = uniforms.astype(numpy.float64)[:, None] * running[:, -1:]
    passed = running > threshold
    tokens = numpy.where(passed.any(axis=1), passed.argmax(axis=1), vocab - 1)
    return {"tokens": tokens.astype(numpy.float64)}


EXERCISES = [
    Exercise(
        id="14.mean_loss", title="The mean loss, one block, the same bits every run", kernel="mean_loss",
        arguments=_mean_loss_arguments,
        launch=lambda size: ((1,), (LOSS_THREADS,)),
        reference=lambda losses, n: {"loss": numpy.array([losses.astype(numpy.float64).mean()])},
        sizes=({"n": 1}, {"n": 255}, {"n": 257}, {"n": 8192 + 5}),
        rtol=1e-5),
    Exercise(
        id="14.sample_token", title="Draw the next token at a temperature", kernel="sample_token",
        arguments=_sample_arguments,
        launch=lambda size: ((blocks(size["rows"], ROWS_PER_BLOCK),), (ROWS_PER_BLOCK,)),
        reference=_sample_reference,
        sizes=({"rows": 1, "vocab": 1, "temperature": 1.0}, {"rows": 5, "vocab": 65, "temperature": 0.8},
               {"rows": 33, "vocab": 257, "temperature": 1.0}, {"rows": 40, "vocab": 2048, "temperature": 0.5}),
        rtol=0.0),  # a token id is right or wrong
]
